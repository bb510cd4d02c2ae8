"""Order-independent sums of client uploads.

Floating-point addition is not associative, so summing the same uploads grouped by 1 host or by 3 hosts
would give slightly different totals, and training would drift apart. Instead every vector entry is
rounded once to a fixed-point integer (resolution 2^-32, about 2.3e-10) and the integers are added:
integer addition is exact, so the total is the same whatever the grouping or order. The rounding is
far below float32 precision for any weight of magnitude above 1e-2.

Range: totals must stay within +-2^31. Each term is checked against 2^31 / num_terms_max, so a value
beyond it (a diverged run, e.g. too large a learning rate) raises instead of wrapping around.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCALE = 2.0**32
TOTAL_LIMIT = 2.0**31


class UploadRangeError(ArithmeticError):
    """An upload is not finite or too large to be summed exactly: the run has diverged."""


@dataclass
class PartialSum:
    """A sum of uploads of one type, held as exact integers; merge with `+`."""

    upload_type: type
    fields: dict[str, np.ndarray | int]
    count: int
    messages: dict[int, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    """Per client: (message sent, previous message for delta uploads); filled only for robust aggregation."""

    def __add__(self, other: PartialSum) -> PartialSum:
        assert self.upload_type is other.upload_type
        fields = {name: self.fields[name] + other.fields[name] for name in self.fields}
        return PartialSum(self.upload_type, fields, self.count + other.count, self.messages | other.messages)

    def __iadd__(self, other: PartialSum) -> PartialSum:
        """Add `other` into this sum in place (a host accumulating its clients' terms without a new array each)."""
        assert self.upload_type is other.upload_type
        for name, value in other.fields.items():
            if isinstance(value, np.ndarray):
                self.fields[name] += value  # type: ignore[operator]
            else:
                self.fields[name] = self.fields[name] + value
        self.count += other.count
        self.messages.update(other.messages)
        return self

    def decode(self) -> Any:
        """The total as an upload of the original type, vectors as float64."""
        values = {name: np.asarray(v, dtype=np.float64) / SCALE for name, v in self.fields.items()}
        values = {name: (float(v) if v.ndim == 0 else v) for name, v in values.items()}
        return self.upload_type(**values)


def encode(upload: Any, max_terms: int, client_id: int) -> PartialSum:
    """One client's upload as a PartialSum of one term."""
    limit = TOTAL_LIMIT / max(max_terms, 1)
    fields: dict[str, np.ndarray | int] = {}
    for f in dataclasses.fields(upload):
        value = np.asarray(getattr(upload, f.name))
        peak = float(np.max(np.abs(value), initial=0.0))  # NaN and inf propagate to the peak
        if not math.isfinite(peak):
            raise UploadRangeError(f"client {client_id}: upload field {f.name!r} has NaN or inf values")
        if peak >= limit:
            raise UploadRangeError(
                f"client {client_id}: upload field {f.name!r} has |value| {peak:.3g} >= {limit:.3g}, beyond the "
                "range of exact summation; the run has diverged (lower the learning rate or penalty)"
            )
        scaled = np.multiply(value, SCALE, out=np.empty(value.shape))  # float64, in two passes over the entries
        np.rint(scaled, out=scaled)
        fields[f.name] = int(scaled) if scaled.ndim == 0 else scaled.astype(np.int64)
    return PartialSum(type(upload), fields, 1)
