"""The pieces of three one-line failures (issue 51, section 2; the real processes are
tests/system/test_one_line_failures.py): the line a local Ray that did not start ends with and the logs folder it
names, a plugin's failure found in the error Ray hands the driver, and the lock under which a sqlite store opens."""

from __future__ import annotations

import fcntl
import os
import pickle
import threading
import time
import traceback
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError, RaySystemError, RayTaskError

from raysim.plugins import PluginError, _arrive, failed_in_worker, import_in_worker
from raysim.runtime.session import _start_failure, ray_logs
from raysim.tracking.mlflow_writer import store_lock

FAILING = "raise ImportError(\"No module named 'lab_secrets'\")\n"


def session(temp: Path, name: str, age_s: float) -> Path:
    folder = temp / "ray" / name
    (folder / "logs").mkdir(parents=True)
    stamp = time.time() - age_s
    os.utime(folder, (stamp, stamp))
    return folder


def test_ray_logs_is_the_newest_session_of_this_process_never_another_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_logs() == f"none written (Ray's temp folder: {tmp_path / 'ray'})"
    session(tmp_path, f"session_2026-01-01_10-00-00_000001_{os.getpid()}", 60)
    newest = session(tmp_path, f"session_2026-01-01_10-01-00_000001_{os.getpid()}", 30)
    session(tmp_path, f"session_2026-01-01_10-02-00_000001_{os.getpid() + 1}", 0)  # another process's, newer
    assert ray_logs() == str(newest / "logs")


def test_a_start_that_failed_is_one_line_with_what_ray_said_the_tries_and_the_logs(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    logs = session(tmp_path, f"session_2026-01-01_10-00-00_000001_{os.getpid()}", 0) / "logs"
    deep = OSError("validate_socket_filename failed: AF_UNIX path length cannot exceed 107 bytes: /t/s/plasma_store")
    assert str(_start_failure(deep, 1)) == (
        "the local Ray did not start: OSError: validate_socket_filename failed: AF_UNIX path length cannot exceed "
        f"107 bytes: /t/s/plasma_store (set RAY_TMPDIR to a shorter folder); Ray's logs: {logs}"
    )
    slow = Exception("The current node timed out during startup. This could happen because...\nsecond line")
    assert str(_start_failure(slow, 3)) == (
        "the local Ray did not start in 3 tries: Exception: The current node timed out during startup. This could "
        f"happen because...; Ray's logs: {logs}"
    )
    assert str(_start_failure(RuntimeError(), 1)) == f"the local Ray did not start: RuntimeError; Ray's logs: {logs}"


def worker_error(plugin: Path) -> ActorDiedError:
    """The error the driver gets when an actor's worker could not import `plugin`, built as Ray builds it: `_arrive`
    raises while Ray reads the actor's arguments, Ray's deserializer keeps the exception and its traceback in a
    RaySystemError, the creation task fails with it, and the actor dies of that."""
    try:
        _arrive([str(plugin)], pickle.dumps(1))
    except PluginError as error:
        system = RaySystemError(error, traceback.format_exc())
    header = "At least one of the input arguments for this task could not be computed:"
    task = RayTaskError("ClientHost.__init__", f"{header}\n{system}", system, "ray::ClientHost", 12, "10.0.0.2")
    return ActorDiedError(task)


def test_a_plugin_that_failed_in_an_actors_worker_is_found_in_rays_error(tmp_path):
    plugin = tmp_path / "driver_only_a.py"
    plugin.write_text(FAILING)
    expected = f"plugin {plugin}: ImportError: No module named 'lab_secrets'"
    error = worker_error(plugin)
    assert "Traceback" in str(error) and failed_in_worker(error) == expected
    assert failed_in_worker(RuntimeError(f"raysim.plugins.PluginError: {expected}")) is None  # not Ray's error
    other = RayTaskError("f", "Traceback (most recent call last):\nValueError: x", ValueError("x"), "t", 1, "h")
    assert failed_in_worker(ActorDiedError(other)) is None


def test_the_workers_check_returns_the_failure_as_a_line_instead_of_raising(tmp_path):
    plugin = tmp_path / "driver_only_b.py"
    plugin.write_text(FAILING)
    assert import_in_worker([str(plugin)]) == f"plugin {plugin}: ImportError: No module named 'lab_secrets'"
    assert import_in_worker([]) is None


def held(folder: Path) -> bool:
    """Whether another open file holds the lock on `folder` (flock locks belong to an open file, so a second open in
    this process sees them as another process would)."""
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(handle)
    return False


def test_a_sqlite_store_is_opened_under_one_lock_whatever_the_spelling_of_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    relative, absolute = "sqlite:///mlflow.db", f"sqlite:///{tmp_path / 'sub' / '..' / 'mlflow.db'}"
    order: list[str] = []
    with store_lock(relative):
        assert held(tmp_path)

        def second() -> None:
            with store_lock(absolute):
                order.append("second")

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and order == []  # waits for the first
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"] and not held(tmp_path)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "sqlite://", "sqlite:///:memory:", "sqlite:///gone/x.db"])
def test_other_stores_and_a_missing_folder_take_no_lock(tmp_path, monkeypatch, uri):
    monkeypatch.chdir(tmp_path)
    with store_lock(uri):
        assert not held(tmp_path)


def test_a_sqlite_file_that_is_not_a_database_is_one_line_naming_the_uri(tmp_path):
    """SQLAlchemy's error escaped the store's opening thread (a traceback, then an AssertionError's)."""
    from raysim.tracking.mlflow_writer import MlflowWriter, TrackingError

    path = tmp_path / "mlflow.db"
    path.write_text("notes, not a database\n" * 100)
    with pytest.raises(TrackingError) as refused:
        MlflowWriter(f"sqlite:///{path}", "tests")
    assert str(refused.value) == f"tracking.uri sqlite:///{path}: (sqlite3.DatabaseError) file is not a database"
