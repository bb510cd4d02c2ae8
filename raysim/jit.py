"""Compiled loops (numba) for the per-client passes that numpy cannot fuse.

A client's vectors have 10^4-10^7 entries. In numpy every operation of an update is its own pass over memory
with a fresh temporary: FLAME's three update equations and its diagnostics took about 25 passes, 0.65 ms per
MLP client, while one pass that reads the inputs once and writes the outputs once takes 0.1 ms. A `kernel` is
such a pass: a plain Python loop over rows (clients) and entries that numba compiles on first use and caches on
disk. Its arithmetic is numpy's IEEE float32 arithmetic in the order written (no fast-math), so an equation
gives the bits numpy would; only the sums that `add_square` accumulates may be reassociated, so that they
vectorize (a norm's last bits may then depend on the CPU's vector width, never on which clients share a chunk).

Kernels take 2-D rows (clients x entries); `rows` views one client's vector as a single row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import numba
import numpy as np

F = TypeVar("F", bound=Callable)


def kernel(function: F) -> F:
    """Compile `function` with numba (no Python objects inside, no GIL held, cached on disk; division by zero
    gives inf or nan as in numpy instead of raising)."""
    compiled = numba.njit(cache=True, nogil=True, error_model="numpy")(function)
    return compiled  # type: ignore[return-value]  # numba's Dispatcher is called as the function it compiles


@numba.njit(fastmath={"reassoc"}, cache=True)
def add_square(total, value):
    """total + value^2, reassociable: a loop that accumulates with it vectorizes (the sum's order may change)."""
    return total + value * value


def rows(vector: np.ndarray) -> np.ndarray:
    """A client's vector [n] as one row [1, n], a chunk's rows [k, n] as they are (a view, no copy); the count of rows
    is named, not -1: numpy cannot infer it for zero-width rows (n = 0)."""
    return vector.reshape(math.prod(vector.shape[:-1]), vector.shape[-1])


@kernel
def _row_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    count, n = a.shape
    shared = b.shape[0] == 1
    out = np.empty(count, np.float64)
    for i in range(count):
        other = 0 if shared else i
        total = np.float32(0.0)
        for j in range(n):
            total = add_square(total, a[i, j] - b[other, j])
        out[i] = np.sqrt(total)
    return out


def distances(a: np.ndarray, b: np.ndarray) -> np.ndarray | float:
    """||a_i - b_i|| of each row (b may be one vector shared by all rows); a number for one client's vectors."""
    found = _row_distances(rows(a), rows(b))
    return float(found[0]) if a.ndim == 1 else found


@kernel
def _row_norms(a: np.ndarray) -> np.ndarray:
    count, n = a.shape
    out = np.empty(count, np.float64)
    for i in range(count):
        total = 0.0
        for j in range(n):
            total = add_square(total, np.float64(a[i, j]))
        out[i] = np.sqrt(total)
    return out


def norms(a: np.ndarray) -> np.ndarray | float:
    """||a_i|| of each row, summed in float64 as `np.linalg.norm` of a float64 copy sums, in one pass without the
    copy (the copy and its squares cost 30 times the pass: 3.4 ms per 16 MLP clients); a number for one vector."""
    found = _row_norms(rows(np.asarray(a)))
    return float(found[0]) if np.ndim(a) == 1 else found


@kernel
def _segment_distances(a: np.ndarray, b: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple:
    count = a.shape[0]
    norm_sums, l2 = np.empty(count, np.float64), np.empty(count, np.float64)
    for i in range(count):
        norm_sum = squares = 0.0
        for segment in range(len(starts)):
            row, reference = a[i, starts[segment] : stops[segment]], b[starts[segment] : stops[segment]]
            total = 0.0
            for j in range(len(row)):  # over slices: this loop vectorizes, one indexed by the bounds did not (9 x)
                total = add_square(total, np.float64(row[j]) - np.float64(reference[j]))
            norm_sum += np.sqrt(total)
            squares += total
        norm_sums[i], l2[i] = norm_sum, np.sqrt(squares)
    return norm_sums, l2


def segment_distances(
    a: np.ndarray, b: np.ndarray, starts: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | tuple[float, float]:
    """Over the segments [starts[s], stops[s]) of each row a_i against the vector b, in float64: the sum of the
    segments' norms sum_s ||a_i[s] - b[s]|| and the norm over all of them sqrt(sum_s ||a_i[s] - b[s]||^2) (per-tensor
    Frobenius norms and their L2, e.g. a split method's deviation); numbers for one vector, [k] arrays for rows."""
    sums, l2 = _segment_distances(
        rows(np.asarray(a)), np.asarray(b).reshape(-1), np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    )
    return (float(sums[0]), float(l2[0])) if np.ndim(a) == 1 else (sums, l2)
