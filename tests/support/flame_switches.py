"""What the flame_switches tests of several tiers share."""

from __future__ import annotations

FLAME = {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "epochs": 3}
