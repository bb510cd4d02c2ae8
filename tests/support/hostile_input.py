"""Hostile config files and command lines, and what a refusal of them must look like."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
