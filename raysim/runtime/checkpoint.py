"""Checkpoints: state trees (dataclasses of numpy arrays) as .npz files, written atomically, plus a manifest.

Layout of one run's checkpoints: `<tracking.checkpoint_dir>/<run_id>/round-000010/` holding `host-<i>.npz`
(written by each host actor in parallel), `coordinator.npz` and `manifest.json` (written last by the
driver). A round's folder exists whole or not at all: its files are written into a hidden folder beside it,
synced, and the folder renamed into place (`round_folder`); a crash, a full disk or a read-only folder never
leaves a round folder without its manifest (one without is incomplete and ignored all the same). Whether the
folder can be written at all is checked before a run starts (`check_writable`).

No pickle: a state tree is stored as a JSON description plus the arrays it references, so reading a
checkpoint runs no code named in it. A dataclass is stored by its `module:qualname` and rebuilt only if
it is a state class: a dataclass defined in raysim's own modules or in a plugin this process imported
(raysim.plugins), or one registered with `register_state_class`. Anything else a file names
(`subprocess:Popen`, `builtins:eval`, a raysim function) is refused with a CheckpointError before any module
outside raysim is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from raysim.errors import CheckpointError, nearest_existing, unwritable
from raysim.files import atomic_file
from raysim.plugins import is_plugin_module

MANIFEST = "manifest.json"
FORMAT = 1


class ArraySink(Protocol):
    """Where `encode_tree` puts the arrays it meets: a dict, or an archive being written (`save_tree`)."""

    def __len__(self) -> int: ...

    def __setitem__(self, key: str, array: np.ndarray, /) -> None: ...


_SEQUENCES = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset}
_REGISTERED: dict[str, type] = {}
_RAYSIM_MODULE = re.compile(r"raysim(\.[A-Za-z_][A-Za-z0-9_]*)*")


def register_state_class(kind: type) -> type:
    """Allow checkpoints to rebuild `kind`, a state dataclass defined outside raysim and outside the plugins (e.g.
    in a module a plugin imports). Usable as a class decorator."""
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise TypeError(f"register_state_class: {kind!r} is not a dataclass")
    _REGISTERED[f"{kind.__module__}:{kind.__qualname__}"] = kind
    return kind


def _state_module(module: str) -> bool:
    """A module whose dataclasses are state classes: raysim's own, or a plugin's (already imported)."""
    return bool(_RAYSIM_MODULE.fullmatch(module)) or is_plugin_module(module)


def state_class(name: str) -> type:
    """The state dataclass a checkpoint names as `module:qualname`, if it is allowed (see module docstring).
    Modules outside raysim are never imported from a name read in a file."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    module, _, qualname = name.partition(":")
    if not _state_module(module):
        raise CheckpointError(f"refusing to rebuild {name!r}: not a raysim state class (see register_state_class)")
    try:
        kind: Any = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    except (ImportError, AttributeError):
        raise CheckpointError(f"cannot rebuild {name!r}: no such class in this raysim version") from None
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind) and kind.__module__ == module):
        raise CheckpointError(f"refusing to rebuild {name!r}: not a state dataclass")
    return kind


def encode_tree(value: Any, arrays: ArraySink) -> Any:
    """A JSON-able description of `value`; numpy arrays (and numpy scalars, as 0-d arrays, so that their
    dtype survives) go into `arrays` under generated keys. Any Mapping is stored as a dict."""
    if isinstance(value, (np.ndarray, np.generic)):
        key = f"a{len(arrays)}"
        arrays[key] = np.asarray(value)
        return {"__array__" if isinstance(value, np.ndarray) else "__scalar__": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        name = f"{kind.__module__}:{kind.__qualname__}"
        if name not in _REGISTERED and not _state_module(kind.__module__):
            raise TypeError(f"cannot checkpoint {name}: a state class outside raysim needs register_state_class")
        fields = {f.name: encode_tree(getattr(value, f.name), arrays) for f in dataclasses.fields(value)}
        return {"__dataclass__": name, "fields": fields}
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return {"__seq__": type(value).__name__, "items": [encode_tree(v, arrays) for v in items]}
    if isinstance(value, Mapping):  # value[k] in the loop: a lazily loaded value is let go once encoded
        return {"__dict__": [[encode_tree(k, arrays), encode_tree(value[k], arrays)] for k in value]}
    raise TypeError(f"cannot checkpoint a value of type {type(value).__name__}")


def decode_tree(node: Any, arrays: Any) -> Any:
    """Inverse of `encode_tree`; `arrays` maps keys to arrays (an open .npz reads each one when asked)."""
    if not isinstance(node, dict):
        return node
    if "__array__" in node:
        return np.asarray(arrays[node["__array__"]])
    if "__scalar__" in node:
        return arrays[node["__scalar__"]][()]
    if "__dataclass__" in node:
        kind = state_class(str(node["__dataclass__"]))
        names = {f.name for f in dataclasses.fields(kind)}
        if not set(node["fields"]) <= names:
            unknown = sorted(set(node["fields"]) - names)
            raise CheckpointError(f"{node['__dataclass__']}: the checkpoint has fields it does not have: {unknown}")
        return kind(**{k: decode_tree(v, arrays) for k, v in node["fields"].items()})
    if "__seq__" in node:
        if node["__seq__"] not in _SEQUENCES:
            raise CheckpointError(f"unknown sequence kind {node['__seq__']!r}; allowed: {', '.join(_SEQUENCES)}")
        return _SEQUENCES[node["__seq__"]](decode_tree(v, arrays) for v in node["items"])
    return {decode_tree(k, arrays): decode_tree(v, arrays) for k, v in node["__dict__"]}


class _NpzWriter:
    """An ArraySink writing each array straight into an .npz archive (the layout np.savez writes), so a
    tree is streamed to disk array by array instead of being copied whole into memory first."""

    def __init__(self, archive: zipfile.ZipFile):
        self.archive = archive
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __setitem__(self, key: str, array: np.ndarray) -> None:
        with self.archive.open(f"{key}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, array, allow_pickle=False)
        self.count += 1


def write_tree(path: str | Path, value: Any) -> str | None:
    """`save_tree`, durable, for an actor writing its part of a checkpoint: a failure to write (a full disk, a
    folder gone read-only) is returned as one line naming the file instead of raised, so that it reaches the
    driver as a message and not as a Ray task error with a remote traceback."""
    try:
        save_tree(path, value)
    except OSError as error:
        return str(error)
    return None


def save_tree(path: str | Path, value: Any, durable: bool = True) -> None:
    """Write a state tree to one .npz file atomically (write, then rename), streaming its arrays: a Mapping
    whose values load lazily (a spilling state store) is written holding one value at a time. `durable`
    fsyncs before the rename (off for scratch files that never outlive the process)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, durable) as handle, zipfile.ZipFile(handle, "w", allowZip64=True) as archive:
        arrays = _NpzWriter(archive)
        structure = encode_tree(value, arrays)
        arrays["__structure__"] = np.frombuffer(json.dumps(structure).encode(), dtype=np.uint8)


_UNREADABLE = (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError)


class TreeFile:
    """An open file written by `save_tree` whose parts are decoded on demand, reading only their arrays
    (a host restores its clients one by one instead of holding a whole checkpoint file in memory)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with self._readable():
            self._arrays = np.load(self.path, allow_pickle=False)
            self.structure: Any = json.loads(self._arrays["__structure__"].tobytes())

    @contextmanager
    def _readable(self) -> Iterator[None]:
        try:
            yield
        except CheckpointError as error:
            raise CheckpointError(f"{self.path}: {error}") from None
        except _UNREADABLE as error:
            raise CheckpointError(f"{self.path}: unreadable checkpoint file ({error})") from None

    def decode(self, node: Any) -> Any:
        """The value a part of `structure` describes."""
        with self._readable():
            return decode_tree(node, self._arrays)

    def entries(self, node: Any) -> list[tuple[Any, Any]]:
        """The (key, undecoded value) pairs of a dict in `structure`."""
        with self._readable():
            return [(decode_tree(k, self._arrays), v) for k, v in node["__dict__"]]

    def close(self) -> None:
        self._arrays.close()

    def __enter__(self) -> TreeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_tree(path: str | Path) -> Any:
    """Read a state tree written by `save_tree`."""
    with TreeFile(path) as tree:
        return tree.decode(tree.structure)


def round_dir(root: str | Path, run_id: str, round_done: int) -> Path:
    return Path(root) / run_id / f"round-{round_done:06d}"


PARTIAL = ".partial-"
"""Marks the hidden folder a round's checkpoint is written into (`.round-000010.partial-<pid>`)."""


def check_writable(folder: Path, key: str = "tracking.checkpoint_dir") -> None:
    """Refuse, in one line naming `key`, a checkpoint folder that cannot be written: below a regular file,
    read-only, not permitted. Nothing is left behind: the folder is not created here, and the probe file written
    into it (or into its nearest existing parent) is removed at once."""
    existing = nearest_existing(folder)
    if not existing.is_dir():
        raise CheckpointError(f"{key}={folder}: {existing} is a file, not a folder")
    reason = unwritable(existing)
    if reason is not None:
        raise CheckpointError(f"{key}={folder}: checkpoints cannot be written there ({reason})")


def _sync(folder: Path) -> None:
    """fsync a folder: the names created or renamed in it are on disk."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextmanager
def round_folder(final: Path) -> Iterator[Path]:
    """The folder to write one round's checkpoint into, which becomes `final` only whole: a hidden folder beside
    it, synced and renamed into place once the block completes (a checkpoint of the same round written before,
    as after resuming from an older one, is replaced). On any error it is removed; a failure to write (a full
    disk, a read-only folder, an actor's write that failed) is one CheckpointError naming `final`."""
    partial = final.with_name(f".{final.name}{PARTIAL}{os.getpid()}")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        yield partial
        _sync(partial)
        if final.exists():
            stale = final.with_name(f".{final.name}.replaced-{os.getpid()}")
            os.rename(final, stale)
            os.rename(partial, final)
            shutil.rmtree(stale)
        else:
            os.rename(partial, final)
        _sync(final.parent)
    except (OSError, CheckpointError) as error:
        raise CheckpointError(f"checkpoint {final} not written: {error}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Complete a checkpoint: the manifest is written last, atomically."""
    with atomic_file(directory / MANIFEST) as handle:
        handle.write(json.dumps({"format": FORMAT, **manifest}, indent=1).encode())


MANIFEST_KEYS = ("run_id", "round", "tracking_uri", "config", "history", "uplink_total", "downlink_total")
"""What a resumed run reads from a manifest (raysim.runtime.rounds writes them all)."""


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's manifest; one CheckpointError line naming it when it is missing, not UTF-8, not JSON, not a
    mapping (`[]`), of another format or without a key a resumed run reads (`config`)."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_bytes().decode())
    except OSError as error:
        raise CheckpointError(f"{path}: no checkpoint manifest ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: corrupt checkpoint manifest (not UTF-8 text at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: corrupt checkpoint manifest ({error})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: corrupt checkpoint manifest (a JSON {type(manifest).__name__}, not a mapping)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, expected {FORMAT}")
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing:
        raise CheckpointError(f"{path}: corrupt checkpoint manifest (no {', '.join(missing)})")
    if not isinstance(manifest["config"], str):
        raise CheckpointError(f"{path}: corrupt checkpoint manifest (its config is not YAML text)")
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
    """Delete all but the newest `keep` complete checkpoints of a run, and what a driver killed while writing one
    left behind (its hidden partial folder)."""
    complete = sorted(p for p in directory.glob("round-*") if (p / MANIFEST).exists())
    for old in [*(complete[:-keep] if keep > 0 else []), *directory.glob(f".round-*{PARTIAL}*")]:
        shutil.rmtree(old)
