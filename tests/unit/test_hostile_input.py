"""Hostile config input (not UTF-8, nested thousands deep, a bool or a non-finite float for a number, a `partition.q`
above the class count) is one `error:` line, exit 2, before any Ray or MLflow work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from raysim.config import is_suite_file, is_sweep_file, load_config
from raysim.errors import ConfigError
from raysim.studies.suite import load_suite
from raysim.studies.sweep import load_sweep
from tests.support.hostile_input import (
    CLI_CASES,
    CONFIGS,
    DEEP,
    argument_cases,
    check_one_error_line,
    check_refused,
    cli_case,
    file_arguments,
    file_settings,
    quickstart_with,
    setting_cases,
    write_hostile,
)


def _refusal(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, overrides)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_file_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path):
    path = write_hostile(tmp_path / "latin.yaml", quickstart_with(), b"notes: caf\xe9\n")
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
    path = write_hostile(tmp_path / "deep.yaml", quickstart_with(), tail.encode())
    message = _refusal(path)
    assert message.startswith(f"{path}: nested too deeply"), message


@pytest.mark.parametrize(
    "assignment",
    ["rounds=" + "[" * DEEP + "]" * DEEP, "algorithm.lr=" + "{a: " * DEEP + "1" + "}" * DEEP, "a." * DEEP + "b=1"],
    ids=["list-value", "mapping-value", "key-path"],
)
def test_deeply_nested_set_values_are_refused_naming_the_assignment(tmp_path, assignment):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
    assert message.startswith(f"--set {assignment.split('.')[0].split('=')[0]}") and "nested too deeply" in message


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), ("rounds=[1",))
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
    message = _refusal(write_hostile(tmp_path / "experiment.yaml", quickstart_with(**changes)))
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
    write_hostile(path, family)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        (load_suite if "runs" in family else load_sweep)(path)


def test_numbers_lists_and_real_bools_still_validate(tmp_path):
    """Not strict mode: an int for a float, a list for a tuple, a bool for a bool field all stay valid."""
    config = load_config(
        write_hostile(tmp_path / "experiment.yaml", quickstart_with(**{"algorithm.lr": 1, "dataset.download": False})),
        ("runtime.host_resources={worker: 1}", "partition={scheme: dirichlet, overlap: true}"),
    )
    assert config.algorithm.lr == 1.0 and isinstance(config.algorithm.lr, float) and config.dataset.download is False
    assert config.partition.overlap is True and config.runtime.host_resources == {"worker": 1.0}
    (tmp_path / "quickstart.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    random = {"count": 2, "params": {"algorithm.lr": {"uniform": [0, 1]}}}
    sweep = write_hostile(tmp_path / "sweep.yaml", {"name": "w", "base_config": "quickstart.yaml", "random": random})
    assert load_sweep(sweep).random.params["algorithm.lr"].uniform == (0.0, 1.0)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_still_validates(path):
    if is_suite_file(path):
        assert load_suite(path).experiments()
    elif is_sweep_file(path):
        assert load_sweep(path).trials("sqlite:////nonexistent/mlflow.db")
    else:
        assert load_config(path).rounds >= 1


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_the_cli_refuses_with_one_error_line_before_ray_or_mlflow(tmp_path, monkeypatch, capsys, case):
    import ray

    from raysim.cli import main
    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)
    monkeypatch.chdir(tmp_path)
    code = main(cli_case(tmp_path, case))
    out = capsys.readouterr()
    check_refused(code, out.out, out.err, tmp_path, CLI_CASES[case][3])


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
    config = load_config(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
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
    tree = {name: part for name, part in quickstart_with().items() if name != left_out}
    loaded = load_config(write_hostile(tmp_path / "ok.yaml", tree), assignments)
    assert getattr(getattr(loaded, section), key) == value


@pytest.mark.parametrize("section", ["algorithm.name", "dataset.name", "partition.scheme"])
def test_a_choosing_name_is_text_whatever_the_choice(tmp_path, section):
    """`yes` is a name no registry has, said as typed (YAML would have made it True)."""
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (f"{section}=yes",))
    assert message.startswith(f"{section}: unknown ") and "'yes'" in message, message


@pytest.mark.parametrize("assignment", ["rounds=5 #x", "partition={scheme: iid} # iid for now", "algorithm.lr=0.1 #"])
def test_a_yaml_comment_in_a_set_value_is_refused(tmp_path, assignment):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
    path, raw = assignment.split("=", 1)
    assert message.startswith(f"--set {path}: '#") and f"dropped from the value {raw!r}" in message, message


@pytest.fixture
def nothing_starts(tmp_path, monkeypatch):
    """Ray and the MLflow writer fail the test if touched (subprocesses already do, tests/unit/conftest.py)."""
    import ray

    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _refused_in_one_line(
    variant: str, argv: list[str], path: Path, names: tuple[str, ...], folder: Path, capsys
) -> str:
    from raysim.cli import main

    code = main(argv)
    out = capsys.readouterr()
    try:
        line = check_one_error_line(code, out.out, out.err, path, names)
    except AssertionError as error:
        raise AssertionError(f"{variant} ({' '.join(argv)}): {error}") from None
    assert not (folder / "mlflow.db").exists() and not (folder / "mlruns").exists(), variant
    return line


@pytest.mark.parametrize("argument", file_arguments(), ids=lambda argument: argument.name)
def test_every_file_argument_of_every_command_refuses_hostile_files_in_one_line(
    tmp_path, nothing_starts, capsys, argument
):
    """Generated from the parser: each command's arguments that name a file or folder, given an empty, truncated,
    not-UTF-8 file, a folder for a file, a file for a folder, a path below a file, one that does not exist, and
    for an output a place that cannot be written: exit non-zero, one `error:` line naming the file or the option,
    no traceback, nothing started."""
    for variant, argv, path in argument_cases(argument, tmp_path / "cases"):
        names = (argument.option,) if argument.option else ()
        _refused_in_one_line(variant, argv, path, names, tmp_path, capsys)


@pytest.mark.parametrize("setting", file_settings(), ids=lambda setting: setting.name)
def test_every_file_setting_refuses_hostile_files_in_one_line(tmp_path, nothing_starts, capsys, fmnist_tenth, setting):
    """Generated from the config models: every setting of every registered choice that names a file or folder
    (`dataset.root` of each source, `algorithm.teacher_weights`, `partition.path`, `tracking.checkpoint_dir`, ...),
    set by a real `raysim run` to the same hostile places; a dataset's folder also holding its layout's files
    (the source's markers) empty or cut off."""
    for variant, tree, path in setting_cases(setting, tmp_path / "cases", fmnist_tenth):
        config = tmp_path / f"{variant}.yaml"
        config.write_text(yaml.safe_dump(tree, sort_keys=False))
        _refused_in_one_line(variant, ["run", str(config), "--quiet"], path, (setting.key,), tmp_path, capsys)


def test_the_walk_finds_the_paths_the_issue_names():
    """The generated lists hold what issue 51 names, so a rule that stopped matching would be seen."""
    arguments = {(a.command, a.option or a.dest, a.writes, a.folder) for a in file_arguments()}
    assert {("pretrain", "--out", True, False), ("figure", "--out", True, True)} <= arguments
    assert {("run", "config", False, False), ("resume", "target", False, True)} <= arguments
    settings = {(s.key, s.choice, s.writes) for s in file_settings()}
    assert {("algorithm.teacher_weights", "augfl", False), ("dataset.root", "crisismmd", False)} <= settings
    assert {("tracking.checkpoint_dir", None, True), ("partition.path", "file", False)} <= settings


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[]", "a JSON list, not a mapping"),
        (b'{"format": "caf\xe9"}', "not UTF-8 text at byte 15"),
        (b'{"format": %s, "run_id": "r"}', "no round, tracking_uri, config"),
    ],
    ids=["list", "not-utf8", "no-config"],
)
def test_a_damaged_checkpoint_manifest_is_one_line_naming_it(tmp_path, content, expected):
    from raysim.errors import CheckpointError
    from raysim.runtime import checkpoint

    folder = tmp_path / "round-000001"
    folder.mkdir()
    (folder / checkpoint.MANIFEST).write_bytes(content.replace(b"%s", json.dumps(checkpoint.FORMAT).encode()))
    with pytest.raises(CheckpointError) as raised:
        checkpoint.read_manifest(folder)
    message = str(raised.value)
    assert message.startswith(str(folder / checkpoint.MANIFEST)) and expected in message and "\n" not in message


def _archive(path: Path, **arrays: Any) -> Path:
    import numpy as np

    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case", ["zero-samples", "1-d-features"])
def test_a_multimodal_archive_without_samples_or_with_1d_features_is_one_line(tmp_path, case):
    import numpy as np

    from raysim.data.fedmultimodal import SOURCES, load_converted
    from raysim.errors import DataError

    name = "kuhar"
    count = 0 if case == "zero-samples" else 2
    arrays = {"y": np.zeros(count, np.int64), "groups": np.zeros(count, np.int64)}
    for modality, _ in SOURCES[name].folders:
        steps = np.zeros(count) if case == "1-d-features" else np.zeros((count, 3), np.float32)
        arrays |= {f"{modality}_steps": steps, f"{modality}_lengths": np.ones(count, np.int64)}
    file = _archive(tmp_path / f"{name}.npz", **arrays)
    with pytest.raises(DataError) as raised:
        load_converted(name, file)
    assert str(raised.value).startswith(f"dataset.root: {file}: ")
    assert ("no samples" if case == "zero-samples" else "must be 2-D") in str(raised.value)


@pytest.mark.parametrize("case", ["text-label", "no-samples"])
def test_the_converter_refuses_a_text_label_and_empty_inputs_in_one_line(tmp_path, capsys, case):
    """`python -m raysim.data.fedmultimodal convert`: both were a traceback (int('fear'); min() of nothing)."""
    import pickle

    from raysim.data import fedmultimodal

    source = fedmultimodal.SOURCES["cremad"]
    samples = [["key", "path", "fear", [[0.5, 0.5]]]] if case == "text-label" else []
    for _, folder in source.folders:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "1.pkl").write_bytes(pickle.dumps(samples))
    code = fedmultimodal.main(["convert", "cremad", str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and str(tmp_path) in err[0], err
    assert ("'fear'" if case == "text-label" else "hold no samples") in err[0]
    assert not (tmp_path / "out" / "cremad.npz").exists()


def test_an_image_folder_with_a_file_link_loop_is_one_line_naming_the_link(tmp_path):
    """Two links that lead to each other: `DirEntry.is_dir` raised ELOOP (it swallows only ENOENT)."""
    from raysim.data.image_folder import _class_images
    from raysim.errors import DataError

    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.png").symlink_to("b.png")
    (tmp_path / "cat" / "b.png").symlink_to("a.png")
    with pytest.raises(DataError, match=r"dataset.root: .*/cat/[ab]\.png: cannot be followed \(Too many levels"):
        _class_images(tmp_path, ["cat"])


def test_an_empty_or_truncated_weights_file_is_one_line_naming_the_field(tmp_path):
    import numpy as np

    from raysim.models.weights import read_weights

    whole = _archive(tmp_path / "whole.npz", params=np.zeros(4096, np.float32), header=np.array("{}")).read_bytes()
    for name, data in (("empty", b""), ("truncated", whole[: len(whole) // 2])):
        path = tmp_path / f"{name}.npz"
        path.write_bytes(data)
        with pytest.raises(ConfigError, match=rf"^algorithm.teacher_weights: {path}: (an empty file|not a raysim)"):
            read_weights(path, "algorithm.teacher_weights")
