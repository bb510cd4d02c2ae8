"""Every algorithm on the runtime classes: unselected clients keep their state bit for bit (partial
participation), on the real ClientHost/Coordinator in one process for all, and on Ray actors for the
running-sum algorithms whose server uses stale messages of unselected clients (FedAPM, pFedMe)."""

from __future__ import annotations

import pytest

from raysim.runtime.driver import run_experiment
from tests.support.algorithms import StateWatch, algorithm_config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedapm", "pfedme"])
def test_unselected_clients_keep_their_state_bit_for_bit_on_actors(name, ray_local, mlflow_uri):
    config = algorithm_config(name, tracking={"uri": mlflow_uri, "experiment": "bits"})
    watch = StateWatch(name, config.seed)
    run_experiment(config, show_progress=False, inspect=lambda r, sim: watch.check(r, sim.client_states()))
    assert watch.rounds == [0, 1, 2]
