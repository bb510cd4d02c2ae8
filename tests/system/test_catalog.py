"""`raysim datasets`: every `dataset.name` says what it is and where it reads, the README lists it, and the command
finds a dataset whose layout is under `--root`."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.data_files import BUILT_IN


def test_the_datasets_command_finds_a_layout_under_root(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    environment = {**os.environ, "RAYSIM_DATA": str(tmp_path / "empty")}
    command = [sys.executable, "-m", "raysim.cli", "datasets", "--root", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert f"found in {tmp_path}" in lines["cifar10"]
    assert "missing" in lines["cifar100"] and "built in" in lines["digits"]
    assert "reads cifar-100-python/" in out and set(BUILT_IN) <= set(lines)


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`raysim datasets | head`: the command exits quietly when its reader has gone (here before any output)."""
    errors = tmp_path / "stderr"
    shell = f"{sys.executable} -m raysim.cli datasets 2>{errors} | true"
    subprocess.run(shell, shell=True, check=True)
    assert errors.read_text() == ""
