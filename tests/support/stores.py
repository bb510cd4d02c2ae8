"""Fresh MLflow sqlite stores for tests, made by copying one that MLflow initialized.

MLflow makes a new sqlite store by creating its first tables and then running every schema migration since, 1.3 s
of CPU each time (measured on the 2-core machine); hundreds of tests each made one. A copy of an empty store that
MLflow itself initialized, made once per process, is the same store at the cost of a file copy. Tests of what a
user's first run does with no store at all (the README's commands, the pages') still start from nothing."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

_template: Path | None = None


def _empty_store() -> Path:
    global _template
    if _template is None:
        from mlflow.tracking import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="raysim-test-store-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / "mlflow.db"
        MlflowClient(f"sqlite:///{path}").search_experiments()  # MLflow creates and migrates it
        _template = path
    return _template


def fresh_store(path: Path) -> str:
    """The URI of a new, empty sqlite store at `path` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_empty_store(), path)
    return f"sqlite:///{path}"


MEMORY = Path("/dev/shm")
"""Linux's shared-memory tmpfs: a sqlite store there commits without waiting for the disk. MLflow commits every
request (about 9 per matrix cell), and each commit of a store on the disk waits for its fsyncs: 20 ms a commit on the
loaded 2-core machine, 0.4 ms on tmpfs."""
MEMORY_FREE = 2 * 2**30
"""The free space /dev/shm must have to be used (a container's default /dev/shm is 64 MiB; Ray's object store may
live there too)."""


def memory_folder(prefix: str) -> Path | None:
    """A new folder on tmpfs (MEMORY), removed when the process exits; None where the machine has none with
    MEMORY_FREE bytes free (the caller then uses its own folder on the disk)."""
    if not MEMORY.is_dir() or shutil.disk_usage(MEMORY).free < MEMORY_FREE:
        return None
    folder = Path(tempfile.mkdtemp(prefix=f"raysim-{prefix}-", dir=MEMORY))
    atexit.register(shutil.rmtree, folder, True)
    return folder
