"""Drive the real host and coordinator classes in one process, without Ray (for the math tests)."""

from __future__ import annotations

import dataclasses

from raysim.config import ExperimentConfig
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.host import ClientHost
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.problem import Problem, prepare, sample_clients


def make_host(config: ExperimentConfig, problem: Problem, clients: list | None = None, **options) -> ClientHost:
    """A ClientHost set up from the config as the driver sets up its actors (all of `problem`'s clients unless
    `clients` is given); `options` override HostSettings fields."""
    settings = HostSettings.from_config(config, problem)
    settings = dataclasses.replace(settings, **options)
    clients = problem.clients if clients is None else clients
    return ClientHost(settings, problem.x, problem.y, clients, problem.init_params)


class InProcess:
    """One ClientHost owning every client plus a Coordinator, stepped round by round."""

    def __init__(self, config: ExperimentConfig, problem: Problem | None = None):
        self.config = config
        self.problem = problem or prepare(config)
        p = self.problem
        self.host = make_host(config, p)
        self.coordinator = Coordinator(CoordinatorSettings.from_config(config, p), p.init_params, p.server_data)

    def round(self, round_index: int, selected: list[int] | None = None) -> dict[str, float]:
        if selected is None:
            m = self.problem.num_training
            selected = sample_clients(
                self.config.seed, round_index, m, self.config.clients.per_round_count(), self.config.clients.sampling
            )
        partial, _records = self.host.train(round_index, selected, self.coordinator.broadcast())
        return self.coordinator.aggregate(partial)

    @property
    def states(self) -> dict[int, object]:
        return self.host.client_states()

    @property
    def server(self) -> object:
        return self.coordinator.server_state()
