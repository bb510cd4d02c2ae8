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
    """A client's vector [n] as one row [1, n], a chunk's rows [k, n] as they are (a view, no copy)."""
    return vector.reshape(-1, vector.shape[-1])


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
