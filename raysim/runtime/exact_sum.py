"""Order-independent sums of client uploads.

Floating-point addition is not associative, so summing the same uploads grouped by 1 host or by 3 hosts
would give slightly different totals, and training would drift apart. Instead every vector entry is
rounded once to a fixed-point integer (resolution 2^-32, about 2.3e-10) and the integers are added:
integer addition is exact, so the total is the same whatever the grouping or order. The rounding is
far below float32 precision for any weight of magnitude above 1e-2.

Range: totals must stay within +-2^31. Each term is checked against 2^31 / num_terms_max, so a value
beyond it (a diverged run, e.g. too large a learning rate) is refused instead of wrapping around.

A host adds a chunk of clients' uploads at once (`add_rows`): the rows of a stacked upload are checked and
rounded in one compiled pass each (raysim.jit), into one running integer total per field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raysim.jit import kernel

SCALE = 2.0**32
TOTAL_LIMIT = 2.0**31


class UploadRangeError(ArithmeticError):
    """An upload is not finite or too large to be summed exactly: the run has diverged."""


@dataclass
class PartialSum:
    """A sum of uploads of one type, held as exact integers (int64 arrays shaped like one upload's fields, 0-d
    for numbers); merge with `+`."""

    upload_type: type
    fields: dict[str, np.ndarray]
    count: int
    messages: dict[int, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    """Per client: (message sent, previous message for delta uploads); filled only for robust aggregation."""

    def __add__(self, other: PartialSum) -> PartialSum:
        assert self.upload_type is other.upload_type
        fields = {name: self.fields[name] + other.fields[name] for name in self.fields}
        return PartialSum(self.upload_type, fields, self.count + other.count, self.messages | other.messages)

    def decode(self) -> Any:
        """The total as an upload of the original type, vectors as float64 and numbers as floats."""
        sums = {name: np.asarray(v, dtype=np.float64) / SCALE for name, v in self.fields.items()}
        values = {name: (float(v) if v.ndim == 0 else v) for name, v in sums.items()}
        return self.upload_type(**values)


def add_rows(
    total: PartialSum | None, upload: Any, client_ids: Sequence[int], max_terms: int
) -> tuple[PartialSum | None, list[int]]:
    """Add the uploads of `client_ids`, the rows of a stacked upload (each field [k, ...] for k clients; see
    raysim.execution.stacking.stack), to `total` (None: start a sum). A client whose upload has a NaN, an inf or an
    entry beyond the range of exact summation is left out; returns the sum (None if nothing was added) and the
    ids of the clients left out (`rejection` says why)."""
    count = len(client_ids)
    limit = TOTAL_LIMIT / max(max_terms, 1)
    values = {f.name: np.asarray(getattr(upload, f.name)) for f in dataclasses.fields(upload)}
    rows = {name: value.reshape(count, -1) for name, value in values.items()}
    largest = max(rows, key=lambda name: rows[name].shape[1], default=None)
    accepted = np.ones(count, bool)
    for name, value in rows.items():  # the small fields first, so that the largest is read once
        if name != largest:
            accepted &= _finite_within(value, limit)
    if total is None:
        fields = {name: np.zeros(value.shape[1:], np.int64) for name, value in values.items()}
        total = PartialSum(type(upload), fields, 0)
    for name in sorted(rows, key=lambda name: name != largest):  # the largest first: it may still refuse rows
        _add_checked(rows[name], limit, accepted, total.fields[name].reshape(-1))
    added = int(accepted.sum())
    total.count += added
    return (total if total.count else None), [c for c, ok in zip(client_ids, accepted, strict=True) if not ok]


def encode(upload: Any, max_terms: int, client_id: int) -> PartialSum:
    """One client's upload as a PartialSum of one term; raises UploadRangeError (naming the client and the field)
    when it cannot be summed exactly."""
    stacked = dataclasses.replace(
        upload, **{f.name: np.asarray(getattr(upload, f.name))[None] for f in dataclasses.fields(upload)}
    )
    total, rejected = add_rows(None, stacked, [client_id], max_terms)
    if rejected or total is None:  # its one term refused
        raise UploadRangeError(rejection(upload, max_terms, client_id))
    return total


def rejection(upload: Any, max_terms: int, client_id: int) -> str:
    """Why one client's upload cannot be summed exactly (the first offending field)."""
    limit = TOTAL_LIMIT / max(max_terms, 1)
    for f in dataclasses.fields(upload):
        peak = float(np.max(np.abs(np.asarray(getattr(upload, f.name))), initial=0.0))  # NaN and inf propagate
        if not math.isfinite(peak):
            return f"client {client_id}: upload field {f.name!r} has NaN or inf values"
        if peak >= limit:
            return (
                f"client {client_id}: upload field {f.name!r} has |value| {peak:.3g} >= {limit:.3g}, beyond the "
                "range of exact summation; the run has diverged (lower the learning rate or penalty)"
            )
    return f"client {client_id}: upload can be summed"


@kernel
def _row_within(values: np.ndarray, row: int, limit: float) -> bool:
    """Every entry of the row finite and below `limit` in magnitude (a NaN compares false)."""
    ok = True
    for j in range(values.shape[1]):
        ok &= abs(values[row, j]) < limit
    return ok


@kernel
def _finite_within(values: np.ndarray, limit: float) -> np.ndarray:
    """Per row: `_row_within`."""
    within = np.empty(values.shape[0], np.bool_)
    for i in range(values.shape[0]):
        within[i] = _row_within(values, i, limit)
    return within


@kernel
def _add_checked(values: np.ndarray, limit: float, accepted: np.ndarray, total: np.ndarray) -> None:
    """total += round(v * 2^32) of each accepted row (int64: exact, so the same total in any order), after checking
    the row (left in the cache for the sum): a row with an entry not finite or beyond `limit` is not added and
    no longer accepted."""
    count, n = values.shape
    for i in range(count):
        if not accepted[i]:
            continue
        ok = _row_within(values, i, limit)
        accepted[i] = ok
        if ok:
            for j in range(n):
                total[j] += np.int64(np.rint(np.float64(values[i, j]) * 4294967296.0))
