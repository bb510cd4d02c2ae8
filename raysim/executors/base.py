"""The executor interface and its registry (raysim.executors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from raysim.algorithms.requests import Request, Result
from raysim.execution.stacking import stack, unstack
from raysim.registry import Registry

if TYPE_CHECKING:  # torch loads where an executor is built (a host), not where a config names one
    import torch

    from raysim.models.flat import FlatModel
    from raysim.training.local import ClientData, Draws

Job = tuple[Request, "ClientData", "Draws | None"]
"""One client's request, its data, and the generator of its request number (None: the request draws nothing)."""


@dataclass(frozen=True)
class ExecutorContext:
    """What a host knows when it builds its executor."""

    model: FlatModel
    device: torch.device
    """The host's device: a CUDA device when it has a GPU share (runtime.host_gpus), else the CPU."""
    chunk: int
    """runtime.vectorize_chunk: the most clients an executor that trains several at once may take."""
    train_sizes: tuple[int, ...] | None = None
    """The distinct training-split sizes of the run's clients (the same on every host), when known."""


class Executor:
    """Runs requests; this base runs each one alone on the LocalTrainer, so a subclass overrides only what it
    does differently. A subclass registers under the name runtime.client_training gives it:
    `@EXECUTORS.register("name")`."""

    stacks: ClassVar[bool] = False
    """Whether a chunk of an algorithm that stacks steps as one step over its stacked states (`run_rows`)."""

    def __init__(self, context: ExecutorContext):
        from raysim.training.local import LocalTrainer

        self.context = context
        self.trainer = LocalTrainer(context.model)
        self.clients_at_once = 1
        """The size of a chunk: the clients whose requests come together, in a turn or as rows."""

    def run(self, request: Request, data: ClientData, draws: Draws | None) -> Result:
        """One client's request."""
        return self.trainer.run(request, data, draws)

    def run_turn(self, jobs: Sequence[Job]) -> list[Result]:
        """One request per client of a chunk, results in the same order."""
        return [self.run(*job) for job in jobs]

    def run_rows(self, request: Request, data: Sequence[ClientData], draws: Sequence[Draws | None]) -> Result:
        """A stacked request (row i: client i of the chunk), its stacked result; by default one row at a time."""
        rows = unstack(request, len(data))
        return stack([self.run(*job) for job in zip(rows, data, draws, strict=True)])


EXECUTORS: Registry[type[Executor]] = Registry("executor", "runtime.client_training")


def build_executor(client_training: str, context: ExecutorContext) -> Executor:
    """The executor runtime.client_training names; `auto`: vectorized for a perceptron (batched matrix products
    beat one client at a time there) or on a GPU, else sequential."""
    if client_training == "auto":
        vectorizes = context.model.perceptron or context.device.type == "cuda"
        client_training = "vectorized" if vectorizes else "sequential"
    return EXECUTORS.get(client_training)(context)
