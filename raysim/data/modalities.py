"""Samples with several named inputs (modalities), each of its own shape, some of them variable-length sequences.

A multimodal dataset is stored as every other dataset is: one float32 array `x` of shape (n, width), one row per
sample. The row packs the modalities one after another, each flattened, a sequence padded with zeros to its
longest length and followed by one column holding the sample's length. So everything that handles a dataset as
rows (the object store, partitions, client splits, batches, label poisoning, evaluation, both executors) handles a
multimodal one unchanged, with the same determinism; only the model unpacks a row into its named inputs
(raysim.models.multimodal.unpack).

`Modalities` is the shape of such a sample: as a tuple it is the packed shape (width,), which is what generic code
(the MLP, the padding of the batched executors) computes with, and it carries the named parts a multimodal model
is built from (`Dataset.input_shape`, `ModelSpec.input_shape`). No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from raysim.errors import DataError


@dataclass(frozen=True)
class Modality:
    """One named input of a sample: `shape` per sample; a `sequence` has shape (longest length, features), its
    samples may be shorter (their length is stored in the column after the padded values)."""

    name: str
    shape: tuple[int, ...]
    sequence: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise DataError(f"modality {self.name!r}: a name of letters, digits and _")
        if not self.shape or min(self.shape) < 1:
            raise DataError(f"modality {self.name}: shape {self.shape} must have positive sizes")
        if self.sequence and len(self.shape) != 2:
            raise DataError(f"modality {self.name}: a sequence has shape (longest length, features), got {self.shape}")

    @property
    def size(self) -> int:
        """Values per sample (the padded sequence's)."""
        return math.prod(self.shape)

    @property
    def width(self) -> int:
        """Columns per sample: the values, and a sequence's length."""
        return self.size + int(self.sequence)


class Modalities(tuple):
    """The packed shape (width,) of a multimodal sample, with its parts (`parts`, in packing order)."""

    parts: tuple[Modality, ...]

    def __new__(cls, parts: Sequence[Modality]) -> Modalities:
        parts = tuple(parts)
        if not parts:
            raise DataError("modalities: at least one modality")
        names = [part.name for part in parts]
        if len(set(names)) != len(names):
            raise DataError(f"modalities: names must differ, got {names}")
        shape = super().__new__(cls, (sum(part.width for part in parts),))
        shape.parts = parts
        return shape

    def __reduce__(self):  # pickled (to Ray's hosts) as its parts, not as the tuple (width,)
        return (Modalities, (self.parts,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Modalities) and self.parts == other.parts

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.parts)

    def __repr__(self) -> str:
        return (
            "Modalities("
            + ", ".join(f"{p.name}{list(p.shape)}{' variable' if p.sequence else ''}" for p in self.parts)
            + ")"
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(part.name for part in self.parts)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def part(self, name: str) -> Modality:
        return self.parts[self.names.index(name)]

    def columns(self, name: str) -> slice:
        """The columns of a packed row holding the modality's values (without a sequence's length column)."""
        start = 0
        for part in self.parts:
            if part.name == name:
                return slice(start, start + part.size)
            start += part.width
        raise KeyError(f"no modality {name!r}; the sample has {', '.join(self.names)}")

    def length_column(self, name: str) -> int:
        """The column of a packed row holding a sequence's length."""
        if not self.part(name).sequence:
            raise KeyError(f"modality {name!r} is not a sequence")
        return self.columns(name).stop

    @property
    def length_columns(self) -> tuple[int, ...]:
        """The columns holding sequence lengths (never noised: raysim.training.local.Inputs.lengths)."""
        return tuple(self.length_column(part.name) for part in self.parts if part.sequence)

    def pack(self, values: Mapping[str, np.ndarray], lengths: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Rows (n, width) float32 from each modality's values (n, *shape) and each sequence's lengths (n, in
        1..longest); values beyond a sample's length are zeroed, so a row does not depend on what was padded."""
        lengths = dict(lengths or {})
        missing = sorted(set(self.names) - set(values))
        if missing or set(values) - set(self.names):
            raise DataError(f"modalities: values for {', '.join(self.names)}, got {', '.join(sorted(values))}")
        n = len(values[self.names[0]])
        rows = np.zeros((n, self[0]), np.float32)
        for part in self.parts:
            array = np.asarray(values[part.name])
            if array.shape != (n, *part.shape):
                raise DataError(f"modality {part.name}: values of shape {(n, *part.shape)}, got {array.shape}")
            columns = self.columns(part.name)
            if not part.sequence:
                rows[:, columns] = array.reshape(n, -1)
                continue
            length = np.asarray(lengths.get(part.name, np.full(n, part.shape[0])))
            if length.shape != (n,) or (n and (length.min() < 1 or length.max() > part.shape[0])):
                raise DataError(f"modality {part.name}: {n} lengths in 1..{part.shape[0]}, got {length}")
            kept = np.arange(part.shape[0])[None, :] < length[:, None]
            rows[:, columns] = (array * kept[:, :, None]).reshape(n, -1)
            rows[:, columns.stop] = length
        return rows

    def unpack(self, rows: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Each modality's values (n, *shape) and each sequence's lengths (int64) from packed rows."""
        n = len(rows)
        values = {p.name: rows[:, self.columns(p.name)].reshape(n, *p.shape) for p in self.parts}
        lengths = {p.name: rows[:, self.length_column(p.name)].astype(np.int64) for p in self.parts if p.sequence}
        return values, lengths
