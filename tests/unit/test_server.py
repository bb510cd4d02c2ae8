"""`raysim server`: a real MLflow tracking server on 127.0.0.1 with a sqlite backend and served artifacts."""

from __future__ import annotations

from pathlib import Path

import pytest

from raysim.tracking.mlflow_writer import MlflowWriter
from raysim.tracking.server import ServerSettings


def test_command_uses_one_worker_and_served_artifacts(tmp_path):
    command = ServerSettings("sqlite:///x.db", str(tmp_path / "a"), "127.0.0.1", 5123).command()
    assert command[command.index("--workers") + 1] == "1"
    assert command[command.index("--artifacts-destination") + 1] == str(tmp_path / "a")
    assert "--serve-artifacts" in command and command[command.index("--host") + 1] == "127.0.0.1"
    assert "--serve-artifacts" not in ServerSettings(artifacts_destination=None).command()


def test_a_local_sqlite_store_keeps_its_artifacts_beside_its_file(tmp_path, monkeypatch):
    """Artifacts of a new experiment go to mlartifacts/<experiment> next to the database, whatever folder the
    command runs in (MLflow's default would be ./mlruns there)."""

    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    writer = MlflowWriter(f"sqlite:///{store / 'runs.db'}", "beside the db")
    run_id = writer.start("r", {}, {})
    note = tmp_path / "note.txt"
    note.write_text("kept")
    writer.log_artifact(note)
    writer.finish()
    kept = store / "mlartifacts" / "beside_the_db" / run_id / "artifacts" / "note.txt"
    assert kept.read_text() == "kept"
    assert list(elsewhere.iterdir()) == []
    assert writer.client.download_artifacts(run_id, "note.txt", str(tmp_path)) == str(tmp_path / "note.txt")


def test_a_backend_with_a_password_reaches_the_server_in_its_environment_not_its_command_line():
    """`ps` shows every user a process's command line; MLflow reads --backend-store-uri from its own variable too."""
    secret = ServerSettings("postgresql://u:pw@db/mlflow")
    assert "--backend-store-uri" not in secret.command() and not [a for a in secret.command() if "pw" in a]
    assert secret.env()["MLFLOW_BACKEND_STORE_URI"] == "postgresql://u:pw@db/mlflow"
    plain = ServerSettings("sqlite:///x.db")
    assert plain.command()[plain.command().index("--backend-store-uri") + 1] == "sqlite:///x.db"
    assert (
        "MLFLOW_BACKEND_STORE_URI" not in plain.env() and plain.env()["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    )


@pytest.mark.parametrize(
    ("uri", "root", "expected"),
    [
        ("postgresql://u:pw@db/m", "runs/art", "{cwd}/runs/art/a_b"),
        ("postgresql://u:pw@db/m", "s3://bucket/raysim/", "s3://bucket/raysim/a_b"),
        ("sqlite:///runs.db", "/srv/art", "/srv/art/a_b"),
        ("sqlite:///runs.db", None, "{cwd}/mlartifacts/a_b"),
        ("http://127.0.0.1:5000", None, None),
        ("http://127.0.0.1:5000", "file:///srv/art", "file:///srv/art/a_b"),
        ("postgresql://u:pw@db/m", None, "refused"),
        ("mysql+pymysql://u@db/m", None, "refused"),
    ],
)
def test_a_new_experiment_keeps_its_artifacts_under_the_named_root(uri, root, expected, tmp_path, monkeypatch):
    """tracking.artifact_root: `<root>/<experiment>` for any store (a folder made absolute); without it, beside a
    sqlite file, the server's own for http://, and refused for another database (MLflow's ./mlruns)."""
    from raysim.tracking.mlflow_writer import TrackingError, experiment_artifact_location

    monkeypatch.chdir(tmp_path)
    if expected == "refused":
        with pytest.raises(
            TrackingError, match=r"^tracking.uri \S+://\*\*\*@db/m: a new experiment 'a b' on a database "
        ):
            experiment_artifact_location(uri, "a b", root)
        return
    located = experiment_artifact_location(uri, "a b", root)
    if expected is not None and "://" not in expected:
        expected = Path(expected.format(cwd=tmp_path.resolve())).as_uri()
    assert located == expected


@pytest.mark.parametrize(
    ("uri", "database"),
    [
        ("sqlite:///runs.db", "runs.db"),
        ("sqlite:////tmp/s/runs.db", "/tmp/s/runs.db"),
        ("sqlite:///sub/runs.db?timeout=30", "sub/runs.db"),
        ("sqlite:///./runs.db", "runs.db"),
        ("sqlite:///:memory:", None),
        ("sqlite://", None),
        ("http://127.0.0.1:5000", None),
        ("postgresql://u@h/db", None),
    ],
)
def test_one_reading_of_a_sqlite_uri_serves_artifacts_sweeps_and_the_reachability_check(
    uri, database, tmp_path, monkeypatch
):
    """The database file of a local sqlite store, as the artifact folder, a sweep's trials (which run in other
    folders: a relative path made absolute, the query kept) and the missing-folder check read it."""
    from raysim.studies.sweep import absolute_tracking_uri
    from raysim.tracking.mlflow_writer import TrackingError, check_reachable, local_artifact_location, sqlite_file

    monkeypatch.chdir(tmp_path)
    assert sqlite_file(uri) == (None if database is None else Path(database))
    located = local_artifact_location(uri, "a b")
    assert located == (None if database is None else (Path(database).resolve().parent / "mlartifacts/a_b").as_uri())
    absolute = absolute_tracking_uri(uri)
    query = uri.partition("?")[2]
    resolved = f"sqlite:///{Path(database).resolve()}" + (f"?{query}" if query else "") if database else None
    assert absolute == (uri if database is None or Path(database).is_absolute() else resolved)
    if database is not None and not Path(database).parent.is_dir():
        with pytest.raises(TrackingError, match="does not exist"):
            check_reachable(uri, 1.0)


@pytest.mark.parametrize(
    ("log", "taken"),
    [
        (
            "ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 5000): address already in use",
            True,
        ),
        ("ModuleNotFoundError: No module named 'mlflow.server'", False),
    ],
)
def test_a_server_whose_log_says_its_port_was_taken_failed_for_its_port_even_when_the_holder_is_gone(
    tmp_path, log, taken
):
    """MLflow exits with code 0 when another process binds its port first; that process may have stopped by the
    time the failure is read (a UI started and stopped beside this one), and the log alone must still say that a
    chosen port should move on rather than fail."""
    from raysim.tracking.server import PortTaken, ServerError, TrackingServer

    path = tmp_path / "server.log"
    path.write_text(
        f"2026/12/06 09:00:40 INFO mlflow.store.db.utils: Creating initial MLflow database tables...\n{log}\n"
    )
    server = TrackingServer(ServerSettings("sqlite:///x.db", None, "127.0.0.1", 1), log_path=path)
    failure = server.failure("exited with code 0")
    assert isinstance(failure, PortTaken) is taken and isinstance(failure, ServerError)
    assert str(failure).startswith("MLflow server on http://127.0.0.1:1 exited with code 0: ")
    assert log.split(":")[-1].strip() in str(failure)
