"""The vectorized executor: a chunk of clients' local SGD trained together (raysim.training.vectorized)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from raysim.algorithms.requests import BatchGradients, LocalSGD, Request, Result
from raysim.executors.base import EXECUTORS, Executor, ExecutorContext, Job

if TYPE_CHECKING:
    from raysim.training.local import ClientData, Draws
    from raysim.training.vectorized import SGDJob


@EXECUTORS.register("vectorized")
class Vectorized(Executor):
    """The LocalSGD (and mini-batch gradient) requests of up to `vectorize_chunk` clients trained together, as
    batched matrix products (perceptrons) or through vmap; other requests one at a time. A model it cannot batch
    (dropout) falls back to one client at a time, said once in the log (VectorizedTrainer.unavailable)."""

    stacks = True

    def __init__(self, context: ExecutorContext):
        from raysim.training.vectorized import VectorizedTrainer

        super().__init__(context)
        self.vectorized = VectorizedTrainer(context.model, context.chunk, context.device, context.train_sizes)
        self.clients_at_once = context.chunk

    def run_turn(self, jobs: Sequence[Job]) -> list[Result]:
        results: dict[int, Result] = {}
        positions: list[int] = []
        training: list[SGDJob] = []
        for position, (request, data, draws) in enumerate(jobs):
            if isinstance(request, LocalSGD) and draws is not None:  # SGD always draws (draws_randomness)
                positions.append(position)
                training.append((request, data, draws))
            else:
                results[position] = self.run(request, data, draws)
        for position, result in zip(positions, self.vectorized.sgd(training), strict=True):
            results[position] = result
        return [results[position] for position in range(len(jobs))]

    def run_rows(self, request: Request, data: Sequence[ClientData], draws: Sequence[Draws | None]) -> Result:
        drawn = [generator for generator in draws if generator is not None]
        if isinstance(request, LocalSGD) and len(drawn) == len(data):
            return self.vectorized.sgd_rows(request, data, drawn)
        if isinstance(request, BatchGradients) and len(drawn) == len(data):
            return self.vectorized.batch_gradients_rows(request, data, drawn)
        return super().run_rows(request, data, draws)
