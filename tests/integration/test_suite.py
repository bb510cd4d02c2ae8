"""Suites: config expansion and errors (plain Python), and every algorithm end to end through `raysim run`
on a suite file, logged to MLflow as child runs of one parent run."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.algorithms.families.split import personal_mask
from raysim.algorithms.fedapm import FedApmSettings
from raysim.cli import main
from raysim.models.flat import FlatModel
from raysim.tracking.plots import mlflow_group_color
from tests.support.experiments import IN_PROCESS, tiny_config

ISSUE_3 = ("flame", "fedavg", "fedprox", "fedadmm", "pfedme", "ditto", "fedapm", "fedalt", "fedsim", "local")


def _bytes_per_client(name: str, model: str) -> tuple[int, int]:
    """(uplink, downlink) bytes of one client in one round: what each algorithm really sends, float32 (4 bytes
    per entry, plus 4 for a scalar weight); the partial-personalization methods send the shared part only."""
    spec = FlatModel(model, (20,), 4).spec  # synthetic_classification: 20 features, 4 classes
    d = spec.size
    shared = int((~personal_mask(FedApmSettings(), spec)).sum()) if model == "mlp" else d
    return {
        "flame": (4 * d, 4 * d),
        "fedavg": (4 * d + 4, 4 * d),
        "fedprox": (4 * d + 4, 4 * d),
        "fedadmm": (4 * d, 4 * d),
        "pfedme": (4 * d, 4 * d),
        "ditto": (4 * d + 4, 4 * d),
        "fedapm": (4 * shared, 4 * shared),
        "fedalt": (4 * shared + 4, 4 * shared),
        "fedsim": (4 * shared + 4, 4 * shared),
        "local": (0, 0),
    }[name]


@pytest.mark.slow
def test_every_algorithm_runs_through_the_cli_as_a_nested_suite(tmp_path, mlflow_uri, capsys):
    split = {"fedapm", "fedalt", "fedsim"}
    runs = [
        {
            "name": name,
            "set": {"algorithm": {"name": name, "lr": 0.05}, "model.name": "mlp" if name in split else "mlr"},
        }
        for name in ISSUE_3
    ]
    base = tiny_config(
        rounds=2, clients={"count": 3}, tracking={"uri": mlflow_uri, "experiment": "suite"}, runtime=IN_PROCESS
    )
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "everything", "base": base, "runs": runs}))
    assert main(["run", str(path), "--quiet"]) == 0  # each child on the actors of the one before (tiny_config)
    printed = capsys.readouterr().out
    assert all(name in printed for name in ISSUE_3)

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("suite")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.suite = 'everything'")
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == sorted(ISSUE_3)
    for child in children:  # the parent's row compares the settings: each one's final accuracy
        final = max(client.get_metric_history(child.info.run_id, "pm/acc"), key=lambda m: m.step).value
        assert parent.data.metrics[f"{child.info.run_name}/pm/acc"] == pytest.approx(final)
    for child in children:  # MLflow's own colour of each setting's group, so its charts and raysim's figures agree
        assert child.data.tags["mlflow.runColor"] == mlflow_group_color(child.data.tags["raysim.group"])
    for child in children:
        assert child.info.status == "FINISHED"
        assert {"pm/acc", "gm/acc", "hm/acc", "pm/best_acc", "pm/f1", "pm/auc"} <= set(child.data.metrics)
        up, down = _bytes_per_client(child.info.run_name, "mlp" if child.info.run_name in split else "mlr")
        assert child.data.metrics["traffic/uplink_bytes_total"] == 2 * 3 * up  # 2 rounds, 3 clients
        assert child.data.metrics["traffic/downlink_bytes_total"] == 2 * 3 * down
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"summary.parquet", "comparison.png", "comparison.pdf", "comparison.svg"} <= artifacts
    table = pq.read_table(client.download_artifacts(parent.info.run_id, "summary.parquet", str(tmp_path)))
    assert table.num_rows == len(ISSUE_3) and {"run", "seed", "run_id", "final/pm/acc"} <= set(table.column_names)
