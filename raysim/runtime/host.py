"""Client-host actors: each owns a fixed, disjoint set of clients and keeps their state across rounds.

One process per client does not scale (about 180 MB per torch process; platform.md), so a small pool
of long-lived hosts each simulates many clients. With `num_hosts` equal to the number of clients this
is one actor per client: same code, different setting. `ClientHost` is a plain class; the driver wraps
it with `ray.remote`, and tests may use it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raysim.algorithms import ClientInfo, build_algorithm, run_client_step
from raysim.algorithms.base import AlgorithmSettings, LocalSGD, SGDResult, Vector
from raysim.data.partitions import ClientSplit
from raysim.data.sources import Task
from raysim.metrics import ClientEvaluation, ModelScores
from raysim.models.flat import FlatModel
from raysim.runtime.exact_sum import PartialSum, encode
from raysim.seeding import Stream, rng
from raysim.training.local import ClientData, LocalTrainer


@dataclass(frozen=True)
class ModelSpec:
    """What a host needs to build the model: name, input shape, outputs, task."""

    name: str
    input_shape: tuple[int, ...]
    outputs: int
    task: Task

    def build(self) -> FlatModel:
        return FlatModel(self.name, self.input_shape, self.outputs, self.task)


class ClientHost:
    """Simulates the clients `clients` (ClientInfo, ClientSplit pairs) of one host."""

    def __init__(
        self,
        algorithm_settings: AlgorithmSettings,
        model_spec: ModelSpec,
        x: np.ndarray,
        y: np.ndarray,
        clients: list[tuple[ClientInfo, ClientSplit]],
        init_params: Vector,
        seed: int,
        torch_threads: int = 1,
    ):
        torch.set_num_threads(torch_threads)
        self.model = model_spec.build()
        self.algorithm = build_algorithm(algorithm_settings, self.model.spec)
        self.trainer = LocalTrainer(self.model)
        self.seed = seed
        self.num_clients = clients[0][0].num_clients if clients else 0
        self.info = {info.id: info for info, _ in clients}
        self.data = {info.id: ClientData(x, y, split.train, split.test, split.val) for info, split in clients}
        self.states = {info.id: self.algorithm.init_client(info, init_params) for info, _ in clients}

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.info)

    def train(self, round_index: int, client_ids: list[int], broadcast: object) -> tuple[PartialSum | None, list[dict]]:
        """Run the client step of each selected client; return the exact sum of their uploads and their metrics."""
        total: PartialSum | None = None
        records: list[dict] = []
        for client_id in sorted(client_ids):
            update = run_client_step(
                self.algorithm,
                self.info[client_id],
                self.states[client_id],
                broadcast,
                self._executor(client_id, round_index),
            )
            self.states[client_id] = update.state
            term = encode(update.upload, self.num_clients, client_id)
            total = term if total is None else total + term
            records.append({"client_id": client_id, **update.metrics})
        return total, records

    def _executor(self, client_id: int, round_index: int):
        """Runs a client's requests with randomness keyed by (seed, client, round, request number)."""
        requests = iter(range(1_000_000))

        def execute(request: LocalSGD) -> SGDResult:
            generator = rng(self.seed, Stream.CLIENT_TRAINING, client_id, round_index, next(requests))
            return self.trainer.sgd(request, self.data[client_id], generator)

        return execute

    def _scores(self, params: Vector, data: ClientData) -> ModelScores:
        test_loss, test_acc = self.model.evaluate(params, *data.arrays("test"))
        train_loss, _ = self.model.evaluate(params, *data.arrays("train"))
        val_acc = self.model.evaluate(params, *data.arrays("val"))[1] if len(data.val) else float("nan")
        return ModelScores(test_acc, test_loss, train_loss, val_acc)

    def evaluate(self, global_params: Vector) -> list[ClientEvaluation]:
        """PM and GM scores of every client of this host."""
        evaluations = []
        for client_id in self.client_ids:
            data = self.data[client_id]
            gm = self._scores(global_params, data)
            personal = self.algorithm.personalized_model(self.states[client_id])
            pm = gm if personal is None else self._scores(personal, data)
            evaluations.append(ClientEvaluation(client_id, pm, gm))
        return evaluations

    def client_states(self, client_ids: list[int] | None = None) -> dict[int, object]:
        """Current state of the given (default: all) clients, for inspection and tests."""
        return {c: self.states[c] for c in (self.client_ids if client_ids is None else client_ids)}
