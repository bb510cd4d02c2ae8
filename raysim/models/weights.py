"""Versioned weights files: a zoo model's flat float32 parameters with a header that says what they are (format
version, the model and its input/output shapes, the dataset and its classes, the training recipe, the parameter
count, the torch version) and the sha256 of the parameters' bytes. `raysim pretrain` writes them; runs read them
(`algorithm.teacher_weights`, FedPCL's `algorithm.encoder_weights`) and refuse, in one line naming the field and
the file, one that is corrupted or made for another model or other classes.

The file is an uncompressed .npz (numpy's zip of arrays, read with allow_pickle=False): `params`, the flat
float32 vector in ParamSpec order, and `header`, the header as JSON text. It is written to a temporary file next to
its destination and renamed over it (os.replace) only once complete: an interrupted write leaves no file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from raysim.errors import ConfigError

FORMAT = "raysim-weights"
FORMAT_VERSION = 1
"""The version of the header's layout; a reader refuses a file of another version."""


def checksum(params: np.ndarray) -> str:
    """sha256 of the parameters as little-endian float32 bytes, in order."""
    return hashlib.sha256(np.ascontiguousarray(params, dtype="<f4").tobytes()).hexdigest()


@dataclass(frozen=True)
class WeightsHeader:
    """What a weights file says of its parameters."""

    model: str
    """The raysim.models.zoo name of the network."""
    input_shape: tuple[int, ...]
    outputs: int
    """The network's output size: the number of classes of a classifier."""
    task: str
    layers: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) of every parameter tensor, in the flat vector's order (ParamSpec)."""
    dataset: str
    """`dataset.name` of the training data."""
    classes: int
    """The dataset's number of classes (its output size)."""
    recipe: dict[str, Any]
    """How the parameters were trained: optimizer settings, epochs, rate steps, seed, the samples' pool."""
    parameters: int
    sha256: str
    """`checksum` of the parameters."""
    torch: str
    """torch.__version__ of the writer."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> WeightsHeader:
        raw = json.loads(text)
        raw["input_shape"] = tuple(raw["input_shape"])
        raw["layers"] = tuple((name, tuple(shape)) for name, shape in raw["layers"])
        return cls(**raw)


def write_weights(path: Path, params: np.ndarray, header: WeightsHeader) -> Path:
    """Write `params` with `header` to `path` atomically (a temporary file in the same folder, fsynced, then renamed
    over `path`); whatever stops the write (an error, Ctrl-C) removes the temporary file and leaves `path` as it was."""
    params = np.ascontiguousarray(params, dtype=np.float32)
    if header.sha256 != checksum(params) or header.parameters != params.size:
        raise ValueError("write_weights: the header's checksum or parameter count is not that of the parameters")
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            np.savez(file, params=params, header=np.array(json.dumps(asdict(header), sort_keys=True)))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def read_weights(path: str | Path, key: str) -> tuple[np.ndarray, WeightsHeader]:
    """The parameters and header of the weights file at `path`, their checksum verified; `key` (the config field
    that named the file) starts the one-line ConfigError of a file that is missing, unreadable, of another format or
    version, or corrupted."""
    path = Path(path).expanduser()
    where = f"{key}: {path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file (write one with `raysim pretrain CONFIG --out {path}`)")
    if path.stat().st_size == 0:
        raise ConfigError(f"{where}: an empty file, not a raysim weights file; write one with `raysim pretrain`")
    try:
        with np.load(path, allow_pickle=False) as stored:
            params = np.asarray(stored["params"])
            header = WeightsHeader.from_json(str(stored["header"]))
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{where}: not a raysim weights file ({reason}); write one with `raysim pretrain`") from None
    if header.format != FORMAT or header.format_version != FORMAT_VERSION:
        raise ConfigError(
            f"{where}: weights format {header.format} version {header.format_version}; this raysim reads {FORMAT} "
            f"version {FORMAT_VERSION} (write it again with `raysim pretrain`)"
        )
    if params.dtype != np.float32 or params.ndim != 1 or params.size != header.parameters:
        raise ConfigError(
            f"{where}: corrupted: {params.size} {params.dtype} values, the header says {header.parameters} float32"
        )
    actual = checksum(params)
    if actual != header.sha256:
        raise ConfigError(
            f"{where}: corrupted: the parameters' sha256 is {actual[:16]}..., the header says {header.sha256[:16]}..."
        )
    return params, header


def check_model(
    header: WeightsHeader,
    key: str,
    path: str | Path,
    model: str,
    input_shape: tuple[int, ...],
    classes: int,
    layers: tuple[tuple[str, tuple[int, ...]], ...],
) -> None:
    """Refuse (one ConfigError line starting with `key` and naming the file) weights of another architecture, input
    shape, class count or parameter layout than the model they are loaded into."""
    mismatches = []
    if header.model != model:
        mismatches.append(f"model {header.model}, not {model}")
    if tuple(header.input_shape) != tuple(input_shape):
        mismatches.append(f"input shape {list(header.input_shape)}, not {list(input_shape)}")
    if header.classes != classes:
        mismatches.append(f"{header.classes} classes, not {classes}")
    if not mismatches and tuple(header.layers) != tuple(layers):
        mismatches.append("another parameter layout (made by another raysim version of the model?)")
    if mismatches:
        raise ConfigError(
            f"{key}: {Path(path).expanduser()} holds weights of {'; '.join(mismatches)} (dataset {header.dataset})"
        )
