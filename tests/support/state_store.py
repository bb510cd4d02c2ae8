"""What the state_store tests of several tiers share."""

from __future__ import annotations

import numpy as np

from raysim.algorithms.flame import FlameClientState


def _flame(value: float, size: int = 100) -> FlameClientState:
    return FlameClientState(np.full(size, value, np.float32), np.full(size, value, np.float32), np.zeros(size))
