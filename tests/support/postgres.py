"""A real PostgreSQL server for tests: Debian's binaries (the Makefile's `tools` installs them), started as their own
user in a temporary data folder on a free port of 127.0.0.1, with password authentication, and stopped and removed
afterwards. As root (a container, CI) the server runs as the `postgres` system user, which PostgreSQL requires (it
refuses to run as root), with a data folder it owns outside pytest's root-only temporary folders.

`LocalPostgres.database(name)` makes an empty MLflow store: a database cloned from one that MLflow created and
migrated once (the migrations take seconds; a clone, a file copy inside PostgreSQL, a fraction of one), and gives
its `postgresql://user:password@127.0.0.1:PORT/name` URI, the form MLflow users write (SQLAlchemy 2.1 reads it with
psycopg 3, the `postgres` extra)."""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.cluster import free_port

USER = "raysim"
TEMPLATE = "mlflow_template"


def postgres_bin() -> Path | None:
    """The folder of Debian's PostgreSQL programs (the newest major version installed), else the one on PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda path: int(path.parts[-3]))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class LocalPostgres:
    """One server: `start()`, then `database(name)` for each store; `stop()` ends it and removes its folder."""

    def __init__(self) -> None:
        binaries = postgres_bin()
        if binaries is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql; `make tools` as root)")
        self.bin = binaries
        self.root = Path(tempfile.mkdtemp(prefix="raysim-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.password = secrets.token_hex(12)
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.log = self.root / "server.log"
        self._as: dict = {}
        """As root: the `postgres` account's user and group for every PostgreSQL process (subprocess's own switch)."""
        if os.getuid() == 0:
            account = pwd.getpwnam("postgres")
            self._as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            os.chown(self.root, account.pw_uid, account.pw_gid)

    def _run(self, *command: str) -> None:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, cwd=self.root, env=self._env(), **self._as
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stdout}{done.stderr}")

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}

    def uri(self, database: str) -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def start(self, timeout_s: float = 120.0) -> LocalPostgres:
        """initdb (superuser `raysim` with a password, scram-sha-256 for every connection), then the server on
        127.0.0.1 only, its socket in its own folder; returns once it accepts connections."""
        secret = self.root / "password"
        secret.write_text(self.password)
        if self._as:
            os.chown(secret, self._as["user"], self._as["group"])
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={secret}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        )
        secret.unlink()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    str(self.bin / "postgres"),
                    *("-D", str(self.data)),
                    *("-h", "127.0.0.1", "-p", str(self.port), "-k", str(self.root)),
                    *("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
                **self._as,
            )
        deadline = time.monotonic() + timeout_s
        while not self._accepts():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        return self

    def _accepts(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.uri("postgres"), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def _execute(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(self.uri("postgres"), autocommit=True) as connection:
            connection.execute(statement)

    def database(self, name: str) -> str:
        """A new, empty MLflow store named `name` (a clone of the migrated template); its URI."""
        if not self._has(TEMPLATE):
            self._execute(f"CREATE DATABASE {TEMPLATE}")
            # MLflow creates and migrates the tables in this process (a process of its own imported MLflow again);
            # its engine's pooled connections, which would keep the template from being cloned, are closed then.
            # MLflow's Default experiment points into this folder, not into the folder the tests started in.
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            SqlAlchemyStore(self.uri(TEMPLATE), (self.root / "mlruns").as_uri()).engine.dispose()
        self._execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return self.uri(name)

    def _has(self, name: str) -> bool:
        import psycopg

        with psycopg.connect(self.uri("postgres")) as connection:
            return connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients disconnected, no checkpoint wait), SIGKILL to what is left after 30 s;
        the data folder removed."""
        if self.process is not None and self.process.poll() is None:
            for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 30)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(wait_s)
                    break
        shutil.rmtree(self.root, ignore_errors=True)
