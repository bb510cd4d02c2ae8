"""Client-host actors: each owns a fixed, disjoint set of clients and keeps their state across rounds.

One process per client does not scale (about 180 MB per torch process; platform.md), so a small pool
of long-lived hosts each simulates many clients. With `num_hosts` equal to the number of clients this
is one actor per client: same code, different setting. `ClientHost` is a plain class; the driver wraps
it with `ray.remote`, and tests may use it directly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.interface import FeatureData
from raysim.algorithms.requests import Vector
from raysim.data.partitions import ClientSplit
from raysim.evaluation.clients import SPLITS, ClientScorer, EvaluationData, evaluation_data
from raysim.evaluation.columns import ClientRecords, evaluation_batch
from raysim.evaluation.records import ClientEvaluation, ModelScores
from raysim.evaluation.sampling import evaluation_sample
from raysim.execution.drivers import drive
from raysim.execution.stacking import own_arrays, unstack
from raysim.runtime import checkpoint
from raysim.runtime.crews import Renewable
from raysim.runtime.exact_sum import PartialSum, UploadRangeError, add_rows, rejection
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.state_columns import ClientColumns, ColumnStates
from raysim.runtime.steps import ClientSteps, keep_freed_memory
from raysim.seeding import Stream, rng, use_kernels
from raysim.training.local import ClientData

EVALUATION_CLIENTS = 64
"""Clients whose splits the global model scores in one pass (ClientHost.evaluate); memory: their samples."""


class ClientDataMap(Mapping[int, ClientData]):
    """Client id -> the client's view of the data (ClientData), made when first asked for and kept: a host that may
    be dealt any client (a shared state store) builds only the views of the clients it trains or evaluates."""

    def __init__(self, make: Callable[[int], ClientData], clients: Mapping[int, Any]):
        self.make = make
        self.clients = clients
        self.made: dict[int, ClientData] = {}

    def __getitem__(self, client_id: int) -> ClientData:
        data = self.made.get(client_id)
        if data is None:
            if client_id not in self.clients:
                raise KeyError(client_id)
            data = self.made[client_id] = self.make(client_id)
        return data

    def __iter__(self) -> Iterator[int]:
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)


class ClientHost(Renewable):
    """Simulates the clients `clients` (ClientInfo, ClientSplit pairs) of one host."""

    def __init__(
        self,
        settings: HostSettings,
        x: np.ndarray,
        y: np.ndarray,
        clients: list[tuple[ClientInfo, ClientSplit]],
        init_params: Vector,
        owned: list[int] | None = None,
    ):
        """`x`, `y`: the whole dataset as stored (one object-store copy shared by the hosts of a node; rows
        become model input through `settings.inputs`); `clients`: the (ClientInfo, ClientSplit) pairs this host
        can train, all starting from `init_params`; `owned`: those it evaluates and checkpoints (default: all).
        With a shared state store (settings.state_folder) a host is given every client and trains those a round
        deals it; their states are the store's, made on first use."""
        torch.set_num_threads(settings.torch_threads)
        use_kernels(settings.deterministic)
        self.settings = settings
        self.model = settings.model.build()
        self.algorithm = build_algorithm(settings.algorithm, self.model.spec)
        self.seed = settings.seed
        self.attack = settings.attack
        self.evaluations = 0
        self.train_seconds = 0.0
        """Seconds the last `train` took (the round's per-host busy time)."""
        self.num_clients = clients[0][0].num_clients if clients else 0
        infos = clients.infos() if isinstance(clients, ClientColumns) else [info for info, _ in clients]
        self.info = {info.id: info for info in infos}
        self.owned = sorted(self.info) if owned is None else sorted(owned)
        sample = evaluation_sample(settings.seed, self.num_clients, settings.eval_sample)
        scored = set(sample.tolist()) if sample is not None else None
        self.scored = [c for c in self.owned if scored is None or c in scored or c >= self.num_clients]
        """The clients of this host an evaluation scores (tracking.eval_sample: the sample and the held-out ones)."""
        classes = settings.model.outputs
        split = clients.split if isinstance(clients, ClientColumns) else {i.id: s for i, s in clients}.__getitem__
        self.data = ClientDataMap(lambda c: self._client_data(x, y, c, split(c), classes), self.info)
        init_params = np.array(init_params)
        init_params.flags.writeable = False  # clients' initial states may share it: a write into one would raise
        shared = None
        if settings.state_folder is not None and clients:
            first = clients[0][0]

            def initial(client_id: int) -> Any:
                return self.algorithm.init_client(self.info[client_id], init_params)

            rows = max(self.info) + 1  # every client's, held-out ones (ids m and past) too: each host has them all
            shared = ColumnStates(settings.state_folder, rows, initial(first.id), initial)
        self.steps = ClientSteps(settings, self.model, self.algorithm, self.data, self.info, shared)
        self.states = self.steps.states
        if shared is None:
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
        """The clients this host evaluates and checkpoints."""
        return self.owned

    def train(
        self, round_index: int, client_ids: list[int], broadcast: object
    ) -> tuple[PartialSum | None, pa.RecordBatch]:
        """Run the client step of each selected client, a chunk at a time; return the exact sum of their uploads
        and their records (ClientRecords: bytes sent and the steps' metrics as columns)."""
        start = time.perf_counter()
        try:
            return self._train(round_index, client_ids, broadcast)
        finally:
            self.train_seconds = time.perf_counter() - start

    def clients_at_once(self) -> int:
        """The clients this host's executor steps at once (its chunk: raysim.runtime.simulation.deal deals them)."""
        return self.steps.executor.clients_at_once

    def last_train_seconds(self) -> float:
        """Seconds the last `train` took: the driver's per-host busy time of a round."""
        return self.train_seconds

    def _train(
        self, round_index: int, client_ids: list[int], broadcast: object
    ) -> tuple[PartialSum | None, pa.RecordBatch]:
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

    def evaluate(self, global_params: Vector, context: Any = None) -> pa.RecordBatch:
        """PM, GM (and the algorithm's extra models', given the server's `context`: Algorithm.evaluation_context)
        scores of every client of this host (those in the run's evaluation sample, tracking.eval_sample) as columns
        (raysim.evaluation.columns.evaluation_batch), EVALUATION_CLIENTS clients at a time: the GM, shared by all,
        scores their splits in shared passes, and their own models (PMs, extra models) score each its own split in
        batched passes."""
        self.evaluations += 1
        every = self.settings.train_loss_every
        with_train = bool(every) and (self.evaluations - 1) % every == 0
        evaluations = []
        ids = self.scored
        scorer = ClientScorer(
            self.model, self.settings.loss_sum_batch, self.settings.auc_single_label, self.settings.train_loss_unit
        )
        network = self.algorithm.personalized_network()  # PMs that are not the network's parameters
        personal = scorer if network is None else dataclasses.replace(scorer, model=self.model.composed(network))
        for begin in range(0, len(ids), EVALUATION_CLIENTS):
            chunk = ids[begin : begin + EVALUATION_CLIENTS]
            splits = evaluation_data(self.data, chunk, with_train, self.seed, self.evaluations)
            gms = scorer.scores(global_params, splits)
            states = {c: self.states[c] for c in chunk}  # each read once (a spilled state comes from disk)
            if self.algorithm.scores_from_features:  # PMs whose outputs the algorithm computes from features
                pms = self._feature_scores(scorer, chunk, states, splits, global_params, context)
            else:
                pms = personal.own_scores(
                    {c: self._personal_model(c, states[c], global_params, context) for c in chunk}, chunk, splits
                )
            models = {c: self.algorithm.extra_models(states[c], global_params, context) for c in chunk}
            names = sorted({name for extra in models.values() for name in extra})
            extras = {name: scorer.own_scores({c: models[c].get(name) for c in chunk}, chunk, splits) for name in names}
            for client_id, gm in zip(chunk, gms, strict=True):
                extra = {name: extras[name][client_id] for name in names if client_id in extras[name]}
                evaluations.append(ClientEvaluation(client_id, pms.get(client_id, gm), gm, extra))
        return evaluation_batch(evaluations)

    def _feature_scores(
        self,
        scorer: ClientScorer,
        chunk: list[int],
        states: dict[int, Any],
        splits: EvaluationData,
        global_params: Vector,
        context: Any,
    ) -> dict[int, ModelScores]:
        """The scores of the PMs of an algorithm that `scores_from_features` (Algorithm.feature_outputs): the global
        model's features of each client's training split (drawn as the evaluation draws it) and its features and
        logits on the client's evaluation block, handed to the algorithm as numpy arrays."""
        point = torch.tensor(np.asarray(global_params), dtype=torch.float32)  # a copy: the vector may be read-only
        outputs = []
        for position, client_id in enumerate(chunk):
            data = self.data[client_id]
            draws = rng(self.seed, Stream.DATA_NOISE, client_id, self.evaluations, SPLITS.index("train"))
            memory_x, memory_y = data.arrays("train", draws if data.redrawn else None)
            memory, _ = self._features(point, memory_x)
            features, logits = self._features(point, splits.x[position])
            draws = rng(self.seed, Stream.ADAPTATION, client_id, self.evaluations)
            feature_data = FeatureData(memory, memory_y, features, logits, draws)
            info = self.info[client_id]
            outputs.append(self.algorithm.feature_outputs(info, states[client_id], feature_data, context))
        return dict(zip(chunk, scorer.output_scores(outputs, splits), strict=True))

    @torch.no_grad()
    def _features(self, point: torch.Tensor, x: np.ndarray, rows: int = 2048) -> tuple[np.ndarray, np.ndarray]:
        """(features [n, d], logits [n, C]) of the network at `point` on `x`, `rows` samples a pass."""
        width, classes = self.model.spec.feature_dim, self.model.head.out_features
        features, logits = np.zeros((len(x), width), np.float32), np.zeros((len(x), classes), np.float32)
        for begin in range(0, len(x), rows):
            block = slice(begin, begin + rows)
            z, g = self.model.features(point, torch.from_numpy(np.array(x[block], np.float32)))
            features[block], logits[block] = z.reshape(len(z), -1).numpy(), g.numpy()
        return features, logits

    def personalized_models(
        self, global_params: Vector, context: Any = None, client_ids: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(client ids, float32 rows [clients x parameters]) of this host's clients in id order (`client_ids`: those
        of them, in their order; the driver asks a block at a time): the model each was
        scored with at the last evaluation (`evaluate`, given its `global_params` and `context`), for the run's saved
        models (tracking.save_models = all). A client without a PM (FedAvg's, or a held-out one that is not adapted)
        gets the global model it is scored with; a held-out client is adapted as at the last evaluation (the same
        stream). With a personalized network (FedCP) the rows are its vectors, and a client scored with the global
        model then (a held-out one) is left out: its model is the global one. Read one state at a time."""
        ids, rows = [], []
        for client_id, row in self._personalized_rows(global_params, context, client_ids):
            ids.append(client_id)
            rows.append(row)
        params = np.stack(rows) if rows else np.zeros((0, self._model_width(global_params)), np.float32)
        return np.asarray(ids, dtype=np.int64), params

    def write_personalized_models(
        self, global_params: Vector, context: Any, path: str
    ) -> tuple[np.ndarray, int] | None:
        """`personalized_models` of all this host's clients written to the file `path` (raw float32 rows, C order,
        one row at a time) instead of returned: a host on the driver's node hands the rows over through the disk, as
        Ray's object store would count a returned block's shared pages in both this host's and the driver's RSS
        (issue 49). Returns (client ids in the rows' order, row width), or None when `path`'s folder is not
        there (another file system: the driver asks for blocks instead)."""
        target = Path(path)
        if not target.parent.is_dir():
            return None
        ids = []
        with target.open("wb") as rows_file:
            for client_id, row in self._personalized_rows(global_params, context, None):
                ids.append(client_id)
                rows_file.write(row.data)
        return np.asarray(ids, dtype=np.int64), self._model_width(global_params)

    def node_id(self) -> str | None:
        """The Ray node this host runs on; None outside Ray (an in-process host runs in the driver)."""
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def _model_width(self, global_params: Vector) -> int:
        """Parameters of a client's saved model: the global model's, or the personalized network's (FedCP)."""
        network = self.algorithm.personalized_network()
        return len(global_params) if network is None else self.model.composed(network).size

    def _personalized_rows(
        self, global_params: Vector, context: Any, client_ids: Sequence[int] | None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """(client id, float32 row) of each of `client_ids` (default: all, in id order) that has a saved model
        (`personalized_models`), one state read at a time."""
        width = self._model_width(global_params)
        for client_id in self.client_ids if client_ids is None else client_ids:
            model = self._personal_model(client_id, self.states[client_id], global_params, context)
            row = np.ascontiguousarray(global_params if model is None else model, dtype=np.float32).reshape(-1)
            if row.size == width:
                yield client_id, row

    def _personal_model(self, client_id: int, state: Any, global_params: Vector, context: Any) -> Vector | None:
        """The PM a client deploys now (None: the global model); a vector of the algorithm's personalized network
        when it has one (Algorithm.composed_model). A held-out (target) client is adapted from the global model at
        this evaluation (Algorithm.adapt)."""
        if not self.info[client_id].heldout:
            if self.algorithm.personalized_network() is not None:
                return self.algorithm.composed_model(state, global_params, context)
            return self.algorithm.evaluated_model(state, global_params)
        adaptation = self.algorithm.adapt(self.info[client_id], global_params)
        execute = self.steps.client_executor(client_id, self.evaluations, Stream.ADAPTATION)
        return None if adaptation is None else drive(adaptation, execute)

    def save_checkpoint(self, path: str, snapshot: str | None = None) -> str | None:
        """Write this host's clients' persistent state (states, Byzantine messages sent, evaluation count) to
        one .npz file; hosts write in parallel, nothing goes through the driver. States are streamed to the
        file one by one (spilled ones read back one at a time). With a shared state store the states are not in
        it: the host asked (`snapshot`, the checkpoint's folder) writes the store's snapshot there
        (ColumnStates.snapshot). A failure to write: its one line."""
        shared = isinstance(self.states, ColumnStates)
        tree = {
            **({} if shared else {"states": self.states}),
            "sent": dict(self.steps.sent),
            "evaluations": self.evaluations,
        }
        if shared and snapshot is not None:
            assert isinstance(self.states, ColumnStates)
            try:
                self.states.snapshot(snapshot)
            except OSError as error:
                return str(error)
        return checkpoint.write_tree(path, tree)

    def restore_checkpoint(self, directory: str) -> None:
        """Take this host's clients' state from a checkpoint folder (any number of hosts may have written it),
        decoding one client's state at a time; with a shared store only what the host keeps itself (the store
        is restored once, `restore_states`)."""
        owned = set(self.client_ids)
        shared = isinstance(self.states, ColumnStates)
        found: set[int] = set()
        for path in sorted(Path(directory).glob("host-*.npz")):
            with checkpoint.TreeFile(path) as tree:
                parts = dict(tree.entries(tree.structure))
                if not shared:
                    for client_id, node in tree.entries(parts["states"]):
                        if client_id in owned:
                            self.states[client_id] = tree.decode(node)
                            found.add(client_id)
                self.steps.sent.update({c: m for c, m in tree.decode(parts["sent"]).items() if c in owned})
                self.evaluations = tree.decode(parts["evaluations"])
        if not shared and found != owned:
            raise checkpoint.CheckpointError(f"{directory}: no state for clients {sorted(owned - found)[:10]}")

    def restore_states(self, directory: str) -> None:
        """Make the shared state store the checkpoint's snapshot (rows written since are forgotten); the driver
        asks one host, once every host has restored its own part."""
        assert isinstance(self.states, ColumnStates), "only a shared state store is restored whole"
        self.states.restore(directory)

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
