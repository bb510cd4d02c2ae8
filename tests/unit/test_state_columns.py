"""The shared client-state store (raysim.runtime.state_columns) and the dealing of a round's clients to hosts
(raysim.runtime.simulation.deal): states come back bit for bit through any store open on the folder, rows never
written are the initial states, a snapshot restores exactly, the files are sparse, LPT dealing keeps every
host within 4/3 of the best makespan, and `state_store: auto` resolves to the store the run can hold."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass

import numpy as np
import pytest

from raysim.config import RuntimeSettings
from raysim.execution.stacking import stack
from raysim.runtime.memory import StoreChoice, choose_store
from raysim.runtime.simulation import GROUPS_PER_HOST, deal
from raysim.runtime.state_columns import SHARED_MEMORY, Column, ColumnStates, store_folder


@dataclass
class State:
    theta: np.ndarray
    count: int
    scale: float
    w: np.ndarray | None = None


def initial(client: int) -> State:
    return State(np.full(5, client, np.float32), 0, 1.0)


def trained(client: int, seed: int = 0) -> State:
    values = np.random.default_rng([client, seed]).standard_normal(5).astype(np.float32)
    return State(values, client + 1, float(values[0]) / 3, values.astype(np.float64) * 2)


def same(a: State, b: State) -> bool:
    return (
        type(a.count) is type(b.count)
        and a.count == b.count
        and type(a.scale) is type(b.scale)
        and a.scale == b.scale
        and np.array_equal(a.theta, b.theta)
        and a.theta.dtype == b.theta.dtype
        and (a.w is None) == (b.w is None)
        and (a.w is None or (np.array_equal(a.w, b.w) and a.w.dtype == b.w.dtype))
    )


@pytest.fixture(params=["disk", "memory"])
def folder(request, tmp_path):
    """A store's folder as a run makes it (raysim.runtime.state_columns.store_folder): on disk (its columns read and
    written with pread and pwrite) and in /dev/shm (its columns mapped)."""
    path, remove = store_folder(request.param, str(tmp_path))
    yield path
    remove()


def test_states_written_by_one_store_are_read_bit_for_bit_by_another_on_the_folder(folder):
    """Two hosts' stores on one folder: what one writes (a field None at first, numbers of their own types) the
    other reads, and a client never written is its initial state."""
    one = ColumnStates(folder, 10, initial(0), initial)
    two = ColumnStates(folder, 10, initial(0), initial)
    assert same(two[3], initial(3)) and two[3].w is None
    one[3] = trained(3)
    two[7] = trained(7)
    assert same(two[3], trained(3)) and same(one[7], trained(7))
    assert same(one[4], initial(4))


def test_rows_and_store_equal_stacking_the_states_and_write_only_the_kept_rows(folder):
    store = ColumnStates(folder, 8, initial(0), initial)
    for client in (1, 2, 5):
        store[client] = trained(client)
    expected = stack([trained(1), trained(2), trained(5)])
    rows = store.rows([1, 2, 5])
    for name in ("theta", "count", "scale", "w"):
        np.testing.assert_array_equal(getattr(rows, name), getattr(expected, name))
        assert getattr(rows, name).dtype == getattr(expected, name).dtype
    mixed = store.rows([0, 1])  # a client never written: its initial state, stacked as `stack` does
    assert mixed.w is None and np.array_equal(mixed.theta, stack([initial(0), trained(1)]).theta)
    new = stack([trained(c, seed=1) for c in (1, 2, 5)])
    store.store([1, 2, 5], new, np.array([True, False, True]))
    assert same(store[1], trained(1, seed=1)) and same(store[2], trained(2)) and same(store[5], trained(5, seed=1))


def test_a_snapshot_restores_exactly_and_forgets_rows_written_since(folder, tmp_path):
    store = ColumnStates(folder, 6, initial(0), initial)
    store[1], store[4] = trained(1), trained(4)
    snapshot = tmp_path / "checkpoint"
    snapshot.mkdir()
    store.snapshot(snapshot)
    store[1], store[2] = trained(1, seed=5), trained(2, seed=5)
    store.restore(snapshot)
    assert same(store[1], trained(1)) and same(store[4], trained(4))
    assert same(store[2], initial(2)), "a client first written after the snapshot is back to its initial state"
    other = tmp_path / "fresh"
    other.mkdir()
    fresh = ColumnStates(other, 6, initial(0), initial)  # a resumed run's new store, no column made yet
    fresh.restore(snapshot)
    assert all(same(fresh[c], store[c]) for c in range(6))


def test_the_columns_take_disk_only_for_the_clients_written(folder):
    """Sparse files: 100,000 clients of 1,000 floats each would take 400 MB; 10 written take a few pages."""
    big = State(np.zeros(1000, np.float32), 0, 1.0)
    store = ColumnStates(folder, 100_000, big, lambda client: big)
    for client in range(0, 100_000, 10_000):
        store[client] = State(np.ones(1000, np.float32), 1, 2.0)
    stats = store.stats()
    assert stats.spilled == 10
    assert stats.disk_bytes < 5 * 2**20


def test_a_memory_stores_views_are_the_rows_its_files_hold(folder):
    """A memory store's column gives consecutive rows as views of its mapping: the rows pread reads."""
    store = ColumnStates(folder, 12, initial(0), initial)
    store.store([7, 8, 9], stack([trained(c) for c in (7, 8, 9)]), kept=np.array([True, False, True]))
    column = store.columns["theta"]
    assert column.mapped == (folder.parent == SHARED_MEMORY)
    view = column.view(np.arange(7, 10))
    assert (view is not None) == column.mapped
    assert view is None or np.array_equal(view[[0, 2]], np.stack([trained(7).theta, trained(9).theta]))
    assert column.view(np.array([7, 9])) is None
    unmapped = Column(folder / "theta.npy")
    assert np.array_equal(unmapped.read([9]), trained(9).theta[None])
    unmapped.close()


def test_a_state_of_another_shape_is_refused_in_one_line(folder):
    store = ColumnStates(folder, 3, initial(0), initial)
    store[0] = trained(0)
    with pytest.raises(ValueError, match="'theta' has rows of shape \\(6,\\).*runtime.state_store=hosts"):
        store[1] = State(np.zeros(6, np.float32), 0, 1.0)


def test_the_store_folder_is_removed_by_its_maker(tmp_path):
    folder, remove = store_folder("disk", str(tmp_path))
    ColumnStates(folder, 4, initial(0), initial)[2] = trained(2)
    remove()
    assert not folder.exists()


def test_dealing_keeps_the_busiest_host_within_lpt_bound_and_pins_attackers():
    """LPT (Graham): makespan <= (4/3 - 1/(3 hosts)) x the best; checked against the best by brute force."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        clients = sorted(rng.choice(40, 7, replace=False).tolist())
        costs = {c: int(rng.integers(10, 600)) for c in range(40)}
        dealt = deal(clients, costs, 2, {})
        assert sorted(itertools.chain(*dealt)) == clients
        makespan = max(sum(costs[c] for c in host) for host in dealt)
        best = min(
            max(sum(costs[c] for c, h in zip(clients, hosts, strict=True) if h == k) for k in range(2))
            for hosts in itertools.product(range(2), repeat=len(clients))
        )
        assert makespan <= (4 / 3 - 1 / 6) * best + 1e-9
    assert deal([0, 1, 2, 3], {c: 10 for c in range(4)}, 2, {0: 1, 1: 1}) == [[2, 3], [0, 1]]
    assert deal([5], {5: 1}, 3, {}) == [[5], [], []]


def test_clients_of_equal_cost_are_dealt_in_runs_of_consecutive_ids_a_chunk_long_when_there_are_enough():
    """Groups of the hosts' chunk: every chunk a host makes of its clients (16 at a time, in id order for equal
    costs) is consecutive ids, and no host gets more than one group over the other; too few clients for
    GROUPS_PER_HOST groups a host are dealt one by one, as without chunks."""
    clients = list(range(1000))
    dealt = deal(clients, {c: 60 for c in clients}, 2, {}, chunk=16)
    assert sorted(itertools.chain(*dealt)) == clients
    assert abs(len(dealt[0]) - len(dealt[1])) <= 16
    for host in dealt:
        for begin in range(0, len(host), 16):
            chunk = host[begin : begin + 16]
            assert chunk == list(range(chunk[0], chunk[0] + len(chunk)))
    few = list(range(GROUPS_PER_HOST * 2 * 16 - 1))
    assert deal(few, {c: 60 for c in few}, 2, {}, chunk=16) == deal(few, {c: 60 for c in few}, 2, {})


def test_a_step_updates_a_mapped_stores_consecutive_rows_in_place_and_copies_the_others(folder):
    """Rows of consecutive clients read from a memory store are views of its mapping (what a step updates in place,
    as a StateTable's rows); any other rows, and every row of a disk store, are new arrays."""
    store = ColumnStates(folder, 8, initial(0), initial)
    store.store(list(range(8)), stack([trained(c) for c in range(8)]))
    mapped = folder.parent == SHARED_MEMORY
    rows = store.rows([3, 4, 5])
    assert np.shares_memory(rows.theta, store.columns["theta"].rows) if mapped else rows.theta.base is None
    rows.theta += 1  # a step in place: its rows are the store's (mapped), or its own copy
    assert np.array_equal(store[4].theta, trained(4).theta + (1 if mapped else 0))  # before `store`
    store.store([3, 4, 5], rows)
    assert np.array_equal(store[4].theta, trained(4).theta + 1)
    scattered = store.rows([1, 6])
    scattered.theta[:] = 0
    assert np.array_equal(store[6].theta, trained(6).theta)


def test_rows_written_in_any_order_read_back_bit_for_bit_in_another_store_on_the_folder(folder):
    """Every row of a chunk lands at its client's place, whatever the order of the ids, the last of a repeated id
    winning, and a second store on the folder (another host) reads them back bit for bit."""
    one = ColumnStates(folder, 40, initial(0), initial)
    ids = [17, 3, 4, 5, 6, 7, 8, 30, 2, 39, 18, 0]
    new = stack([trained(c, seed=1) for c in ids])
    one.store(ids, new)
    again = trained(5, seed=2)
    one.store([9, 5], stack([trained(9, seed=2), again]))
    two = ColumnStates(folder, 40, initial(0), initial)
    for client in ids:
        assert same(two[client], again if client == 5 else trained(client, seed=1))
    assert same(two[9], trained(9, seed=2))
    assert all(same(two[c], initial(c)) for c in set(range(40)) - {*ids, 9})


def test_client_columns_give_back_every_pair_as_packed_and_pickle_small(tmp_path):
    """The (ClientInfo, ClientSplit) pairs a shared store's driver sends its hosts, packed as columns: each pair
    read back (by position, by slice, by client id, after a pickle round trip) equals the one packed, field by field
    and bit for bit, the index arrays read-only."""
    import pickle

    from raysim.algorithms.interface import ClientInfo
    from raysim.data.scheme import ClientSplit
    from raysim.runtime.state_columns import ClientColumns

    draws = np.random.default_rng(3)
    pairs = []
    for client in (4, 0, 2, 1, 3, 5):  # not in id order; 5 is held out (id >= num_clients)
        sizes = draws.integers(0, 6, size=3)
        parts = [draws.integers(0, 1000, size=n) for n in sizes]
        weight = 0.0 if client == 5 else float(draws.random()) / 7
        pairs.append((ClientInfo(client, int(sizes[0]), weight, 5), ClientSplit(client, *parts, float(draws.random()))))
    packed = pickle.loads(pickle.dumps(ClientColumns(pairs)))

    def equal(a: tuple, b: tuple) -> bool:
        (info_a, split_a), (info_b, split_b) = a, b
        arrays = all(np.array_equal(getattr(split_a, p), getattr(split_b, p)) for p in ("train", "test", "val"))
        return (
            info_a == info_b
            and split_a.client_id == split_b.client_id
            and split_a.noise_std == split_b.noise_std
            and arrays
        )

    assert len(packed) == len(pairs) and all(equal(a, b) for a, b in zip(packed, pairs, strict=True))
    assert packed.infos() == [info for info, _ in pairs]
    assert [type(v) for v in vars(packed.infos()[0]).values()] == [type(v) for v in vars(pairs[0][0]).values()]
    assert all(equal(a, b) for a, b in zip(packed[1:4], pairs[1:4], strict=True)) and equal(packed[-1], pairs[-1])
    for info, split in pairs:
        found = packed.split(info.id)
        assert found.noise_std == split.noise_std and np.array_equal(found.test, split.test)
        assert not found.train.flags.writeable
    with pytest.raises(KeyError):
        packed.split(6)
    with pytest.raises(IndexError):
        packed[6]


def test_auto_puts_the_store_in_shared_memory_when_it_fits_else_on_disk_with_one_line(tmp_path):
    """/dev/shm stands in as `shm`: columns within half its free bytes and half the memory the run may take go
    there, more (Docker's 64 MB /dev/shm) go to disk with a line naming the setting; spill_dir means disk; a
    multi-node cluster without spill_dir keeps the hosts' own stores, saying why; an explicit store is kept."""
    free = shutil.disk_usage(tmp_path).free
    auto = RuntimeSettings()
    assert auto.state_store == "auto"
    assert choose_store(auto, 2**20, 2, shm=tmp_path) == StoreChoice("memory")
    big = choose_store(auto, free, 2, shm=tmp_path)
    assert big.store == "disk" and big.note is not None
    assert (
        big.note.startswith("runtime.state_store=auto: the client states' columns (")
        and "runtime.spill_dir" in big.note
    )
    assert choose_store(auto, 2**20, 2, shm=tmp_path / "absent").store == "disk"
    limited = choose_store(RuntimeSettings(memory_limit_mb=100), 51 * 2**20, 2, shm=tmp_path)
    assert limited.store == "disk" and limited.note is not None
    assert "exceed half the 100 MiB of memory the run may take (runtime.memory_limit_mb)" in limited.note
    assert choose_store(RuntimeSettings(memory_limit_mb=100), 50 * 2**20, 2, shm=tmp_path).store == "memory"
    assert choose_store(RuntimeSettings(spill_dir=str(tmp_path)), 2**20, 2, nodes=3) == StoreChoice("disk")
    cluster = choose_store(auto, 2**20, 2, nodes=3, shm=tmp_path)
    assert cluster.store == "hosts" and cluster.note is not None and "runtime.spill_dir" in cluster.note
    for store in ("hosts", "memory", "disk"):
        assert choose_store(RuntimeSettings(state_store=store), free, 2, nodes=3) == StoreChoice(store)


def test_with_auto_state_memory_mb_bounds_the_store_in_memory_and_refuses_only_with_an_explicit_store(tmp_path):
    """state_memory_mb times the hosts is what auto lets the columns take in memory; with memory or disk named
    it has no meaning and is refused naming both settings."""
    budget = RuntimeSettings(state_memory_mb=1)
    assert choose_store(budget, 2 * 2**20, 2, shm=tmp_path).store == "memory"
    over = choose_store(budget, 2 * 2**20 + 1, 2, shm=tmp_path)
    assert over.store == "disk" and over.note is not None and "runtime.state_memory_mb=1 on 2 hosts" in over.note
    assert RuntimeSettings(state_store="hosts", state_memory_mb=1).state_memory_mb == 1
    for store in ("memory", "disk"):
        with pytest.raises(ValueError, match=f"runtime.state_memory_mb=1 .* not {store}"):
            RuntimeSettings(state_store=store, state_memory_mb=1)
