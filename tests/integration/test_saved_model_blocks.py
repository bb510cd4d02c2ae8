"""The clients' saved models come from the hosts a block of client ids at a time (issue 49: gathered whole, 1,000 MLP
clients' models took 1.7 GB more at a run's end than its rounds): whatever the block size, the blocks hold every
client once, in id order, each row the client's PM (FLAME's theta_i) bit for bit, across hosts that own
interleaved ids, and written block by block they make the archive the whole array makes. A host on the driver's node
writes its rows to a file the driver reads the blocks from (the object store counted each block's pages in both
processes' RSS); one on another node (here: the driver told it is on another) is asked a block at a time; both give
the same blocks, and the scratch files are gone when the blocks are."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from raysim.tracking.models import save_client_models
from tests.support.experiments import IN_PROCESS, tiny_config


def test_blocks_of_any_size_are_every_clients_pm_in_id_order(mlflow_uri, tmp_path):
    config = validate_config(
        tiny_config(clients={"count": 9}, rounds=2, runtime=IN_PROCESS, tracking={"uri": mlflow_uri})
    )
    seen: dict[str, object] = {}
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def inspect(round_index: int, simulation) -> None:
        if round_index == config.rounds - 1:
            seen["owners"] = simulation.host_clients
            seen["states"] = simulation.client_states()
            row = 4 * simulation.model_size
            for node, name in ((None, "blocks"), ("another node", "remote")):
                seen[name] = {
                    size: _blocks(simulation.personalized_models(size, node, scratch), scratch, seen, name)
                    for size in (1, 2 * row, 4 * row, 2**30)
                }
            early = simulation.personalized_models(1, None, scratch)
            next(early)
            early.close()  # a reader that stops early leaves no scratch file either
            seen["left"] = list(scratch.iterdir())

    run_experiment(config, show_progress=False, inspect=inspect)
    owners = seen["owners"]
    assert len(owners) == 2 and owners != [list(range(5)), list(range(5, 9))]  # hosts own interleaved ids
    states = seen["states"]
    expected = np.stack([np.asarray(states[c].theta, np.float32) for c in range(9)])
    row = 4 * expected.shape[1]
    clients_per_block = {1: [1] * 9, 2 * row: [2, 2, 2, 2, 1], 4 * row: [4, 4, 1], 2**30: [9]}
    for name in ("blocks", "remote"):
        for size, blocks in seen[name].items():
            assert [len(ids) for ids, _ in blocks] == clients_per_block[size]
            assert all(ids.dtype == np.int64 and rows.dtype == np.float32 for ids, rows in blocks)
            assert np.concatenate([ids for ids, _ in blocks]).tolist() == list(range(9)), (name, size)
            assert np.array_equal(np.concatenate([rows for _, rows in blocks]), expected), (name, size)
    assert seen["files blocks"] == {"host-0.rows", "host-1.rows"} and seen["files remote"] == set()
    assert seen["left"] == []

    save_client_models(iter(seen["blocks"][1]), tmp_path / "blocks.npz")
    with np.load(tmp_path / "blocks.npz") as saved:
        assert saved["client_id"].tolist() == list(range(9)) and np.array_equal(saved["params"], expected)


def _blocks(blocks: Iterator[tuple[np.ndarray, np.ndarray]], scratch: Path, seen: dict, name: str) -> list:
    """The blocks, and in `seen` the scratch files there while they were read; none is left after the last."""
    found = [next(blocks)]
    seen[f"files {name}"] = {path.name for folder in scratch.iterdir() for path in folder.iterdir()}
    found.extend(blocks)
    assert list(scratch.iterdir()) == []
    return found


def test_hosts_on_ray_actors_of_the_drivers_node_write_their_rows_to_files(ray_local, mlflow_uri, tmp_path):
    """On Ray, the hosts' actors report the driver's node: they write their rows to the scratch folder instead of
    sending them through the object store, and the blocks are those the object store's path gives."""
    config = validate_config(tiny_config(clients={"count": 5}, rounds=1, tracking={"uri": mlflow_uri}))
    seen: dict[str, object] = {}
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def inspect(round_index: int, simulation) -> None:
        for node, name in ((None, "ray"), ("another node", "remote")):
            seen[name] = _blocks(simulation.personalized_models(2**30, node, scratch), scratch, seen, name)

    run_experiment(config, show_progress=False, inspect=inspect)
    assert seen["files ray"] == {"host-0.rows", "host-1.rows"} and seen["files remote"] == set()
    ((ids, rows),), ((remote_ids, remote_rows),) = seen["ray"], seen["remote"]
    assert ids.tolist() == remote_ids.tolist() == list(range(5)) and np.array_equal(rows, remote_rows)


def test_clients_without_a_saved_row_are_left_out_on_both_paths(mlflow_uri):
    """FedCP's held-out clients (scored with the global model) have no row of its personalized network: their host's
    file leaves them out as its reply does, and a block of only such clients is empty with the network's width."""
    algorithm = {"name": "fedcp", "lr": 0.1, "batch_size": 16}
    clients = {"count": 5, "heldout": 0.4}
    tree = tiny_config(algorithm=algorithm, model={"name": "mlp"}, clients=clients, rounds=1, runtime=IN_PROCESS)
    config = validate_config({**tree, "tracking": {**tree["tracking"], "uri": mlflow_uri}})
    seen: dict[object, list] = {}

    def inspect(round_index: int, simulation) -> None:
        seen["network"] = [simulation.model_size]
        for node in (None, "another node"):
            seen[node] = list(simulation.personalized_models(1, node))

    run_experiment(config, show_progress=False, inspect=inspect)
    for node in (None, "another node"):
        blocks = seen[node]
        assert [ids.tolist() for ids, _ in blocks] == [[0], [1], [2], [], []]
        assert len({rows.shape[1] for _, rows in blocks}) == 1 and blocks[0][1].shape[1] != seen["network"][0]
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(seen[None], seen["another node"], strict=True))
