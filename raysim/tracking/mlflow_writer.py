"""The driver's MLflow writer: batched logging through `MlflowClient.log_batch`.

SQLite rejects concurrent writers ("database is locked") and single calls are slow (platform.md), so
exactly one process, the driver, writes, with one `log_batch` per round.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100  # log_batch limits


def resolve_tracking_uri(configured: str | None) -> str:
    """The config's `tracking.uri`, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def git_commit() -> str:
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

    def __init__(self, tracking_uri: str, experiment: str, retry_max_s: float = 10.0):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str | None = None
        self.retry_max_s = retry_max_s
        self.failures = 0
        """Failed requests so far (each was retried)."""
        self._queue: queue.Queue = queue.Queue()
        self._files = tempfile.TemporaryDirectory(prefix="raysim-artifacts-")
        self._thread = threading.Thread(target=self._drain, name="mlflow-writer", daemon=True)
        self._thread.start()

    def start(
        self, run_name: str | None, params: dict[str, object], tags: dict[str, str], parent: str | None = None
    ) -> str:
        if parent:
            tags = {**tags, "mlflow.parentRunId": parent}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS])
        return self.run_id

    def reopen(self, run_id: str) -> None:
        """Continue an existing run (raysim resume): it is marked RUNNING again."""
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")

    def last_step(self, key: str) -> int:
        """The highest step logged for `key` (-1 if none): what a resumed run must not log again."""
        return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Queue one step's metrics (non-finite values are skipped) in as few requests as allowed."""
        stamp = int(time.time() * 1000)
        items = [Metric(k, float(v), stamp, step) for k, v in metrics.items() if math.isfinite(v)]
        for start in range(0, len(items), MAX_METRICS):
            self._queue.put(("metrics", items[start : start + MAX_METRICS]))

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for start in range(0, len(items), MAX_TAGS):
            self._queue.put(("tags", items[start : start + MAX_TAGS]))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Queue a copy of the file (the caller may delete the original at once)."""
        folder = Path(tempfile.mkdtemp(dir=self._files.name))
        copy = folder / Path(path).name
        shutil.copyfile(path, copy)
        self._queue.put(("artifact", (copy, artifact_path)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued has reached the server; False if `timeout` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
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
                self.tracking_uri,
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

    def _landed(self, items: list[Metric]) -> bool:
        """Whether a metric batch whose request failed was stored anyway (a batch is one transaction)."""
        first = items[0]
        return any(
            m.step == first.step and m.timestamp == first.timestamp
            for m in self.client.get_metric_history(self.run_id, first.key)
        )

    def _send(self, kind: str, payload) -> None:
        if kind == "metrics":
            self.client.log_batch(self.run_id, metrics=payload)
        elif kind == "tags":
            self.client.log_batch(self.run_id, tags=payload)
        elif kind == "artifact":
            self.client.log_artifact(self.run_id, str(payload[0]), payload[1])
        else:
            self.client.set_terminated(self.run_id, payload)
