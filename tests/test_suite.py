"""Suites: config expansion and errors (plain Python), and every algorithm end to end through `raysim run`
on a suite file, logged to MLflow as child runs of one parent run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from matplotlib.colors import to_hex
from mlflow.tracking import MlflowClient

from raysim.algorithms.fedapm import FedApmSettings, personal_mask
from raysim.cli import main
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.studies.children import one_line
from raysim.studies.suite import SuiteConfig, check_partitions, is_suite_file, load_suite, run_suite
from tests.support.experiments import tiny_config

RAYSIM = str(Path(sys.executable).parent / "raysim")
ISSUE_3 = ("flame", "fedavg", "fedprox", "fedadmm", "pfedme", "ditto", "fedapm", "fedalt", "fedsim", "local")


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
    colors = [c.tracking.color for _, c in children]  # a run's seeds alike, the runs apart: plots.setting_colors
    assert colors[0] == colors[1] != colors[2] == colors[3] and colors[0] == to_hex("C0") and colors[2] == to_hex("C1")


def test_run_colors_a_run_sets_itself_win_and_more_than_ten_runs_stay_apart():
    runs = [{"name": f"r{i}"} for i in range(12)] + [{"name": "mine", "set": {"tracking.color": "#123456"}}]
    children = SuiteConfig.model_validate(_suite(runs=runs)).experiments()
    colors = {name: config.tracking.color for name, config in children}
    assert colors["mine"] == "#123456" and len({colors[f"r{i}"] for i in range(12)}) == 12
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
def test_every_algorithm_runs_through_the_cli_as_a_nested_suite(tmp_path, ray_local, mlflow_uri, capsys):
    split = {"fedapm", "fedalt", "fedsim"}
    runs = [
        {
            "name": name,
            "set": {"algorithm": {"name": name, "lr": 0.05}, "model.name": "mlp" if name in split else "mlr"},
        }
        for name in ISSUE_3
    ]
    base = tiny_config(rounds=2, clients={"count": 3}, tracking={"uri": mlflow_uri, "experiment": "suite"})
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
    assert len({child.data.tags["mlflow.runColor"] for child in children}) == len(ISSUE_3)  # MLflow's chart colours
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


@pytest.mark.slow
def test_a_failing_child_is_marked_failed_and_the_suite_goes_on_then_resumes_only_it(tmp_path, ray_local):
    """A child whose uploads diverge (algorithm.lr=1e30 with runtime.on_nonfinite=stop, the default: valid, but
    the run stops at its first round) is marked FAILED with its error; the children after it run on the same Ray;
    the suite (a real `raysim run` process) ends with the failed child named on stderr, nothing else there, and
    exit 1, and its parent's summary, plot and tables come from the finished children. Fixed in the suite file,
    `--resume PARENT` reruns that child only."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = tiny_config(rounds=1, clients={"count": 3}, tracking={"uri": uri, "experiment": "failing"})
    runs = [
        {"name": "before", "set": {}},
        {"name": "diverges", "set": {"algorithm.lr": 1e30}},
        {"name": "after", "set": {"algorithm.rho": 0.5}},
    ]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))

    client = MlflowClient(uri)
    client.search_experiments()  # the store exists: MLflow's own "creating tables" lines are not the suite's
    done = subprocess.run([RAYSIM, "run", str(path), "--quiet"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    printed = [line.split() for line in done.stdout.splitlines()]
    assert ["diverges", "failed"] in printed and len(next(row for row in printed if row[:1] == ["before"])) == 4

    experiment = client.get_experiment_by_name("failing").experiment_id
    (parent,) = client.search_runs([experiment], "tags.suite = 'one-bad'")
    parent_id = parent.info.run_id
    nested = f"tags.mlflow.parentRunId = '{parent_id}'"
    children = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    assert {n: r.info.status for n, r in children.items()} == {
        "before": "FINISHED",
        "diverges": "FAILED",
        "after": "FINISHED",
    }
    error = children["diverges"].data.tags["raysim.error"]
    assert "round 0: client" in error and "raysim.error" not in children["after"].data.tags
    assert len(client.get_metric_history(children["after"].info.run_id, "pm/acc")) == 2  # rounds 0 and 1
    lines = done.stderr.splitlines()
    assert lines[0] == "1 of 3 suite children failed (marked FAILED, error in their raysim.error tag):", done.stderr
    assert lines[1].startswith(f"  diverges: run {children['diverges'].info.run_id} stopped: ") and error in lines[1]
    rerun = f"`raysim run {path} --resume {parent_id}`"
    assert lines[2:] == [f"rerun the failed ones (finished ones are kept) with {rerun}"], done.stderr
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raysim.error"] == "1 of 3 children failed: diverges"
    assert parent.data.metrics["children/failed"] == 1 and parent.data.metrics["children/finished"] == 2
    summary = pq.read_table(client.download_artifacts(parent_id, "summary.parquet", str(tmp_path))).to_pylist()
    assert [(row["run"], row["status"]) for row in summary] == [
        ("before", "finished"),
        ("diverges", "failed"),
        ("after", "finished"),
    ]
    assert summary[1]["error"] and math.isnan(summary[1]["final/pm/acc"]) and summary[2]["final/pm/acc"] > 0
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"comparison.png", "fairness.png", "table_final.md", "table_best.csv"} <= artifacts
    assert {"fairness.pdf", "fairness.svg"} <= artifacts
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path))).read_text()
    assert "left out, not finished: diverges (FAILED)" in table.splitlines()[0]
    assert [line.split(" | ")[0] for line in table.splitlines()[4:]] == ["| before", "| after"]

    runs[1]["set"] = {"algorithm.lr": 0.05}  # the fix
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))
    kept = {name: client.get_metric_history(children[name].info.run_id, "pm/acc") for name in ("before", "after")}
    assert main(["run", str(path), "--quiet", "--resume", parent_id]) == 0

    after = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    assert sorted(after) == ["after", "before", "diverges"]
    assert all(r.info.status == "FINISHED" and "raysim.error" not in r.data.tags for r in after.values())
    for name, history in kept.items():  # kept, not run again
        assert after[name].info.run_id == children[name].info.run_id
        assert client.get_metric_history(after[name].info.run_id, "pm/acc") == history
    assert after["diverges"].info.run_id != children["diverges"].info.run_id  # its setting changed: run anew
    assert client.get_run(children["diverges"].info.run_id).info.lifecycle_stage == "deleted"
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and "raysim.error" not in parent.data.tags
    assert parent.data.metrics["children/failed"] == 0
    (tmp_path / "again").mkdir()
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path / "again"))).read_text()
    assert "left out" not in table and "| diverges |" in table


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
