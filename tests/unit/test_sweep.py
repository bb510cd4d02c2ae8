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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"scheduler": "hyperband"}, r"^sweep: scheduler.name: Input should be 'none', 'asha' or 'median_stopping'"),
        ({"scheduler": {"name": "asha", "reduction_factor": 1}}, r"scheduler.reduction_factor: .*greater than 1"),
        ({"scheduler": {"name": "median_stopping", "max_t": 4}}, "max_t is a setting of the asha scheduler"),
        ({"scheduler": {"name": "asha", "min_samples_required": 2}}, "a setting of the median_stopping scheduler"),
        ({"scheduler": {"name": "asha", "mode": "up"}}, r"scheduler.mode: Input should be 'max' or 'min'"),
        ({"search": "bayes"}, r"search.algorithm: Input should be 'grid', 'random' or 'optuna'"),
        ({"search": "random"}, r"search.algorithm=random needs a random section"),
        (
            {"search": "optuna", "grid": {"algorithm.rho": [0.1]}, "random": {"count": 2, "params": {}}},
            "random.params",
        ),
        (
            {"search": "optuna", "random": {"count": 2, "params": {"algorithm.lr": {"uniform": [0.01, 0.1]}}}}
            | {"grid": {"algorithm.rho": [0.1]}},
            "search.algorithm=optuna: put the swept keys under random.params",
        ),
        (
            {"search": "optuna", "seeds": [1, 2]}
            | {"random": {"count": 2, "params": {"algorithm.lr": {"uniform": [0.01, 0.1]}}}},
            "one seed at most",
        ),
    ],
)
def test_bad_schedulers_and_searches_are_one_line_errors(extra, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_sweep(sweep_data(**extra))
    assert "\n" not in str(error.value)


def test_a_scheduler_is_a_name_or_a_section_and_builds_tunes_own():
    """`scheduler: asha` and its section give Tune's ASHA with the sweep's metric, mode and rungs over the trials'
    rounds (its `round` reports); max_t defaults to the base's rounds; `none` is no scheduler (every round runs)."""
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule

    assert parse_sweep(sweep_data()).scheduler.build(3) is None
    short = parse_sweep(sweep_data(scheduler="asha")).scheduler
    assert (short.name, short.metric, short.mode, short.grace_period) == ("asha", "pm/acc", "max", 1)
    asha = parse_sweep(sweep_data(scheduler={"name": "asha", "grace_period": 2, "reduction_factor": 3})).scheduler
    built = asha.build(20)
    assert isinstance(built, ASHAScheduler)
    assert (built._time_attr, built._metric, built._mode, built._max_t) == ("round", "pm/acc", "max", 20)
    assert [rung for rung, _ in built._brackets[0]._rungs] == [18, 6, 2]  # 2 * 3^k below max_t
    median = parse_sweep(sweep_data(scheduler={"name": "median_stopping", "metric": "pm/loss", "mode": "min"}))
    rule = median.scheduler.build(5)
    assert isinstance(rule, MedianStoppingRule)
    assert (rule._time_attr, rule._metric, rule._mode, rule._min_samples_required) == ("round", "pm/loss", "min", 3)


def test_random_distributions_become_the_same_tune_domains():
    """What Optuna samples from: the same bounds, randint's inclusive high made Tune's exclusive one."""
    from ray import tune

    from raysim.studies.sweep import Distribution

    assert Distribution(choice=[1, "a"]).domain().categories == [1, "a"]
    uniform = Distribution(uniform=(0.1, 0.2)).domain()
    assert isinstance(uniform, tune.search.sample.Float) and (uniform.lower, uniform.upper) == (0.1, 0.2)
    assert isinstance(uniform.sampler, tune.search.sample.Uniform)
    log = Distribution(loguniform=(1e-4, 1e-1)).domain()
    assert (log.lower, log.upper) == (1e-4, 1e-1) and isinstance(log.sampler, tune.search.sample.LogUniform)
    integers = Distribution(randint=(2, 5)).domain()
    assert isinstance(integers, tune.search.sample.Integer) and (integers.lower, integers.upper) == (2, 6)


def test_optuna_without_the_package_refuses_before_anything_starts(tmp_path):
    """The YAML may name Optuna; without the package the sweep stops at once, one line naming the field and the
    install command, before the parent run (or Ray) exists."""
    import importlib.util

    if importlib.util.find_spec("optuna") is not None:
        pytest.skip("optuna is installed here")
    store = tmp_path / "mlflow.db"
    base = tiny_config(tracking={"uri": f"sqlite:///{store}", "experiment": "sweep"})
    random = {"count": 3, "params": {"algorithm.lr": {"loguniform": [0.001, 0.1]}}}
    sweep = parse_sweep({"name": "s", "base": base, "search": "optuna", "random": random})
    with pytest.raises(ConfigError) as error:
        run_sweep(sweep, show_progress=False)
    assert str(error.value) == "search.algorithm=optuna needs the optuna package: pip install optuna"
    assert not store.exists()


def test_a_trial_stopped_early_is_kept_by_a_resume_as_a_finished_one(mlflow_uri):
    """A stopped trial's run is FINISHED with its `raysim.stopped_early` tag: a resumed sweep keeps it (nothing
    reruns), and reads it back as `stopped`, with the reason, not as finished or failed."""
    from mlflow.entities import Metric

    from raysim.studies.children import outcome_line
    from raysim.studies.resume import Previous, kept_outcome
    from raysim.tracking.mlflow_writer import MlflowWriter

    writer = MlflowWriter(mlflow_uri, "stopped")
    sweep = parse_sweep(sweep_data(grid={"algorithm.lr": [0.1, 0.2]}, scheduler="asha"))
    trials = sweep.trials(mlflow_uri)
    client = writer.client
    parent = client.create_run(writer.experiment_id, run_name="s").info.run_id
    runs = {}
    for trial in trials:
        run = client.create_run(
            writer.experiment_id,
            run_name=trial.config.tracking.run_name,
            tags={"mlflow.parentRunId": parent},
        ).info.run_id
        client.log_batch(run, metrics=[Metric("pm/acc", 0.1 * step, 0, step) for step in range(3)])
        runs[trial.index] = run
    client.set_tag(runs[1], "raysim.stopped_early", "asha at round 2 of 3")
    for run in runs.values():
        client.set_terminated(run, "FINISHED")
    previous = Previous({t.config.tracking.run_name: client.get_run(runs[t.index]) for t in trials})
    assert [previous.state(t.config) for t in trials] == ["finished", "finished"]
    stopped = kept_outcome(writer, client.get_run(runs[1]))
    assert (stopped.status, stopped.finished, stopped.failed, stopped.stopped_at) == (
        "stopped",
        False,
        False,
        "asha at round 2 of 3",
    )
    assert stopped.history == {0: {"pm/acc": 0.0}, 1: {"pm/acc": 0.1}, 2: {"pm/acc": 0.2}}
    assert (
        outcome_line("lr=0.2 seed=7", stopped) == "lr=0.2 seed=7: stopped early by asha at round 2 of 3, last PM 0.2000"
    )
    assert kept_outcome(writer, client.get_run(runs[0])).status == "finished"


def test_a_failed_tune_trial_is_its_experiments_one_line():
    """Tune hands a failed trial's error back as the exception (its cause the trainable's TrialFailed) or as the
    text of its traceback; either way the sweep's line is the experiment's own error."""
    from ray.tune.error import TuneError

    from raysim.studies.sweep import TrialFailed, _error_line

    line = "model.name=cnn needs image input"
    assert _error_line(TrialFailed(line)) == line
    text = f"Traceback (most recent call last):\n  File x\nraysim.studies.sweep.TrialFailed: {line}\n"
    assert _error_line(TuneError(text)) == line
    assert _error_line(RuntimeError("a\nOSError: disk full")) == "OSError: disk full"
    assert _error_line(None) == "failed"


def test_reused_trial_actors_share_the_head_so_that_tune_queues_the_others():
    """Without a scheduler a trial reserves 1/limit of the head's marker (floored to Ray's 0.0001) and Tune is told no
    limit: `limit` trials fit on the head at once, the rest queue, and a finished trial's actor is kept for them.
    Under a scheduler, a thousandth and Tune's own limit (its trials start in its order, each with an actor)."""
    from raysim.studies.sweep import HEAD_MARKER, trial_limits

    plain = parse_sweep(sweep_data(grid={"algorithm.rho": [0.1, 0.2, 0.3]}))
    share, told = trial_limits(plain, 3)
    assert told is None and share == {HEAD_MARKER: 0.3333}
    assert 3 * share[HEAD_MARKER] <= 1.0 < 4 * share[HEAD_MARKER]  # three fit on the head's 1, a fourth does not
    assert trial_limits(plain, 1) == ({HEAD_MARKER: 1.0}, None)
    assert trial_limits(plain, 50_000) == ({HEAD_MARKER: 0.0001}, None)
    asha = parse_sweep(sweep_data(grid={"algorithm.rho": [0.1, 0.2]}, scheduler="asha"))
    assert trial_limits(asha, 2) == ({HEAD_MARKER: 0.001}, 2)
