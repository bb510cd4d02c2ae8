"""Small suites and sweeps for the study tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.experiments import tiny_config


def sweep_data(**extra) -> dict:
    return {"name": "s", "base": tiny_config(), **extra}


def resumable_suite(folder: Path, uri: str) -> Path:
    base = tiny_config(
        rounds=3,
        tracking={
            "uri": uri,
            "experiment": "resume",
            "checkpoint_every": 1,
            "checkpoint_dir": str(folder / "checkpoints"),
        },
    )
    suite = {
        "name": "stopped",
        "base": base,
        "runs": [
            {"name": "first", "set": {}},
            {"name": "long", "set": {"rounds": 25, "seed": 3}},
            {"name": "last", "set": {"algorithm.lr": 0.1}},
        ],
    }
    path = folder / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path
