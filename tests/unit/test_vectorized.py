"""Vectorized client training (runtime.client_training = vectorized) against the one-client-at-a-time path:
VectorizedTrainer against LocalTrainer request by request, the lockstep driver against run_client_step, and
whole in-process runs of both modes."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from raysim.algorithms import build_algorithm
from raysim.algorithms.families.averaging import WeightedUpload
from raysim.algorithms.fedavg import FedAvg, FedAvgSettings
from raysim.algorithms.interface import ClientInfo, ClientUpdate
from raysim.algorithms.requests import LocalSGD, Request, Result
from raysim.algorithms.terms import L1, Linear, Offset, Prox
from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.execution import run_client_step, run_client_steps
from raysim.models.flat import FlatModel, param_spec
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.exact_sum import UploadRangeError
from raysim.runtime.problem import prepare
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import SGDJob, VectorizedTrainer, step_widths
from tests.support.executors import CLASSES, EMPTY, INPUT, assert_close_runs, client_data, run_executor
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess, make_host


def _requests(model: FlatModel, count: int, seed: int, **fields) -> list[LocalSGD]:
    """One request per client, each from its own start point; `fields` are LocalSGD fields, or the terms' parts
    (prox_weight with prox_center: Prox; linear: Linear; offset: Offset; l1: L1), where the value "vector" stands for a
    per-client random vector and "mask" for a random mask."""
    source = np.random.default_rng(seed)
    start = model.initial_parameters(seed)
    requests = []
    for _ in range(count):
        drawn = dict(fields)
        for key, value in fields.items():
            if value == "vector":
                drawn[key] = (0.1 * source.normal(size=model.size)).astype(np.float32)
                if key == "l1":
                    drawn[key] = np.abs(drawn[key])
            elif value == "mask":
                drawn[key] = source.random(model.size) < 0.7
        terms = []
        if "offset" in drawn:
            terms.append(Offset(drawn.pop("offset")))
        if "prox_weight" in drawn:
            terms.append(Prox(drawn.pop("prox_center"), drawn.pop("prox_weight")))
        if "linear" in drawn:
            terms.append(Linear(drawn.pop("linear")))
        if "l1" in drawn:
            terms.append(L1(drawn.pop("l1")))
        drawn.setdefault("epochs", 2)
        drawn.setdefault("lr", 0.1)
        drawn.setdefault("batch_size", 16)
        noise = (0.1 * source.normal(size=model.size)).astype(np.float32)
        requests.append(LocalSGD(start=start + noise, terms=tuple(terms), **drawn))
    return requests


def _jobs(requests: list[LocalSGD], clients: list[ClientData], seed: int) -> list[SGDJob]:
    """Fresh generators, keyed by client like the host's, so both trainers draw the same batches."""
    return [(r, d, np.random.default_rng([seed, i])) for i, (r, d) in enumerate(zip(requests, clients, strict=True))]


def _assert_matches_local(model: FlatModel, requests, clients, chunk: int, seed: int = 0) -> VectorizedTrainer:
    """Each client's vectorized result equals LocalTrainer's up to float rounding: within 1e-5, widened by
    what LocalTrainer itself moves when its start point moves by one ulp (long runs at batch size 1 with
    momentum amplify any rounding difference that much)."""
    expected = [LocalTrainer(model).sgd(*job) for job in _jobs(requests, clients, seed)]
    nudged = [dataclasses.replace(r, start=np.nextafter(r.start, np.float32(np.inf))) for r in requests]
    wobble = [LocalTrainer(model).sgd(*job) for job in _jobs(nudged, clients, seed)]
    trainer = VectorizedTrainer(model, chunk)
    actual = trainer.sgd(_jobs(requests, clients, seed))
    assert len(actual) == len(expected)
    for client, (want, got, moved) in enumerate(zip(expected, actual, wobble, strict=True)):
        assert got.steps == want.steps, f"client {client}"
        assert got.params.dtype == np.float32 and got.params.shape == want.params.shape
        atol = 1e-5 + 4 * float(np.max(np.abs(moved.params - want.params), initial=0.0))
        np.testing.assert_allclose(got.params, want.params, rtol=1e-5, atol=atol, err_msg=f"client {client}")
        loss_atol = 4 * abs(moved.mean_loss - want.mean_loss) if want.steps else 0.0
        np.testing.assert_allclose(got.mean_loss, want.mean_loss, rtol=1e-5, atol=loss_atol, err_msg=f"client {client}")
    return trainer


SIZES = [7, 0, 33, 64, 5, 100, 1, 40]
"""Batch size 16: fewer samples than one batch (7, 5, 1), none, an exact multiple (64), a smaller last batch."""


OBJECTIVES = {
    "fedavg": {},
    "flame": {"momentum": 0.5, "weight_decay": 0.01, "prox_weight": 1.0, "prox_center": "vector"},
    "admm": {"prox_weight": 0.5, "prox_center": "vector", "linear": "vector", "momentum": 0.9},
    "partial": {"prox_weight": 0.5, "prox_center": "vector", "mask": "mask", "momentum": 0.5},
    "sparse": {"offset": "vector", "l1": "vector", "weight_decay": 0.001},
    "sparse_masked": {"l1": 0.05, "mask": "mask"},
}


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("name", ["mlr", "mlp"])
def test_vectorized_sgd_matches_local_trainer(name, objective):
    """Unequal clients (one with feature noise, one with random labels, one with its own features), every
    objective term; chunks of 3 so clients of different lengths share a chunk and finish at different steps."""
    model = FlatModel(name, INPUT, CLASSES)
    clients = client_data(SIZES, seed=1, noisy=3, poisoned=4, private=6)
    requests = _requests(model, len(SIZES), seed=2, **OBJECTIVES[objective])
    trainer = _assert_matches_local(model, requests, clients, chunk=3)
    assert trainer.mode == "perceptron"


def test_requests_with_different_settings_train_in_separate_groups():
    model = FlatModel("mlp", INPUT, CLASSES)
    clients = client_data([20, 31, 9, 50, 12, 3], seed=3, noisy=0)
    fast = _requests(model, 3, seed=4, lr=0.2, batch_size=8)
    slow = _requests(model, 3, seed=5, lr=0.05, epochs=3, momentum=0.5)
    mixed = [fast[0], slow[0], fast[1], slow[1], slow[2], fast[2]]
    _assert_matches_local(model, mixed, clients, chunk=256)


def test_regression_model_matches_local_trainer():
    model = FlatModel("linear", (6,), 1, "regression")
    source = np.random.default_rng(6)
    x = source.normal(size=(120, 6)).astype(np.float32)
    y = (x @ source.normal(size=6) + 0.1 * source.normal(size=120)).astype(np.float32)
    clients = [ClientData(x, y, np.arange(a, b), EMPTY, EMPTY) for a, b in [(0, 50), (50, 57), (57, 120)]]
    _assert_matches_local(model, _requests(model, 3, seed=7, momentum=0.5), clients, chunk=2)


def test_other_models_run_through_vmap(caplog):
    """A CNN is no Flatten/Linear/ReLU stack: its clients are vmapped over functional_call (on the CPU with a
    warning that one at a time is usually faster there)."""
    model = FlatModel("cnn", (3, 8, 8), 4)
    source = np.random.default_rng(8)
    x = source.normal(size=(90, 3, 8, 8)).astype(np.float32)
    y = source.integers(0, 4, 90).astype(np.int64)
    clients = [ClientData(x, y, np.arange(a, b), EMPTY, EMPTY) for a, b in [(0, 40), (40, 53), (53, 56), (56, 90)]]
    requests = _requests(model, 4, seed=9, batch_size=8, momentum=0.9, prox_weight=0.5, prox_center="vector")
    with caplog.at_level(logging.WARNING, logger="raysim.training.vectorized"):
        trainer = _assert_matches_local(model, requests, clients, chunk=3)
    assert trainer.mode == "vmap"
    assert ["usually slower than one client at a time" in r.getMessage() for r in caplog.records] == [True]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raysim.training.vectorized"):
        VectorizedTrainer(FlatModel("mlp", (3, 8, 8), 4))
    assert caplog.records == []  # perceptrons are batched matrix products, fast on a CPU


class _SignFlip(nn.Module):
    """A network whose control flow depends on its data, which vmap refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten, self.linear = nn.Flatten(), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(self.flatten(x))
        return hidden if hidden.sum() > 0 else -hidden


def test_model_that_cannot_be_vmapped_falls_back_to_one_client_at_a_time():
    """A model on which one vectorized step fails (the trainer tries one first): the trainer says why and gives
    LocalTrainer's results exactly. (A BatchNorm model falls back by rule: tests/unit/test_batch_norm.py.)"""
    model = FlatModel("mlr", INPUT, CLASSES)
    model.module = _SignFlip()
    model.spec = param_spec(model.module)
    model.layers = None
    clients = client_data([30, 18], seed=10)
    requests = _requests(model, 2, seed=11)
    trainer = VectorizedTrainer(model)
    assert trainer.mode == "sequential" and "cannot be trained vectorized" in trainer.unavailable
    expected = [LocalTrainer(model).sgd(*job) for job in _jobs(requests, clients, 0)]
    for want, got in zip(expected, trainer.sgd(_jobs(requests, clients, 0)), strict=True):
        assert np.array_equal(got.params, want.params) and got.mean_loss == want.mean_loss


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 45), min_size=1, max_size=6),
    batch_size=st.integers(1, 20),
    epochs=st.integers(1, 3),
    momentum=st.sampled_from([0.0, 0.9]),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_any_sizes_and_batches_match_local_trainer(sizes, batch_size, epochs, momentum, chunk, seed):
    model = FlatModel("mlr", INPUT, CLASSES)
    clients = client_data(sizes, seed, noisy=seed % 7, poisoned=seed % 5)
    requests = _requests(model, len(sizes), seed, epochs=epochs, batch_size=batch_size, momentum=momentum)
    _assert_matches_local(model, requests, clients, chunk, seed)


@pytest.fixture
def one_thread():
    """One torch thread, as every host runs (runtime.torch_threads): a multi-threaded product splits its work by
    the size of the whole chunk, so only one thread gives each client the same bits whatever shares its chunk."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("objective", ["fedavg", "flame", "admm"])
def test_a_stacked_request_trains_its_rows_as_the_requests_one_by_one(objective, one_thread):
    """`sgd_rows` (a chunk's rows in one request, the unit of a stacked step) gives the per-request results of
    `sgd`: rows in any order (sorted longest first inside and back), trained in place in the request's rows
    (LocalSGD.in_place: the result is those rows, with the same bits as a copy) or on a copy of them, and a
    start vector shared by all rows (a received global model)."""
    from raysim.training.vectorized import stack_requests

    model = FlatModel("mlp", INPUT, CLASSES)
    clients = client_data([9, 40, 17, 40, 3], seed=13, noisy=2)
    requests = _requests(model, len(clients), seed=14, **OBJECTIVES[objective])
    jobs = _jobs(requests, clients, 0)
    alone = VectorizedTrainer(model, chunk=8).sgd(jobs)
    stacked = stack_requests(requests)
    generators = [generator for _r, _d, generator in _jobs(requests, clients, 0)]
    copied = VectorizedTrainer(model, chunk=8).sgd_rows(stacked, clients, generators)
    assert not np.shares_memory(copied.params, stacked.start)
    for row, want in enumerate(alone):
        assert np.array_equal(copied.params[row], want.params) and copied.steps[row] == want.steps
        assert copied.mean_loss[row] == want.mean_loss
    order = [1, 3, 2, 0, 4]  # longest first: trained where they are
    rows = dataclasses.replace(stack_requests([requests[i] for i in order]), in_place=True)
    start = rows.start
    generators = [generator for _r, _d, generator in _jobs(requests, clients, 0)]
    trainer = VectorizedTrainer(model, chunk=8)
    in_place = trainer.sgd_rows(rows, [clients[i] for i in order], [generators[i] for i in order])
    assert in_place.params is start
    assert all(np.array_equal(in_place.params[k], alone[i].params) for k, i in enumerate(order))
    shared = dataclasses.replace(stacked, start=requests[0].start)
    generators = [generator for _r, _d, generator in _jobs(requests, clients, 0)]
    from_one = VectorizedTrainer(model, chunk=8).sgd_rows(shared, clients, generators)
    same_start = VectorizedTrainer(model, chunk=8).sgd(
        _jobs([dataclasses.replace(r, start=requests[0].start) for r in requests], clients, 0)
    )
    assert all(np.array_equal(from_one.params[i], want.params) for i, want in enumerate(same_start))


class _Uneven(FedAvg):
    """FedAvg whose client i trains i % 3 times in a row (client 0, 3, ... send the broadcast back unchanged)."""

    def client_step(self, client: ClientInfo, state, broadcast):
        params = broadcast
        for _ in range(client.id % 3):
            params = (yield self.settings.local_sgd(params)).params
        return ClientUpdate(state, WeightedUpload(params, 1.0), {"trained": float(client.id % 3)})


def _executors(clients: list[ClientData], model: FlatModel):
    """Per client, an executor whose randomness is keyed by (client, request number), like the host's."""
    trainer = LocalTrainer(model)

    def executor(client_id: int):
        numbers = itertools.count()
        return lambda request: trainer.sgd(
            request, clients[client_id], np.random.default_rng([client_id, next(numbers)])
        )

    return executor


def _same(a: object, b: object) -> bool:
    """Dataclasses (states, uploads) with bit-identical fields."""
    return all(
        np.asarray(getattr(a, f.name)).tobytes() == np.asarray(getattr(b, f.name)).tobytes()
        for f in dataclasses.fields(a)
    )


@pytest.mark.parametrize("which", ["flame_per_epoch", "uneven"])
def test_lockstep_driver_with_one_client_at_a_time_execution_equals_run_client_step(which):
    model = FlatModel("mlr", INPUT, CLASSES)
    data = client_data([23, 40, 8, 31, 16], seed=12, noisy=1)
    infos = [ClientInfo(i, len(d.train), 0.2, len(data)) for i, d in enumerate(data)]
    if which == "uneven":
        algorithm = _Uneven(FedAvgSettings(name="fedavg", lr=0.1, batch_size=16), model.spec)
    else:
        settings_ = {"name": "flame", "epochs": 3, "dual_updates": "per_epoch", "lr": 0.1, "batch_size": 16}
        algorithm = build_algorithm(validate_config(tiny_config(algorithm=settings_)).algorithm, model.spec)
    init = model.initial_parameters(0)
    states = [algorithm.init_client(info, init) for info in infos]
    broadcast = algorithm.broadcast(algorithm.init_server(init, len(infos)))
    executor = _executors(data, model)
    expected = [run_client_step(algorithm, i, s, broadcast, executor(i.id)) for i, s in zip(infos, states, strict=True)]

    executors: dict[int, Callable[[Request], Result]] = {}
    turns: list[list[int]] = []

    def execute_many(requests):
        turns.append([client_id for client_id, _ in requests])
        return [executors.setdefault(c, executor(c))(request) for c, request in requests]

    updates = run_client_steps(algorithm, infos, states, broadcast, execute_many)
    for want, got in zip(expected, updates, strict=True):
        assert _same(got.state, want.state) and _same(got.upload, want.upload) and got.metrics == want.metrics
    if which == "uneven":
        assert turns == [[1, 2, 4], [2]]  # clients 0 and 3 never yield; client 2 trains twice
    else:
        assert turns == [[0, 1, 2, 3, 4]] * 3


def test_lockstep_driver_refuses_an_executor_that_loses_results():
    model = FlatModel("mlr", INPUT, CLASSES)
    algorithm = FedAvg(FedAvgSettings(name="fedavg"), model.spec)
    infos = [ClientInfo(i, 10, 0.5, 2) for i in range(2)]
    init = model.initial_parameters(0)
    with pytest.raises(ValueError, match="2 requests but 1 results"):
        run_client_steps(algorithm, infos, [None, None], init, lambda requests: requests[:1])


RUNS = {
    "flame": (
        {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "momentum": 0.5},
        {"model": {"name": "mlp"}, "clients": {"count": 6, "per_round": 4}},
    ),
    "flame_per_epoch": (
        {"name": "flame", "lr": 0.05, "batch_size": 16, "epochs": 2, "dual_updates": "per_epoch", "weight_decay": 0.01},
        {"clients": {"count": 5}},
    ),
    "fedavg": ({"name": "fedavg", "lr": 0.05, "batch_size": 32}, {"clients": {"count": 6}}),
    "fedapm": ({"name": "fedapm", "lr": 0.05, "batch_size": 32, "rho": 0.25}, {"model": {"name": "mlp"}}),
    "fedprox_loss_scale": (
        {"name": "fedprox", "lr": 0.2, "batch_size": 32, "mu": 0.5, "weight_decay": 0.01, "loss_scale": "1/m"},
        {"clients": {"count": 6, "per_round": 4}},
    ),
    "fedalt_authors": (
        {
            "name": "fedalt",
            "lr": 0.2,
            "batch_size": 32,
            "loss_scale": "1/m",
            "average_over": "all",
            "order": "shared_first",
        },
        {"model": {"name": "mlp"}, "clients": {"count": 5, "per_round": 2}},
    ),
    "fedslr": ({"name": "fedslr", "lambda": 0.05, "mu": 0.01, "lr": 0.05, "batch_size": 32}, {}),
    "scaffold": ({"name": "scaffold", "lr": 0.05, "batch_size": 32}, {"clients": {"count": 6, "per_round": 4}}),
    "feddyn": ({"name": "feddyn", "alpha": 0.1, "lr": 0.05, "batch_size": 32}, {"clients": {"count": 6}}),
    "gpgd": ({"name": "gpgd", "lambda": 0.05, "lr": 0.05, "batch_size": 32}, {"model": {"name": "mlp"}}),
    "lpgd": ({"name": "lpgd", "lambda": 0.05, "lr": 0.05, "batch_size": 32}, {"model": {"name": "mlp"}}),
}


@pytest.mark.parametrize("name", RUNS)
def test_vectorized_runs_match_sequential_runs(name):
    """Whole rounds on the real host and coordinator: global model, round metrics and every client's state."""
    algorithm, sections = RUNS[name]
    assert_close_runs(
        run_executor(algorithm, "sequential", **sections), run_executor(algorithm, "vectorized", **sections)
    )


def test_gradient_requests_run_one_at_a_time_with_the_same_randomness():
    """AugFL asks only for full gradients: the vectorized mode runs them as the sequential one, bit for bit."""
    algorithm = {"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0, "query_split": "val"}
    partition = {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.5}
    sequential = run_executor(algorithm, "sequential", partition=partition)
    vectorized = run_executor(algorithm, "vectorized", partition=partition)
    assert_close_runs(sequential, vectorized, atol=0.0)


@pytest.mark.parametrize(
    "attack", [{"kind": "gaussian", "fraction": 0.5, "training": "skip"}, {"kind": "label_poisoning", "fraction": 0.5}]
)
def test_attacked_hosts_match(attack):
    """Byzantine clients that skip training stay untrained; label poisoners' random labels are drawn as sequentially."""
    config = validate_config(
        tiny_config(algorithm=RUNS["flame"][0], clients={"count": 6}, attack=attack, model={"name": "mlp"})
    )
    problem = prepare(config)
    results = {}
    for mode in ("sequential", "vectorized"):
        # a GPU share: the vectorized host trains there when this machine has one
        host = make_host(config, problem, send_messages=True, client_training=mode, vectorize_chunk=4, gpus=0.5)
        if mode == "vectorized":
            assert host.steps.executor.vectorized.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        coordinator = Coordinator(CoordinatorSettings(config.algorithm, problem.params, 6), problem.init_params)
        records = []
        for round_index in range(2):
            partial, round_records = host.train(round_index, host.client_ids, coordinator.broadcast())
            coordinator.aggregate(partial)
            records.append(round_records)
        results[mode] = (coordinator.global_model(), records, host.client_states())
    (model_s, records_s, states_s), (model_v, records_v, states_v) = results["sequential"], results["vectorized"]
    np.testing.assert_allclose(model_v, model_s, atol=1e-5)
    for want, got in zip(records_s, records_v, strict=True):  # each round's record columns
        assert want.column_names == got.column_names
        assert want["client_id"].to_pylist() == got["client_id"].to_pylist()
        for name in want.column_names:
            np.testing.assert_allclose(
                got[name].to_numpy(zero_copy_only=False).astype(float),
                want[name].to_numpy(zero_copy_only=False).astype(float),
                rtol=1e-4,
                atol=1e-5,
                err_msg=name,
            )
    for client in states_s:
        np.testing.assert_allclose(states_v[client].theta, states_s[client].theta, atol=1e-5)


def test_client_training_settings_are_validated():
    with pytest.raises(ConfigError, match="runtime.vectorize_chunk"):
        validate_config(tiny_config(runtime={"vectorize_chunk": 0}))
    with pytest.raises(ConfigError, match="runtime.client_training"):
        validate_config(tiny_config(runtime={"client_training": "parallel"}))


def test_stacked_client_steps_give_the_same_bits_whatever_the_chunks():
    """FLAME's vectorized hosts update a chunk's stacked states in one step (Algorithm.stacks); each row's
    arithmetic is its own, so the chunking (which depends on how clients are spread over hosts) changes nothing."""
    algorithm, sections = RUNS["flame"]
    runs = []
    for chunk in (1, 2, 5):
        runtime = {"num_hosts": 1, "client_training": "vectorized", "vectorize_chunk": chunk}
        sim = InProcess(validate_config(tiny_config(algorithm=algorithm, runtime=runtime, **sections)))
        assert sim.host.steps.stacked
        runs.append(([sim.round(r) for r in range(3)], sim))
    (metrics, first), others = runs[0], runs[1:]
    for other_metrics, other in others:
        assert np.array_equal(other.coordinator.global_model(), first.coordinator.global_model())
        for client, state in first.states.items():
            for field in ("theta", "w", "pi"):
                assert np.array_equal(getattr(other.states[client], field), getattr(state, field)), (client, field)
        for want, got in zip(metrics, other_metrics, strict=True):
            assert {k: v for k, v in want.items() if "seconds" not in k} == {
                k: v for k, v in got.items() if "seconds" not in k
            }


@pytest.mark.parametrize("mode", ["sequential", "vectorized"])
def test_a_dropped_upload_leaves_its_clients_state_as_it_was_in_a_stacked_chunk(mode):
    """runtime.on_nonfinite = drop_client: a client whose upload is NaN (its training data is) is left out of the
    sum and keeps its state, row of a chunk or not; the others of its chunk move on as in a round without it."""
    config = validate_config(
        tiny_config(
            clients={"count": 6},
            runtime={"client_training": mode, "vectorize_chunk": 4, "on_nonfinite": "drop_client"},
        )
    )
    problem = prepare(config)
    bad = problem.clients[2][1]
    problem.x = problem.x.copy()
    problem.x[bad.train] = np.nan
    host = make_host(config, problem)
    assert host.steps.stacked == (mode == "vectorized")
    coordinator = Coordinator(CoordinatorSettings(config.algorithm, problem.params, 6), problem.init_params)
    before = host.client_states()
    partial, records = host.train(0, host.client_ids, coordinator.broadcast())
    assert partial.count == 5 and records["dropped"].to_pylist() == [False, False, True, False, False, False]
    assert records["uplink_bytes"][2].as_py() == 0.0 and records["train_loss"][2].as_py() is None
    after = host.client_states()
    for client in range(6):
        old, new = before[client], after[client]
        unchanged = all(np.array_equal(getattr(new, f), getattr(old, f)) for f in ("theta", "w", "pi"))
        assert unchanged == (client == 2), client
    with pytest.raises(UploadRangeError, match="round 1: client 2: upload field 'change' has NaN"):
        make_host(
            config.model_copy(update={"runtime": config.runtime.model_copy(update={"on_nonfinite": "stop"})}), problem
        ).train(1, [0, 1, 2, 3], coordinator.broadcast())


def test_each_step_pads_to_the_runs_widest_batch_and_a_clients_bits_do_not_depend_on_its_neighbours(one_thread):
    """With `train_sizes` (the run's split sizes, the same on every host) step t pads batches only to the widest
    batch a client of the run has at step t: a client's result is then the same bits alone or beside clients of
    other sizes (products over a batch round differently at another width, so the width must not follow the
    chunk), and the same values as batches padded to the batch size, up to rounding. A client whose split size
    the run does not list is refused."""
    model = FlatModel("mlp", INPUT, CLASSES)
    sizes = [12, 40, 3, 25]  # batches of 16: 1, 3, 1 and 2 an epoch, the last ones of 12, 8, 3 and 9 samples
    clients = client_data(sizes, seed=15)
    objective = {"momentum": 0.5, "prox_weight": 1.0, "prox_center": "vector"}
    requests = _requests(model, 4, seed=16, epochs=2, batch_size=16, **objective)
    trainer = VectorizedTrainer(model, chunk=4, train_sizes=sizes)
    together = trainer.sgd(_jobs(requests, clients, 0))
    for i in range(4):
        (alone,) = trainer.sgd([_jobs(requests, clients, 0)[i]])
        assert np.array_equal(alone.params, together[i].params) and alone.mean_loss == together[i].mean_loss
    wide = VectorizedTrainer(model, chunk=4).sgd(_jobs(requests, clients, 0))  # every step 16 wide
    for narrow, padded in zip(together, wide, strict=True):
        np.testing.assert_allclose(narrow.params, padded.params, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="8 samples at step 5, wider than the run's 6 .*train_sizes"):
        VectorizedTrainer(model, chunk=4, train_sizes=[12, 38, 3, 25]).sgd(_jobs(requests, clients, 0))
    with pytest.raises(ValueError, match="wider than the run's 3 samples .*train_sizes"):
        VectorizedTrainer(model, chunk=4, train_sizes=[3]).sgd(_jobs(requests, clients, 0)[:1])
    with pytest.raises(ValueError, match="trains 4 steps, the run's widths cover 2"):
        VectorizedTrainer(model, chunk=4, train_sizes=[12, 3]).sgd(_jobs(requests, clients, 0)[3:])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=30), st.integers(1, 120), st.integers(1, 4))
def test_a_steps_width_is_the_widest_batch_any_client_has_at_that_step(sizes, batch_size, epochs):
    """step_widths against the batches themselves: each epoch a client of n samples takes full batches of the batch
    size, then the rest; step t's width is the largest batch at t over all clients (a client done counts 0)."""
    batches = []
    for n in sizes:
        per_epoch = [min(batch_size, n - start) for start in range(0, n, batch_size)]
        batches.append(per_epoch * epochs)
    length = max(map(len, batches))
    expected = [max(b[t] if t < len(b) else 0 for b in batches) for t in range(length)]
    assert step_widths(np.array(sizes), batch_size, epochs).tolist() == expected
    assert step_widths(np.array([112] * 5), 100, 2).tolist() == [100, 12, 100, 12]  # 500 Fashion-MNIST clients
