"""Running algorithms' client steps: the drivers of their request generators and the stacked form of a chunk's states.

Between the algorithm interface (raysim.algorithms.interface) and the runtime: it knows no particular algorithm and
nothing of Ray, so a unit test drives a client step with a stand-in for local training exactly as a host drives it
with its trainers (raysim.runtime.steps)."""

from __future__ import annotations

from raysim.execution.drivers import drive, run_client_step, run_client_steps, run_stacked_step
from raysim.execution.stacking import one_row, own_arrays, stack, unstack, unstack_update

__all__ = [
    "drive",
    "one_row",
    "own_arrays",
    "run_client_step",
    "run_client_steps",
    "run_stacked_step",
    "stack",
    "unstack",
    "unstack_update",
]
