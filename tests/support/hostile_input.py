"""Hostile config files and command lines, and what a refusal of them must look like."""

from __future__ import annotations

import argparse
import io
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel

from tests.support.paths import ROOT

CONFIGS = ROOT / "configs"


DEEP = 5000


def quickstart_with(**changes: Any) -> dict[str, Any]:
    """The shipped quickstart as a mapping, with dotted keys replaced (`changes={"algorithm.lr": 0.1}`)."""
    config = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    for dotted, value in changes.items():
        *sections, key = dotted.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return config


def write_hostile(path: Path, config: dict[str, Any], tail: bytes = b"") -> Path:
    path.write_bytes(yaml.safe_dump(config, sort_keys=False).encode() + tail)
    return path


# End to end: the command line on each case (in this process, with Ray and MLflow made to fail if touched), and
# two of them in a real subprocess (one per kind of input: a file, a --set value).
CLI_CASES: dict[str, tuple[dict[str, Any], bytes, tuple[str, ...], str]] = {
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


def cli_case(folder: Path, name: str) -> list[str]:
    """The case's config written to `folder` (tracking to a sqlite file there); the `raysim` arguments."""
    changes, tail, options, _ = CLI_CASES[name]
    config = quickstart_with(**changes, **{"tracking.uri": f"sqlite:///{folder / 'mlflow.db'}"})
    return ["run", str(write_hostile(folder / "experiment.yaml", config, tail)), "--quiet", *options]


def check_refused(returncode: int, stdout: str, stderr: str, folder: Path, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    assert "Traceback" not in stderr + stdout and "Started a local Ray instance" not in stderr + stdout
    assert not (folder / "mlflow.db").exists() and not (folder / "mlruns").exists()


# The generated walk (issue 51): every CLI command's file arguments, read from the argparse parser, and every
# file-reading setting, read from the config models, each given empty, truncated and wrong-type files. A new
# command, option or setting whose name or help says it takes a file or folder is walked without being listed here.

FILE_WORDS = re.compile(r"\b(files?|folders?|dir|directory|yaml|path)\b|\.py\b", re.IGNORECASE)
"""An argument's help that says it takes a file or folder (or its metavar: FILE, FOLDER, DIR)."""
FILE_DESTS = re.compile(r"(^|_)(config|sweep|out|json|root|site|dir|path|file|weights|plugin|destination)$")
"""An argument's or setting's name that says so."""
WRITES = re.compile(r"\bwrite\b|where to write|folder for|folder of the", re.IGNORECASE)
"""Help or description of a place written to, not read from."""
VALUE = "<the hostile path>"
SERVING = ("docs", "server")
"""Commands that serve until Ctrl-C from their first line on: they read no file before serving one."""
UNWRITABLE = Path("/sys/raysim-hostile")
"""A place nobody may write, root included (the tests run as root in the container, where chmod does not bind)."""
COMPANIONS: dict[str, dict[str, Any]] = {
    "tracking.checkpoint_dir": {"tracking.checkpoint_every": 1},
    "dataset.root-huggingface": {"dataset.path": VALUE},
    "dataset.root-medmnist": {"dataset.subset": "pathmnist"},
}
"""The settings under which a file-reading setting is read at all (a checkpoint folder only with checkpoints; the
hub cache of a saved dataset's folder); VALUE stands for the hostile path."""


@dataclass(frozen=True)
class FileArgument:
    """One CLI argument that names a file or folder."""

    command: str
    option: str | None
    """`--out`; None for a positional."""
    dest: str
    writes: bool
    folder: bool
    content: str
    """What a file holds: `yaml`, `python` or `any`."""

    @property
    def name(self) -> str:
        return f"{self.command}-{self.option or self.dest}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from raysim.cli import parser

    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def _takes_a_path(action: argparse.Action) -> bool:
    if action.choices is not None:  # one of fixed words (whatever its help says of files)
        return False
    named = re.search(r"FILE|FOLDER|DIR", str(action.metavar or ""))
    return action.type is Path or bool(named or FILE_WORDS.search(action.help or "") or FILE_DESTS.search(action.dest))


def _is_folder(name: str, about: str) -> bool:
    """A folder when the text first speaks of a folder (not a file), or, saying neither, the name ends in `root` or
    `dir`."""
    first = re.search(r"\b(file|folder|directory|dir)\b", about)
    return first.group(1) != "file" if first else bool(re.search(r"(root|_dir)$", name))


def file_arguments() -> list[FileArgument]:
    """Every argument of every `raysim` command that names a file or folder, read from the parser."""
    found = []
    for command, sub in _subcommands().items():
        if command in SERVING:
            continue
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.nargs == 0 or not _takes_a_path(action):
                continue
            text = f"{action.dest} {action.metavar or ''} {action.help or ''}"
            writes = bool(WRITES.search(action.help or ""))
            folder = _is_folder(action.dest, action.help or "")
            content = "yaml" if "YAML" in text or action.dest == "config" else "python" if ".py" in text else "any"
            option = action.option_strings[-1] if action.option_strings else None
            found.append(FileArgument(command, option, action.dest, writes, folder, content))
    return found


def _fillers(command: str, tested: str, folder: Path) -> list[str]:
    """The command's other required arguments, with harmless values."""
    sub = _subcommands()[command]
    argv: list[str] = []
    for action in sub._actions:
        if action.dest == tested or isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings and action.nargs != "?":
            if action.dest in ("config", "sweep"):
                argv.append(str(write_hostile(folder / "valid.yaml", quickstart_with())))
            else:
                argv.append("no-such-run")
        elif action.required:
            argv += [action.option_strings[-1], str(folder / "filler.out")]
    return argv


def _archive_half() -> bytes:
    """The first half of a real .npz archive (a zip of arrays): a file cut off in the middle."""
    buffer = io.BytesIO()
    np.savez(buffer, x=np.zeros((64, 8), np.float32), y=np.arange(64))
    whole = buffer.getvalue()
    return whole[: len(whole) // 2]


def hostile_inputs(folder: Path, content: str, wants_folder: bool) -> dict[str, Path]:
    """Name -> a path that is no good as the input: empty, truncated, of the wrong type, missing."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a-file").write_text("a file\n")
    if wants_folder:
        return {"a-file": folder / "a-file", "below-a-file": folder / "a-file" / "inside", "missing": folder / "none"}
    quickstart = (CONFIGS / "quickstart.yaml").read_bytes()
    cases = {
        "empty": b"",
        "truncated": {
            "yaml": quickstart[: quickstart.index(b"partition:")] + b'notes: "cut off',
            "python": b"def register(:\n",
        }.get(content, _archive_half()),
        "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    }
    if content == "python":
        del cases["empty"]  # an empty module is a valid plugin that registers nothing
    paths = {}
    for name, data in cases.items():
        path = folder / f"{name}.{ {'yaml': 'yaml', 'python': 'py'}.get(content, 'npz') }"
        path.write_bytes(data)
        paths[name] = path
    (folder / "a-folder").mkdir(exist_ok=True)
    paths["a-folder"] = folder / "a-folder"
    paths["missing"] = folder / f"none.{ {'yaml': 'yaml', 'python': 'py'}.get(content, 'npz') }"
    return paths


def hostile_outputs(folder: Path, wants_folder: bool) -> dict[str, Path]:
    """Name -> a place the output cannot go: the wrong type there, below a file, not writable."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a-file").write_text("a file\n")
    (folder / "a-folder").mkdir(exist_ok=True)
    wrong = {"a-file": folder / "a-file"} if wants_folder else {"a-folder": folder / "a-folder"}
    return {**wrong, "below-a-file": folder / "a-file" / "out", "not-writable": UNWRITABLE / "out"}


def argument_cases(argument: FileArgument, folder: Path) -> list[tuple[str, list[str], Path]]:
    """(variant, raysim argv, the hostile path) for every hostile value of one file argument."""
    values = (
        hostile_outputs(folder, argument.folder)
        if argument.writes
        else hostile_inputs(folder, argument.content, argument.folder)
    )
    cases = []
    for variant, path in values.items():
        given = [str(path)] if argument.option is None else [argument.option, str(path)]
        argv = [argument.command, *given, *_fillers(argument.command, argument.dest, folder)]
        if "quiet" in {action.dest for action in _subcommands()[argument.command]._actions}:
            argv.append("--quiet")
        cases.append((variant, argv, path))
    return cases


@dataclass(frozen=True)
class FileSetting:
    """A config setting that names a file or folder raysim reads or writes, and the choice it belongs to."""

    key: str
    """`dataset.root`."""
    section: str
    choice: str | None
    """The `algorithm.name`, `dataset.name` or `partition.scheme` whose settings hold it; None: a fixed section."""
    writes: bool
    folder: bool

    @property
    def name(self) -> str:
        return f"{self.key}-{self.choice}" if self.choice else self.key


def file_settings() -> list[FileSetting]:
    """Every setting of every registered choice whose name says it names a file or folder, from the models."""
    from raysim.config import SWITCHES, ExperimentConfig, choice_models

    found = []
    for section, field in ExperimentConfig.model_fields.items():
        if section in SWITCHES:
            models = list(choice_models(section).items())
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            models = [(None, field.annotation)]
        else:
            continue
        for choice, model in models:
            for name, setting in model.model_fields.items():
                if not FILE_DESTS.search(name) or "str" not in str(setting.annotation):
                    continue
                about = setting.description or ""
                writes = bool(WRITES.search(about))
                found.append(FileSetting(f"{section}.{name}", section, choice, writes, _is_folder(name, about)))
    return found


def _marker_files(choice: str) -> list[str]:
    """The files a dataset source's layout names (its `markers`, globs made names)."""
    from raysim.data import DATASETS

    named = (re.sub(r"^\*|(?<=/)\*|\*(?=\.)", "x", marker) for marker in DATASETS.settings_of(choice).markers)
    return [name.replace("*", "") for name in named]


def setting_tree(setting: FileSetting, value: Path, partition_file: Path, data_root: Path) -> dict[str, Any]:
    """The quickstart with the setting's choice made (its example's sections, for an algorithm or a scheme), its
    companions set and the setting itself set to `value`; downloads off."""
    from raysim.algorithms import ALGORITHMS
    from raysim.config import choice_models, set_value
    from raysim.data.partitions import PARTITIONS
    from raysim.examples import ExampleContext

    tree = quickstart_with(**{"dataset.root": str(data_root)})
    # the hosts on this node whatever the process: a Ray this test process already runs (an earlier tier's) would make
    # the run join it, where settings about this node's files (runtime.spill_dir) are checked only once connected
    tree.setdefault("runtime", {})["actors"] = "in_process"
    context = ExampleContext(tree, partition_file)
    if setting.section == "algorithm" and setting.choice:
        tree.update(ALGORITHMS.get(setting.choice).example(context))
    elif setting.section == "partition" and setting.choice:
        tree.update(PARTITIONS.get(setting.choice).example(context))
    elif setting.section == "dataset" and setting.choice:
        tree["dataset"] = {"name": setting.choice, **_required_choices("dataset", setting.choice)}
        if "download" in choice_models("dataset")[setting.choice].model_fields:
            tree["dataset"]["download"] = False
    for dotted, companion in {**COMPANIONS.get(setting.key, {}), **COMPANIONS.get(setting.name, {})}.items():
        set_value(tree, dotted, str(value) if companion == VALUE else companion)
    set_value(tree, setting.key, str(value))
    return tree


def _required_choices(section: str, choice: str) -> dict[str, Any]:
    """The first allowed value of every required field with a fixed set of values (`dataset.split` of EMNIST)."""
    from raysim.config import choice_models

    model = choice_models(section)[choice]
    return {
        name: typing.get_args(field.annotation)[0]
        for name, field in model.model_fields.items()
        if field.is_required() and typing.get_origin(field.annotation) is typing.Literal
    }


def setting_cases(setting: FileSetting, folder: Path, data_root: Path) -> list[tuple[str, dict[str, Any], Path]]:
    """(variant, config tree, the hostile path) for every hostile value of one file setting; the quickstart reads
    its Fashion-MNIST from `data_root`."""
    if setting.writes:
        values = hostile_outputs(folder, setting.folder)
    else:
        values = hostile_inputs(folder, "any", setting.folder)
        if setting.folder and setting.section == "dataset" and setting.choice:
            for variant, data in (("empty-files", b""), ("truncated-files", _archive_half())):
                root = folder / variant
                root.mkdir(parents=True, exist_ok=True)
                for marker in _marker_files(setting.choice):
                    (root / marker).parent.mkdir(parents=True, exist_ok=True)
                    (root / marker).write_bytes(data)
                values[variant] = root
    return [
        (variant, setting_tree(setting, path, folder / "partition.parquet", data_root), path)
        for variant, path in values.items()
    ]


def check_one_error_line(code: int, stdout: str, stderr: str, path: Path, names: tuple[str, ...]) -> str:
    """Exit non-zero, exactly one line on stderr, starting `error:` and naming the file (or a folder above it) or
    one of `names` (the option or setting), and no traceback; the line."""
    lines = stderr.strip().splitlines()
    assert code != 0, f"exit 0 on {path}: {stdout[-500:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stdout + stderr, stderr
    places = [str(path), *(str(p) for p in path.parents if p != Path("/") and len(p.parts) > 3)]
    assert any(place in lines[0] for place in [*places, *names]), lines[0]
    return lines[0]
