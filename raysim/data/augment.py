"""Image augmentation on stored arrays: the random crop after padding and the horizontal flip that training
(`dataset.augment: crop_flip`, raysim.training.local) and AugFL's server transfer set (`algorithm.server_augment`)
both apply."""

from __future__ import annotations

import numpy as np


def crop_flip(
    rows: np.ndarray, corners: np.ndarray, flips: np.ndarray, padding: int, fill: np.ndarray | float = 0.0
) -> np.ndarray:
    """Each image (n, C, H, W) padded by `padding` on each side with `fill` (a value, or one per channel), cropped
    back to H x W with its top-left corner at `corners[i]` (row, column in the padded image), flipped left-right
    where `flips[i]`."""
    n, channels, height, width = rows.shape
    padded = np.empty((n, channels, height + 2 * padding, width + 2 * padding), rows.dtype)
    padded[...] = np.broadcast_to(np.asarray(fill, rows.dtype).reshape(-1, 1, 1), (channels, 1, 1))
    padded[:, :, padding : padding + height, padding : padding + width] = rows
    top = corners[:, :1] + np.arange(height)
    left = corners[:, 1:] + np.arange(width)
    left = np.where(flips[:, None], left[:, ::-1], left)
    return padded[
        np.arange(n)[:, None, None, None],
        np.arange(channels)[None, :, None, None],
        top[:, None, :, None],
        left[:, None, None, :],
    ]
