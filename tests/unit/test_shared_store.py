"""One sqlite MLflow store written by several runs at once (a sweep's trials, its parent, `raysim ui`): a run's
dataset input logged by runs at the same moment, sqlite's busy timeout, and the line a SQL store's error is told in."""

from __future__ import annotations

import threading

import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.data.partitions import ClientSplit
from raysim.studies.children import one_line
from raysim.tracking.identity import log_dataset
from raysim.tracking.mlflow_writer import SQLITE_BUSY_S, waiting_for_writers
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store


def test_runs_logging_the_same_new_dataset_at_once_each_link_it(tmp_path):
    """Four runs of one experiment log the same dataset at the same moment, for five new datasets in turn: MLflow
    looks a dataset up and inserts it in one transaction, so runs failed with an IntegrityError (5 to 16 of the 20
    here, before log_dataset tried again); now each run has its one input and the experiment each dataset once."""
    uri = waiting_for_writers(fresh_store(tmp_path / "mlflow.db"))
    config = validate_config(tiny_config())
    client = MlflowClient(uri)
    experiment = client.create_experiment("shared")
    failures: list[str] = []

    def log(run_id: str, labels: np.ndarray, start: threading.Barrier) -> None:
        own = MlflowClient(uri)  # a process of its own has its own connections
        splits = [ClientSplit(0, np.arange(4), np.arange(4, 6), np.array([], np.int64))]
        start.wait()
        try:
            log_dataset(own, run_id, config, labels, splits)
        except Exception as error:  # noqa: BLE001 - what the test counts
            failures.append(one_line(error))

    runs = []
    for dataset in range(5):
        start = threading.Barrier(4)
        labels = np.arange(6) % (dataset + 2)  # a new digest: a dataset the experiment does not have yet
        batch = [client.create_run(experiment).info.run_id for _ in range(4)]
        threads = [threading.Thread(target=log, args=(run_id, labels, start)) for run_id in batch]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runs += batch
    assert failures == []
    digests = [client.get_run(run_id).inputs.dataset_inputs for run_id in runs]
    assert all(len(inputs) == 1 for inputs in digests)
    assert len({inputs[0].dataset.digest for inputs in digests}) == 5


def test_a_local_sqlite_store_is_opened_with_sqlites_busy_timeout_and_other_stores_as_they_are(tmp_path):
    database = tmp_path / "mlflow.db"
    uri = waiting_for_writers(f"sqlite:///{database}")
    assert uri == f"sqlite:///{database}?timeout={SQLITE_BUSY_S}"
    assert waiting_for_writers("sqlite:///mlflow.db") == f"sqlite:///mlflow.db?timeout={SQLITE_BUSY_S}"
    assert waiting_for_writers(f"sqlite:///{database}?timeout=5") == f"sqlite:///{database}?timeout=5"
    assert waiting_for_writers("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    store = MlflowClient(uri)._tracking_client.store
    assert store.engine.dialect.create_connect_args(store.engine.url)[1]["timeout"] == SQLITE_BUSY_S
    assert database.is_file()  # the file the URI without its query names


def test_a_sql_stores_error_is_told_by_its_cause_not_by_sqlalchemys_footnote():
    error = MlflowException(
        "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name\n"
        "[SQL: INSERT INTO datasets (dataset_uuid) VALUES (?)]\n"
        "(Background on this error at: https://sqlalche.me/e/21/gkpj)"
    )
    cause = "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name"
    assert one_line(error) == f"MlflowException: {cause}"
