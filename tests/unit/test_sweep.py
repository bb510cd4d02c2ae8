"""Sweeps: settings from grid and random draws, validation, and a real concurrent sweep on local Ray."""

from __future__ import annotations

import json

import pytest

from raysim.config import is_sweep_file
from raysim.errors import ConfigError
from raysim.studies.sweep import load_sweep, parse_sweep, run_sweep
from raysim.tracking.plots import mlflow_group_color
from tests.support.experiments import tiny_config
from tests.support.studies import sweep_data


def test_grid_times_draws_times_seeds():
    sweep = parse_sweep(
        sweep_data(
            grid={"algorithm.rho": [0.1, 0.2], "clients.count": [4, 6]},
            random={"count": 3, "seed": 5, "params": {"algorithm.lr": {"loguniform": [0.001, 0.1]}}},
            seeds=[1, 2],
        )
    )
    settings = sweep.settings()
    assert len(settings) == 2 * 2 * 3
    assert all(0.001 <= s["algorithm.lr"] <= 0.1 for s in settings)
    assert settings == parse_sweep(sweep.model_dump(exclude_none=True)).settings()  # draws are reproducible
    trials = sweep.trials("sqlite:////tmp/x.db")
    assert len(trials) == 24
    assert {t.config.seed for t in trials} == {1, 2}
    first = trials[0].config
    assert (first.algorithm.rho, first.clients.count, first.tracking.uri) == (0.1, 4, "sqlite:////tmp/x.db")
    assert len({t.config.tracking.run_name for t in trials}) == 24
    colors = {
        t.setting_index: {x.config.tracking.color for x in trials if x.setting_index == t.setting_index} for t in trials
    }
    assert all(len(c) == 1 for c in colors.values())  # a setting's seeds share MLflow's colour of its group
    assert all(t.config.tracking.color == mlflow_group_color(t.label) for t in trials)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"base_config": "x.yaml"}, "exactly one of `base` and `base_config`"),
        ({"grid": {"algorithm.rho": []}}, "grid.algorithm.rho: needs at least one value"),
        ({"random": {"count": 1, "params": {"seed": {"uniform": [2, 1]}}}}, "low 2.0 exceeds high 1.0"),
        ({"random": {"count": 1, "params": {"seed": {"choice": [1], "randint": [1, 2]}}}}, "exactly one of choice"),
        ({"grid": {"seed": [1]}, "random": {"count": 1, "params": {"seed": {"randint": [1, 2]}}}}, "also in grid"),
        ({"max_concurrent": 0}, "max_concurrent"),
    ],
)
def test_bad_sweeps_are_rejected_with_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_sweep(sweep_data(**extra))


def test_a_bad_trial_config_names_the_trial():
    sweep = parse_sweep(sweep_data(grid={"algorithm.rho": [0.1, -1.0]}))
    with pytest.raises(ConfigError, match=r"sweep trial 1 \(rho=-1\): algorithm.rho"):
        sweep.trials("sqlite:////tmp/x.db")


def test_load_sweep_resolves_base_config_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(json.dumps(tiny_config()))
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"name": "s", "base_config": "base.yaml", "grid": {"algorithm.rho": [0.1]}}))
    assert is_sweep_file(path) and not is_sweep_file(tmp_path / "base.yaml")
    sweep = load_sweep(path, ["rounds=5"])
    assert sweep.base_tree()["rounds"] == 5
    assert sweep.trials("sqlite:////tmp/x.db")[0].config.rounds == 5


def test_an_impossible_partition_fails_before_the_sweep_starts(tmp_path):
    """Every distinct partition of the trials is made up front: the bad trial is named, and neither the parent
    MLflow run nor Ray is started (a trial used to fail inside its own Ray task)."""
    from raysim.errors import PartitionError

    store = tmp_path / "mlflow.db"
    base = tiny_config(tracking={"uri": f"sqlite:///{store}", "experiment": "sweep"})
    sweep = parse_sweep({"name": "s", "base": base, "grid": {"clients.count": [4, 1500]}, "seeds": [1, 2]})
    with pytest.raises(PartitionError) as error:
        run_sweep(sweep, show_progress=False)
    assert str(error.value) == (
        "sweep trial 2 (count=1500, seed 1): clients.count=1500: the dataset has 2000 samples, fewer than 2 per "
        "client (each client needs at least one training and one test sample)"
    )
    assert not store.exists()
    writers = parse_sweep({"name": "s", "base": base, "grid": {"partition": [{"scheme": "natural"}]}})
    assert len(writers.trials(f"sqlite:///{store}")) == 1  # a valid config: only making the partition fails
    with pytest.raises(PartitionError, match=r"^sweep trial 0 \(partition=.*, seed 7\): partition.scheme=natural"):
        run_sweep(writers, show_progress=False)
    assert not store.exists()


def test_trial_progress_reads_each_running_trials_rounds_from_the_store(mlflow_uri):
    """The sweep's view of its trials in flight: rounds logged (`time/round` points) by its running children,
    a line when a trial has done another tenth of its rounds; other runs' histories are not counted."""
    import io

    from mlflow.entities import Metric
    from rich.console import Console

    from raysim.studies.trial_progress import TrialProgress
    from raysim.tracking.mlflow_writer import MlflowWriter

    writer = MlflowWriter(mlflow_uri, "progress")
    client = writer.client
    parent = client.create_run(writer.experiment_id, run_name="sweep").info.run_id
    tags = {"mlflow.parentRunId": parent}
    fast, slow = (client.create_run(writer.experiment_id, run_name=n, tags=tags).info.run_id for n in ("a", "b"))
    other = client.create_run(writer.experiment_id, run_name="a").info.run_id  # same name, another parent

    def log_rounds(run_id: str, first: int, last: int) -> None:
        client.log_batch(run_id, metrics=[Metric("time/round", 0.1, 0, step) for step in range(first, last + 1)])

    log_rounds(fast, 1, 3)
    log_rounds(slow, 1, 1)
    log_rounds(other, 1, 9)
    shown = io.StringIO()
    progress = TrialProgress(writer, parent, Console(file=shown, width=200), every_s=3600)
    assert progress.rounds_done(["a", "b"]) == {"a": 3, "b": 1}
    progress.look({"a": 30, "b": 10}, force=True)
    assert shown.getvalue().splitlines() == ["a: round 3/30", "b: round 1/10"]
    log_rounds(fast, 4, 5)
    progress.look({"a": 30, "b": 10})  # within every_s: no look
    progress.look({"a": 30, "b": 10}, force=True)  # a: 5 is still its third tenth; b unchanged
    assert shown.getvalue().splitlines() == ["a: round 3/30", "b: round 1/10"]
    log_rounds(fast, 6, 6)
    client.set_terminated(slow, "FINISHED")
    progress.look({"a": 30, "b": 10}, force=True)
    assert shown.getvalue().splitlines()[2:] == ["a: round 6/30"]
