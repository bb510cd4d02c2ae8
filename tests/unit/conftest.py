"""The unit tier's rule, checked on every test: no Ray, no subprocess (docs/development.md). A test that needs either
belongs in tests/integration or tests/system; here it fails with that line instead of slowing `make check` down."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

platform.processor()  # asks `uname -p` once and keeps it: libraries ask at import (MLflow), which is no test's process
MOVE = "belongs in tests/integration or tests/system, not in the unit tier"


@pytest.fixture(autouse=True)
def no_process_and_no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test that starts a process ({args[0] if args else kwargs.get('args')}) {MOVE}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    ray_before = _ray_up()
    yield
    if _ray_up() and not ray_before:  # a Ray this worker's earlier tests started (ray_local) is not this test's
        raise AssertionError(f"a test that starts Ray {MOVE}")


def _ray_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
