"""Client states: a FLAME state of given values, and bit-for-bit equality of two states."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from raysim.algorithms.flame import FlameClientState


def assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Same types all the way down, arrays with the same dtype, shape, order and bytes, floats bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.flags.f_contiguous == b.flags.f_contiguous, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, (np.generic, float)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes() and np.asarray(a).dtype == np.asarray(b).dtype, where
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            assert_identical(getattr(a, field.name), getattr(b, field.name), f"{where}.{field.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for (k, x), (j, y) in zip(a.items(), b.items(), strict=True):
            assert_identical(k, j, f"{where} key")
            assert_identical(x, y, f"{where}[{k!r}]")
    else:
        assert a == b, where


def flame_state(value: float, size: int = 100) -> FlameClientState:
    return FlameClientState(np.full(size, value, np.float32), np.full(size, value, np.float32), np.zeros(size))
