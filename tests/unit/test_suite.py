"""Suites: config expansion and errors (plain Python), and every algorithm end to end through `raysim run`
on a suite file, logged to MLflow as child runs of one parent run."""

from __future__ import annotations

import pytest
import yaml

from raysim.cli import main
from raysim.config import is_suite_file
from raysim.errors import ConfigError
from raysim.studies.children import one_line
from raysim.studies.suite import SuiteConfig, check_partitions, load_suite, run_suite
from raysim.tracking.plots import MLFLOW_COLORS, mlflow_group_color
from tests.support.experiments import tiny_config


def _suite(**fields) -> dict:
    return {"name": "s", "base": tiny_config(), "runs": [{"name": "a"}], **fields}


def test_runs_and_seeds_expand_with_overrides_applied():
    suite = SuiteConfig.model_validate(
        _suite(
            runs=[
                {"name": "flame-rho", "set": {"algorithm.rho": 0.5}},
                {"name": "avg", "set": {"algorithm": {"name": "fedavg", "lr": 0.1}, "clients.count": 6}},
            ],
            seeds=[3, 4],
        )
    )
    children = suite.experiments()
    assert [(n, c.seed, c.tracking.run_name) for n, c in children] == [
        ("flame-rho", 3, "flame-rho/seed3"),
        ("flame-rho", 4, "flame-rho/seed4"),
        ("avg", 3, "avg/seed3"),
        ("avg", 4, "avg/seed4"),
    ]
    assert children[0][1].algorithm.rho == 0.5 and children[0][1].algorithm.lam == 1.0
    assert children[2][1].algorithm.name == "fedavg" and children[2][1].clients.count == 6
    colors = [c.tracking.color for _, c in children]  # a run's seeds alike: MLflow's colour of its group
    assert colors[0] == colors[1] == mlflow_group_color("flame-rho") and colors[2] == colors[3] == mlflow_group_color(
        "avg"
    )


def test_run_colors_a_run_sets_itself_win_and_the_others_are_mlflows_colours_of_their_groups():
    """The colour MLflow's comparison view draws a group in, as read off its page (tests/system/test_ui.py): a
    checksum of `tag.raysim.group.<name>` over MLflow's 29 colours; a run that sets its own keeps it."""
    assert [mlflow_group_color(name) for name in ("fedavg", "fedprox", "ditto")] == ["#a6630c", "#115026", "#be501e"]
    runs = [{"name": f"r{i}"} for i in range(12)] + [{"name": "mine", "set": {"tracking.color": "#123456"}}]
    children = SuiteConfig.model_validate(_suite(runs=runs)).experiments()
    colors = {name: config.tracking.color for name, config in children}
    assert colors["mine"] == "#123456" and all(colors[f"r{i}"] == mlflow_group_color(f"r{i}") for i in range(12))
    assert set(colors.values()) - {"#123456"} <= set(MLFLOW_COLORS)
    with pytest.raises(ConfigError, match=r"suite run 'x': tracking.color: .*\^#\[0-9a-fA-F\]\{6\}\$"):
        SuiteConfig.model_validate(_suite(runs=[{"name": "x", "set": {"tracking.color": "red"}}])).experiments()


def test_bad_suites_are_rejected_with_the_field_named(tmp_path):
    with pytest.raises(ValueError, match="duplicate run names"):
        SuiteConfig.model_validate(_suite(runs=[{"name": "a"}, {"name": "a"}]))
    with pytest.raises(ValueError, match="exactly one of `base` and `base_config`"):
        SuiteConfig.model_validate(_suite(base_config="x.yaml"))
    bad = SuiteConfig.model_validate(_suite(runs=[{"name": "b", "set": {"algorithm.rho": -1}}]))
    with pytest.raises(ConfigError, match=r"suite run 'b': algorithm.rho: .*greater than 0"):
        bad.experiments()


def test_base_config_path_is_relative_to_the_suite_and_set_overrides_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_config()))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base_config": "base.yaml", "runs": [{"name": "a"}]}))
    assert is_suite_file(path) and not is_suite_file(tmp_path / "base.yaml")
    ((_, config),) = load_suite(path, ["rounds=7"]).experiments()
    assert config.rounds == 7 and config.clients.count == 4


def test_impossible_partitions_fail_before_any_run_naming_the_child(tmp_path, capsys):
    """A suite child whose partition cannot be made fails at once, naming the run, before the parent MLflow run
    or Ray exist (each child used to find out inside its own run, after the children before it had run)."""
    store = tmp_path / "mlflow.db"
    base = tiny_config(tracking={"uri": f"sqlite:///{store}", "experiment": "suite"})
    runs = [
        {"name": "fine", "set": {"algorithm.rho": 0.5}},
        {"name": "no-writers", "set": {"partition": {"scheme": "natural"}}},
    ]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": base, "runs": runs, "seeds": [3, 4]}))
    assert main(["run", str(path), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "error: suite run 'no-writers/seed3': partition.scheme=natural needs a dataset with a group id column "
        "(e.g. writer ids)"
    )
    assert not store.exists()
    attacked = [{"name": "all-bad", "set": {"attack": {"kind": "gaussian", "fraction": 1.0}}}]
    path.write_text(yaml.safe_dump({"name": "s", "base": base, "runs": attacked}))
    with pytest.raises(ConfigError, match=r"^suite run 'all-bad': attack.fraction=1.0 .*no benign client"):
        run_suite(load_suite(path), show_progress=False)
    assert not store.exists()


def test_partition_check_makes_each_distinct_partition_once(monkeypatch):
    import raysim.studies.suite as suite_module
    from raysim.data.sources import SyntheticClassificationSettings

    calls = {"load": 0, "partition": 0}
    load, partition = SyntheticClassificationSettings.load, suite_module.partition_dataset

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(SyntheticClassificationSettings, "load", counted("load", load))
    monkeypatch.setattr(suite_module, "partition_dataset", counted("partition", partition))
    runs = [{"name": n, "set": {"algorithm.rho": r}} for n, r in (("a", 0.1), ("b", 0.2), ("c", 0.3))]
    runs.append({"name": "more", "set": {"clients.count": 6}})
    suite = SuiteConfig.model_validate(_suite(runs=runs, seeds=[1, 2]))
    check_partitions([(name, config) for name, config in suite.experiments()])
    # synthetic data depend on the seed: one load per seed; partitions: (4 or 6 clients) x 2 seeds
    assert calls == {"load": 2, "partition": 4}


def test_a_childs_error_is_one_line_with_credentials_redacted():
    """What a failed child's summary line and tag hold: an input error's own message; anything else its last line
    (a Ray task error's is the exception raised inside the task) led by its type; no password."""
    assert one_line(ConfigError("algorithm.rho: must be > 0")) == "algorithm.rho: must be > 0"
    task_error = RuntimeError("ray::ClientHost.train() (pid=1)\n  File 'host.py', line 2\nValueError: bad shape")
    assert one_line(task_error) == "ValueError: bad shape"
    assert (
        one_line(OSError("no route to http://ann:s3cret@mlflow:5000")) == "OSError: no route to http://***@mlflow:5000"
    )
    assert one_line(KeyError()) == "KeyError"
