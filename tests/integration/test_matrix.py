"""The space of settings, tested (tests/support/matrix.py plans it): every cell of the pairwise cover runs end to end
on real Fashion-MNIST (2,000 training and 500 test images of it, in its standard IDX layout: the loader, the uint8
normalization and the data's structure are the real ones; MATRIX_SAMPLES in tests/integration/conftest.py), 4
clients, 1 round, through the driver, the hosts and the coordinator in this process (runtime.actors: in_process, the
code Ray's actors run, without the actors: tests/integration/test_matrix_on_ray.py shows a sample of cells logs the
same on Ray), logging to one sqlite MLflow store, and is read back from the store: FINISHED, every metric finite,
every documented metric key logged once at every step. A cell that cannot run must be refused before any MLflow work
with one ConfigError line naming the key, and leave no run behind."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.runtime.driver import run_experiment
from raysim.tracking.mlflow_writer import local_artifact_folder
from tests.support.logged import check_logged
from tests.support.matrix import REFUSALS, RUNS, experiment


@pytest.mark.matrix
@pytest.mark.parametrize("cell", RUNS, ids=lambda cell: cell.name)
def test_cell_runs_and_logs_every_key_once_per_step(cell, contexts, matrix_store, pretrained_cache):
    config = experiment(cell, contexts[cell.val], matrix_store)
    result = run_experiment(validate_config(config), show_progress=False)
    run = check_logged(MlflowClient(matrix_store), result.run_id, config)
    folder = local_artifact_folder(run.info.artifact_uri)  # read as it is: MLflow's listing asks the store again
    assert folder is not None and folder.is_dir()
    assert not sorted(folder.rglob("*.png"))  # figures: []


@pytest.mark.matrix
@pytest.mark.parametrize(("cell", "key"), REFUSALS, ids=lambda item: getattr(item, "name", item))
def test_cell_that_cannot_run_is_refused_with_one_line(cell, key, contexts, matrix_store, pretrained_cache):
    config = experiment(cell, contexts[cell.val], matrix_store)
    with pytest.raises(ConfigError) as refused:
        run_experiment(validate_config(config), show_progress=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(key), message
    client = MlflowClient(matrix_store)
    found = client.get_experiment_by_name(config["tracking"]["experiment"])
    if found is not None:
        name = config["tracking"]["run_name"]
        assert not client.search_runs([found.experiment_id], f"attributes.run_name = '{name}'")
