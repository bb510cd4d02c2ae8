"""Every algorithm's small settings (those a tiny run needs beyond the defaults), the partitions some need, and
watching a run's client states."""

from __future__ import annotations

import dataclasses

import numpy as np

from raysim.algorithms import ALGORITHMS as RAYSIM_ALGORITHMS
from raysim.config import validate_config
from raysim.runtime.problem import sample_clients
from tests.support.experiments import tiny_config

SGD = {"lr": 0.05, "batch_size": 32}


def sgd_settings(name: str) -> dict[str, float]:
    """SGD's small settings, those of them the algorithm's settings have (AFL has a rate and no batches, KD only
    neither)."""
    fields = RAYSIM_ALGORITHMS.get(name).Settings.model_fields
    return {key: value for key, value in SGD.items() if key in fields}


def model_for(name: str) -> str:
    """The model a tiny run of the algorithm takes: its own (FedBN: a BatchNorm one), a model of several layers for a
    split method, else MLR."""
    return MODELS.get(name, "mlp" if name in SPLIT else "mlr")


def algorithm_config(name: str, model: str | None = None, settings: dict | None = None, **sections):
    """A tiny run of the algorithm: 5 clients, 2 a round, 3 rounds, on `model` (default: `model_for`), with
    `settings` over its tiny ones."""
    return validate_config(
        tiny_config(
            algorithm={"name": name, **sgd_settings(name), **ALGORITHMS[name], **(settings or {})},
            model={"name": model or model_for(name)},
            clients={"count": 5, "per_round": 2},
            rounds=3,
            **({"partition": PARTITIONS[name]} if name in PARTITIONS else {}),
            **sections,
        )
    )


def state_bytes(state: object) -> dict[str, bytes]:
    return {f.name: np.asarray(getattr(state, f.name)).tobytes() for f in dataclasses.fields(state)}


class StateWatch:
    """Compares every client's state after a round with the one before, bit for bit."""

    def __init__(self, name: str, seed: int):
        self.name, self.seed = name, seed
        self.previous: dict[int, dict[str, bytes]] = {}
        self.rounds: list[int] = []

    def check(self, round_index: int, states: dict[int, object]) -> None:
        selected = sample_clients(self.seed, round_index, 5, 2)
        current = {c: state_bytes(s) for c, s in states.items()}
        for client, state in current.items():
            if client in selected and state:
                assert state != self.previous.get(client), f"{self.name}: selected client {client} did not change"
            elif client not in selected and self.previous:
                assert state == self.previous[client], f"{self.name}: unselected client {client} changed"
        self.previous = current
        self.rounds.append(round_index)


SPLIT = (
    "fedapm",
    "fedalt",
    "fedsim",
    "fedrep",
    "lg_fedavg",
    "fedproto",
    "fedrod",
    "fedcp",
    "fedper",
    "fedbabu",
    "feddbe",
    "fedas",
    "fedpac",
    "fedgen",
    "gpfl",
)
"""Algorithms that need a model of several layers (a personal and a shared part, a body and a head)."""

MODELS = {"fedbn": "mlp_bn", "pfedla": "mlp"}
"""Algorithms that need a model of their own."""


ALGORITHMS = {
    "fedadmm": {"rho": 0.25},
    "fedprox": {"mu": 0.1},
    "pfedme": {"lambda": 1.0},
    "ditto": {"lambda": 1.0},
    "fedapm": {"rho": 0.25},
    "fedalt": {},
    "fedsim": {},
    "local": {},
    "scaffold": {},
    "feddyn": {"alpha": 0.1},
    "gpgd": {"lambda": 0.01},
    "lpgd": {"lambda": 0.01},
    "fedrep": {"head_epochs": 2},
    "lg_fedavg": {},
    "fedspa": {"density": 0.5},
    "perfedavg": {"alpha": 0.05},
    "apfl": {"adaptive_alpha": True},
    "lp_proj": {"lambda": 1.0, "rho": 0.25, "d_sub": 3},
    "fedproto": {"lambda": 1.0},
    "fedrod": {},
    "fedlp": {"teacher_epochs": 1},
    "fedala": {},
    "fedcp": {},
    "kd_only": {"teacher_epochs": 1, "transfer": {"negatives": 32}},
    "fedpcl": {"teacher_epochs": 1},
    "moon": {"mu": 1.0},
    "fedavgm": {},
    "fedopt": {"server_optimizer": {"kind": "yogi", "lr": 0.01}},
    "fedper": {},
    "fedbabu": {"finetune_epochs": 1},
    "fedbn": {},
    "qffl": {"q": 1.0},
    "term": {"tilt": 0.5},
    "afl": {"lambda_lr": 0.05},
    "fedntd": {},
    "fedlc": {},
    "cfl": {"warmup": 1, "eps1": 10.0, "eps2": 0.0},
    "feddbe": {},
    "fedcac": {"tau": 0.5, "beta": 2.0},
    "fedamp": {"alpha_k": 0.2},
    "fedas": {},
    "pfedhn": {"local_steps": 3},
    "fedpac": {"lambda": 1.0},
    "fedfomo": {"num_models": 2},
    "apple": {"local_steps": 2, "p_lr": 0.01, "decay_rounds": 2},
    "fedgen": {"generator_steps": 5, "beta": 1.0},
    "fedkd": {"ramp_rounds": 3, "t_start": 0.5, "t_end": 0.9},
    "gpfl": {"lambda": 0.01, "mu": 0.1},
    "pfedla": {"hn_lr": 0.5},
    "knnper": {"k": 3},
    "fedem": {"components": 2},
}
"""Each algorithm's settings for a tiny run (tests/unit/test_algorithms.py checks that every registered one has an
entry or is in ELSEWHERE)."""

ELSEWHERE = {"flame", "fedavg", "fedslr", "augfl"}
"""Algorithms whose tiny runs live in their own test modules (their settings there: test_flame.py, ...)."""


META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 64}


PARTITIONS = {
    "fedlp": META,
    "kd_only": META,
    "fedpcl": META,
    "fedfomo": {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.2},
}
"""Partitions other than tiny_config's: the PM-aided methods need the meta partition's held-back pools, FedFomo a
validation split."""


FLAME = {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "epochs": 3}
