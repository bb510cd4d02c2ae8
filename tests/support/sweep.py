"""What the sweep tests of several tiers share."""

from __future__ import annotations

from tests.support.experiments import tiny_config


def sweep_data(**extra) -> dict:
    return {"name": "s", "base": tiny_config(), **extra}
