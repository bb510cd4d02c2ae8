"""Client state spilled to disk beyond a memory budget (runtime.state_memory_mb): states come back bit for
bit, the least recently used spill first, files are complete or absent and removed at the end, and runs and
checkpoints with nearly every state on disk equal the in-memory ones."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.algorithms.flame import FlameClientState
from raysim.config import validate_config
from raysim.runtime import checkpoint
from raysim.runtime.problem import sample_clients
from raysim.runtime.state_store import OWNER_LOCK, ClientStateStore, state_nbytes
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess, make_host
from tests.support.states import assert_identical, flame_state

ALGORITHMS = {
    "flame": {"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32},
    "fedslr": {"name": "fedslr", "lambda": 0.05, "eta_g": 10.0, "mu": 0.01, "lr": 0.05, "batch_size": 32},
    "augfl": {"name": "augfl", "alpha": 0.1, "rho": 0.7, "lambda": 0.0, "query_split": "val"},
    "scaffold": {"name": "scaffold", "lr": 0.05, "batch_size": 32},
    "feddyn": {"name": "feddyn", "alpha": 0.1, "lr": 0.05, "batch_size": 32},
    "fedrep": {"name": "fedrep", "personal": ["*.bias"], "head_epochs": 2, "lr": 0.05, "batch_size": 32},
    "lg_fedavg": {"name": "lg_fedavg", "global_layers": ["*.bias"], "lr": 0.05, "batch_size": 32},
    "fedspa": {"name": "fedspa", "density": 0.5, "lr": 0.05, "batch_size": 32},
    "perfedavg": {"name": "perfedavg", "alpha": 0.05, "lr": 0.1, "hessian": "finite_difference"},
    "apfl": {"name": "apfl", "lr": 0.05, "adaptive_alpha": True},
    "lp_proj": {"name": "lp_proj", "lambda": 1.0, "rho": 0.25, "d_sub": 3, "lr": 0.05},
    "fedproto": {"name": "fedproto", "lambda": 1.0, "lr": 0.05, "batch_size": 32},
    "fedrod": {"name": "fedrod", "lr": 0.05, "batch_size": 32},
    "fedala": {"name": "fedala", "lr": 0.05, "batch_size": 32},
    "fedcp": {"name": "fedcp", "lr": 0.05, "batch_size": 32},
}


AUGFL_PARTITION = {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.5}


@checkpoint.register_state_class
@dataclass
class _Inner:
    scale: np.float32
    flag: np.bool_
    counts: np.ndarray


@checkpoint.register_state_class
@dataclass
class _Exotic:
    """Every kind of field a client state may hold."""

    theta: np.ndarray
    fortran: np.ndarray
    big_endian: np.ndarray
    scalar_array: np.ndarray
    empty: np.ndarray
    inner: _Inner
    maybe: np.ndarray | None
    nothing: None
    rounds: int
    step: float
    done: bool
    ranks: dict[str, int]
    sent: dict[int, np.ndarray]
    seen: set[int]
    pair: tuple[float, str]


def _exotic() -> _Exotic:
    return _Exotic(
        theta=np.array([1e-30, -0.0, np.nan, np.inf, -np.inf, 1.5], np.float32),
        fortran=np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        big_endian=np.arange(5, dtype=">i4"),
        scalar_array=np.array(2.5, np.float16),
        empty=np.zeros((0, 3), np.int8),
        inner=_Inner(np.float32(0.1), np.bool_(True), np.arange(4, dtype=np.uint64)),
        maybe=None,
        nothing=None,
        rounds=2**40,
        step=-0.0,
        done=False,
        ranks={"fc1": 3, "fc2": 0},
        sent={4: np.float64([0.1, 0.2]), 1: np.zeros(0)},
        seen={3, 1},
        pair=(0.1 + 0.2, "x"),
    )


def _states_after_training(name: str, rounds: int = 2) -> dict[int, Any]:
    """Real client states of an algorithm (made by its init_client, then trained for a few rounds)."""
    partition = AUGFL_PARTITION if name == "augfl" else {"scheme": "dirichlet", "beta": 0.5}
    config = validate_config(
        tiny_config(algorithm=ALGORITHMS[name], partition=partition, clients={"count": 5, "per_round": 3})
    )
    sim = InProcess(config)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim.states


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_real_algorithm_states_come_back_bit_for_bit(name, tmp_path):
    states = _states_after_training(name)
    if name == "fedslr":
        assert any(s.w is None for s in states.values()) and any(s.w is not None for s in states.values())
    with ClientStateStore(0, tmp_path) as store:
        for client_id, state in states.items():
            store[client_id] = state
        assert store.stats().spilled == len(states) and store.stats().memory_bytes == 0
        for client_id, state in states.items():
            assert_identical(store[client_id], state, f"{name} client {client_id}")


def test_every_field_type_comes_back_exactly(tmp_path):
    state = _exotic()
    with ClientStateStore(0, tmp_path) as store:
        store[7] = state
        assert store.stats().spilled == 1
        back = store[7]
    assert_identical(back, state)
    assert back is not state and back.theta is not state.theta


def test_numpy_scalars_keep_their_dtype_in_checkpoints(tmp_path):
    checkpoint.save_tree(tmp_path / "t.npz", {"x": np.float32(0.1), "n": np.int8(-3), "k": {np.int64(5): 1}})
    back = checkpoint.load_tree(tmp_path / "t.npz")
    assert type(back["x"]) is np.float32 and back["x"] == np.float32(0.1)
    assert type(back["n"]) is np.int8 and back["n"] == -3
    assert list(back["k"]) == [5] and type(next(iter(back["k"]))) is np.int64


def test_budget_keeps_the_most_recently_used_states_in_memory(tmp_path):
    one = state_nbytes(flame_state(0))
    assert one == 100 * (4 + 4 + 8)
    with ClientStateStore(2 * one + one // 2, tmp_path) as store:
        for client_id in range(5):
            store[client_id] = flame_state(client_id)
        stats = store.stats()
        assert (stats.in_memory, stats.spilled, stats.memory_bytes, stats.spills) == (2, 3, 2 * one, 3)
        spilled = {int(p.stem.split("-")[1]) for p in store.folder.glob("client-*.npz")}
        assert spilled == {0, 1, 2}  # least recently set first
        assert stats.disk_bytes == sum(p.stat().st_size for p in store.folder.glob("client-*.npz"))

        assert store[3].theta[0] == 3  # in memory: 3 becomes the most recently used ...
        store[5] = flame_state(5)  # ... so 4 spills, not 3
        assert {int(p.stem.split("-")[1]) for p in store.folder.glob("client-*.npz")} == {0, 1, 2, 4}

        before = store.stats()
        assert store[0].theta[0] == 0  # reading a spilled state loads a copy and evicts nothing
        after = store.stats()
        assert (after.loads, after.spills, after.in_memory) == (before.loads + 1, before.spills, before.in_memory)

        store[0] = flame_state(10)  # a new state for a spilled client: its file goes, the oldest in memory spills
        assert {int(p.stem.split("-")[1]) for p in store.folder.glob("client-*.npz")} == {1, 2, 3, 4}
        assert store[0].theta[0] == 10 and store.stats().in_memory == 2
        assert list(store) == [0, 1, 2, 3, 4, 5]  # key order is insertion order, wherever a state lives


def test_a_state_larger_than_the_budget_goes_straight_to_disk(tmp_path):
    with ClientStateStore(10, tmp_path) as store:
        store[0] = flame_state(1.0)
        assert store.stats().in_memory == 0 and store.stats().spilled == 1
        assert_identical(store[0], flame_state(1.0))


def test_files_are_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "client-0.npz"
    checkpoint.save_tree(path, {"ok": np.arange(3)})
    with pytest.raises(TypeError):  # the encoder fails after the first array is written
        checkpoint.save_tree(path, {"a": np.ones(1000), "b": object()})
    assert [p.name for p in tmp_path.iterdir()] == ["client-0.npz"]  # no partial or temporary file
    assert_identical(checkpoint.load_tree(path), {"ok": np.arange(3)})  # the old file is untouched

    with ClientStateStore(0, tmp_path / "spill") as store:
        with pytest.raises(TypeError):
            store[1] = {"a": np.ones(3), "b": object()}
        assert 1 not in store and len(store) == 0 and [p.name for p in store.folder.iterdir()] == [OWNER_LOCK]


def test_spill_folders_are_removed_on_close_and_when_collected(tmp_path):
    first, second = ClientStateStore(0, tmp_path), ClientStateStore(0, tmp_path)
    first[0], second[0] = flame_state(1.0), flame_state(2.0)
    assert first.folder != second.folder and first.folder.parent == second.folder.parent == tmp_path
    folder = first.folder
    first.close()
    assert not folder.exists() and len(first) == 0 and tmp_path.exists()
    folder = second.folder
    del second
    gc.collect()
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []

    unspilled = ClientStateStore(None, tmp_path)
    unspilled[0] = flame_state(1.0)
    assert unspilled.stats().spilled == 0 and list(tmp_path.iterdir()) == []  # no folder until a spill


_DTYPES = [np.float32, np.float64, np.int64, np.uint8]


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(0, 600),
    operations=st.lists(
        st.tuples(
            st.sampled_from(["set", "get", "delete"]),
            st.integers(0, 5),
            st.integers(0, 40),
            st.sampled_from(_DTYPES),
        ),
        max_size=40,
    ),
)
def test_random_reads_writes_and_deletes_behave_like_a_dict(budget, operations):
    model: dict[int, Any] = {}
    with ClientStateStore(budget) as store:
        for step, (operation, key, size, dtype) in enumerate(operations):
            if operation == "set":
                state = FlameClientState(np.arange(size, dtype=dtype), np.full(size, step, dtype), None)
                store[key] = model[key] = state
            elif operation == "get":
                if key in model:
                    assert_identical(store[key], model[key])
                else:
                    with pytest.raises(KeyError):
                        store[key]
            elif key in model:
                del store[key], model[key]
            else:
                with pytest.raises(KeyError):
                    del store[key]
            stats = store.stats()
            assert list(store) == list(model) and len(store) == len(model)
            assert all(k in store for k in model) and (key in store) == (key in model)
            assert stats.in_memory + stats.spilled == len(model) and stats.memory_bytes <= budget
            if store.stats().spilled:
                assert len(list(store.folder.glob("client-*.npz"))) == stats.spilled
        assert_identical(dict(store.items()), model)


def _config(name: str = "flame", **runtime: Any):
    partition = AUGFL_PARTITION if name == "augfl" else {"scheme": "dirichlet", "beta": 0.5}
    return validate_config(
        tiny_config(
            algorithm=ALGORITHMS[name],
            partition=partition,
            clients={"count": 6, "per_round": 4},
            runtime={"num_hosts": 2, **runtime},
        )
    )


def _run(sim: InProcess, rounds: range) -> list[str]:
    """Every round's per-client records and server metrics but timings (as repr: exact floats, nan equal to
    nan)."""
    seen = []
    for round_index in rounds:
        selected = sample_clients(sim.config.seed, round_index, 6, 4)
        partial, records = sim.host.train(round_index, selected, sim.coordinator.broadcast())
        metrics = {k: v for k, v in sim.coordinator.aggregate(partial).items() if not k.endswith("_seconds")}
        seen.append(repr((records.to_pydict(), metrics)))
    return seen


def _final(sim: InProcess) -> tuple[np.ndarray, str, dict[int, Any]]:
    global_model = sim.coordinator.global_model()
    evaluation = sim.host.evaluate(global_model, sim.coordinator.evaluation_context())
    return global_model, repr(evaluation.to_pydict()), sim.states


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("budget_states", [0, 2.5])
def test_runs_with_spilled_states_equal_in_memory_runs(name, budget_states, tmp_path):
    """A budget below one state (all on disk) or of a few states (mixed): same metrics, global model,
    evaluations and client states, bit for bit."""
    reference = InProcess(_config(name))
    one = state_nbytes(reference.states[0])
    spilling = InProcess(_config(name, state_memory_mb=budget_states * one / 2**20, spill_dir=str(tmp_path)))
    assert _run(spilling, range(3)) == _run(reference, range(3))
    stats = spilling.host.states.stats()
    assert stats.spilled >= 6 - math.floor(budget_states) and stats.loads > 0
    (w, evaluations, states), (w_ref, evaluations_ref, states_ref) = _final(spilling), _final(reference)
    assert w.tobytes() == w_ref.tobytes() and evaluations == evaluations_ref
    assert_identical(states, states_ref)
    assert spilling.host.state_memory()["state/spilled_clients"] == stats.spilled
    spilling.host.close()
    assert list(tmp_path.iterdir()) == []


def _save(sim: InProcess, directory: Path) -> None:
    sim.host.save_checkpoint(str(directory / "host-0.npz"))
    sim.coordinator.save_checkpoint(str(directory / "coordinator.npz"))


def _restore(sim: InProcess, directory: Path) -> None:
    sim.host.restore_checkpoint(str(directory))
    sim.coordinator.restore_checkpoint(str(directory / "coordinator.npz"))


def test_checkpoint_of_spilled_states_restores_into_any_store(tmp_path):
    reference = InProcess(_config())
    expected = _run(reference, range(4))
    spilling = InProcess(_config(state_memory_mb=0))
    assert _run(spilling, range(2)) == expected[:2]
    _save(spilling, tmp_path / "ckpt")
    assert spilling.host.states.stats().spilled == 6  # checkpointing read them without bringing them back
    final = _final(reference)
    for runtime in ({"state_memory_mb": 0}, {}):  # into spilled and into in-memory hosts alike
        resumed = InProcess(_config(**runtime))
        _restore(resumed, tmp_path / "ckpt")
        assert _run(resumed, range(2, 4)) == expected[2:]
        assert_identical(_final(resumed), final)


def test_a_checkpoint_of_one_spilling_host_restores_into_two(tmp_path):
    sim = InProcess(_config(state_memory_mb=0))
    _run(sim, range(2))
    _save(sim, tmp_path)
    problem = sim.problem
    for part in (problem.clients[:2], problem.clients[2:]):
        host = make_host(sim.config, problem, part, state_memory_mb=0)
        host.restore_checkpoint(str(tmp_path))
        assert_identical(host.client_states(), sim.host.client_states(host.client_ids))
        host.close()


def test_checkpoints_written_before_streaming_still_restore(tmp_path):
    """The format is np.savez's; a file written the old way (whole tree, then np.savez) reads the same."""
    sim = InProcess(_config())
    _run(sim, range(2))
    tree = {"states": sim.states, "sent": {}, "evaluations": 0}
    arrays: dict[str, np.ndarray] = {}
    structure = checkpoint.encode_tree(tree, arrays)
    np.savez(tmp_path / "host-0.npz", __structure__=np.frombuffer(json.dumps(structure).encode(), np.uint8), **arrays)
    sim.host.save_checkpoint(str(tmp_path / "streamed.npz"))
    with np.load(tmp_path / "host-0.npz") as old, np.load(tmp_path / "streamed.npz") as new:
        assert sorted(old.files) == sorted(new.files)
        assert all(old[k].tobytes() == new[k].tobytes() for k in old.files)
    resumed = InProcess(_config(state_memory_mb=0))
    resumed.host.restore_checkpoint(str(tmp_path))
    assert_identical(resumed.states, sim.states)


def _mlp_host(state_memory_mb: float | None, clients: int = 20) -> InProcess:
    config = validate_config(
        tiny_config(model={"name": "mlp"}, clients={"count": clients}, runtime={"state_memory_mb": state_memory_mb})
    )
    return InProcess(config)


def _peak_bytes(action) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_checkpoint_and_restore_of_spilled_states_hold_one_state_at_a_time(tmp_path):
    """Numpy allocations while saving and restoring 20 spilled states stay under four states' worth (one
    state and the buffers reading it; the whole host would be 20)."""
    sim = _mlp_host(0)
    one = state_nbytes(sim.states[0])
    assert one > 100_000
    path = tmp_path / "host-0.npz"
    assert _peak_bytes(lambda: sim.host.save_checkpoint(str(path))) < 4 * one
    assert path.stat().st_size > 20 * one
    restored = _mlp_host(0)
    assert _peak_bytes(lambda: restored.host.restore_checkpoint(str(tmp_path))) < 4 * one
    assert_identical(restored.states, sim.states)
    in_memory = _mlp_host(None)
    assert _peak_bytes(lambda: in_memory.host.restore_checkpoint(str(tmp_path))) > 20 * one  # the test can fail
