"""What the algorithms tests of several tiers share."""

from __future__ import annotations

import dataclasses

import numpy as np

from raysim.config import validate_config
from raysim.runtime.problem import sample_clients
from tests.support.experiments import tiny_config
from tests.support.settings import ALGORITHMS, PARTITIONS, SPLIT

SGD = {"lr": 0.05, "batch_size": 32}


NO_LOCAL_TRAINING = ("kd_only",)
"""Algorithms without local SGD settings."""


def _config(name: str, **sections):
    return validate_config(
        tiny_config(
            algorithm={"name": name, **({} if name in NO_LOCAL_TRAINING else SGD), **ALGORITHMS[name]},
            model={"name": "mlp" if name in SPLIT else "mlr"},
            clients={"count": 5, "per_round": 2},
            rounds=3,
            **({"partition": PARTITIONS[name]} if name in PARTITIONS else {}),
            **sections,
        )
    )


def _bytes(state: object) -> dict[str, bytes]:
    return {f.name: np.asarray(getattr(state, f.name)).tobytes() for f in dataclasses.fields(state)}


class StateWatch:
    """Compares every client's state after a round with the one before, bit for bit."""

    def __init__(self, name: str, seed: int):
        self.name, self.seed = name, seed
        self.previous: dict[int, dict[str, bytes]] = {}
        self.rounds: list[int] = []

    def check(self, round_index: int, states: dict[int, object]) -> None:
        selected = sample_clients(self.seed, round_index, 5, 2)
        current = {c: _bytes(s) for c, s in states.items()}
        for client, state in current.items():
            if client in selected and state:
                assert state != self.previous.get(client), f"{self.name}: selected client {client} did not change"
            elif client not in selected and self.previous:
                assert state == self.previous[client], f"{self.name}: unselected client {client} changed"
        self.previous = current
        self.rounds.append(round_index)
