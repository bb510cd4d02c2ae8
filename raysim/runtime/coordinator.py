"""The coordinator actor: holds the server state (the global model) and runs the server step."""

from __future__ import annotations

import torch

from raysim.algorithms import build_algorithm
from raysim.algorithms.base import AlgorithmSettings, Vector
from raysim.runtime.exact_sum import PartialSum
from raysim.runtime.host import ModelSpec


class Coordinator:
    def __init__(
        self,
        algorithm_settings: AlgorithmSettings,
        model_spec: ModelSpec,
        init_params: Vector,
        num_clients: int,
        torch_threads: int = 1,
    ):
        torch.set_num_threads(torch_threads)
        self.model = model_spec.build()
        self.algorithm = build_algorithm(algorithm_settings, self.model.spec)
        self.state = self.algorithm.init_server(init_params, num_clients)

    def broadcast(self) -> object:
        return self.algorithm.broadcast(self.state)

    def aggregate(self, *partials: PartialSum | None) -> dict[str, float]:
        """Merge the hosts' exact partial sums and run the server step; returns its metrics."""
        present = [p for p in partials if p is not None]
        total = present[0]
        for partial in present[1:]:
            total = total + partial
        self.state, metrics = self.algorithm.server_step(self.state, total.decode(), total.count)
        return metrics

    def global_model(self) -> Vector:
        return self.algorithm.global_model(self.state)

    def server_state(self) -> object:
        return self.state
