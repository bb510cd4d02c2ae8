"""What the multimodal tests of several tiers share."""

from __future__ import annotations

SMALL_CRISIS = {"name": "crisismmd_synthetic", "samples": 120, "image_dim": 24, "text_dim": 8, "tokens": 6}
"""A CrisisMMD-shaped substitute small enough to train in milliseconds (the models read their sizes from it)."""
