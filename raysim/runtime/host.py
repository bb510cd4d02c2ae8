"""Client-host actors: each owns a fixed, disjoint set of clients and keeps their state across rounds.

One process per client does not scale (about 180 MB per torch process; platform.md), so a small pool
of long-lived hosts each simulates many clients. With `num_hosts` equal to the number of clients this
is one actor per client: same code, different setting. `ClientHost` is a plain class; the driver wraps
it with `ray.remote`, and tests may use it directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raysim.algorithms import ClientInfo, build_algorithm, run_client_step
from raysim.algorithms.base import (
    AlgorithmSettings,
    ClientUpdate,
    FullGradient,
    GradientResult,
    LocalSGD,
    SGDResult,
    Vector,
    drive,
    run_client_steps,
    run_stacked_step,
)
from raysim.config import ExperimentConfig
from raysim.data.partitions import ClientSplit
from raysim.data.sources import Task
from raysim.models.flat import FlatModel, Scores
from raysim.runtime import checkpoint
from raysim.runtime.exact_sum import PartialSum, UploadRangeError, encode
from raysim.runtime.state_store import ClientStateStore
from raysim.seeding import Stream, rng
from raysim.threats.attacks import AttackPlan
from raysim.tracking.metrics import (
    ClientEvaluation,
    ClientRecord,
    ModelScores,
    SingleLabelAuc,
    classification_scores_many,
)
from raysim.training.local import ClientData, Inputs, LocalTrainer
from raysim.training.vectorized import SGDJob, VectorizedTrainer


@dataclass(frozen=True)
class ModelSpec:
    """What a host needs to build the model: name, input shape, outputs, task."""

    name: str
    input_shape: tuple[int, ...]
    outputs: int
    task: Task

    def build(self) -> FlatModel:
        return FlatModel(self.name, self.input_shape, self.outputs, self.task)


@dataclass(frozen=True)
class HostSettings:
    """Everything a host needs besides its data and clients (`from_config`: as a run sets its hosts up)."""

    algorithm: AlgorithmSettings
    model: ModelSpec
    seed: int
    torch_threads: int = 1
    attack: AttackPlan | None = None
    """Which clients are malicious and how (None: no attack)."""
    send_messages: bool = False
    """Add each selected client's message to the partial sums, for a robust aggregator at the coordinator."""
    auc_single_label: SingleLabelAuc = "zero"
    """The AUC of a one-label test split (raysim.tracking.metrics.classification_scores)."""
    on_nonfinite: str = "stop"
    """`stop` raises UploadRangeError on a NaN/inf upload, `drop_client` leaves it out (runtime.on_nonfinite)."""
    state_memory_mb: float | None = None
    """Client states beyond this spill to a folder in `spill_dir` (runtime.state_memory_mb, runtime.spill_dir)."""
    spill_dir: str | None = None
    client_training: str = "sequential"
    """`vectorized`: the selected clients train together, `vectorize_chunk` at a time (runtime.client_training)."""
    vectorize_chunk: int = 16
    gpus: float = 0.0
    """The host's GPU share: vectorized training runs on the GPU when it has one (runtime.host_gpus)."""
    inputs: Inputs = Inputs()
    """How the dataset's stored rows become model input: the dataset's normalization, dataset.augment."""
    loss_sum_batch: int = 100
    """Batch size of the summed test loss (tracking.loss_sum_batch)."""
    train_loss_every: int = 1
    """Score training losses at every N-th evaluation, 0: never (tracking.train_loss)."""

    @classmethod
    def from_config(
        cls, config: ExperimentConfig, model: ModelSpec, attack: AttackPlan | None, inputs: Inputs | None = None
    ) -> HostSettings:
        """`inputs`: the run's (Problem.inputs); None for a dataset stored ready, augmented as the config says."""
        runtime = config.runtime
        return cls(
            config.algorithm, model, config.seed, runtime.torch_threads, attack, config.aggregation.active,
            config.tracking.auc_single_label, runtime.on_nonfinite, runtime.state_memory_mb, runtime.spill_dir,
            runtime.client_training, runtime.vectorize_chunk, runtime.host_gpus,
            Inputs(augment=config.dataset.augment) if inputs is None else inputs,
            config.tracking.loss_sum_batch, config.tracking.train_loss_every,
        )  # fmt: skip


STACKED_CHUNK_BYTES = 2 * 2**20
"""A vectorized host steps a chunk of clients as one stacked step (Algorithm.stacks) when a stacked vector of the
chunk takes at most this much. Measured on a 2-core EPYC (L2 1 MiB a core): FLAME's stacked algebra is faster
for mlr (16 clients x 31 KB) and slower for mlp (16 x 436 KB), whose temporaries no longer stay in cache."""

EVALUATION_CLIENTS = 64
"""Clients whose splits the global model scores in one pass (ClientHost.evaluate); memory: their samples."""


@dataclass(frozen=True)
class EvaluationData:
    """One client's (x, y) splits as scored at one evaluation; train only when its loss is scored, val when
    the client has one."""

    test: tuple[np.ndarray, np.ndarray]
    train: tuple[np.ndarray, np.ndarray] | None
    val: tuple[np.ndarray, np.ndarray] | None


def _untrained(request: LocalSGD | FullGradient) -> SGDResult | GradientResult:
    """Executor of a Byzantine client that skips training: every SGD request returns its start point, every
    gradient is zero."""
    if isinstance(request, FullGradient):
        return GradientResult(np.zeros_like(request.point), float("nan"))
    return SGDResult(np.array(request.start, copy=True), float("nan"), 0)


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
        self.trainer = LocalTrainer(self.model)
        device = torch.device("cuda" if settings.gpus > 0 and torch.cuda.is_available() else "cpu")
        self.vectorized = (
            VectorizedTrainer(self.model, settings.vectorize_chunk, device)
            if settings.client_training == "vectorized"
            else None
        )
        """runtime.client_training = vectorized: the trainer of the selected clients' LocalSGD requests."""
        self.stacked = (
            self.vectorized is not None
            and self.algorithm.stacks
            and self.vectorized.chunk * self.model.size * 4 <= STACKED_CHUNK_BYTES
        )
        """Whether a chunk's client steps run as one step over stacked states (Algorithm.stacks); decided by the
        configured chunk, never by who shares a chunk, so that results do not depend on the number of hosts."""
        self.seed = settings.seed
        self.attack = settings.attack
        self.sent: dict[int, Vector] = {}
        """The last message each Byzantine client sent (delta uploads must be relative to it)."""
        self.evaluations = 0
        self.num_clients = clients[0][0].num_clients if clients else 0
        self.info = {info.id: info for info, _ in clients}
        classes = settings.model.outputs
        self.data = {info.id: self._client_data(x, y, info.id, split, classes) for info, split in clients}
        self.states: MutableMapping[int, Any] = (
            {}
            if settings.state_memory_mb is None
            else ClientStateStore(int(settings.state_memory_mb * 2**20), settings.spill_dir)
        )
        init_params = np.array(init_params)
        init_params.flags.writeable = False  # clients' initial states may share it: a write into one would raise
        for info, _ in clients:  # one at a time: a budgeted store spills while they are made
            self.states[info.id] = self.algorithm.init_client(info, init_params)

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
    ) -> tuple[PartialSum | None, list[ClientRecord]]:
        """Run the client step of each selected client; return the exact sum of their uploads and their metrics."""
        total: PartialSum | None = None
        records: list[ClientRecord] = []
        for client_id, previous_state, update in self._updates(round_index, sorted(client_ids), broadcast):
            if self._idle(client_id):  # attack.training = skip: no local work, state kept; the step shapes the upload
                update = dataclasses.replace(update, state=previous_state, metrics={})
            self.states[client_id] = update.state
            upload, message = self._outgoing(client_id, round_index, update, broadcast)
            try:
                term = encode(upload, self.num_clients, client_id)
            except UploadRangeError as error:
                if self.settings.on_nonfinite != "drop_client":
                    raise UploadRangeError(f"round {round_index}: {error}") from None
                self.states[client_id] = previous_state  # runtime.on_nonfinite = drop_client: as if not selected
                records.append(ClientRecord(client_id, {}, 0.0, dropped=True))
                continue
            if message is not None:
                term.messages[client_id] = message
            if total is None:
                total = term
            else:
                total += term
            uplink = float(self.algorithm.uplink_bytes(upload))
            records.append(ClientRecord(client_id, dict(update.metrics), uplink))
        return total, records

    def _idle(self, client_id: int) -> bool:
        """A Byzantine client that skips training (attack.training = skip)."""
        return self.attack is not None and self.attack.skips_training(client_id)

    def _updates(
        self, round_index: int, client_ids: list[int], broadcast: object
    ) -> Iterator[tuple[int, Any, ClientUpdate]]:
        """(client id, state before, update) of each client, in the order given. Sequentially each client's
        step runs when its turn comes; vectorized, the steps of the next `vectorize_chunk` training clients run
        together (one chunk at a time, so that only a chunk's updates are held at once): as one step over their
        stacked states when the algorithm stacks (Algorithm.stacks), else in lockstep."""
        done: dict[int, tuple[Any, ClientUpdate]] = {}
        for index, client_id in enumerate(client_ids):
            if self.vectorized is not None and index % self.vectorized.chunk == 0:
                chunk = client_ids[index : index + self.vectorized.chunk]
                ids = [c for c in chunk if not self._idle(c)]
                states = [self.states[c] for c in ids]
                infos = [self.info[c] for c in ids]
                execute_many = self._execute_many(round_index, self.vectorized)
                run = run_stacked_step if self.stacked and ids else run_client_steps
                updates = run(self.algorithm, infos, states, broadcast, execute_many)
                done = {c: (state, update) for c, state, update in zip(ids, states, updates, strict=True)}
            if client_id in done:
                yield client_id, *done.pop(client_id)
                continue
            execute = _untrained if self._idle(client_id) else self._executor(client_id, round_index)
            previous_state = self.states[client_id]
            yield (
                client_id,
                previous_state,
                run_client_step(self.algorithm, self.info[client_id], previous_state, broadcast, execute),
            )

    def _outgoing(self, client_id: int, round_index: int, update, broadcast) -> tuple[object, tuple | None]:
        """The upload actually sent (a Byzantine client's carries its forged message) and, for robust
        aggregation, (message, previous message)."""
        byzantine = self.attack is not None and self.attack.byzantine(client_id)
        if not (byzantine or self.settings.send_messages):
            return update.upload, None
        message = self.algorithm.message(update)
        previous = self.sent.get(client_id)
        if previous is None:
            previous = self.algorithm.previous_message(update)
        upload = update.upload
        if byzantine:
            message = self.attack.corrupt(client_id, round_index, message, broadcast)  # type: ignore[union-attr]
            upload = self.algorithm.upload_from_message(upload, message, previous)
            self.sent[client_id] = message
        return upload, ((np.asarray(message, np.float32), previous) if self.settings.send_messages else None)

    def _generators(
        self, client_id: int, round_index: int, stream: Stream = Stream.CLIENT_TRAINING
    ) -> Iterator[np.random.Generator]:
        """The generators of a client's successive requests, keyed by (seed, stream, client, round, request number)."""
        return (rng(self.seed, stream, client_id, round_index, number) for number in itertools.count())

    def _executor(self, client_id: int, round_index: int, stream: Stream = Stream.CLIENT_TRAINING):
        """Runs a client's requests with randomness keyed by (seed, stream, client, round, request number)."""
        generators = self._generators(client_id, round_index, stream)

        def execute(request: LocalSGD | FullGradient) -> SGDResult | GradientResult:
            generator = next(generators)
            if isinstance(request, FullGradient):
                return self.trainer.full_gradient(request, self.data[client_id], generator)
            return self.trainer.sgd(request, self.data[client_id], generator)

        return execute

    def _execute_many(
        self, round_index: int, trainer: VectorizedTrainer
    ) -> Callable[[list[tuple[int, LocalSGD | FullGradient]]], list[SGDResult | GradientResult]]:
        """The lockstep executor of a round (runtime.client_training = vectorized): each client's randomness is
        keyed as by `_executor`; a turn's SGD requests train together, its gradient requests one at a time."""
        generators: dict[int, Iterator[np.random.Generator]] = {}

        def execute_many(requests: list[tuple[int, LocalSGD | FullGradient]]) -> list[SGDResult | GradientResult]:
            results: list[SGDResult | GradientResult | None] = [None] * len(requests)
            jobs: list[SGDJob] = []
            positions: list[int] = []
            for position, (client_id, request) in enumerate(requests):
                if client_id not in generators:
                    generators[client_id] = self._generators(client_id, round_index)
                generator = next(generators[client_id])
                if isinstance(request, FullGradient):
                    results[position] = self.trainer.full_gradient(request, self.data[client_id], generator)
                else:
                    jobs.append((request, self.data[client_id], generator))
                    positions.append(position)
            for position, result in zip(positions, trainer.sgd(jobs), strict=True):
                results[position] = result
            return results  # type: ignore[return-value]

        return execute_many

    def _evaluation_data(self, client_id: int, with_train: bool) -> EvaluationData:
        """The client's splits as it sees them at this evaluation (its access-time noise drawn afresh, keyed by
        the evaluation count, so that every model it scores sees the same draw)."""
        data = self.data[client_id]

        def arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
            if not data.redrawn:  # nothing to draw: no generator to make (10,000 clients make 30,000 of them)
                return data.arrays(split)
            part = ("train", "test", "val").index(split)
            return data.arrays(split, rng(self.seed, Stream.DATA_NOISE, client_id, self.evaluations, part))

        return EvaluationData(
            arrays("test"), arrays("train") if with_train else None, arrays("val") if len(data.val) else None
        )

    def _scores(self, params: Vector | list[Vector], splits: list[EvaluationData]) -> list[ModelScores]:
        """The scores on each of some clients' splits of one model shared by all (a vector: FlatModel.scores_many)
        or of each client's own (a list, one per split: FlatModel.scores_each), the splits' samples through the
        network together; the training loss only where the train split is given (else NaN)."""
        model, classifier = self.model, self.model.task == "classification"

        def score(pairs: list[tuple[Vector, tuple[np.ndarray, np.ndarray]]], **options: Any) -> list[Scores]:
            if isinstance(params, list):
                return model.scores_each([p for p, _ in pairs], [g for _, g in pairs], **options)
            return model.scores_many(params, [g for _, g in pairs], **options)

        own = params if isinstance(params, list) else [params] * len(splits)
        pairs = list(zip(own, splits, strict=True))
        tests = score([(p, s.test) for p, s in pairs], sum_batch=self.settings.loss_sum_batch, keep_outputs=classifier)
        trains = iter(score([(p, s.train) for p, s in pairs if s.train is not None]))
        vals = iter(score([(p, s.val) for p, s in pairs if s.val is not None]))
        f1_auc = [(float("nan"), float("nan"))] * len(splits)
        if classifier and splits:
            f1_auc = classification_scores_many(
                np.concatenate([test.outputs for test in tests]),  # type: ignore[misc]
                np.concatenate([split.test[1] for split in splits]),
                [len(split.test[1]) for split in splits],
                self.settings.auc_single_label,
            )
        scores = []
        for split, test, (f1, auc) in zip(splits, tests, f1_auc, strict=True):
            train_loss = next(trains).loss if split.train is not None else float("nan")
            val_acc = next(vals).accuracy if split.val is not None else float("nan")
            scores.append(ModelScores(test.accuracy, test.loss, train_loss, val_acc, f1, auc, test.loss_sum))
        return scores

    def evaluate(self, global_params: Vector) -> list[ClientEvaluation]:
        """PM, GM (and the algorithm's extra models') scores of every client of this host, EVALUATION_CLIENTS
        clients at a time: the GM, shared by all, scores their splits in shared passes, and their own models
        (PMs, extra models) score each its own split in batched passes."""
        self.evaluations += 1
        every = self.settings.train_loss_every
        with_train = bool(every) and (self.evaluations - 1) % every == 0
        evaluations = []
        ids = self.client_ids
        for begin in range(0, len(ids), EVALUATION_CLIENTS):
            chunk = ids[begin : begin + EVALUATION_CLIENTS]
            splits = [self._evaluation_data(c, with_train) for c in chunk]
            gms = self._scores(global_params, splits)
            states = {c: self.states[c] for c in chunk}  # each read once (a spilled state comes from disk)
            pms = self._own_scores({c: self._personal_model(c, states[c], global_params) for c in chunk}, chunk, splits)
            models = {c: self.algorithm.extra_models(states[c], global_params) for c in chunk}
            names = sorted({name for extra in models.values() for name in extra})
            extras = {name: self._own_scores({c: models[c].get(name) for c in chunk}, chunk, splits) for name in names}
            for client_id, gm in zip(chunk, gms, strict=True):
                extra = {name: extras[name][client_id] for name in names if client_id in extras[name]}
                evaluations.append(ClientEvaluation(client_id, pms.get(client_id, gm), gm, extra))
        return evaluations

    def _personal_model(self, client_id: int, state: Any, global_params: Vector) -> Vector | None:
        """The PM a client deploys now (None: the global model). A held-out (target) client is adapted from the
        global model at this evaluation (Algorithm.adapt)."""
        if not self.info[client_id].heldout:
            return self.algorithm.evaluated_model(state, global_params)
        adaptation = self.algorithm.adapt(self.info[client_id], global_params)
        execute = self._executor(client_id, self.evaluations, Stream.ADAPTATION)
        return None if adaptation is None else drive(adaptation, execute)

    def _own_scores(
        self, models: dict[int, Vector | None], chunk: list[int], splits: list[EvaluationData]
    ) -> dict[int, ModelScores]:
        """The scores of the clients' own models (None: the client has none) on their own splits."""
        having = [(c, split) for c, split in zip(chunk, splits, strict=True) if models[c] is not None]
        scores = self._scores([models[c] for c, _ in having], [split for _, split in having])  # type: ignore[misc]
        return {c: s for (c, _), s in zip(having, scores, strict=True)}

    def save_checkpoint(self, path: str) -> None:
        """Write this host's clients' persistent state (states, Byzantine messages sent, evaluation count) to
        one .npz file; hosts write in parallel, nothing goes through the driver. States are streamed to the
        file one by one (spilled ones read back one at a time)."""
        checkpoint.save_tree(path, {"states": self.states, "sent": dict(self.sent), "evaluations": self.evaluations})

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
                self.sent.update({c: m for c, m in tree.decode(parts["sent"]).items() if c in owned})
                self.evaluations = tree.decode(parts["evaluations"])
        if found != owned:
            raise checkpoint.CheckpointError(f"{directory}: no state for clients {sorted(owned - found)[:10]}")

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()

    def client_states(self, client_ids: list[int] | None = None) -> dict[int, object]:
        """Current state of the given (default: all) clients, for inspection and tests (all in memory at once)."""
        return {c: self.states[c] for c in (self.client_ids if client_ids is None else client_ids)}

    def state_memory(self) -> dict[str, float]:
        """Where this host's client states are (runtime.state_memory_mb): clients spilled to disk, bytes in
        memory and on disk; empty without a budget."""
        if not isinstance(self.states, ClientStateStore):
            return {}
        stats = self.states.stats()
        return {
            "state/spilled_clients": float(stats.spilled),
            "state/memory_bytes": float(stats.memory_bytes),
            "state/disk_bytes": float(stats.disk_bytes),
        }

    def close(self) -> None:
        """Remove the spilled client state (the driver calls this before it ends the actor, which skips
        Python's cleanup); the host holds no client state afterwards."""
        if isinstance(self.states, ClientStateStore):
            self.states.close()
