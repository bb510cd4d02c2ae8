"""A resumed study logs each of its parent's metrics once at a step (issue 51, section 3): resuming a suite with a
failed child logged the parent's summary twice at step 0 (`children/failed` read 1.0 and 0.0). Each attempt of the
study logs its summary at its own step: 0 when it first ends, 1 after the first resume, and so on."""

from __future__ import annotations

import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from tests.support.experiments import IN_PROCESS, tiny_config


def test_a_resumed_suite_logs_each_parent_metric_once_per_attempt(tmp_path, mlflow_uri, capsys):
    base = tiny_config(
        rounds=1, clients={"count": 3}, runtime=IN_PROCESS, tracking={"uri": mlflow_uri, "experiment": "attempts"}
    )
    runs = [{"name": "good", "set": {}}, {"name": "diverges", "set": {"algorithm.lr": 1e30}}]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "attempts", "base": base, "runs": runs}))
    assert main(["run", str(path), "--quiet"]) == 1
    client = MlflowClient(mlflow_uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("attempts").experiment_id], "tags.suite = 'attempts'")
    parent_id = parent.info.run_id

    runs[1]["set"] = {"algorithm.lr": 0.05}  # the fix
    path.write_text(yaml.safe_dump({"name": "attempts", "base": base, "runs": runs}))
    assert main(["run", str(path), "--quiet", "--resume", parent_id]) == 0
    capsys.readouterr()

    parent = client.get_run(parent_id)
    histories = {key: client.get_metric_history(parent_id, key) for key in parent.data.metrics}
    assert {"children/finished", "children/failed", "good/pm/acc", "diverges/pm/acc"} <= set(histories)
    for key, history in histories.items():
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{key} logged twice at a step: {steps}"
    ordered = {key: [m.value for m in sorted(h, key=lambda m: m.step)] for key, h in histories.items()}
    assert ordered["children/failed"] == [1.0, 0.0] and ordered["children/finished"] == [1.0, 2.0]
    assert len(ordered["diverges/pm/acc"]) == 1  # no mean while its only seed had failed
    assert parent.data.metrics["children/failed"] == 0.0  # the latest: the study as it stands
