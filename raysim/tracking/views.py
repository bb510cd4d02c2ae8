"""A study's comparison view in MLflow's UI: the children of a suite or sweep parent, grouped by setting.

MLflow's runs page collapses a parent's children under it and charts only the first ten runs, with no metric column
until one is picked by hand. A shared view (an experiment tag `mlflow.sharedViewState.KEY` holding the page's state,
opened with `?viewStateShareKey=KEY`, the UI's own "Share" format) shows instead every child, grouped by its setting
(`tracking.group`, the run tag GROUP_TAG): the table with each group's mean PM/GM/HM accuracy, the charts with each
setting's mean curve over its seeds and a band."""

from __future__ import annotations

import json

from raysim.credentials import redact
from raysim.tracking.mlflow_writer import MlflowWriter

GROUP_TAG = "raysim.group"
"""Run tag: the setting of a study the run belongs to (`tracking.group`); its seeds share it."""
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
HEADLINE_METRICS = ("pm/acc", "gm/acc", "hm/acc")


def view_state(parent_run_id: str) -> dict[str, object]:
    """The runs page's state: the parent's children, every one shown (not the first ten), their global models
    (LoggedModels) and headline accuracies as columns, grouped by setting with the mean over seeds (the setting of
    the best mean PM accuracy first), charts of the headline curves. Ordered by their start time instead, the UI
    would also load the parent of the runs found, and show it in a group of its own ("Additional runs")."""
    return {
        "searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}'",
        "orderByKey": f"metrics.`{HEADLINE_METRICS[0]}`",
        "orderByAsc": False,
        "runsHiddenMode": "SHOW_ALL",
        "selectedColumns": ["attributes.`Models`", *(f"metrics.`{key}`" for key in HEADLINE_METRICS)],
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": GROUP_TAG}]},
        "useGroupedValuesInCharts": True,
        "chartsSearchFilter": "^(pm|gm|hm)/acc$",
    }


def view_path(experiment_id: str, parent_run_id: str) -> str:
    """The comparison view's path in the UI, after the server's URL (in MLflow's model-training view: MLflow 3
    opens its GenAI view, with Traces, Judges and Prompts, unless told)."""
    return (
        f"/#/experiments/{experiment_id}/runs?viewStateShareKey={parent_run_id}"
        "&workflowType=machine_learning&compareRunsMode=CHART"
    )


def share_children_view(writer: MlflowWriter) -> None:
    """Store the comparison view of the writer's (parent) run's children and link it from the run's description."""
    parent = writer.run_id or ""
    writer.client.set_experiment_tag(writer.experiment_id, SHARED_VIEW_PREFIX + parent, json.dumps(view_state(parent)))
    path = view_path(writer.experiment_id, parent)
    writer.set_tags(
        {
            "mlflow.note.content": f"[Compare the settings]({path}): every child, grouped by setting "
            "(mean over seeds), in charts and (the table icon) the runs table."
        }
    )


def compare_command(writer: MlflowWriter) -> str:
    """The command that opens the MLflow UI on the comparison view of the writer's (parent) run."""
    return f"raysim ui --tracking-uri {writer.shown_uri} --compare {writer.run_id}"


def comparison_path(tracking_uri: str, parent_run_id: str) -> str:
    """The comparison view of a suite's or sweep's parent run (`raysim ui --compare`), or a ConfigError naming the
    run when the store has no such parent."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.credentials import connect_uri
    from raysim.errors import ConfigError

    client = MlflowClient(connect_uri(tracking_uri))
    try:
        run = client.get_run(parent_run_id)
    except MlflowException:
        raise ConfigError(f"--compare: no run {parent_run_id!r} in {redact(tracking_uri)}") from None
    experiment = client.get_experiment(run.info.experiment_id)
    if SHARED_VIEW_PREFIX + parent_run_id not in experiment.tags:
        raise ConfigError(
            f"--compare: run {parent_run_id!r} ({run.info.run_name}) is not the parent run of a suite or sweep"
        )
    return view_path(run.info.experiment_id, parent_run_id)
