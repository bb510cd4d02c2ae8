"""Runs of one algorithm through the sequential and the vectorized executor, compared within float tolerance."""

from __future__ import annotations

import dataclasses

import numpy as np

from raysim.config import validate_config
from raysim.training.local import ClientData
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

INPUT = (2, 3, 4)


CLASSES = 5


EMPTY = np.array([], np.int64)


def client_data(
    sizes: list[int], seed: int, noisy: int = -1, poisoned: int = -1, private: int = -1
) -> list[ClientData]:
    """Clients with `sizes` training samples each, drawn shuffled from one shared dataset; client `noisy` has
    feature noise, `poisoned` random labels and `private` its own feature array."""
    source = np.random.default_rng(seed)
    total = sum(sizes) + 3  # a few samples nobody trains on
    x = source.normal(size=(total, *INPUT)).astype(np.float32)
    y = source.integers(0, CLASSES, total).astype(np.int64)
    owners = source.permutation(total)
    clients, start = [], 0
    for i, size in enumerate(sizes):
        features = x + 1.0 if i == private else x
        noise, labels = (0.3 if i == noisy else 0.0), (CLASSES if i == poisoned else 0)
        clients.append(ClientData(features, y, owners[start : start + size], EMPTY, EMPTY, noise, labels))
        start += size
    return clients


def run_executor(algorithm: dict, mode: str, rounds: int = 3, **sections):
    runtime = {"num_hosts": 2, "client_training": mode, "vectorize_chunk": 3}
    config = validate_config(tiny_config(algorithm=algorithm, runtime=runtime, **sections))
    sim = InProcess(config)
    metrics = [sim.round(r) for r in range(rounds)]
    return sim, metrics


def assert_close_runs(sequential, vectorized, atol: float = 1e-5) -> None:
    (sim_s, metrics_s), (sim_v, metrics_v) = sequential, vectorized
    np.testing.assert_allclose(sim_v.coordinator.global_model(), sim_s.coordinator.global_model(), atol=atol)
    for want, got in zip(metrics_s, metrics_v, strict=True):
        assert want.keys() == got.keys()
        keys = [k for k in want if "seconds" not in k]  # timings differ from run to run
        np.testing.assert_allclose([got[k] for k in keys], [want[k] for k in keys], rtol=1e-4, atol=atol)
    states_s, states_v = sim_s.states, sim_v.states
    for client, state in states_s.items():
        for field in dataclasses.fields(state):
            want, got = np.asarray(getattr(state, field.name)), np.asarray(getattr(states_v[client], field.name))
            np.testing.assert_allclose(got, want, atol=atol, err_msg=f"client {client} {field.name}")
