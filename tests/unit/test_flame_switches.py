"""The FLAME authors' switches spec 9 lists (flame.md 9.5, 9.7, 9.16): random local epochs (their --fixed 0), a
zero initial model, deterministic cuDNN kernels, on the real trainers, hosts and coordinator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.runtime.problem import prepare
from raysim.seeding import Stream, rng
from raysim.training.local import LocalTrainer, drawn_epochs
from raysim.training.vectorized import VectorizedTrainer
from tests.support.algorithms import FLAME
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess, make_host


def test_random_epochs_are_uniform_on_one_to_h_and_the_request_first_draw():
    """E ~ U{1..H} as random.randint(1, local_ep): both ends reachable, nothing outside, frequencies 1/H; drawn
    first from the request's generator, so the same (seed, client, round) gives the same E on any host."""
    config = validate_config(tiny_config(algorithm=FLAME | {"random_epochs": True}))
    request = config.algorithm.local_sgd(np.zeros(5, np.float32))
    assert request.random_epochs and request.epochs == 3
    keys = [(i, t) for i in range(60) for t in range(50)]
    drawn = [drawn_epochs(request, rng(7, Stream.CLIENT_TRAINING, i, t, 0)).epochs for i, t in keys]
    counts = np.bincount(drawn, minlength=4)
    assert counts[0] == 0 and set(drawn) == {1, 2, 3}
    assert np.all(np.abs(counts[1:] / len(drawn) - 1 / 3) < 0.03)  # 3,000 draws: 4.6 standard deviations
    assert drawn[:5] == [int(rng(7, Stream.CLIENT_TRAINING, 0, t, 0).integers(1, 4)) for t in range(5)]
    fixed = dataclasses.replace(request, random_epochs=False)
    assert drawn_epochs(fixed, rng(7, Stream.CLIENT_TRAINING, 0, 0, 0)) is fixed


def test_every_executor_trains_each_client_its_drawn_passes():
    """LocalTrainer, the lockstep jobs and a stacked chunk's rows each train E_i full passes (steps = E_i times the
    batches of a pass) with the same batches, so their models agree; fixed epochs train H passes."""
    config = validate_config(tiny_config(algorithm=FLAME | {"random_epochs": True}))
    problem = prepare(config)
    host = make_host(config, problem)
    model, data = host.model, host.data
    ids = sorted(data)
    request = config.algorithm.local_sgd(problem.init_params)
    round_index = 1

    def generator(i: int) -> np.random.Generator:  # client i's first request of the round
        return rng(config.seed, Stream.CLIENT_TRAINING, i, round_index, 0)

    passes = {i: int(generator(i).integers(1, 4)) for i in ids}
    assert len(set(passes.values())) > 1  # the clients' draws differ: the chunk below mixes pass counts
    batches = {i: -(-len(data[i].train) // 32) for i in ids}
    vectorized = VectorizedTrainer(model, chunk=8)
    alone = [LocalTrainer(model).sgd(request, data[i], generator(i)) for i in ids]
    jobs = vectorized.sgd([(request, data[i], generator(i)) for i in ids])
    rows = vectorized.sgd_rows(request, [data[i] for i in ids], [generator(i) for i in ids])
    for row, i in enumerate(ids):
        assert alone[row].steps == jobs[row].steps == rows.steps[row] == passes[i] * batches[i]
        np.testing.assert_allclose(jobs[row].params, alone[row].params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rows.params[row], alone[row].params, rtol=1e-5, atol=1e-6)
    fixed = LocalTrainer(model).sgd(dataclasses.replace(request, random_epochs=False), data[0], generator(0))
    assert fixed.steps == 3 * batches[0]


def test_a_flame_round_with_random_epochs_is_the_same_sequential_or_stacked():
    """The switch reaches FLAME's round: a host stepping clients one at a time and one stepping them as a stacked
    chunk give the same states; the states differ from the fixed-H run's (some client trained fewer passes)."""
    config = validate_config(tiny_config(algorithm=FLAME | {"random_epochs": True}))
    problem = prepare(config)
    runs = {}
    for mode in ("sequential", "vectorized"):
        sim = InProcess(config, problem)
        sim.host = make_host(config, problem, client_training=mode)
        sim.round(0)
        runs[mode] = sim.states
    fixed = InProcess(validate_config(tiny_config(algorithm=FLAME)), problem)
    fixed.round(0)
    for i, state in runs["sequential"].items():
        np.testing.assert_allclose(runs["vectorized"][i].theta, state.theta, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(fixed.states[i].theta, s.theta) for i, s in runs["sequential"].items())


@pytest.mark.parametrize(
    ("algorithm", "sections", "message"),
    [
        (FLAME | {"random_epochs": True, "dual_updates": "per_epoch"}, {}, "set algorithm.dual_updates: per_round"),
        ({"name": "pfedme", "random_epochs": True}, {}, "pfedme trains one epoch at a time"),
        (FLAME | {"random_epochs": "sometimes"}, {}, "algorithm.random_epochs"),
        (FLAME, {"model": {"name": "mlr", "init": "zero"}}, "'zeros'"),
        (FLAME, {"runtime": {"deterministic": "yes"}}, "'cudnn'"),
    ],
)
def test_switches_refuse_what_they_cannot_do_in_one_line(algorithm, sections, message):
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config(algorithm=algorithm, **sections))
    assert message in str(error.value) and "\n" not in str(error.value).strip()


def test_the_authors_batches_refuse_random_epochs():
    config = tiny_config(
        algorithm={"name": "flame", "random_epochs": True},
        partition={"scheme": "q_label", "q": 2, "draw": "authors"},
        model={"name": "mlr", "init": "authors"},
        clients={"count": 4, "batches": "authors"},
    )
    with pytest.raises(ConfigError, match="algorithm.random_epochs: false"):
        validate_config(config)


def test_a_zero_initial_model_starts_every_state_and_the_global_model_at_zero():
    """model.init: zeros, FLAME's linear analysis (w_i^0 = pi_i^0 = w^0 = 0): the initial GM and every client's
    theta, w and pi are zero; a FLAME round then trains (an MLR's gradient at zero is not) and stays finite."""
    config = validate_config(tiny_config(algorithm=FLAME, model={"name": "mlr", "init": "zeros"}))
    sim = InProcess(config)
    assert sim.problem.init_params.dtype == np.float32 and not sim.problem.init_params.any()
    assert sim.problem.init_params.size == sim.problem.params.size
    assert not sim.coordinator.global_model().any()
    assert all(not (s.theta.any() or s.w.any() or s.pi.any()) for s in sim.states.values())
    sim.round(0)
    assert sim.coordinator.global_model().any() and np.isfinite(sim.coordinator.global_model()).all()
    raysim_init = prepare(validate_config(tiny_config(algorithm=FLAME))).init_params
    assert raysim_init.any()  # the default is not zero: the switch made the difference
