"""Checkpoints: state trees (dataclasses of numpy arrays) as .npz files, written atomically, plus a manifest.

Layout of one run's checkpoints: `<tracking.checkpoint_dir>/<run_id>/round-000010/` holding `host-<i>.npz`
(written by each host actor in parallel), `coordinator.npz` and `manifest.json` (written last by the
driver: a checkpoint without a manifest is incomplete and ignored). Files are written to a temporary name
and renamed, so a crash never leaves a half-written file under the final name.

No pickle: a state tree is stored as a JSON description plus the arrays it references, so a checkpoint
can be read without running code from it. Dataclasses are rebuilt from their `module:qualname`, which
must be importable (raysim's own state classes are).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from raysim.errors import RaysimError

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(RaysimError):
    """A checkpoint is missing, incomplete or unreadable; the message names the path."""


def encode_tree(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """A JSON-able description of `value`; numpy arrays go into `arrays` under generated keys."""
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {"__array__": key}
    if isinstance(value, np.generic):
        return encode_tree(value.item(), arrays)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        fields = {f.name: encode_tree(getattr(value, f.name), arrays) for f in dataclasses.fields(value)}
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return {"__seq__": type(value).__name__, "items": [encode_tree(v, arrays) for v in items]}
    if isinstance(value, dict):
        return {"__dict__": [[encode_tree(k, arrays), encode_tree(v, arrays)] for k, v in value.items()]}
    raise TypeError(f"cannot checkpoint a value of type {type(value).__name__}")


_SEQUENCES = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}


def decode_tree(node: Any, arrays: Any) -> Any:
    """Inverse of `encode_tree`."""
    if not isinstance(node, dict):
        return node
    if "__array__" in node:
        return np.array(arrays[node["__array__"]])
    if "__dataclass__" in node:
        module, _, name = node["__dataclass__"].partition(":")
        kind: Any = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
        return kind(**{k: decode_tree(v, arrays) for k, v in node["fields"].items()})
    if "__seq__" in node:
        return _SEQUENCES[node["__seq__"]](decode_tree(v, arrays) for v in node["items"])
    return {decode_tree(k, arrays): decode_tree(v, arrays) for k, v in node["__dict__"]}


def _atomic_write(path: Path, payload: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def save_tree(path: str | Path, value: Any) -> None:
    """Write a state tree to one .npz file atomically (write, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    structure = encode_tree(value, arrays)
    buffer = io.BytesIO()
    np.savez(buffer, __structure__=np.frombuffer(json.dumps(structure).encode(), dtype=np.uint8), **arrays)
    _atomic_write(path, buffer.getvalue())


def load_tree(path: str | Path) -> Any:
    """Read a state tree written by `save_tree`."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            structure = json.loads(arrays["__structure__"].tobytes())
            return decode_tree(structure, arrays)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(f"{path}: unreadable checkpoint file ({error})") from None


def round_dir(root: str | Path, run_id: str, round_done: int) -> Path:
    return Path(root) / run_id / f"round-{round_done:06d}"


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Complete a checkpoint: the manifest is written last, atomically."""
    _atomic_write(directory / MANIFEST, json.dumps({"format": FORMAT, **manifest}, indent=1).encode())


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except OSError as error:
        raise CheckpointError(f"{path}: no checkpoint manifest ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: corrupt checkpoint manifest ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def latest_checkpoint(path: str | Path) -> Path:
    """The newest complete checkpoint under a run's checkpoint folder (or `path` itself if it is one)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    complete = sorted(p for p in path.glob("round-*") if (p / MANIFEST).exists())
    if not complete:
        raise CheckpointError(f"{path}: no complete checkpoint (round-*/{MANIFEST}) found")
    return complete[-1]


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints of a run."""
    complete = sorted(p for p in directory.glob("round-*") if (p / MANIFEST).exists())
    for old in complete[:-keep] if keep > 0 else []:
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
