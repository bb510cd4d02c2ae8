"""`raysim pretrain` (raysim.launch.pretrain, raysim.algorithms.augfl.teacher) and its versioned weights files
(raysim.models.weights): the file's header and checksum, a run's teacher equal to the file, the one-line refusal of a
corrupted or mismatched file, the authors' recipe as defaults, and no file left by an interrupted pretraining."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.support.augfl import CRD, PRETRAIN_META
from tests.support.experiments import tiny_config
from tests.support.paths import ROOT
from tests.support.terminal import sigint_as_from_a_terminal


@pytest.mark.slow
def test_ctrl_c_during_raysim_pretrain_leaves_no_file(tmp_path):
    """A real `raysim pretrain` process stopped by SIGINT while it trains: exit 130, one line, no file (the
    weights are written only once trained, and then atomically)."""
    config = tiny_config(algorithm={**CRD, "teacher_epochs": 20, "teacher_batch_size": 1}, partition=PRETRAIN_META)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "weights" / "teacher.npz"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "raysim.cli", "pretrain", str(tmp_path / "c.yaml"), "--out", str(out)]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=environment, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_from_a_terminal
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 120
    line = ""
    while "epoch" not in line and time.monotonic() < deadline:  # a plain line every epoch: it is training
        line = process.stderr.readline()
    assert "epoch" in line, line
    process.send_signal(signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 128 + signal.SIGINT, rest
    assert rest.strip().splitlines()[-1] == "interrupted by SIGINT"
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))
