"""Ray Jobs: submit an experiment or a sweep to a Ray cluster, follow it, list and stop jobs.

The job carries its config with it (the validated YAML in the job's environment, $RAYSIM_JOB_CONFIG), so
the submitter's files need not exist on the cluster. The code comes either from this checkout (the
project directory as the job's `working_dir`) or, with `package=True`, from the raysim package already
installed on the cluster (e.g. the docker/ images). The entrypoints (jobs/experiment.py, jobs/sweep.py,
or `python -m raysim.jobs KIND`) run the ordinary `raysim run` / `raysim sweep` inside the job, which
finds the cluster through $RAY_ADDRESS as any driver does.

The MLflow tracking URI goes to the job as $MLFLOW_TRACKING_URI: `--tracking-uri`, else the config's
`tracking.uri`, else the submitter's $MLFLOW_TRACKING_URI. Use a tracking server (`raysim server`) that
the cluster's nodes can reach; a relative sqlite path would land in the job's temporary directory.

Token authentication (on by default in Ray 2.60): the dashboard's job API wants the cluster's token as
`Authorization: Bearer TOKEN`. It is read from `--auth-token`, $RAY_AUTH_TOKEN, the file named by
$RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (where `ray start` / `ray get-auth-token --generate` put it);
with $RAY_AUTH_MODE=disabled no token is sent.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from raysim.errors import RaysimError

Kind = Literal["experiment", "sweep"]
CONFIG_ENV = "RAYSIM_JOB_CONFIG"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
EXCLUDES = [".venv", ".git", "mlruns", "mlartifacts", "*.db", "__pycache__", ".pytest_cache", ".ruff_cache",
            ".hypothesis", "*.egg-info", "runs", "data"]  # fmt: skip
RUN_ID = re.compile(r"\brun ([0-9a-f]{32})\b")


class JobError(RaysimError):
    """A job could not be submitted, found or stopped."""


def auth_token(explicit: str | None = None) -> str | None:
    """The cluster token to send, or None (auth disabled, or no token anywhere)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    if explicit or os.environ.get("RAY_AUTH_TOKEN"):
        return explicit or os.environ["RAY_AUTH_TOKEN"]
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def job_client(address: str | None = None, token: str | None = None):
    """A JobSubmissionClient for `address` (default $RAY_ADDRESS if it is http(s), else 127.0.0.1:8265)."""
    from ray.job_submission import JobSubmissionClient

    env_address = os.environ.get("RAY_ADDRESS", "")
    address = address or (env_address if env_address.startswith("http") else DEFAULT_ADDRESS)
    found = auth_token(token)
    headers = {"Authorization": f"Bearer {found}"} if found else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError) as error:
        raise JobError(f"--address {address}: cannot reach the Ray job API ({str(error).splitlines()[0]})") from None


def job_config_yaml(kind: Kind, path: str | Path, overrides: list[str], tracking_uri: str | None) -> tuple[str, str]:
    """(validated config as self-contained YAML, tracking URI for the job or '') for the job to carry."""
    if kind == "experiment":
        from raysim.config import load_config

        config = load_config(path, overrides)
        uri = tracking_uri or config.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if uri:
            config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": uri})})
        return config.to_yaml(), uri
    from raysim.sweep import load_sweep

    sweep = load_sweep(path, overrides)
    base = sweep.base_tree()
    uri = tracking_uri or (base.get("tracking") or {}).get("uri") or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        base.setdefault("tracking", {})["uri"] = uri
    data = sweep.model_copy(update={"base": base, "base_config": None}).model_dump(mode="json", exclude_none=True)
    return yaml.safe_dump(data, sort_keys=False), uri


@dataclass
class Submission:
    job_id: str
    address: str
    tracking_uri: str


def submit(
    kind: Kind,
    path: str | Path,
    overrides: list[str] | None = None,
    address: str | None = None,
    tracking_uri: str | None = None,
    package: bool = False,
    token: str | None = None,
    env: dict[str, str] | None = None,
) -> Submission:
    """Submit an experiment or a sweep as a Ray job; returns its id at once."""
    text, uri = job_config_yaml(kind, path, list(overrides or []), tracking_uri)
    env_vars = {CONFIG_ENV: text, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    if uri:
        env_vars["MLFLOW_TRACKING_URI"] = uri
    runtime_env: dict[str, object] = {"env_vars": env_vars}
    if package:
        entrypoint = f"python -m raysim.jobs {kind}"
    else:
        if not (PROJECT_ROOT / "jobs" / f"{kind}.py").is_file():
            raise JobError(f"{PROJECT_ROOT}: no jobs/{kind}.py here (an installed package? submit with --package)")
        runtime_env |= {"working_dir": str(PROJECT_ROOT), "excludes": EXCLUDES}
        entrypoint = f"python jobs/{kind}.py"
    client = job_client(address, token)
    try:
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, metadata={"raysim": kind})
    except RuntimeError as error:
        raise JobError(f"submitting to {client.get_address()} failed: {str(error).splitlines()[0]}") from None
    return Submission(job_id, client.get_address(), uri)


def wait_for_run_id(client, job_id: str, timeout_s: float = 300.0) -> str | None:
    """The MLflow run id the job prints when its (parent) run starts; None if the job ends or time runs out."""
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = RUN_ID.search(client.get_job_logs(job_id))
        if found:
            return found.group(1)
        if client.get_job_status(job_id) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return None
        time.sleep(1.0)
    return None


def follow(client, job_id: str) -> str:
    """Stream the job's logs to stdout until it ends; returns its final status."""

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)

    asyncio.run(tail())
    return str(client.get_job_status(job_id).value)


def entrypoint(kind: Kind) -> int:
    """Inside the job: write the carried config to a file and run it as `raysim run` / `raysim sweep` would."""
    from raysim.cli import main

    text = os.environ.get(CONFIG_ENV)
    if not text:
        print(f"error: ${CONFIG_ENV} is empty: submit with `raysim submit`", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="raysim-job-"))
    try:
        path = folder / f"{kind}.yaml"
        path.write_text(text)
        return main(["run" if kind == "experiment" else "sweep", str(path)])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("experiment", "sweep"):
        sys.exit("usage: python -m raysim.jobs experiment|sweep")
    sys.exit(entrypoint(sys.argv[1]))  # type: ignore[arg-type]
