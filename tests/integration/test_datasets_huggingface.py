"""`dataset.name: huggingface` on small datasets written with `save_to_disk` here (no network): images and
features, ClassLabel and plain int labels, split choice and pooling, one-line errors, and a CLI run."""

from __future__ import annotations

from tests.support.data_files import save_dataset, tabular_dataset
from tests.support.experiments import IN_PROCESS, run_through_cli, tiny_config


def test_fedavg_runs_two_rounds_on_a_saved_tabular_dataset_through_the_cli(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    path = save_dataset(tabular_dataset(240), tmp_path / "tabular")
    config = tiny_config(
        algorithm={"name": "fedavg", "lr": 0.05, "batch_size": 16},
        dataset={"name": "huggingface", "path": path, "image": "features", "label": "target"},
        partition={"scheme": "dirichlet", "beta": 0.5},
        model={"name": "mlp"},
        clients={"count": 4},
        rounds=2,
        tracking={"uri": mlflow_uri, "experiment": "huggingface"},
        runtime=IN_PROCESS,
    )
    run = run_through_cli(config, mlflow_uri)
    client = MlflowClient(mlflow_uri)
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "2"
    history = client.get_metric_history(run.info.run_id, "gm/acc")
    assert history and all(0.0 <= m.value <= 1.0 for m in history)
