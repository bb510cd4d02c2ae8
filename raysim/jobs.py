"""Ray Jobs: submit an experiment or a sweep to a Ray cluster, follow it, list and stop jobs.

The job carries its config with it (the validated YAML in the job's environment, $RAYSIM_JOB_CONFIG), so
the submitter's files need not exist on the cluster. The code comes either from this checkout (the
project directory as the job's `working_dir`) or, with `package=True`, from the raysim package already
installed on the cluster (e.g. the docker/ images). The entrypoints (jobs/experiment.py, jobs/sweep.py,
or `python -m raysim.jobs KIND`) run the ordinary `raysim run` / `raysim sweep` inside the job, which
finds the cluster through $RAY_ADDRESS as any driver does.

Plugins (raysim.plugins) go with the job too: module names as they are (the cluster must have them installed),
`.py` files in the job's `py_modules` (each as a package folder of its module's name), where the job and every
worker of the cluster import them by that name (the carried config names them so).

The MLflow tracking URI goes to the job as $MLFLOW_TRACKING_URI: `--tracking-uri`, else the config's
`tracking.uri`, else the submitter's $MLFLOW_TRACKING_URI. Use a tracking server (`raysim server`) that
the cluster's nodes can reach; a relative sqlite path would land in the job's temporary directory. Credentials
in it are never shipped (Ray keeps a job's runtime env and shows it): see shipped_tracking_uri. The job's log
ends with `raysim code: FOLDER`, where its raysim modules came from (the shipped working dir).

`raysim stop-nodes DIR` stops the Ray nodes started on this machine with `ray start --temp-dir
DIR` and nothing else (`ray stop` stops every Ray instance of the machine).

Token authentication (Ray 2.60): the dashboard's job API of a cluster with a token wants it as
`Authorization: Bearer TOKEN`. It is read from `--auth-token`, $RAY_AUTH_TOKEN, the file named by
$RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token (where `ray get-auth-token --generate` puts one); with
$RAY_AUTH_MODE=disabled no token is sent. A refused or missing token is a JobError naming these places.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml

from raysim.credentials import connect_uri, has_credentials, redact, redact_text
from raysim.errors import RaysimError

Kind = Literal["experiment", "sweep"]
CONFIG_ENV = "RAYSIM_JOB_CONFIG"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# gitignore patterns (Ray's packaging, ray._private.runtime_env.packaging): a leading "/" anchors a pattern to
# the project root, so that raysim/data/ (the dataset code) ships while ./data (downloaded datasets) does not.
EXCLUDES = [
    "/.venv",
    "/.git",
    "/mlruns",
    "/mlartifacts",
    "*.db",
    "__pycache__",
    "/.pytest_cache",
    "/.ruff_cache",
    "/.hypothesis",
    "*.egg-info",
    "/runs",
    "/data",
    "/checkpoints",
]
RUN_ID = re.compile(r"\brun ([0-9a-f]{32})\b")
TOKEN_HELP = "give the cluster's token with --auth-token, $RAY_AUTH_TOKEN or ~/.ray/auth_token (`ray get-auth-token` on the head prints it)"  # noqa: E501


class JobError(RaysimError):
    """A job could not be submitted, found or stopped."""


def auth_token(explicit: str | None = None) -> str | None:
    """The cluster token to send, or None (auth disabled, or no token anywhere)."""
    return _token_and_source(explicit)[0]


def _token_and_source(explicit: str | None) -> tuple[str | None, str]:
    """(token or None, where it came from) in the order --auth-token, $RAY_AUTH_TOKEN, token file."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None, "none sent: $RAY_AUTH_MODE=disabled"
    if explicit:
        return explicit, "--auth-token"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"], "$RAY_AUTH_TOKEN"
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if path.is_file():
        return path.read_text().strip(), str(path)
    return None, f"none sent: no --auth-token, no $RAY_AUTH_TOKEN, no {path}"


def job_client(address: str | None = None, token: str | None = None):
    """A JobSubmissionClient for `address` (default $RAY_ADDRESS if it is http(s), else 127.0.0.1:8265); a
    refused or missing token is a JobError saying where the token was looked for, not a Ray traceback."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    env_address = os.environ.get("RAY_ADDRESS", "")
    address = address or (env_address if env_address.startswith("http") else DEFAULT_ADDRESS)
    found, source = _token_and_source(token)
    headers = {"Authorization": f"Bearer {found}"} if found else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError:
        what = f"the token from {source}" if found else f"the request (token: {source})"
        raise JobError(f"--address {address}: the Ray cluster refused {what}; {TOKEN_HELP}") from None
    except (ConnectionError, RuntimeError) as error:
        raise JobError(f"--address {address}: cannot reach the Ray job API ({str(error).splitlines()[0]})") from None


def _tracking_uri(explicit: str | None, configured: str | None) -> str:
    return explicit or configured or os.environ.get("MLFLOW_TRACKING_URI", "")


def shipped_tracking_uri(uri: str) -> tuple[str, str | None]:
    """(the URI a job may carry, a warning or None). A job's runtime env and config are stored by Ray and shown
    by its dashboard, so credentials never go in: an http(s) server's are dropped (the job gets them on the
    cluster from MLflow's own variables), and a database password cannot reach a job at all."""
    if not has_credentials(uri):
        return uri, None
    shown = redact(uri) or ""
    if urlsplit(uri).scheme not in ("http", "https"):
        raise JobError(
            f"tracking URI {shown}: a database password cannot be shipped with a job; run a tracking server on "
            "that database (`raysim server --backend-store-uri ...`) and submit with --tracking-uri http://SERVER:5000"
        )
    return shown, (
        f"the tracking URI's credentials are not shipped (the job gets {shown}): set MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment of `ray start` on the cluster's nodes"
    )


def job_config_yaml(
    kind: Kind, path: str | Path, overrides: list[str], tracking_uri: str | None, plugins: list[str] | None = None
) -> tuple[str, str]:
    """(validated config as self-contained YAML, tracking URI for the job or '') for the job to carry; both
    without credentials (see shipped_tracking_uri)."""
    return _carried_config(kind, path, overrides, tracking_uri, plugins or [])[:2]


def shipped_plugins(specs: list[str]) -> tuple[list[str], list[str]]:
    """(the plugins as the job names them, the files to ship in its py_modules): a `.py` file becomes its module
    name, which the job's processes import from py_modules."""
    from raysim.plugins import is_file, module_name

    return [module_name(spec) for spec in specs], [spec for spec in specs if is_file(spec)]


def _carried_config(
    kind: Kind, path: str | Path, overrides: list[str], tracking_uri: str | None, plugins: list[str]
) -> tuple[str, str, str | None, list[str]]:
    """job_config_yaml's pair, the warning of shipped_tracking_uri and the plugin files to ship."""
    if kind == "experiment":
        from raysim.config import load_config

        config = load_config(path, overrides, plugins)
        uri, warning = shipped_tracking_uri(_tracking_uri(tracking_uri, config.tracking.uri))
        if uri:
            config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": uri})})
        names, files = shipped_plugins(config.plugins)
        config = config.model_copy(update={"plugins": names})
        return redact_text(config.to_yaml()), uri, warning, files
    from raysim.studies.sweep import load_sweep

    sweep = load_sweep(path, overrides, plugins)
    base = sweep.base_tree()  # the sweep file's plugins join the base's
    uri, warning = shipped_tracking_uri(_tracking_uri(tracking_uri, (base.get("tracking") or {}).get("uri")))
    if uri:
        base.setdefault("tracking", {})["uri"] = uri
    base["plugins"], files = shipped_plugins(base["plugins"])
    carried = sweep.model_copy(update={"base": base, "base_config": None, "plugins": []})
    data = carried.model_dump(mode="json", exclude_none=True)
    return redact_text(yaml.safe_dump(data, sort_keys=False)), uri, warning, files


@dataclass(frozen=True)
class JobSpec:
    """Everything a submission sends to the cluster (none of it may hold a credential) and what to tell the user."""

    kind: Kind
    entrypoint: str
    runtime_env: dict[str, object]
    tracking_uri: str
    warning: str | None


def job_spec(
    kind: Kind,
    path: str | Path,
    overrides: list[str] | None = None,
    tracking_uri: str | None = None,
    package: bool = False,
    env: dict[str, str] | None = None,
    plugins: list[str] | None = None,
) -> JobSpec:
    """The job's entrypoint and runtime env, built without a cluster (so what is shipped can be checked);
    `plugins`: `--plugin` modules and files, besides the config's own."""
    text, uri, warning, files = _carried_config(kind, path, list(overrides or []), tracking_uri, plugins or [])
    env_vars = {CONFIG_ENV: text, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    if uri:
        env_vars["MLFLOW_TRACKING_URI"] = connect_uri(uri)  # a redacted URI loses its "***@"; nothing moves
    runtime_env: dict[str, object] = {"env_vars": env_vars}
    if files:
        runtime_env["py_modules"] = files
    if package:
        entrypoint = f"python -m raysim.jobs {kind}"
    else:
        if not (PROJECT_ROOT / "jobs" / f"{kind}.py").is_file():
            raise JobError(f"{PROJECT_ROOT}: no jobs/{kind}.py here (an installed package? submit with --package)")
        runtime_env |= {"working_dir": str(PROJECT_ROOT), "excludes": EXCLUDES}
        entrypoint = f"python jobs/{kind}.py"
    return JobSpec(kind, entrypoint, runtime_env, uri, warning)


@dataclass
class Submission:
    job_id: str
    address: str
    tracking_uri: str
    warning: str | None = None


def submit(
    kind: Kind,
    path: str | Path,
    overrides: list[str] | None = None,
    address: str | None = None,
    tracking_uri: str | None = None,
    package: bool = False,
    token: str | None = None,
    env: dict[str, str] | None = None,
    plugins: list[str] | None = None,
) -> Submission:
    """Submit an experiment or a sweep as a Ray job; returns its id at once."""
    spec = job_spec(kind, path, overrides, tracking_uri, package, env, plugins)
    client = job_client(address, token)
    try:
        with tempfile.TemporaryDirectory(prefix="raysim-plugins-") as staging:
            runtime_env = staged_plugins(spec.runtime_env, Path(staging))
            job_id = client.submit_job(entrypoint=spec.entrypoint, runtime_env=runtime_env, metadata={"raysim": kind})
    except RuntimeError as error:
        message = redact_text(str(error).splitlines()[0])
        raise JobError(f"submitting to {client.get_address()} failed: {message}") from None
    return Submission(job_id, client.get_address(), spec.tracking_uri, spec.warning)


def staged_plugins(runtime_env: dict[str, object], staging: Path) -> dict[str, object]:
    """`runtime_env` with each plugin file of its py_modules as a package folder of the same name in `staging`
    (`fedavgm.py` -> `fedavgm/__init__.py`): a job submission uploads folders only, and the job's processes then
    import the file's module by its name."""
    files = runtime_env.get("py_modules")
    if not files:
        return runtime_env
    assert isinstance(files, list)  # job_spec puts a list of paths here
    folders = []
    for file in map(Path, files):
        folder = staging / file.stem
        folder.mkdir()
        shutil.copyfile(file, folder / "__init__.py")
        folders.append(str(folder))
    return {**runtime_env, "py_modules": folders}


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
    from raysim.launch import guarded, run_file

    text = os.environ.get(CONFIG_ENV)
    if not text:
        print(f"error: ${CONFIG_ENV} is empty: submit with `raysim submit`", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="raysim-job-"))
    try:
        path = folder / f"{kind}.yaml"
        path.write_text(text)
        return guarded(lambda: run_file(path, []))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"raysim code: {', '.join(f'{root} ({count} modules)' for root, count in code_roots().items())}")


def code_roots() -> dict[str, int]:
    """The folders the loaded raysim modules came from, with how many each: one folder, the job's working dir,
    when the shipped package is complete (a module missing from it would come from an installed raysim)."""
    roots: dict[str, int] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if (name == "raysim" or name.startswith("raysim.")) and file:
            where = Path(file).resolve()
            where = where.parent if where.name == "__init__.py" else where
            root = str(where.parents[name.count(".")])
            roots[root] = roots.get(root, 0) + 1
    return roots


def _ray_package_dir() -> str:
    import ray

    return str(Path(ray.__file__).resolve().parent)


def _is_ray_daemon(argv: list[str], ray_dir: str) -> bool:
    """A program of the ray package, `python -m ray...`, or a process Ray renamed (`ray::...`, `ray-dashboard-...`):
    not a user's `tail` of a log file in the temp dir."""
    head = argv[0] if argv else ""
    return head.startswith(("ray::", "ray-")) or any(ray_dir in arg or arg.startswith("ray.") for arg in argv[:3])


def _parent(pid: int) -> int:
    """The parent's pid (ValueError for a zombie: it has exited, only its exit status is left to collect)."""
    state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    if state == "Z":
        raise ValueError(f"{pid} is a zombie")
    return int(parent)


def _has_file_under(pid: int, root: str, only_output: bool = False) -> bool:
    """Whether the process keeps a file open under `root` (only_output: as its stdout or stderr)."""
    folder = Path(f"/proc/{pid}/fd")
    try:
        fds = [folder / "1", folder / "2"] if only_output else list(folder.iterdir())
        links = [os.readlink(fd) for fd in fds if fd.is_symlink()]
    except OSError:
        return False
    return any(link == root or link.startswith(root + "/") for link in links)


def node_pids(temp_dir: str | Path) -> list[int]:
    """Processes of the Ray nodes started on this machine with `ray start --temp-dir DIR`, and their children
    (workers, agents, job drivers). Each Ray daemon of such a node names DIR on its command line or keeps its
    log files open in it, and whatever a node starts writes its output to a log file there (a job driver, even
    once orphaned); `ray stop` cannot tell nodes apart and stops every Ray instance of the machine."""
    root = str(Path(temp_dir).resolve())
    names_root = re.compile(re.escape(root) + r"(?=$|[/\s,;:'\"])")
    ray_dir = _ray_package_dir()
    own = {os.getpid()}
    with contextlib.suppress(OSError, IndexError, ValueError):
        pid = os.getpid()
        while pid > 1:
            pid = _parent(pid)
            own.add(pid)
    children: dict[int, list[int]] = {}
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in own:
            continue
        pid = int(entry.name)
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            children.setdefault(_parent(pid), []).append(pid)
        except (OSError, IndexError, ValueError):
            continue
        daemon = _is_ray_daemon(argv, ray_dir)
        if daemon and any(names_root.search(arg) for arg in argv) or _has_file_under(pid, root, only_output=not daemon):
            found.add(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child not in own:
                found.add(child)
                stack.append(child)
    return sorted(found)


def stop_nodes(temp_dir: str | Path, grace_s: float = 10.0) -> int:
    """Stop the Ray nodes started with `--temp-dir DIR` on this machine, and nothing else; returns how many
    processes there were. In `ray stop`'s order: raylets, then the other daemons and workers, then the GCS (a
    raylet whose GCS is already gone waits about 10 s before it exits); SIGKILL for what outlives `grace_s`."""
    if not Path(temp_dir).is_dir():
        raise JobError(f"{temp_dir}: no such folder (give the --temp-dir the nodes were started with)")
    first = node_pids(temp_dir)
    deadline = time.monotonic() + grace_s
    for stage in ("raylet", None, "gcs_server"):
        group = [pid for pid in node_pids(temp_dir) if stage is None or _program(pid) == stage]
        group = [pid for pid in group if stage is not None or _program(pid) not in ("raylet", "gcs_server")]
        _signal(group, signal.SIGTERM)
        while _running(group) and time.monotonic() < deadline:  # not node_pids: a scan of every process each time
            time.sleep(0.1)
    _signal(node_pids(temp_dir), signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while node_pids(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = node_pids(temp_dir)
    if left:
        raise JobError(f"{temp_dir}: processes {left} of these nodes did not stop (another user's?)")
    return len(first)


def _running(pids: list[int]) -> bool:
    """Whether any of `pids` has not exited yet (a zombie has: node_pids no longer counts it either)."""
    for pid in pids:
        try:
            _parent(pid)
        except (OSError, IndexError, ValueError):
            continue
        return True
    return False


def _program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1]
    except OSError:
        return ""


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _main(argv: list[str]) -> int:
    """`python -m raysim.jobs experiment|sweep`: a job's entrypoint."""
    if argv == ["experiment"]:
        return entrypoint("experiment")
    if argv == ["sweep"]:
        return entrypoint("sweep")
    print("usage: python -m raysim.jobs experiment|sweep", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
