"""One round that checks a configuration runs and logs, not what it learns: light local training."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raysim.algorithms import ALGORITHMS

LIGHT = {"epochs": 1, "head_epochs": 1, "phase2_epochs": 1}
"""A matrix cell or a shipped config's one-round run checks that its settings run together and log every key, not
what they learn: every pass count above one is one (FedSLR's setting trains 2 epochs at batch 20, ten times
FedAvg's work), and batches are at least 100 samples."""


def light_training(algorithm: Mapping[str, Any]) -> dict[str, Any]:
    """The algorithm section's local-training settings made light (LIGHT), where its settings have them."""
    fields = ALGORITHMS.get(algorithm["name"]).Settings.model_fields
    light = {key: value for key, value in LIGHT.items() if key in fields}
    if "batch_size" in fields:
        light["batch_size"] = max(100, algorithm.get("batch_size", fields["batch_size"].default))
    return light
