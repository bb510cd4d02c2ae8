"""Rounds of the split-model methods (FedRep, LG-FedAvg, FedSPA) on the in-process host, each selected client's
step recomputed from its state before the round."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from raysim.config import validate_config
from raysim.execution.drivers import run_client_step
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

SGD = {"lr": 0.05, "batch_size": 32}


def simulate(algorithm: dict, rounds: int = 2, model: str = "mlp", **sections) -> InProcess:
    config = tiny_config(algorithm={**SGD, **algorithm}, model={"name": model}, clients={"count": 5, "per_round": 3})
    sim = InProcess(validate_config({**config, **sections}))
    for round_index in range(rounds):
        sim.round(round_index)
    return sim


def check_round(algorithm: dict, selected: list[int], model: str = "mlp") -> tuple[InProcess, list]:
    """One round of `selected` after a first one, one client at a time; every selected client's step recomputed
    from its state before the round with the host's own executor (the same draws, the same bits); unselected
    clients' states must stay bit for bit. Returns the simulation and the recomputed updates."""
    sim = simulate(algorithm, rounds=1, model=model, runtime={"num_hosts": 2, "client_training": "sequential"})
    before = {c: dataclasses.replace(s) for c, s in sim.states.items()}
    broadcast = sim.coordinator.broadcast()
    expected = [
        run_client_step(
            sim.host.algorithm, sim.host.info[c], before[c], broadcast, sim.host.steps.client_executor(c, 1)
        )
        for c in selected
    ]
    sim.round(1, selected)
    for client, state in sim.states.items():
        for field in dataclasses.fields(state):
            got, was = getattr(state, field.name), getattr(before[client], field.name)
            if client in selected:
                want = getattr(expected[selected.index(client)].state, field.name)
                np.testing.assert_array_equal(got, want, err_msg=f"client {client} {field.name}")
            else:
                assert got.tobytes() == was.tobytes(), f"unselected client {client} changed its {field.name}"
    return sim, expected


class RecordedStep(NamedTuple):
    update: Any
    requests: list
    results: list


def step_results(sim: InProcess, client: int, broadcast) -> RecordedStep:
    """Client `client`'s step from its current state on `broadcast`, run with the host's own executor (the same
    draws as a round): its update, and its requests and their results, in order."""
    requests: list = []
    results: list = []
    execute = sim.host.steps.client_executor(client, 1)

    def run(request):
        requests.append(request)
        results.append(execute(request))
        return results[-1]

    update = run_client_step(sim.host.algorithm, sim.host.info[client], sim.states[client], broadcast, run)
    return RecordedStep(update, requests, results)
