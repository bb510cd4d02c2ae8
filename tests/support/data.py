"""What the data tests of several tiers share."""

from __future__ import annotations

import numpy as np


def _write_npz(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)
