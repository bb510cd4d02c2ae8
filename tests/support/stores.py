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
