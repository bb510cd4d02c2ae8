"""Sweeps: settings from grid and random draws, validation, and a real concurrent sweep on local Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.studies import sweep_data

RAYSIM = str(Path(sys.executable).parent / "raysim")


def test_raysim_run_takes_a_sweep_file_and_names_its_bad_key(tmp_path):
    """`raysim run` dispatches on the file: the error is the sweep's, not an experiment's missing sections."""
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(sweep_data(grid={"algorithm.rho": []})))
    done = subprocess.run([RAYSIM, "run", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip() == f"error: {path}: grid.algorithm.rho: needs at least one value"
