"""The clients' saved models come from the hosts a block of client ids at a time (issue 49: gathered whole, 1,000 MLP
clients' models took 1.7 GB more at a run's end than its rounds): whatever the block size, the blocks hold every
client once, in id order, each row the client's PM (FLAME's theta_i) bit for bit, across hosts that own
interleaved ids, and written block by block they make the archive the whole array makes."""

from __future__ import annotations

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

    def inspect(round_index: int, simulation) -> None:
        if round_index == config.rounds - 1:
            seen["owners"] = simulation.host_clients
            seen["states"] = simulation.client_states()
            row = 4 * simulation.model_size
            seen["blocks"] = {size: list(simulation.personalized_models(size)) for size in (1, 2 * row, 4 * row, 2**30)}

    run_experiment(config, show_progress=False, inspect=inspect)
    owners = seen["owners"]
    assert len(owners) == 2 and owners != [list(range(5)), list(range(5, 9))]  # hosts own interleaved ids
    states = seen["states"]
    expected = np.stack([np.asarray(states[c].theta, np.float32) for c in range(9)])
    row = 4 * expected.shape[1]
    clients_per_block = {1: [1] * 9, 2 * row: [2, 2, 2, 2, 1], 4 * row: [4, 4, 1], 2**30: [9]}
    for size, blocks in seen["blocks"].items():
        assert [len(ids) for ids, _ in blocks] == clients_per_block[size]
        assert np.concatenate([ids for ids, _ in blocks]).tolist() == list(range(9)), size
        assert np.array_equal(np.concatenate([rows for _, rows in blocks]), expected), size

    save_client_models(iter(seen["blocks"][1]), tmp_path / "blocks.npz")
    with np.load(tmp_path / "blocks.npz") as saved:
        assert saved["client_id"].tolist() == list(range(9)) and np.array_equal(saved["params"], expected)
