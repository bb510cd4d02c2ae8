"""The averaging family: a server that takes the weighted mean of what this round's clients upload.

Weighted-average servers (`weight_field` set: FedAvg flame.md 2.3, FedProx, Ditto flame.md 2.4, FedAlt and
FedSim fedapm.md 4.3). The global model is the weighted mean of this round's selected clients' messages:

    w = sum_{i in S} a_i x_i / sum_{i in S} a_i

Each client uploads a_i * x_i and a_i (`WeightedUpload`); the runtime sums both exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.algorithms.families.consensus import server_metrics
from raysim.algorithms.interface import Upload
from raysim.algorithms.requests import Number, Vector


@dataclass
class WeightedUpload(Upload):
    """An averaging client's upload: its message times its weight, a_i x_i, and a_i."""

    weighted: Vector
    weight: Number

    message_field = "weighted"
    weight_field = "weight"


def upload_weight(num_train: Number, aggregation: str) -> np.ndarray:
    """A client's weight in a WeightedUpload (float32; one per row of a chunk): its training-set size n_i with
    `aggregation: samples` (McMahan et al.), else 1."""
    samples = np.asarray(num_train, np.float32)
    return samples if aggregation == "samples" else np.ones_like(samples)


def weighted_average(total: Upload, previous: Vector) -> tuple[Vector, dict[str, float]]:
    """sum(weight * message) / sum(weight) over the selected clients (float32), and the server metrics.

    `previous` is the current global model (for `global_change`)."""
    if total.delta or total.message_field is None or total.weight_field is None:
        kind = type(total).__name__
        raise TypeError(f"weighted_average needs an Upload with message_field and weight_field, got {kind}")
    model = (getattr(total, total.message_field) / getattr(total, total.weight_field)).astype(np.float32)
    return model, server_metrics(model, previous)
