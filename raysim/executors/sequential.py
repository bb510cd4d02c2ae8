"""The sequential executor: each client's requests alone, one client after another."""

from __future__ import annotations

from raysim.executors.base import EXECUTORS, Executor


@EXECUTORS.register("sequential")
class Sequential(Executor):
    """Each client's requests alone, one client after another: the reference every executor agrees with."""
