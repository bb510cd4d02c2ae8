"""Client-host actors: each owns a fixed, disjoint set of clients and keeps their state across rounds.

One process per client does not scale (about 180 MB per torch process; platform.md), so a small pool
of long-lived hosts each simulates many clients. With `num_hosts` equal to the number of clients this
is one actor per client: same code, different setting. `ClientHost` is a plain class; the driver wraps
it with `ray.remote`, and tests may use it directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.base import Vector
from raysim.data.partitions import ClientSplit
from raysim.execution.drivers import drive
from raysim.execution.stacking import own_arrays, unstack
from raysim.runtime import checkpoint
from raysim.runtime.exact_sum import PartialSum, UploadRangeError, add_rows, rejection
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.steps import ClientSteps, keep_freed_memory
from raysim.seeding import Stream, rng
from raysim.tracking.metrics import (
    ClientEvaluation,
    ClientRecords,
    ModelScores,
    classification_scores_many,
    evaluation_batch,
)
from raysim.training.local import ClientData

EVALUATION_CLIENTS = 64
"""Clients whose splits the global model scores in one pass (ClientHost.evaluate); memory: their samples."""

SPLITS = ("train", "test", "val")
"""A client's splits, in the order whose position keys a split's access-time draws at an evaluation."""


@dataclass(frozen=True)
class EvaluationData:
    """The samples some clients are scored on at one evaluation, each client's in one block (x, y): its test split,
    its train split when training losses are scored, its val split; `parts` [clients, 3] their sizes."""

    x: list[np.ndarray]
    y: list[np.ndarray]
    parts: np.ndarray
    with_train: bool

    def subset(self, keep: list[int]) -> EvaluationData:
        """The data of the clients at positions `keep`."""
        return EvaluationData([self.x[i] for i in keep], [self.y[i] for i in keep], self.parts[keep], self.with_train)


class ClientHost:
    """Simulates the clients `clients` (ClientInfo, ClientSplit pairs) of one host."""

    def __init__(
        self,
        settings: HostSettings,
        x: np.ndarray,
        y: np.ndarray,
        clients: list[tuple[ClientInfo, ClientSplit]],
        init_params: Vector,
    ):
        """`x`, `y`: the whole dataset as stored (one object-store copy shared by the hosts of a node; rows
        become model input through `settings.inputs`); `clients`: the (ClientInfo, ClientSplit) pairs this host
        owns, all starting from `init_params`."""
        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.model = settings.model.build()
        self.algorithm = build_algorithm(settings.algorithm, self.model.spec)
        self.seed = settings.seed
        self.attack = settings.attack
        self.evaluations = 0
        self.num_clients = clients[0][0].num_clients if clients else 0
        self.info = {info.id: info for info, _ in clients}
        classes = settings.model.outputs
        self.data = {info.id: self._client_data(x, y, info.id, split, classes) for info, split in clients}
        self.steps = ClientSteps(settings, self.model, self.algorithm, self.data, self.info)
        self.states = self.steps.states
        init_params = np.array(init_params)
        init_params.flags.writeable = False  # clients' initial states may share it: a write into one would raise
        for info, _ in clients:  # one at a time: a budgeted store spills while they are made
            self.states[info.id] = self.algorithm.init_client(info, init_params)
        keep_freed_memory()

    def _client_data(self, x: np.ndarray, y: np.ndarray, client_id: int, split: ClientSplit, classes: int):
        """A client's view of the data: its noise, and for a label poisoner random labels (raysim.threats.attacks)."""
        redraw = 0
        if self.attack is not None and self.attack.poisons_labels(client_id):
            if self.attack.settings.labels == "per_access":
                redraw = classes
            else:  # a private copy of y with this client's labels drawn once
                owned = np.concatenate([split.train, split.test, split.val])
                y = self.attack.poisoned_labels(client_id, y, owned, classes)
        return ClientData(
            x, y, split.train, split.test, split.val, split.noise_std, redraw, inputs=self.settings.inputs
        )

    @property
    def client_ids(self) -> list[int]:
        return sorted(self.info)

    def train(
        self, round_index: int, client_ids: list[int], broadcast: object
    ) -> tuple[PartialSum | None, pa.RecordBatch]:
        """Run the client step of each selected client, a chunk at a time; return the exact sum of their uploads
        and their records (ClientRecords: bytes sent and the steps' metrics as columns)."""
        total: PartialSum | None = None
        records = ClientRecords()
        for chunk in self.steps.chunks(round_index, client_ids, broadcast):
            ids, update = chunk.ids, chunk.update
            if self.settings.send_messages or any(self.steps.byzantine(c) for c in ids):
                # each upload on its own: forged by an attacker, or its message kept for robust aggregation
                total, rejected, uploads = self.steps.add_one_by_one(total, round_index, ids, update, broadcast)
            else:
                total, rejected = add_rows(total, update.upload, ids, self.num_clients)
                uploads = unstack(update.upload, len(ids))
            kept = np.array([c not in rejected for c in ids])
            if rejected and self.settings.on_nonfinite != "drop_client":
                position = ids.index(rejected[0])
                reason = rejection(uploads[position], self.num_clients, ids[position])
                raise UploadRangeError(f"round {round_index}: {reason}")
            chunk.commit(kept)  # on_nonfinite = drop_client: a dropped client keeps its state, as if not selected
            if rejected:
                records.add(rejected, np.zeros(len(rejected)), dropped=True)
            uplink = [float(self.algorithm.uplink_bytes(u)) for u, ok in zip(uploads, kept, strict=True) if ok]
            metrics = {name: np.broadcast_to(values, (len(ids),))[kept] for name, values in update.metrics.items()}
            records.add([c for c, ok in zip(ids, kept, strict=True) if ok], uplink, metrics)
        return total, records.batch()

    def _evaluation_data(self, client_ids: list[int], with_train: bool) -> EvaluationData:
        """The clients' splits as they see them at this evaluation: the samples of every client without per-access
        randomness read (and normalized) in one call; a client with it draws its noise and labels afresh, keyed by
        the evaluation count and split, so that every model it scores sees the same draw."""
        names = ("test", "train", "val") if with_train else ("test", "val")
        parts = np.zeros((len(client_ids), 3), np.int64)
        xs: list[np.ndarray] = [np.zeros(0)] * len(client_ids)
        ys: list[np.ndarray] = [np.zeros(0)] * len(client_ids)
        plain: dict[int, np.ndarray] = {}
        for position, client_id in enumerate(client_ids):
            data = self.data[client_id]
            parts[position] = [len(data.test), len(data.train) if with_train else 0, len(data.val)]
            if not data.redrawn:  # nothing to draw: no generator to make (10,000 clients make 30,000 of them)
                plain[position] = np.concatenate([getattr(data, name) for name in names])
                ys[position] = data.y[plain[position]]
                continue
            drawn = [
                data.arrays(name, rng(self.seed, Stream.DATA_NOISE, client_id, self.evaluations, SPLITS.index(name)))
                for name in names
            ]
            xs[position] = np.concatenate([x for x, _ in drawn])
            ys[position] = np.concatenate([y for _, y in drawn])
        if plain:  # one read of the stored rows for all of them (one dataset, one normalization on a host)
            data = self.data[client_ids[next(iter(plain))]]
            rows = data.inputs.rows(data.x, np.concatenate(list(plain.values())))
            blocks = np.split(rows, np.cumsum([len(indices) for indices in plain.values()])[:-1])
            for position, block in zip(plain, blocks, strict=True):
                xs[position] = block
        return EvaluationData(xs, ys, parts, with_train)

    def _scores(self, params: Vector | list[Vector], data: EvaluationData) -> list[ModelScores]:
        """The scores on each client's splits of one model shared by all (a vector: FlatModel.sample_scores_many) or
        of each client's own (a list, one per client: FlatModel.sample_scores_each): every sample of every split in
        one pass per model; the training loss only where the train split is scored (else NaN)."""
        model, classifier = self.model, self.model.task == "classification"
        groups = list(zip(data.x, data.y, strict=True))
        if isinstance(params, list):
            samples = model.sample_scores_each(params, groups, keep_outputs=classifier)
        else:
            samples = model.sample_scores_many(params, groups, keep_outputs=classifier)
        scores = model.group_scores(samples, data.parts.reshape(-1), self.settings.loss_sum_batch, classifier)
        tests, trains, vals = scores[0::3], scores[1::3], scores[2::3]
        f1_auc = [(float("nan"), float("nan"))] * len(groups)
        if classifier and groups:
            f1_auc = classification_scores_many(
                np.concatenate([test.outputs for test in tests]),  # type: ignore[misc]
                np.concatenate([y[:size] for y, size in zip(data.y, data.parts[:, 0], strict=True)]),
                data.parts[:, 0].tolist(),
                self.settings.auc_single_label,
            )
        return [
            ModelScores(
                test.accuracy,
                test.loss,
                train.loss if data.with_train else float("nan"),
                val.accuracy if size else float("nan"),
                f1,
                auc,
                test.loss_sum,
            )
            for test, train, val, size, (f1, auc) in zip(tests, trains, vals, data.parts[:, 2], f1_auc, strict=True)
        ]

    def evaluate(self, global_params: Vector) -> pa.RecordBatch:
        """PM, GM (and the algorithm's extra models') scores of every client of this host as columns
        (raysim.tracking.metrics.evaluation_batch), EVALUATION_CLIENTS clients at a time: the GM, shared by all,
        scores their splits in shared passes, and their own models (PMs, extra models) score each its own split in
        batched passes."""
        self.evaluations += 1
        every = self.settings.train_loss_every
        with_train = bool(every) and (self.evaluations - 1) % every == 0
        evaluations = []
        ids = self.client_ids
        for begin in range(0, len(ids), EVALUATION_CLIENTS):
            chunk = ids[begin : begin + EVALUATION_CLIENTS]
            splits = self._evaluation_data(chunk, with_train)
            gms = self._scores(global_params, splits)
            states = {c: self.states[c] for c in chunk}  # each read once (a spilled state comes from disk)
            pms = self._own_scores({c: self._personal_model(c, states[c], global_params) for c in chunk}, chunk, splits)
            models = {c: self.algorithm.extra_models(states[c], global_params) for c in chunk}
            names = sorted({name for extra in models.values() for name in extra})
            extras = {name: self._own_scores({c: models[c].get(name) for c in chunk}, chunk, splits) for name in names}
            for client_id, gm in zip(chunk, gms, strict=True):
                extra = {name: extras[name][client_id] for name in names if client_id in extras[name]}
                evaluations.append(ClientEvaluation(client_id, pms.get(client_id, gm), gm, extra))
        return evaluation_batch(evaluations)

    def _personal_model(self, client_id: int, state: Any, global_params: Vector) -> Vector | None:
        """The PM a client deploys now (None: the global model). A held-out (target) client is adapted from the
        global model at this evaluation (Algorithm.adapt)."""
        if not self.info[client_id].heldout:
            return self.algorithm.evaluated_model(state, global_params)
        adaptation = self.algorithm.adapt(self.info[client_id], global_params)
        execute = self.steps.executor(client_id, self.evaluations, Stream.ADAPTATION)
        return None if adaptation is None else drive(adaptation, execute)

    def _own_scores(
        self, models: dict[int, Vector | None], chunk: list[int], splits: EvaluationData
    ) -> dict[int, ModelScores]:
        """The scores of the clients' own models (None: the client has none) on their own splits."""
        having = [i for i, c in enumerate(chunk) if models[c] is not None]
        scores = self._scores([models[chunk[i]] for i in having], splits.subset(having))  # type: ignore[misc]
        return {chunk[i]: score for i, score in zip(having, scores, strict=True)}

    def save_checkpoint(self, path: str) -> str | None:
        """Write this host's clients' persistent state (states, Byzantine messages sent, evaluation count) to
        one .npz file; hosts write in parallel, nothing goes through the driver. States are streamed to the
        file one by one (spilled ones read back one at a time). A failure to write: its one line."""
        tree = {"states": self.states, "sent": dict(self.steps.sent), "evaluations": self.evaluations}
        return checkpoint.write_tree(path, tree)

    def restore_checkpoint(self, directory: str) -> None:
        """Take this host's clients' state from a checkpoint folder (any number of hosts may have written it),
        decoding one client's state at a time."""
        owned = set(self.client_ids)
        found: set[int] = set()
        for path in sorted(Path(directory).glob("host-*.npz")):
            with checkpoint.TreeFile(path) as tree:
                parts = dict(tree.entries(tree.structure))
                for client_id, node in tree.entries(parts["states"]):
                    if client_id in owned:
                        self.states[client_id] = tree.decode(node)
                        found.add(client_id)
                self.steps.sent.update({c: m for c, m in tree.decode(parts["sent"]).items() if c in owned})
                self.evaluations = tree.decode(parts["evaluations"])
        if found != owned:
            raise checkpoint.CheckpointError(f"{directory}: no state for clients {sorted(owned - found)[:10]}")

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()

    def client_states(self, client_ids: list[int] | None = None) -> dict[int, object]:
        """A copy of the current state of the given (default: all) clients, for inspection and tests (all in memory
        at once; copies, as a table's rows change in place)."""
        return {c: own_arrays(self.states[c]) for c in (self.client_ids if client_ids is None else client_ids)}

    def state_memory(self) -> dict[str, float]:
        """Where this host's client states are (runtime.state_memory_mb): clients spilled to disk, bytes in
        memory and on disk; empty without a budget."""
        stats = self.states.stats()
        if stats is None:
            return {}
        return {
            "state/spilled_clients": float(stats.spilled),
            "state/memory_bytes": float(stats.memory_bytes),
            "state/disk_bytes": float(stats.disk_bytes),
        }

    def close(self) -> None:
        """Remove the spilled client state (the driver calls this before it ends the actor, which skips
        Python's cleanup); the host holds no client state afterwards."""
        self.states.close()
