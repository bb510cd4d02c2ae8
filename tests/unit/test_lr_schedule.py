"""The per-round learning-rate schedule (`algorithm.lr_decay`, raysim.algorithms.settings.LrSchedule): at round t every
algorithm with a local rate steps its clients with lr * lr_decay^t, in both executors, and the FedSLR family (whose
0.998^t it generalizes) trains as before, when it read t from its broadcast."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from raysim.algorithms import ALGORITHMS
from raysim.algorithms.settings import LrSchedule
from raysim.config import validate_config
from tests.support.algorithms import ALGORITHMS as SETTINGS
from tests.support.algorithms import PARTITIONS, model_for, sgd_settings
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

EXTRA = {"fedavg": {}, "flame": {"lambda": 1.0, "rho": 0.25}, "fedslr": {"lambda": 1e-3, "eta_g": 1.0}}
"""The settings of the algorithms tests/unit/test_algorithms.py does not list (its ALGORITHMS has the others')."""
SCHEDULED = sorted(name for name in ALGORITHMS.names() if issubclass(ALGORITHMS.get(name).Settings, LrSchedule))
T, DECAY, LR = 3, 0.5, 0.05


def _config(name: str, executor: str, **rates: float):
    batches = {key: value for key, value in sgd_settings(name).items() if key != "lr"}
    algorithm = {"name": name, **batches, **SETTINGS.get(name, EXTRA.get(name, {})), **rates}
    return validate_config(
        tiny_config(
            algorithm=algorithm,
            model={"name": model_for(name)},
            clients={"count": 5, "per_round": 2},
            runtime={"num_hosts": 1, "client_training": executor},
            **({"partition": PARTITIONS[name]} if name in PARTITIONS else {}),
        )
    )


TRAINS_FROM_ITS_SECOND_ROUND = {"fedpcl"}
"""Methods whose first round trains nothing (FedPCL's clients only compute their first prototypes): round t - 1
runs first, rate-free, so that round t trains."""


def _round(config, round_index: int) -> tuple[dict[int, bytes], bytes]:
    """The clients' states and the global model after one round `round_index` from the initial states (after round
    `round_index - 1` for TRAINS_FROM_ITS_SECOND_ROUND)."""
    sim = InProcess(config)
    if config.algorithm.name in TRAINS_FROM_ITS_SECOND_ROUND:
        sim.round(round_index - 1)
    sim.round(round_index)
    states = {client: pickle.dumps(state) for client, state in sim.states.items()}
    return states, np.asarray(sim.coordinator.global_model()).tobytes()


def test_every_algorithm_with_a_local_rate_has_the_schedule():
    """A registered method whose settings have an `lr` decays it (LrSchedule), so `lr_decay` means one thing."""
    with_lr = sorted(name for name in ALGORITHMS.names() if "lr" in ALGORITHMS.get(name).Settings.model_fields)
    assert with_lr == SCHEDULED and {"fedavg", "fedslr", "perfedavg", "apfl", "scaffold", "flame"} <= set(SCHEDULED)


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", SCHEDULED)
def test_round_t_steps_with_lr_times_decay_to_the_t(name, executor, tmp_path, monkeypatch):
    """Round t with (lr, lr_decay) gives, bit for bit, the round t of a constant rate lr * lr_decay^t (every rate of
    `decayed_rates`), and not that of the constant lr: whatever uses the rate in the client step (SGD requests, its
    own loop, control variates)."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))  # FedLP's pretrained model
    settings = _config(name, executor, lr=LR).algorithm
    rates = {rate: getattr(settings, rate) for rate in settings.decayed_rates}
    at_t = {rate: value * DECAY**T for rate, value in rates.items() if value is not None}
    decayed = _round(_config(name, executor, **rates, lr_decay=DECAY), T)
    assert decayed == _round(_config(name, executor, **at_t, lr_decay=1.0), T), name
    assert decayed != _round(_config(name, executor, **rates, lr_decay=1.0), T), name


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", ["fedslr", "feddyn", "gpgd", "lpgd"])
def test_the_fedslr_family_trains_as_when_its_broadcast_carried_the_round(name, executor):
    """Before the schedule was general, FedSLR, FedDyn, GPGD and LPGD sent t with the model and their client step
    used lr * lr_decay^t: run that way (each round's clients stepped by a copy of the algorithm whose settings hold
    that rate, lr_decay 1) and the general way, three rounds give the same model bit for bit (on the tiny problem
    below, both also equal the global models computed before the change)."""
    config = _config(name, executor, lr=0.1, lr_decay=0.8)
    general, previous = InProcess(config), InProcess(config)
    algorithm = previous.host.steps.algorithm
    for round_index in range(3):
        rate = config.algorithm.lr * config.algorithm.lr_decay**round_index
        by_round = copy.copy(algorithm)
        by_round.settings = algorithm.settings.model_copy(update={"lr": rate, "lr_decay": 1.0})
        previous.host.steps.algorithm = by_round
        previous.round(round_index)
        general.round(round_index)
    assert np.array_equal(general.coordinator.global_model(), previous.coordinator.global_model())
    assert pickle.dumps(general.states) == pickle.dumps(previous.states)
