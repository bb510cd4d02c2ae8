"""The `raysim` command end to end: a real run read back from MLflow, and clear one-line errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.cli import HOSTS_IN_PROCESS, raysim, write_config
from tests.support.experiments import tiny_config
from tests.support.one_process import raysim_commands
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("system-cli")
"""One worker runs this module's tests: the `raysim run`s they read are made once, in one process."""

BAD_CONFIGS = [
    ({"clientz": {"count": 3}}, "clientz"),
    ({"algorithm": {"name": "flame", "rho": -0.1}}, "algorithm.rho"),
    ({"clients": {"count": 3000}}, "clients.count"),
    ({"algorithm": {"name": "flamingo"}}, "algorithm.name"),
    ({"partition": {"scheme": "q_label", "q": 4}, "clients": {"count": 600}}, "partition.q"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every `raysim run` of this module, each in a folder (and a tracking store) of its own, one after the other in
    one process of their own (tests/support/one_process.py: one import of raysim and its libraries, not nine); the
    two that succeed run their hosts in process (HOSTS_IN_PROCESS: what reaches MLflow is their subject)."""
    commands: dict[str, tuple[list[str], Path]] = {}

    def command(name: str, config: dict, *options: str) -> None:
        folder = tmp_path_factory.mktemp(name)
        config = yaml.safe_load(yaml.safe_dump(config).replace("{folder}", str(folder)))
        commands[name] = (["run", str(write_config(folder, config)), *options], folder)

    store = "sqlite:///{folder}/mlflow.db"
    for index, (change, _) in enumerate(BAD_CONFIGS):
        command(f"bad-{index}", {**tiny_config(tracking={"uri": store, "experiment": "bad"}), **change}, "--quiet")
    unknown = tiny_config()
    unknown["algorithm"]["lamda"] = 3
    command("unknown-key", unknown)
    command("bad-set", tiny_config(), "--set", "rounds=-1")
    tracking = {"uri": store, "experiment": "cli", "figures": ["png", "pdf", "svg"]}
    command("run", tiny_config(tracking=tracking, rounds=3), "--set", "rounds=2", *HOSTS_IN_PROCESS, "--quiet")
    elsewhere = [*("--tracking-uri", "sqlite:///{folder}/elsewhere.db", "--experiment", "from-cli")]
    options = [*elsewhere, "--set", "tracking.system_metrics=false", "--set", "tracking.figures=[png]"]
    command("from-cli", tiny_config(rounds=1), "--quiet", *options, *HOSTS_IN_PROCESS)
    for name, (argv, folder) in commands.items():
        argv[:] = [part.replace("{folder}", str(folder)) for part in argv]
        if name.startswith("bad-") or name == "run":
            fresh_store(folder / "mlflow.db")
    results = raysim_commands(commands, timeout=600)  # nine commands, two of them whole runs
    for name, result in results.items():
        result["folder"] = commands[name][1]
    return results


@pytest.mark.slow
def test_run_creates_an_mlflow_run_with_metrics_params_and_artifacts(runs, tmp_path):
    done = runs["run"]
    assert done["code"] == 0, done["stderr"][-2000:]
    mlflow_uri = f"sqlite:///{done['folder'] / 'mlflow.db'}"
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["rounds"] == "2" and run.data.params["algorithm.lambda"] == "1.0"
    assert run.data.tags["algorithm"] == "flame" and run.data.tags["partition"] == "dirichlet"
    history = client.get_metric_history(run.info.run_id, "pm/acc")
    assert [m.step for m in history] == [0, 1, 2]
    assert all(0.0 <= m.value <= 1.0 for m in history)
    for name in ("gm/acc", "hm/acc", "pm/loss_var", "update/primal_residual", "server/global_change", "time/round"):
        assert client.get_metric_history(run.info.run_id, name), name
    metrics = run.data.metrics
    assert metrics["hm/acc"] >= max(metrics["pm/acc"], metrics["gm/acc"])
    assert metrics["pm/best_acc"] >= metrics["pm/acc"] and not any(k.startswith(("final/", "best/")) for k in metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "clients.parquet", "convergence.png", "clients.json", "partition.json"} <= artifacts
    assert {"convergence.pdf", "convergence.svg", "partition.pdf", "partition.svg"} <= artifacts
    tables = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "clients.json", "type": "table"} in tables and {"path": "partition.json", "type": "table"} in tables
    shown = json.loads(Path(client.download_artifacts(run.info.run_id, "clients.json", str(tmp_path))).read_text())
    assert len(shown["data"]) == 4 and "pm_test_acc" in shown["columns"]
    table = pq.read_table(client.download_artifacts(run.info.run_id, "clients.parquet", str(tmp_path)))
    assert table.num_rows == 4 and {"client_id", "pm_test_acc", "gm_test_acc", "hm_test_acc"} <= set(table.column_names)
    config_path = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    resolved = yaml.safe_load(Path(config_path).read_text())
    assert resolved["rounds"] == 2 and resolved["algorithm"]["rho"] == 0.25


@pytest.mark.parametrize(("change", "field"), BAD_CONFIGS)
def test_bad_configs_exit_nonzero_with_one_line_naming_the_field(runs, change, field):
    done = runs[f"bad-{BAD_CONFIGS.index((change, field))}"]
    assert done["code"] == 2
    lines = done["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], done["stderr"]
    client = MlflowClient(f"sqlite:///{done['folder'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bad")
    assert experiment is None or not client.search_runs([experiment.experiment_id])  # nothing half-written


def test_unknown_key_suggests_the_right_one(runs):
    done = runs["unknown-key"]
    assert done["code"] == 2 and "did you mean 'lambda'" in done["stderr"]


def test_set_override_errors_name_the_key(runs):
    done = runs["bad-set"]
    assert done["code"] == 2 and "rounds" in done["stderr"]


def test_algorithms_lists_the_registry(tmp_path):
    done = raysim("algorithms", cwd=tmp_path)
    names = {line.split()[0] for line in done.stdout.splitlines()}
    assert done.returncode == 0 and {"flame", "fedavg"} <= names


def test_version_and_defaults_in_help(tmp_path):
    from raysim import __version__

    done = raysim("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"raysim {__version__}"
    bench = raysim("bench", "--help", cwd=tmp_path).stdout
    assert "(default: 5)" in " ".join(bench.split()) and "(default: mlp)" in bench
    run = raysim("run", "--help", cwd=tmp_path).stdout
    assert "examples:" in run and "raysim run configs/quickstart.yaml" in run and "--tracking-uri" in run


def test_config_prints_the_resolved_config_that_run_would_use(tmp_path):
    from raysim.config import load_config, validate_config

    path = write_config(tmp_path, tiny_config())
    done = raysim("config", str(path), "--set", "algorithm.name=fedavg", "--set", "rounds=9", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["rounds"] == 9 and printed["algorithm"]["name"] == "fedavg" and "rho" not in printed["algorithm"]
    assert validate_config(printed) == load_config(path, ["algorithm.name=fedavg", "rounds=9"])
    bad = raysim("config", str(path), "--set", "partition.beta=-1", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: partition.beta") and bad.stdout == ""


@pytest.mark.slow
def test_run_takes_the_tracking_uri_and_experiment_from_the_command_line(runs):
    done = runs["from-cli"]
    assert done["code"] == 0, done["stderr"][-2000:]
    client = MlflowClient(f"sqlite:///{done['folder'] / 'elsewhere.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("from-cli").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["tracking.experiment"] == "from-cli"
    assert not any(key.startswith("system/") for key in run.data.metrics)  # tracking.system_metrics: false
    figures = {a.path for a in client.list_artifacts(run.info.run_id) if a.path.endswith((".png", ".pdf", ".svg"))}
    assert figures == {"convergence.png", "partition.png"}  # tracking.figures: [png]
