"""The shared MLflow tracking server: a database backend store plus a served artifact store.

`mlflow server` with its defaults starts 15 processes and 2.2 GB; one worker with job execution off
starts in about 6 s with 0.4 GB (platform.md), so that is what `raysim server` runs, in one process instead of
MLflow's two (raysim.tracking.mlflow_server: about 3 s). With
`--artifacts-destination` the server proxies artifacts (clients need only the http:// tracking URI,
no shared file system). Bind to 127.0.0.1 unless the cluster's nodes must reach it (then 0.0.0.0
behind your network's protection: the server has no authentication).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from raysim.credentials import has_credentials, redact, redact_text
from raysim.errors import RaysimError


class ServerError(RaysimError):
    """The tracking server did not come up."""


class PortTaken(ServerError):
    """Someone else listens on the server's port (before it started, or took it while it was starting)."""


TIMESTAMP = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s+")  # MLflow's log lines start with one
ERROR = re.compile(r"\b(ERROR|Error|error)\b|Errno|Exception")
BIND_FAILED = re.compile(rf"\[Errno {errno.EADDRINUSE}\]|address already in use", re.IGNORECASE)


@dataclass(frozen=True)
class ServerSettings:
    backend_store_uri: str = "sqlite:///mlflow.db"
    """sqlite:///path, or postgresql://user:password@host:5432/db (needs psycopg: the `postgres` extra)"""
    artifacts_destination: str | None = "./mlartifacts"
    """where the server stores artifacts (a directory, s3://..., ...); None: no artifact serving"""
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """`mlflow server` with these settings (in one process: raysim.tracking.mlflow_server); a backend URI with a
        password goes in `env` instead, out of the command line that `ps` shows every user of the machine."""
        command = [sys.executable, "-m", "raysim.tracking.mlflow_server"]
        if not has_credentials(self.backend_store_uri):
            command += ["--backend-store-uri", self.backend_store_uri]
        if self.artifacts_destination:
            destination = self.artifacts_destination
            if "://" not in destination:
                destination = str(Path(destination).resolve())
            command += ["--serve-artifacts", "--artifacts-destination", destination]
        return command + ["--host", self.host, "--port", str(self.port), "--workers", str(self.workers)]

    def env(self) -> dict[str, str]:
        """The server's environment: job execution off, and a backend URI with credentials (MLflow's own variable
        for --backend-store-uri)."""
        secret = {"MLFLOW_BACKEND_STORE_URI": self.backend_store_uri} if has_credentials(self.backend_store_uri) else {}
        return {**server_env(), **secret}


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of the group `process` leads is left (the leader reaped if it exited)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def server_env() -> dict[str, str]:
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # nothing there, or something that does not speak HTTP
        return False


def listening_pids(port: int) -> set[int] | None:
    """The processes holding a listening TCP socket on `port` (any address), read from /proc; None where /proc
    does not tell (not Linux). Another user's processes show only to root."""
    inodes: set[str] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(table.exists() for table in tables):
        return None
    for table in tables:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    pids: set[int] = set()
    if not inodes:
        return pids
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (process / "fd").iterdir()):
                pids.add(int(process.name))
    return pids


def port_holder(port: int) -> str | None:
    """`pid N: its command line` (redacted, shortened) of the process listening on `port`, if knowable."""
    pids = listening_pids(port)
    if not pids:
        return None
    pid = min(pids)  # the server's first process; its workers share the socket
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    command = redact_text(" ".join(" ".join(arguments).split()))  # one line, whatever the arguments hold
    return f"pid {pid}: {command[:100]}{'...' if len(command) > 100 else ''}"


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on (host, port) now: binding it as servers do (SO_REUSEADDR, so a
    closed server's lingering connections do not count) fails with "address in use". Any other reason (an
    address not on this machine, a port below 1024) is a ServerError naming it."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ServerError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise ServerError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return False


def in_use_message(host: str, port: int) -> str:
    holder = port_holder(port)
    return f"port {port} on {host} is in use" + (f" by {holder}" if holder else "")


def check_port(host: str, port: int) -> None:
    """A ServerError naming the port and who holds it if a server could not listen on it."""
    if port_in_use(host, port):
        raise PortTaken(f"{in_use_message(host, port)}: choose another --port, or stop it")


def exposure_warning(host: str) -> str | None:
    """The warning a bind address other than loopback deserves: MLflow's server has no authentication."""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return None  # binding fails with its own error
    if all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses):
        return None
    return (
        f"warning: --host {host} lets every machine that reaches this one read, change and delete its runs (MLflow "
        "has no authentication); it answers Host headers of localhost and private addresses only"
    )


def next_free_port(host: str, first: int, tries: int = 100) -> int:
    """The first port from `first` on that nothing listens on."""
    for port in range(first, min(first + tries, 65536)):
        if not port_in_use(host, port):
            return port
    raise ServerError(f"ports {first}-{first + tries - 1} on {host} are all in use: choose one with --port")


class TrackingServer:
    """A tracking server in its own process group, stopped with everything it started. Its output goes to
    `log_path` (default: a temporary file, removed when the server is stopped unless it failed)."""

    def __init__(self, settings: ServerSettings, log_path: Path | None = None):
        self.settings = settings
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self._temporary_log = log_path is None
        self._failed = False

    def start(self, timeout_s: float = 90.0) -> TrackingServer:
        """Start the server and wait until it answers on its port, refusing a port in use (one line naming
        it and who holds it). Healthy means /health answers and the listening socket is this server's, so
        another server that took the port meanwhile is never mistaken for it."""
        check_port(self.settings.host, self.settings.port)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="raysim-mlflow-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.settings.command(),
                env=self.settings.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_until_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.failure(f"exited with code {self.process.returncode}")
            if is_healthy(self.settings.url) and self._listening():
                return
            time.sleep(0.5)
        raise self.failure(f"not healthy after {timeout_s:.0f} s")

    def _listening(self) -> bool:
        """Whether the socket listening on the port is this server's (True where /proc cannot tell)."""
        pids = listening_pids(self.settings.port)
        return pids is None or bool(self._own(pids))

    def _own(self, pids: set[int]) -> set[int]:
        """Those of `pids` in this server's process group (the server and the workers it started)."""
        own = set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                if self.process is not None and os.getpgid(pid) == self.process.pid:
                    own.add(pid)
        return own

    def failure(self, what: str) -> ServerError:
        """The one line for a server that did not start or stopped by itself: what happened, the last error of
        its log (else its last line), who holds the port if someone else does; the log is kept. (MLflow exits
        with code 0 when its port is taken: its log tells.)"""
        self._failed = True
        lines: list[str] = []
        assert self.log_path is not None  # start chose it
        with contextlib.suppress(OSError):
            text = Path(self.log_path).read_text(errors="replace")
            lines = [" ".join(TIMESTAMP.sub("", line).split()) for line in text.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if ERROR.search(line)), lines[-1] if lines else "")
        pids = listening_pids(self.settings.port) or set()
        held_by_another = bool(pids - self._own(pids))
        if held_by_another:
            last += f" ({in_use_message(self.settings.host, self.settings.port)})"
        # The holder may be gone by now (another UI that started and stopped meanwhile): the log still says why.
        taken = held_by_another or any(BIND_FAILED.search(line) for line in lines)
        detail = f": {redact_text(last)[:300]}" if last else ""
        error = PortTaken if taken else ServerError
        return error(f"MLflow server on {self.settings.url} {what}{detail} (log: {self.log_path})")

    def stop(self, wait_s: float = 15.0) -> None:
        """SIGTERM to the server's whole process group (its workers too, even when the leader has already
        exited), SIGKILL to whatever is left after `wait_s`."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.process):
                time.sleep(0.1)
        self.process.wait()
        if self._temporary_log and not self._failed and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> TrackingServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _start_on_a_free_port(settings: ServerSettings, port_chosen: bool, attempts: int = 20) -> TrackingServer:
    for _ in range(attempts - 1):
        try:
            return TrackingServer(settings).start(timeout_s=300)  # MLflow: 6 s on an idle machine, a minute busy
        except PortTaken:
            if not port_chosen:
                raise
        taken = settings.port
        settings = replace(settings, port=next_free_port(settings.host, taken + 1))
        print(f"{in_use_message(settings.host, taken)}: the server takes port {settings.port}", flush=True)
    return TrackingServer(settings).start(timeout_s=300)


def runs_page(url: str, tracking_uri: str, experiment: str | None = None) -> str:
    """The UI link that opens an experiment's runs table in MLflow's model-training view: `experiment` if
    given and present, else the experiment whose runs changed last; the experiments list if there is none. Asked of
    the server at `url` (serving `tracking_uri`) over MLflow's REST API, as the UI asks it: `raysim ui` imports no
    MLflow of its own (1.5 CPU s)."""
    view = "workflowType=machine_learning"  # MLflow 3 opens in its GenAI view unless told
    found = None
    if experiment:
        name = urllib.parse.urlencode({"experiment_name": experiment})
        found = _api(url, tracking_uri, f"experiments/get-by-name?{name}").get("experiment")
    if found is None:
        search = {"max_results": 1000, "order_by": ["last_update_time DESC"]}  # MlflowClient.search_experiments'
        recent = _api(url, tracking_uri, "experiments/search", search).get("experiments", [])
        found = next((e for e in recent if _has_runs(url, tracking_uri, e["experiment_id"])), None)
    if found is None:
        return f"{url}/#/experiments?{view}"
    return f"{url}/#/experiments/{found['experiment_id']}/runs?{view}"


def _has_runs(url: str, tracking_uri: str, experiment_id: str) -> bool:
    search = {"experiment_ids": [experiment_id], "max_results": 1}
    return bool(_api(url, tracking_uri, "runs/search", search).get("runs"))


def _api(url: str, tracking_uri: str, path: str, body: dict[str, object] | None = None) -> dict[str, Any]:
    """The MLflow server's answer at `url` to a GET (no `body`) or a POST of its REST API (`path` after
    /api/2.0/mlflow/); {} for a thing it does not have (404: no experiment of that name)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return {}
        raise ServerError(f"MLflow UI on {url} ({redact(tracking_uri)}): {path} answered {error.code}") from None


def serve(
    settings: ServerSettings,
    what: str = "MLflow tracking server",
    landing: Callable[[str], str] | None = None,
    port_chosen: bool = False,
) -> NoReturn:
    """Run the server until Ctrl-C or SIGTERM, then stop it with every process it started (the server runs in
    its own process group, so nothing is left holding the port). Nothing is printed before it answers on its
    port; `landing`: the link to print then for the user to open, made from the server's URL. A server that
    fails to start, or stops by itself, is one `error:` line (ServerError). `port_chosen`: the port was picked
    as a free one, so another process taking it in the meantime (two UIs started at once) moves this server
    to the next free port, said in one line, instead of failing."""
    from raysim.errors import sigterm_interrupts

    with sigterm_interrupts():
        server = _start_on_a_free_port(settings, port_chosen)
        settings = server.settings
        try:
            artifacts = f", artifacts {settings.artifacts_destination}" if settings.artifacts_destination else ""
            print(
                f"{what} on {settings.url} (backend {redact(settings.backend_store_uri)}{artifacts}; log "
                f"{server.log_path})",
                flush=True,
            )
            if landing:
                print(f"open {landing(settings.url)}", flush=True)
            assert server.process is not None
            raise server.failure(f"stopped by itself with code {server.process.wait()}")
        finally:
            server.stop()
