"""The CPU census (tests/support/cpu_census.py): a test's CPU seconds include those of the processes it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import ROOT

MEASURED = """
import subprocess, sys, time
from pathlib import Path
from tests.support.cpu_census import Census

census = Census(Path(sys.argv[1]), "probe")
census.start("tests/system/test_x.py::test_busy_child")
busy = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"
subprocess.run([sys.executable, "-c", busy])
census.finish("tests/system/test_x.py::test_busy_child")
census.close()
"""


def test_a_tests_cpu_seconds_include_its_child_processes(tmp_path):
    out = tmp_path / "census.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    if os.geteuid() != 0:  # no cgroup of its own without root: one line says so, nothing is recorded
        assert "cpu census: no cgroup can be made here (root needed)" in done.stderr and not out.exists()
        return
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert line["test"] == "tests/system/test_x.py::test_busy_child" and line["worker"] == "probe"
    assert 1.0 <= line["cpu_s"] <= line["wall_s"] + 0.5, line
