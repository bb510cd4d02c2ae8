"""Every algorithm on the runtime classes: unselected clients keep their state bit for bit (partial
participation), on the real ClientHost/Coordinator in one process for all, and on Ray actors for the
running-sum algorithms whose server uses stale messages of unselected clients (FedAPM, pFedMe)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raysim.algorithms import ALGORITHMS as REGISTERED
from raysim.errors import ConfigError
from tests.support.algorithms import ALGORITHMS, ELSEWHERE, StateWatch, algorithm_config
from tests.support.inprocess import InProcess


def test_every_registered_algorithm_has_tiny_settings_here_or_is_tested_elsewhere():
    assert set(REGISTERED.names()) == set(ALGORITHMS) | ELSEWHERE


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_unselected_clients_keep_their_state_bit_for_bit_in_process(name, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))  # a pretrained model's cache
    config = algorithm_config(name)
    sim = InProcess(config)
    watch = StateWatch(name, config.seed)
    for round_index in range(3):
        sim.round(round_index)
        watch.check(round_index, sim.states)
    assert watch.rounds == [0, 1, 2]


REFUSES_STATISTICS = {"fedem", "fedcp"}
"""Algorithms that train vectors of other sizes than the network's and refuse a model with running statistics, with
an error that says so."""


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_trains_a_batchnorm_model(name, tmp_path, monkeypatch):
    """A round of each algorithm on a model with running statistics (mlp_bn): the statistics sit where the
    algorithm's trained vector holds the model (FedRoD's vector holds a personal head after the model: a shape error
    before Term.model_window), and every client state stays finite; FedEM and FedCP refuse such a model."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path))
    fields = REGISTERED.get(name).Settings.model_fields
    teacher = {"teacher_model": "mlp"} if "teacher_model" in fields else {}  # mlp_bn has no default teacher
    config = algorithm_config(name, model="mlp_bn", settings=teacher)
    if name in REFUSES_STATISTICS:
        with pytest.raises(ConfigError, match="model.name: .*running statistics"):
            InProcess(config)
        return
    sim = InProcess(config)
    sim.round(0)
    for state in sim.states.values():
        for field in dataclasses.fields(state) if dataclasses.is_dataclass(state) else ():
            value = getattr(state, field.name)
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                assert np.isfinite(value).all(), f"{name}: {field.name} not finite"


@dataclasses.dataclass
class _State:
    vector: np.ndarray
    count: int
    table: np.ndarray | None = None
    nothing: None = None


def test_stacked_states_round_trip():
    """`stack`/`unstack` move client states between one-per-client and a chunk's rows (Algorithm.stacks): the
    rows come back as they went in (a matrix field as the client's matrix), numbers as numbers; a chunk of one is a
    view."""
    from raysim.execution import stack, unstack

    states = [_State(np.full(3, i, np.float32), i, np.full((2, 5), i, np.float32)) for i in range(4)]
    stacked = stack(states)
    assert stacked.vector.shape == (4, 3) and stacked.count.tolist() == [0, 1, 2, 3] and stacked.nothing is None
    assert stacked.table.shape == (4, 2, 5)
    rows = unstack(stacked, 4)
    assert [r.count for r in rows] == [0, 1, 2, 3] and all(isinstance(r.count, int) for r in rows)
    assert all(np.array_equal(r.vector, s.vector) for r, s in zip(rows, states, strict=True))
    assert all(np.array_equal(r.table, s.table) for r, s in zip(rows, states, strict=True))
    assert np.shares_memory(stack(states[2:3]).vector, states[2].vector)


def test_state_table_gives_views_of_consecutive_rows_and_stores_only_what_is_not_in_place():
    """A StateTable holds copies of a block's states (a read-only shared initial vector stays untouched); a chunk
    of consecutive clients is a view of its rows, any other a copy; `store` writes new rows back, skips rows a
    step wrote in place, and leaves a dropped client's row (kept False) as it was."""
    from raysim.runtime.state_table import StateTable

    shared = np.zeros(3, np.float32)
    shared.flags.writeable = False
    table = StateTable([7, 3, 5, 9], [_State(shared, i) for i in range(4)])
    assert not np.shares_memory(table.stacked.vector, shared) and table.stacked.vector.flags.writeable
    middle = table.rows([3, 5])
    assert np.shares_memory(middle.vector, table.stacked.vector) and middle.count.tolist() == [1, 2]
    middle.vector += 1.0  # a step writing in place
    table.store([3, 5], middle)
    assert table.state(3).vector.tolist() == [1.0] * 3 and table.state(9).vector.tolist() == [0.0] * 3
    scattered = table.rows([9, 7])
    assert not np.shares_memory(scattered.vector, table.stacked.vector)
    new = _State(np.array([[4.0] * 3, [5.0] * 3], np.float32), np.array([40, 50]))
    table.store([9, 7], new, kept=np.array([True, False]))
    assert table.state(9).vector.tolist() == [4.0] * 3 and table.state(9).count == 40
    assert table.state(7).vector.tolist() == [0.0] * 3 and table.state(7).count == 0
    assert isinstance(table.state(7).count, int) and np.shares_memory(table.state(7).vector, table.stacked.vector)
    assert not shared.any()


@pytest.mark.parametrize("container", ["tables", "store"])
def test_both_state_containers_answer_the_host_alike(container, tmp_path):
    """StateTables (in memory) and ClientStateStore (past a budget; here every state on disk) are one ClientStates:
    a chunk of one block's clients as rows, its kept new rows stored (a dropped client keeps its state), and a state
    set after its block was stepped (a restore) is the one the block's next rows hold, not a stale table row."""
    from raysim.algorithms.flame import FlameClientState
    from raysim.runtime.state_store import ClientStateStore
    from raysim.runtime.state_table import StateTables

    def state(value: float) -> FlameClientState:
        return FlameClientState(*(np.full(2, value + k, np.float32) for k in range(3)))

    states = StateTables([[0, 1, 2], [3]]) if container == "tables" else ClientStateStore(0, tmp_path)
    for client in range(4):
        states[client] = state(10.0 * client)
    rows = states.rows([0, 2])
    assert rows.w.tolist() == [[1.0, 1.0], [21.0, 21.0]]
    states.store([0, 2], FlameClientState(rows.theta + 100, rows.w + 100, rows.pi + 100), np.array([True, False]))
    assert states[0].w.tolist() == [101.0, 101.0] and states[2].w.tolist() == [21.0, 21.0]
    states[1] = state(-5.0)
    assert states.rows([0, 1, 2]).theta.tolist() == [[100.0] * 2, [-5.0] * 2, [20.0] * 2]
    assert list(states) == [0, 1, 2, 3] and states[3].pi.tolist() == [32.0, 32.0]
    stats = states.stats()
    assert stats is None if container == "tables" else stats.spilled == 4
    states.close()


def test_a_step_writes_into_its_state_only_where_the_runtime_donated_it():
    """`writable` gives a step the state's arrays themselves only for a donated chunk (ClientChunk.in_place) whose
    step does not keep their old values to its end; otherwise equal copies (a single client's state is never
    donated). `may_write` says the same for training in place."""
    from raysim.algorithms.interface import ClientChunk, ClientInfo

    clients = (ClientInfo(0, 5, 0.5, 2), ClientInfo(1, 5, 0.5, 2))
    w, pi = np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32)
    donated = ClientChunk(clients, in_place=True)
    assert all(got is given for got, given in zip(donated.writable(w, pi), (w, pi), strict=True))
    assert donated.may_write() and not donated.may_write(keep=True) and not ClientChunk(clients).may_write()
    assert not clients[0].may_write()
    for owner, arrays in ((donated, (w, pi)), (ClientChunk(clients), (w, pi)), (clients[0], (w[0], pi[0]))):
        copies = owner.writable(*arrays, keep=owner is donated)
        assert all(np.array_equal(c, a) and not np.shares_memory(c, a) for c, a in zip(copies, arrays, strict=True))
