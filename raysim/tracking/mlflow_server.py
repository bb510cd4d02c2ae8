"""`python -m raysim.tracking.mlflow_server ARGS`: `mlflow server ARGS` in one process instead of two.

`mlflow server` checks its options and prepares the backend store, then starts uvicorn as a second Python process
and waits for it; each process imports MLflow. With one worker (raysim.tracking.server.ServerSettings) the second
process is not needed: here MLflow's own command runs as it is, and only its last step, starting uvicorn, runs
uvicorn's command line in this process. Measured on the 2-core machine (a new sqlite store, up to the first
answered request): 3.6 CPU s and 3.8 s against 6.5 CPU s and 6.4 s, and 2.9 against 5.3 CPU s for an existing
store. With an MLflow that starts its server some other way, the command runs as MLflow ships it (two processes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import mlflow.server
from mlflow.cli import cli

UVICORN = ("-m", "uvicorn")
"""How MLflow's command line for the server starts uvicorn (after the Python executable)."""


def serve_in_this_process(command: Sequence[str], extra_env: Mapping[str, str] | None = None, **_: object) -> None:
    """Stand-in for MLflow's process launcher: uvicorn's command line `command` run here, with the environment
    MLflow would give its process; exits with uvicorn's status."""
    if tuple(command[1:3]) != UVICORN:
        raise RuntimeError(f"mlflow server started {list(command)[:3]}, not uvicorn: raysim cannot run it in-process")
    os.environ.update(extra_env or {})
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(args=list(command[3:]), prog_name="uvicorn")


def main(argv: Sequence[str]) -> None:
    if hasattr(mlflow.server, "_exec_cmd"):
        mlflow.server._exec_cmd = serve_in_this_process  # type: ignore[assignment]  # the launcher _run_server calls
    cli(args=["server", *argv], prog_name="mlflow")


if __name__ == "__main__":
    main(sys.argv[1:])
