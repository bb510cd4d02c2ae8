"""Several `raysim` commands, one after the other, in one process of their own: one import of raysim and its
libraries (seconds on the 2-core machine) for all of them, where each would pay it as a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = """
import json, os, sys, time, traceback
from pathlib import Path

import ray
from raysim.cli import main
from raysim.studies.procmem import descendants

results = {}
for name, (argv, folder) in json.loads(sys.argv[1]).items():
    os.chdir(folder)
    sys.stdout.flush(), sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd, stream in ((1, "stdout"), (2, "stderr")):  # the file descriptors: a Ray starting would write there
        os.dup2(os.open(Path(folder) / f"{name}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    started = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    except BaseException:  # as a process of its own would end: its traceback on stderr, exit 1
        traceback.print_exc()
        code = 1
    elapsed = time.monotonic() - started
    sys.stdout.flush(), sys.stderr.flush()
    for fd, copy in saved.items():
        os.dup2(copy, fd)
        os.close(copy)
    left = [Path(f"/proc/{pid}/comm") for pid in descendants(os.getpid())[1:]]
    left = [comm.read_text().strip() for comm in left if comm.exists()]
    results[name] = {
        "code": code,
        "seconds": elapsed,
        "stdout": (Path(folder) / f"{name}.stdout").read_text(),
        "stderr": (Path(folder) / f"{name}.stderr").read_text(),
        "ray": ray.is_initialized() or any(comm in ("gcs_server", "raylet") for comm in left),
    }
print(json.dumps(results))
"""


def raysim_commands(
    commands: dict[str, tuple[list[str], Path]], timeout: float = 300, env: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Each named command (`raysim ARGV` in a folder, run by `raysim.cli.main` in that order) in one fresh Python
    with none of this process's MLflow or Ray variables (`env`: variables to set there): its exit code, seconds,
    stdout and stderr (the file descriptors, so what a Ray or a library prints is there too; kept as NAME.stdout and
    NAME.stderr in the command's folder) and whether a Ray was left initialized or running under the process after
    it."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "RAY_ADDRESS"))}
    environment.update(env or {})
    plan = {name: (argv, str(folder)) for name, (argv, folder) in commands.items()}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
