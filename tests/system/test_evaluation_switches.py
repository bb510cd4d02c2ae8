"""Evaluation switches for the FLAME authors' numbers (flame.md 4.3, 4.4, 11): when the GM is scored, their
fairness unit, the optional training-loss pass, and progress lines when the console is not a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

REPO = ROOT


@pytest.mark.slow
def test_without_a_terminal_progress_prints_a_line_every_few_rounds(tmp_path):
    """`raysim run` with stdout and stderr going to files (as in Ray job logs, CI or nohup)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "raysim.cli",
        "run",
        str(REPO / "configs/quickstart.yaml"),
        "--set",
        "rounds=3",
        "--set",
        f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
        "--set",
        "dataset.name=digits",
        "--set",
        "model.name=mlr",
        "--set",
        "runtime.actors=in_process",  # the console is the subject, not Ray
    ]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        done = subprocess.run(command, cwd=tmp_path, env=env, stdout=out, stderr=err, timeout=600)
    shown = (tmp_path / "err").read_text()
    assert done.returncode == 0, shown
    lines = [line for line in shown.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], shown
    assert all("PM 0." in line and "GM 0." in line and "HM 0." in line and "s/round" in line for line in lines)
    assert "final PM" in (tmp_path / "out").read_text()
