"""A small classification problem for the tests of methods that act on a model's features and head (FedProto,
FedRoD): every client holds the same number of samples of each class it has."""

from __future__ import annotations

import numpy as np

from raysim.algorithms.interface import ClientInfo
from raysim.data.scheme import ClientSplit
from raysim.models.flat import ModelSpec
from raysim.runtime.problem import Problem

CLASSES, DIM = 3, 6


def labelled_problem(
    clients: int, per_class: int, seed: int, held: list[list[int]] | None = None, model: str = "mlp"
) -> Problem:
    """`clients` clients with `per_class` training samples of each class they hold (`held[i]`, default all
    CLASSES) and 3 test samples, Gaussian features around a mean per class."""
    generator = np.random.default_rng(seed)
    centers = 2.0 * generator.normal(size=(CLASSES, DIM))
    xs, ys, entries, offset = [], [], [], 0
    for i in range(clients):
        classes = list(range(CLASSES)) if held is None else held[i]
        labels = np.concatenate([np.repeat(classes, per_class), generator.choice(classes, 3)])
        xs.append(centers[labels] + generator.normal(size=(len(labels), DIM)))
        ys.append(labels)
        train = np.arange(offset, offset + len(labels) - 3)
        test = np.arange(offset + len(labels) - 3, offset + len(labels))
        offset += len(labels)
        split = ClientSplit(i, train, test, np.array([], np.int64))
        entries.append((ClientInfo(i, len(train), 1.0 / clients, clients), split))
    spec = ModelSpec(model, (DIM,), CLASSES, "classification")
    return Problem(
        x=np.concatenate(xs).astype(np.float32),
        y=np.concatenate(ys).astype(np.int64),
        model_spec=spec,
        clients=entries,
        init_params=spec.build().initial_parameters(seed),
    )
