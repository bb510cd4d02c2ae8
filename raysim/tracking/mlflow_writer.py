"""The driver's MLflow writer: batched logging through `MlflowClient.log_batch`.

SQLite rejects concurrent writers ("database is locked") and single calls are slow (platform.md), so
exactly one process, the driver, writes, with one `log_batch` per round.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import json
import logging
import math
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from raysim.credentials import connect_uri, redact, redact_text
from raysim.errors import RaysimError

if TYPE_CHECKING:  # MLflow (1.5 CPU s to import) where it is used: not for `resolve_tracking_uri` and the like alone
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""The experiment tag that makes MLflow 3's UI open raysim's experiments as model training (runs, charts),
not as GenAI development (traces)."""

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # log_batch limits


def resolve_tracking_uri(configured: str | None) -> str:
    """The config's `tracking.uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def sqlite_file(uri: str) -> Path | None:
    """The database file of a local sqlite store's URI (`sqlite:///relative.db`, `sqlite:////absolute.db`, as
    given: relative to the working folder), None for an in-memory database or any other store."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme != "sqlite" or parts.path in ("", "/", "/:memory:"):
        return None
    return Path(parts.path[1:] if uri.startswith("sqlite:///") else parts.path)


SQLITE_BUSY_S = 60
"""How long a write to a local sqlite store waits for another process's write to end (sqlite's busy timeout; Python's
default is 5 s): a sweep's trials, its parent and `raysim ui` share one store, and on a loaded machine a write could
wait longer than 5 s and fail its run with "database is locked"."""


def waiting_for_writers(uri: str) -> str:
    """A local sqlite store's URI with SQLITE_BUSY_S as its connections' timeout (SQLAlchemy passes the URI's
    `timeout` to sqlite3.connect), unless it names one; any other URI as it is."""
    parts = urllib.parse.urlsplit(uri)
    if sqlite_file(uri) is None or "timeout" in urllib.parse.parse_qs(parts.query):
        return uri
    return f"{uri}{'&' if parts.query else '?'}timeout={SQLITE_BUSY_S}"


def local_artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of a local sqlite store keeps its artifacts: beside the database file, in
    `mlartifacts/<experiment>` (MLflow's own default is ./mlruns of whatever folder the first command ran in);
    None (the store's default) for any other store."""
    database = sqlite_file(uri)
    if database is None:
        return None
    return (database.resolve().parent / "mlartifacts" / _folder_name(experiment)).as_uri()


def _folder_name(experiment: str) -> str:
    return re.sub(r"[^\w.-]+", "_", experiment)


URI_SCHEME = re.compile(r"^[a-zA-Z][\w+.-]*:/")
"""A URI (s3://, file:///) rather than a folder path."""


def local_artifact_folder(artifact_root: str) -> Path | None:
    """tracking.artifact_root's folder on this machine (a path, or a file:// URI's), or None for a remote store."""
    if not URI_SCHEME.match(artifact_root):
        return Path(artifact_root).expanduser()
    parsed = urllib.parse.urlparse(artifact_root)
    return Path(urllib.parse.unquote(parsed.path)) if parsed.scheme == "file" else None


def experiment_artifact_location(uri: str, experiment: str, artifact_root: str | None) -> str | None:
    """Where a new experiment keeps its artifacts: `<artifact_root>/<experiment>` with tracking.artifact_root (a
    folder, made absolute here, or a URI as given: file:///..., s3://...), else `local_artifact_location`. A new
    experiment on another database store (postgresql://, mysql://) needs artifact_root: MLflow would put its
    artifacts in ./mlruns of whatever folder the command ran in, where a run or `raysim ui` started in another
    folder, or on another machine, does not look. None: the store's default (a tracking server's own)."""
    from mlflow.store.db.db_types import DATABASE_ENGINES, SQLITE
    from mlflow.utils.uri import get_uri_scheme

    if artifact_root:
        if URI_SCHEME.match(artifact_root):
            return f"{artifact_root.rstrip('/')}/{_folder_name(experiment)}"
        return (Path(artifact_root).expanduser().resolve() / _folder_name(experiment)).as_uri()
    if get_uri_scheme(uri) in DATABASE_ENGINES and get_uri_scheme(uri) != SQLITE:
        raise TrackingError(
            f"tracking.uri {redact(uri)}: a new experiment {experiment!r} on a database store needs "
            "tracking.artifact_root, the folder or URI (s3://...) its artifacts go to (MLflow's default is ./mlruns "
            "of the working folder)"
        )
    return local_artifact_location(uri, experiment)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Inside: no other process is inside for the same local sqlite store. MLflow creates a new sqlite store's tables
    and then migrates them with no lock of its own (its tracking store's constructor), so a second `raysim run`
    started a second after the first found half the tables and failed ("table spans already exists"), and two that
    both found no experiment both created it. An exclusive `flock` on the database's folder, held while the store is
    opened and the experiment looked up or made: nothing is left beside the database, any spelling of its path
    finds the same folder, and the lock goes with a process that dies holding it. Any other store: no lock."""
    database = sqlite_file(uri)
    try:
        folder = os.open(database.resolve().parent, os.O_RDONLY | os.O_DIRECTORY) if database else None
    except OSError:  # a folder that cannot be opened: check_reachable has named a missing one already
        folder = None
    if folder is None:
        yield
        return
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


class TrackingError(RaysimError):
    """The tracking store cannot be reached or used; the message names the (redacted) URI."""


def _auth_headers() -> dict[str, str]:
    """The credentials MLflow itself would send (MLFLOW_TRACKING_TOKEN, or _USERNAME and _PASSWORD)."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user is not None and password is not None:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


def check_reachable(uri: str, timeout_s: float) -> None:
    """Fail within `timeout_s` with one line naming the URI when the tracking store cannot be used, before a
    run starts anything (MLflow's own client retries an unreachable server for minutes). `uri` is the one
    MLflow is given (credentials already moved out of it, see credentials.connect_uri)."""
    parts = urllib.parse.urlsplit(uri)
    shown = redact(uri)
    _check_store_kind(uri, shown)
    if parts.scheme in ("http", "https"):
        query = urllib.parse.urlencode({"experiment_name": "Default"})
        request = urllib.request.Request(
            f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}", headers=_auth_headers()
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return
        except urllib.error.HTTPError as error:
            if error.code == 404 and _is_mlflow_answer(error):
                return  # an MLflow server without that experiment: reachable
            if error.code in (401, 403):
                raise TrackingError(
                    f"tracking.uri {shown}: the server refused the credentials (HTTP {error.code}); give them "
                    "in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
                ) from None
            raise TrackingError(f"tracking.uri {shown}: not an MLflow tracking server (HTTP {error.code})") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise TrackingError(
                f"tracking.uri {shown}: MLflow server not reachable within {timeout_s:g} s ({reason}); start it "
                "(`raysim server`) or fix tracking.uri / $MLFLOW_TRACKING_URI (wait: tracking.connect_timeout_s)"
            ) from None
    elif (database := sqlite_file(uri)) is not None and not database.parent.is_dir():
        raise TrackingError(f"tracking.uri {shown}: folder {database.parent} does not exist")


def _check_store_kind(uri: str, shown: str | None) -> None:
    """Refuse a URI MLflow has no tracking store for (`ftp://`), and a database URI whose driver (the DBAPI
    module SQLAlchemy imports for it) is not installed: MLflow would fail only once the run had started."""
    from mlflow.store.db.db_types import DATABASE_ENGINES, SQLITE
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
    from mlflow.utils.uri import get_uri_scheme

    try:
        _tracking_store_registry.get_store_builder(uri)
    except UnsupportedModelRegistryStoreURIException:
        allowed = ", ".join(sorted(scheme for scheme in _tracking_store_registry._registry if scheme))
        raise TrackingError(
            f"tracking.uri {shown}: MLflow has no tracking store for scheme {get_uri_scheme(uri)!r}; allowed: "
            f"{allowed} (or a plain path)"
        ) from None
    if get_uri_scheme(uri) not in DATABASE_ENGINES or get_uri_scheme(uri) == SQLITE:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        dialect = make_url(uri).get_dialect()
    except (ArgumentError, ImportError) as error:
        raise TrackingError(f"tracking.uri {shown}: not a usable database URL ({error})") from None
    try:
        dialect.import_dbapi()
    except ImportError as error:
        raise TrackingError(
            f"tracking.uri {shown}: its database driver {dialect.driver!r} is not installed ({error}); install it, "
            f"or name an installed one as {dialect.name}+DRIVER://"
        ) from None


def _is_mlflow_answer(error: urllib.error.HTTPError) -> bool:
    try:
        return "error_code" in json.loads(error.read() or b"{}")
    except ValueError:
        return False


@functools.cache
def git_commit() -> str:
    """The commit of the raysim checkout this process runs (once per process: a run of `git` took 12 ms a run)."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class MlflowWriter:
    """Writes one run. Everything after `start` goes through an in-order queue drained by a background
    thread, so a tracking server that is down or slow never stops or slows the rounds: a failed request is
    retried (with backoff) until it succeeds, and before a metric batch is re-sent the writer asks the
    server whether the failed attempt landed after all, so every metric point arrives exactly once."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        retry_max_s: float = 10.0,
        connect_timeout_s: float = 10.0,
        background: bool = False,
        artifact_root: str | None = None,
    ):
        """Checks at once that the store can be reached (`check_reachable`, up to `connect_timeout_s`); then opens
        it and its experiment (a new sqlite store creates its tables: about 1.5 s), with `background` in a thread
        while the caller goes on (a run starts Ray meanwhile): the first use of the store waits for it, and raises
        the TrackingError if opening failed. `artifact_root`: tracking.artifact_root, for an experiment made new
        (`experiment_artifact_location`)."""
        self.tracking_uri = tracking_uri
        """As given (credentials included: other processes of the run connect with it); never shown."""
        from mlflow.tracking import MlflowClient  # here, not in the thread that opens the store with it

        uri = waiting_for_writers(connect_uri(tracking_uri))
        check_reachable(uri, connect_timeout_s)
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None
        self._open_error: TrackingError | None = None
        self._opening = threading.Thread(
            target=self._open, args=(MlflowClient, uri, experiment, artifact_root), name="mlflow-open", daemon=True
        )
        self._opening.start()
        if not background:
            self._ready()
        self.run_id: str | None = None
        self.retry_max_s = retry_max_s
        self.failures = 0
        """Failed requests so far (each was retried)."""
        self._queue: queue.Queue = queue.Queue()
        self._logged: dict[tuple[str, int], Metric] = {}
        """The last metric point logged for each (key, step): a LoggedModel's metrics repeat them exactly (same
        timestamp), so that the run's history, which MLflow also writes them to, keeps one point per step."""
        self._files = tempfile.TemporaryDirectory(prefix="raysim-artifacts-")
        self._thread = threading.Thread(target=self._drain, name="mlflow-writer", daemon=True)
        self._thread.start()

    def _open(self, client_class: type[MlflowClient], uri: str, experiment: str, artifact_root: str | None) -> None:
        """Open the store and the experiment (made if new, its artifacts where `experiment_artifact_location` says,
        tagged as model training), one process at a time per local sqlite store (`store_lock`)."""
        try:
            with store_lock(uri):
                client = client_class(uri)
                found = client.get_experiment_by_name(experiment)
                if found is None:
                    location = experiment_artifact_location(uri, experiment, artifact_root)
                    self._experiment_id = client.create_experiment(experiment, location, tags=EXPERIMENT_KIND)
                else:
                    self._experiment_id = found.experiment_id
                    if not EXPERIMENT_KIND.items() <= found.tags.items():  # made by another tool, or an older raysim
                        for key, value in EXPERIMENT_KIND.items():
                            client.set_experiment_tag(self._experiment_id, key, value)
            self._client = client
        except TrackingError as error:  # a new experiment without its artifact root
            self._open_error = error
        except Exception as error:  # MLflow's errors, and SQLAlchemy's (a sqlite file that is not a database)
            message = redact(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
            self._open_error = TrackingError(f"tracking.uri {self.shown_uri}: {message}")

    def _ready(self) -> None:
        """Wait until the store is open; raise what opening it raised."""
        self._opening.join()
        if self._open_error is not None:
            raise self._open_error

    @property
    def client(self) -> MlflowClient:
        """The MLflow client of the store (waits for it to be open)."""
        self._ready()
        assert self._client is not None  # _open set it, or _ready raised why it could not
        return self._client

    @property
    def experiment_id(self) -> str:
        self._ready()
        assert self._experiment_id is not None  # as the client (see `client`)
        return self._experiment_id

    @property
    def shown_uri(self) -> str:
        """The tracking URI as printed and stored anywhere: credentials redacted."""
        return redact(self.tracking_uri) or ""

    def start(
        self, run_name: str | None, params: Mapping[str, object], tags: dict[str, str], parent: str | None = None
    ) -> str:
        """Create the run; params whose value is None (options left unset) are not logged. Credentials in any
        value (a URI, the command line in `mlflow.source.name`) are redacted, as in every tag set later."""
        if parent:
            tags = {**tags, "mlflow.parentRunId": parent}
        tags = {key: redact_text(str(value)) for key, value in tags.items()}
        from mlflow.entities import Param

        run = self.client.create_run(self.experiment_id, run_name=run_name and redact_text(run_name), tags=tags)
        self.run_id = run.info.run_id
        items = [Param(k, redact_text(str(v))[:6000]) for k, v in params.items() if v is not None]
        for start in range(0, len(items), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS])
        return self.run_id

    def reopen(self, run_id: str) -> None:
        """Continue an existing run (raysim resume, a resumed suite or sweep): it is marked RUNNING again, without
        the `raysim.error` tag that said why it stopped (a run that stops again is tagged anew)."""
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        if "raysim.error" in self.client.get_run(run_id).data.tags:
            self.client.delete_tag(run_id, "raysim.error")

    def _run(self) -> str:
        """The run's id: `start` or `reopen` one first."""
        if self.run_id is None:
            raise RuntimeError("MlflowWriter: no run yet (start or reopen one)")
        return self.run_id

    def last_step(self, key: str) -> int:
        """The highest step logged for `key` (-1 if none): what a resumed run must not log again."""
        return max((m.step for m in self.client.get_metric_history(self._run(), key)), default=-1)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Queue one step's metrics (non-finite values are skipped) in as few requests as allowed."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        items = [Metric(k, float(v), stamp, step) for k, v in metrics.items() if math.isfinite(v)]
        self._logged.update(((item.key, step), item) for item in items)
        for start in range(0, len(items), MAX_METRICS):
            self._queue.put(("metrics", items[start : start + MAX_METRICS]))

    def set_tags(self, tags: dict[str, str]) -> None:
        """Queue tags (credentials in their values redacted)."""
        from mlflow.entities import RunTag

        items = [RunTag(k, redact_text(str(v))) for k, v in tags.items()]
        for start in range(0, len(items), MAX_TAGS):
            self._queue.put(("tags", items[start : start + MAX_TAGS]))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Queue a copy of the file (the caller may delete the original at once)."""
        folder = Path(tempfile.mkdtemp(dir=self._files.name))
        copy = folder / Path(path).name
        shutil.copyfile(path, copy)
        self._queue.put(("artifact", (copy, artifact_path)))

    def log_table(self, path: Path) -> None:
        """Queue a JSON table (raysim.tracking.reports.write_table_json, pandas' `split` layout) as a table of the
        run: `mlflow.log_table`, which the UI's Artifacts tab and `mlflow.load_table` read."""
        data = json.loads(Path(path).read_text())
        self._queue.put(("table", {"data": data, "file": Path(path).name}))

    def log_model(self, folder: Path, name: str, step: int, metrics: Mapping[str, float]) -> None:
        """Queue the MLflow model in `folder` (an MLmodel file and its data: mlflow.pytorch.save_model) as a
        LoggedModel `name` of the run, READY once its files are uploaded (MLmodel last), with the run's params and
        `metrics` at `step` (the run's final ones): the Models column of the runs table, `search_logged_models`,
        and `mlflow.pytorch.load_model("runs:/RUN_ID/NAME")` find it. (What `mlflow.pytorch.log_model` does, through
        this writer's client: the fluent function reads the process's global tracking URI.)"""
        copy = Path(tempfile.mkdtemp(dir=self._files.name)) / name
        shutil.copytree(folder, copy)
        self._queue.put(("model", {"folder": copy, "name": name, "step": step, "metrics": dict(metrics)}))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued has reached the server; False if `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:  # Queue.join's condition, with a deadline: woken by the last task_done
            while self._queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def finish(self, status: str = "FINISHED", timeout: float | None = 600.0) -> None:
        """Mark the run ended (after everything queued before it), wait up to `timeout` s for the queue to
        drain, and stop the writer thread once it has."""
        if self.run_id is not None:
            self._queue.put(("status", status))
        self._queue.put(("stop", None))
        if not self.flush(timeout):
            logging.getLogger(__name__).warning(
                "MLflow at %s unreachable: %d queued requests not sent (tracking.flush_timeout_s=%s)",
                self.shown_uri,
                self._queue.unfinished_tasks,
                timeout,
            )

    def _drain(self) -> None:
        while True:
            kind, payload = self._queue.get()
            if kind == "stop":
                self._queue.task_done()
                self._files.cleanup()
                return
            delay, attempt = 0.2, 0
            while True:
                try:
                    if attempt == 0 or not (kind == "metrics" and self._landed(payload)):
                        self._send(kind, payload)
                    break
                except Exception:  # noqa: BLE001 - any failure of the server or network: retry in order
                    self.failures += 1
                    attempt += 1
                    time.sleep(delay)
                    delay = min(delay * 2, self.retry_max_s)
            self._queue.task_done()

    def _log_table(self, run_id: str, task: dict) -> None:
        """`MlflowClient.log_table` appends to a table file already there: a retry whose file landed before the
        request failed logs no rows again (only what the failed request may have left undone, the run's list of
        tables)."""
        import pandas as pd

        data = task["data"]
        rows = [] if task.get("tried") and self._has_artifact(run_id, task["file"]) else data["data"]
        task["tried"] = True
        self.client.log_table(run_id, pd.DataFrame(rows, columns=data["columns"]), task["file"])

    def _has_artifact(self, run_id: str, path: str) -> bool:
        return any(found.path == path for found in self.client.list_artifacts(run_id))

    def _log_model(self, run_id: str, task: dict) -> None:
        """One LoggedModel from `task` (log_model's); a retry goes on with the model created before it failed."""
        from mlflow.entities import LoggedModelOutput, Metric

        client = self.client
        if "model_id" not in task:
            params = {key: value[:6000] for key, value in client.get_run(run_id).data.params.items()}
            model = client.create_logged_model(self.experiment_id, task["name"], run_id, params=params)
            task["model_id"] = model.model_id
        model_id = task["model_id"]
        client.log_outputs(run_id, [LoggedModelOutput(model_id, task["step"])])
        stamp = int(time.time() * 1000)
        items = []
        for key, value in task["metrics"].items():
            if math.isfinite(value):
                logged = self._logged.get((key, task["step"]))
                same = logged is not None and logged.value == float(value)  # the run's own point, repeated
                at = logged.timestamp if same and logged is not None else stamp
                items.append(Metric(key, float(value), at, task["step"], run_id=run_id, model_id=model_id))
        for start in range(0, len(items), MAX_METRICS):
            client.log_batch(run_id, metrics=items[start : start + MAX_METRICS])
        folder: Path = task["folder"]
        with tempfile.TemporaryDirectory(dir=self._files.name) as last:  # MLmodel last: no half model loads
            shutil.move(folder / "MLmodel", Path(last) / "MLmodel")
            client.log_model_artifacts(model_id, str(folder))
            shutil.copyfile(Path(last) / "MLmodel", folder / "MLmodel")
            client.log_model_artifacts(model_id, last)
        client.finalize_logged_model(model_id, "READY")

    def _landed(self, items: list[Metric]) -> bool:
        """Whether a metric batch whose request failed was stored anyway (a batch is one transaction)."""
        first = items[0]
        return any(
            m.step == first.step and m.timestamp == first.timestamp
            for m in self.client.get_metric_history(self._run(), first.key)
        )

    def _send(self, kind: str, payload) -> None:
        run_id = self._run()
        if kind == "metrics":
            self.client.log_batch(run_id, metrics=payload)
        elif kind == "tags":
            self.client.log_batch(run_id, tags=payload)
        elif kind == "artifact":
            self.client.log_artifact(run_id, str(payload[0]), payload[1])
        elif kind == "table":
            self._log_table(run_id, payload)
        elif kind == "model":
            self._log_model(run_id, payload)
        else:
            self.client.set_terminated(run_id, payload)
