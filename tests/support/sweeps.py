"""Reading a sweep's runs back from MLflow: its parent run from the CLI's output, its children, their logged steps
(shared by the sweep tests on a local Ray and on a cluster)."""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient


def children_of(client: MlflowClient, parent: str) -> list[Any]:
    """The child runs of the parent run `parent`."""
    experiment = client.get_run(parent).info.experiment_id
    return client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)


def metric_steps(client: MlflowClient, run: Any) -> dict[str, list[int]]:
    """Every metric's logged steps (a point logged twice shows as a repeated step)."""
    return {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


def parent_of(out: str) -> str:
    """The parent run id in `raysim sweep`'s output ("... parent run ID at ...")."""
    return out.split("parent run ", 1)[1].split()[0]
