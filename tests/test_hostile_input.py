"""Hostile config input (not UTF-8, nested thousands deep, a bool or a non-finite float for a number, a `partition.q`
above the class count) is one `error:` line, exit 2, before any Ray or MLflow work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from raysim.config import load_config
from raysim.errors import ConfigError
from raysim.studies.suite import is_suite_file, load_suite
from raysim.studies.sweep import is_sweep_file, load_sweep

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEEP = 5000


def _quickstart(**changes: Any) -> dict[str, Any]:
    """The shipped quickstart as a mapping, with dotted keys replaced (`changes={"algorithm.lr": 0.1}`)."""
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return config


def _write(path: Path, config: dict[str, Any], tail: bytes = b"") -> Path:
    path.write_bytes(yaml.safe_dump(config, sort_keys=False).encode() + tail)
    return path


def _refusal(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, overrides)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_file_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path):
    path = _write(tmp_path / "latin.yaml", _quickstart(), b"notes: caf\xe9\n")
    message = _refusal(path)
    assert message.startswith(f"{path}: ") and "not UTF-8" in message and "byte 0xe9" in message


@pytest.mark.parametrize(
    "tail",
    [
        "notes: " + "[" * DEEP + "]" * DEEP,
        "notes: " + "{a: " * DEEP + "1" + "}" * DEEP,
        "notes:\n" + "".join("  " * level + "a:\n" for level in range(1, 400)) + "  " * 400 + "a: 1",
        "notes: &loop [*loop]",
    ],
    ids=["flow-lists", "flow-mappings", "block-mappings", "self-reference"],
)
def test_deeply_nested_yaml_is_refused_naming_the_file(tmp_path, tail):
    path = _write(tmp_path / "deep.yaml", _quickstart(), tail.encode())
    message = _refusal(path)
    assert message.startswith(f"{path}: nested too deeply"), message


@pytest.mark.parametrize(
    "assignment",
    ["rounds=" + "[" * DEEP + "]" * DEEP, "algorithm.lr=" + "{a: " * DEEP + "1" + "}" * DEEP, "a." * DEEP + "b=1"],
    ids=["list-value", "mapping-value", "key-path"],
)
def test_deeply_nested_set_values_are_refused_naming_the_assignment(tmp_path, assignment):
    message = _refusal(_write(tmp_path / "ok.yaml", _quickstart()), (assignment,))
    assert message.startswith(f"--set {assignment.split('.')[0].split('=')[0]}") and "nested too deeply" in message


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    message = _refusal(_write(tmp_path / "ok.yaml", _quickstart()), ("rounds=[1",))
    assert message.startswith("--set rounds: not valid YAML")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rounds": True}, "rounds: must be an integer, not a bool (got true)"),
        ({"seed": False}, "seed: must be an integer, not a bool (got false)"),
        ({"algorithm.lr": True}, "algorithm.lr: must be a number, not a bool (got true)"),
        ({"algorithm.epochs": True}, "algorithm.epochs: must be an integer, not a bool"),
        ({"algorithm.lr": float("inf")}, "algorithm.lr: Input should be a finite number"),
        ({"algorithm.lr": float("nan")}, "algorithm.lr: Input should be a finite number"),
        ({"algorithm.lambda": float("-inf")}, "algorithm.lambda: Input should be a finite number"),
        ({"partition.q": True}, "partition.q: must be an integer, not a bool"),
        ({"partition.test_fraction": True}, "partition.test_fraction: must be a number, not a bool"),
        ({"clients.count": True}, "clients.count: must be an integer, not a bool"),
        ({"clients.fraction": True}, "clients.fraction: must be a number, not a bool"),
        ({"runtime.host_cpus": True}, "runtime.host_cpus: must be a number, not a bool"),
        ({"runtime.host_resources": {"worker": True}}, "runtime.host_resources.worker: must be a number, not a bool"),
        ({"tracking.eval_every": True}, "tracking.eval_every: must be an integer, not a bool"),
        ({"attack.kind": "gaussian", "attack.fraction": True}, "attack.fraction: must be a number, not a bool"),
        ({"attack.std": float("inf")}, "attack.std: Input should be a finite number"),
        ({"aggregation.byzantine": True}, "aggregation.byzantine: must be an integer, not a bool"),
        ({"aggregation.trim_fraction": float("nan")}, "aggregation.trim_fraction: Input should be a finite number"),
        (
            {"algorithm": {"name": "augfl", "transfer": {"negatives": True}}},
            "algorithm.transfer.negatives: must be an integer, not a bool",
        ),
        (
            {"partition": {"scheme": "meta", "classes_per_client": True}},
            "partition.classes_per_client: must be an integer, not a bool",
        ),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, dict) else None,
)
def test_a_bool_or_non_finite_float_for_a_number_is_refused_naming_the_field(tmp_path, changes, expected):
    """As YAML the file holds `true`, `.inf`, `.nan`: what a person types, not what Python writes."""
    message = _refusal(_write(tmp_path / "experiment.yaml", _quickstart(**changes)))
    assert message.startswith(expected), message


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"runs": [{"name": "a", "set": {}}], "seeds": [1, True]}, "seeds.1: must be an integer, not a bool"),
        (
            {"random": {"count": True, "params": {"rounds": {"randint": [1, 2]}}}},
            "random.count: must be an integer, not a bool",
        ),
        (
            {"random": {"count": 1, "params": {"rounds": {"uniform": [0, True]}}}},
            "random.params.rounds.uniform.1: must be a number, not a bool",
        ),
    ],
    ids=["suite-seeds", "sweep-count", "sweep-uniform"],
)
def test_suites_and_sweeps_refuse_a_bool_for_a_number(tmp_path, section, expected):
    path = tmp_path / "family.yaml"
    (tmp_path / "quickstart.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    family = {"name": "f", "base_config": "quickstart.yaml", **section}
    _write(path, family)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        (load_suite if "runs" in family else load_sweep)(path)


def test_numbers_lists_and_real_bools_still_validate(tmp_path):
    """Not strict mode: an int for a float, a list for a tuple, a bool for a bool field all stay valid."""
    config = load_config(
        _write(tmp_path / "experiment.yaml", _quickstart(**{"algorithm.lr": 1, "dataset.download": False})),
        ("runtime.host_resources={worker: 1}", "partition={scheme: dirichlet, overlap: true}"),
    )
    assert config.algorithm.lr == 1.0 and isinstance(config.algorithm.lr, float) and config.dataset.download is False
    assert config.partition.overlap is True and config.runtime.host_resources == {"worker": 1.0}
    (tmp_path / "quickstart.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    random = {"count": 2, "params": {"algorithm.lr": {"uniform": [0, 1]}}}
    sweep = _write(tmp_path / "sweep.yaml", {"name": "w", "base_config": "quickstart.yaml", "random": random})
    assert load_sweep(sweep).random.params["algorithm.lr"].uniform == (0.0, 1.0)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_still_validates(path):
    if is_suite_file(path):
        assert load_suite(path).experiments()
    elif is_sweep_file(path):
        assert load_sweep(path).trials("sqlite:////nonexistent/mlflow.db")
    else:
        assert load_config(path).rounds >= 1


# End to end: the command line on each case (in this process, with Ray and MLflow made to fail if touched), and
# two of them in a real subprocess (one per kind of input: a file, a --set value).
_CLI_CASES: dict[str, tuple[dict[str, Any], bytes, tuple[str, ...], str]] = {
    "not-utf8": ({}, b"notes: caf\xe9\n", (), "not UTF-8"),
    "deep-file": ({}, b"notes: " + b"[" * DEEP + b"]" * DEEP, (), "nested too deeply"),
    "deep-set": ({}, b"", ("--set", "algorithm.lr=" + "[" * DEEP + "]" * DEEP), "--set algorithm.lr: nested too"),
    "rounds-true": ({"rounds": True}, b"", (), "rounds: must be an integer, not a bool"),
    "lr-inf": ({"algorithm.lr": float("inf")}, b"", (), "algorithm.lr: Input should be a finite number"),
    "lr-nan": ({"algorithm.lr": float("nan")}, b"", (), "algorithm.lr: Input should be a finite number"),
    "attack-bool": ({"attack.kind": "gaussian", "attack.fraction": True}, b"", (), "attack.fraction: must be a number"),
    "partition-bool": ({"partition.q": False}, b"", (), "partition.q: must be an integer, not a bool"),
    "q-above-classes": ({"partition.q": 11}, b"", (), "partition.q=11: the dataset has 10 classes"),
}


def _case(folder: Path, name: str) -> list[str]:
    """The case's config written to `folder` (tracking to a sqlite file there); the `raysim` arguments."""
    changes, tail, options, _ = _CLI_CASES[name]
    config = _quickstart(**changes, **{"tracking.uri": f"sqlite:///{folder / 'mlflow.db'}"})
    return ["run", str(_write(folder / "experiment.yaml", config, tail)), "--quiet", *options]


def _check_refused(returncode: int, stdout: str, stderr: str, folder: Path, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    assert "Traceback" not in stderr + stdout and "Started a local Ray instance" not in stderr + stdout
    assert not (folder / "mlflow.db").exists() and not (folder / "mlruns").exists()


@pytest.mark.parametrize("case", list(_CLI_CASES))
def test_the_cli_refuses_with_one_error_line_before_ray_or_mlflow(tmp_path, monkeypatch, capsys, case):
    import ray

    from raysim.cli import main
    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)
    monkeypatch.chdir(tmp_path)
    code = main(_case(tmp_path, case))
    out = capsys.readouterr()
    _check_refused(code, out.out, out.err, tmp_path, _CLI_CASES[case][3])


def test_the_raysim_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    """A real `python -m raysim.cli run` for a file that is not UTF-8 and a --set value nested 5,000 deep (both
    were tracebacks), run at once: what a person sees."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    started = {}
    for name in ("not-utf8", "deep-set"):
        folder = tmp_path / name
        folder.mkdir()
        command = [sys.executable, "-m", "raysim.cli", *_case(folder, name)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        started[name] = (subprocess.Popen(command, cwd=folder, env=env, text=True, **pipes), folder)
    for name, (process, folder) in started.items():
        stdout, stderr = process.communicate(timeout=300)
        _check_refused(process.returncode, stdout, stderr, folder, _CLI_CASES[name][3])


@pytest.mark.parametrize(
    ("assignment", "key", "value"),
    [
        ("tracking.experiment=my exp #2", "experiment", "my exp #2"),
        ("tracking.run_name=yes", "run_name", "yes"),
        ("tracking.run_name=2024-01-01", "run_name", "2024-01-01"),
        ("tracking.run_name=[a] {b}: c", "run_name", "[a] {b}: c"),
        ("tracking.checkpoint_dir= /x #y ", "checkpoint_dir", " /x #y "),
        ('tracking={experiment: "a #b", run_name: c}', "experiment", "a #b"),
    ],
)
def test_names_are_literal_strings(tmp_path, assignment, key, value):
    """A text field's --set value is what was typed: YAML dropped ` #2` as a comment, made `yes` a bool and
    `2024-01-01` a date."""
    config = load_config(_write(tmp_path / "ok.yaml", _quickstart()), (assignment,))
    assert getattr(config.tracking, key) == value


@pytest.mark.parametrize(
    ("left_out", "assignments", "section", "key", "value"),
    [
        (None, ("dataset.root=/data/fmnist #2",), "dataset", "root", "/data/fmnist #2"),
        ("dataset", ("dataset.root=no",), "dataset", "root", "no"),  # no dataset section: the default source's
        (None, ("dataset.name=npz", "dataset.path=yes"), "dataset", "path", "yes"),
        (None, ("partition.scheme=file", "partition.path=2024-01-01"), "partition", "path", "2024-01-01"),
    ],
)
def test_text_fields_of_the_chosen_settings_are_literal(tmp_path, left_out, assignments, section, key, value):
    """The sections a name chooses (`dataset.name`, `partition.scheme`, `algorithm.name`, looked up in their
    registries) have the text fields of the settings chosen, after the --set that switches them."""
    tree = {name: part for name, part in _quickstart().items() if name != left_out}
    loaded = load_config(_write(tmp_path / "ok.yaml", tree), assignments)
    assert getattr(getattr(loaded, section), key) == value


@pytest.mark.parametrize("section", ["algorithm.name", "dataset.name", "partition.scheme"])
def test_a_choosing_name_is_text_whatever_the_choice(tmp_path, section):
    """`yes` is a name no registry has, said as typed (YAML would have made it True)."""
    message = _refusal(_write(tmp_path / "ok.yaml", _quickstart()), (f"{section}=yes",))
    assert message.startswith(f"{section}: unknown ") and "'yes'" in message, message


@pytest.mark.parametrize("assignment", ["rounds=5 #x", "partition={scheme: iid} # iid for now", "algorithm.lr=0.1 #"])
def test_a_yaml_comment_in_a_set_value_is_refused(tmp_path, assignment):
    message = _refusal(_write(tmp_path / "ok.yaml", _quickstart()), (assignment,))
    path, raw = assignment.split("=", 1)
    assert message.startswith(f"--set {path}: '#") and f"dropped from the value {raw!r}" in message, message


@pytest.mark.slow
def test_experiment_and_run_names_reach_mlflow_as_typed(tmp_path):
    """A real `raysim run` with `--experiment "my exp #2"` and a run name YAML would have cut or retyped; and a
    comment in a number refused by a real process, before Ray."""
    from mlflow.tracking import MlflowClient

    from tests.support.experiments import tiny_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(rounds=1, tracking={"uri": uri})))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    raysim = str(Path(sys.executable).parent / "raysim")
    refused = subprocess.run(
        [raysim, "run", str(path), "--quiet", "--set", "rounds=1 #x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --set rounds: '#x' would be a YAML comment and dropped from the value '1 #x'; quote the text that "
        "holds it, or leave the comment out"
    ], refused.stderr
    assert not (tmp_path / "mlflow.db").exists()
    done = subprocess.run(
        [raysim, "run", str(path), "--quiet", "--experiment", "my exp #2", "--set", "tracking.run_name=no #1: on"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("my exp #2").experiment_id])
    assert run.info.run_name == "no #1: on" and run.data.params["tracking.experiment"] == "my exp #2"
