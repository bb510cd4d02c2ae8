"""Client-host actors: each owns a fixed, disjoint set of clients and keeps their state across rounds.

One process per client does not scale (about 180 MB per torch process; platform.md), so a small pool
of long-lived hosts each simulates many clients. With `num_hosts` equal to the number of clients this
is one actor per client: same code, different setting. `ClientHost` is a plain class; the driver wraps
it with `ray.remote`, and tests may use it directly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from raysim.algorithms import ALGORITHMS, ClientInfo, build_algorithm, run_client_step
from raysim.algorithms.base import (
    AlgorithmSettings,
    ClientUpdate,
    FullGradient,
    GradientResult,
    LocalSGD,
    Request,
    Result,
    SGDResult,
    Vector,
    drive,
    one_row,
    run_client_steps,
    run_stacked_step,
    stack,
    unstack,
    unstack_update,
)
from raysim.config import ExperimentConfig
from raysim.data.partitions import ClientSplit
from raysim.models.spec import ModelSpec
from raysim.runtime import checkpoint
from raysim.runtime.exact_sum import PartialSum, UploadRangeError, add_rows, rejection
from raysim.runtime.state_store import ClientStateStore
from raysim.runtime.state_table import StateTable
from raysim.seeding import Stream, rng
from raysim.threats.attacks import AttackPlan
from raysim.tracking.metrics import (
    ClientEvaluation,
    ClientRecords,
    ModelScores,
    SingleLabelAuc,
    classification_scores_many,
    evaluation_batch,
)
from raysim.training.authors_batches import AuthorsBatchPlan, AuthorsStreams, ReplayedBatches
from raysim.training.local import ClientData, Draws, Inputs, LocalTrainer
from raysim.training.vectorized import SGDJob, VectorizedTrainer

if TYPE_CHECKING:
    from raysim.runtime.problem import Problem


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
    client_training: str = "auto"
    """`vectorized`: the selected clients train together, `vectorize_chunk` at a time; `auto`: so for perceptrons
    and on GPUs (runtime.client_training)."""
    vectorize_chunk: int = 16
    gpus: float = 0.0
    """The host's GPU share: vectorized training runs on the GPU when it has one (runtime.host_gpus)."""
    inputs: Inputs = Inputs()
    """How the dataset's stored rows become model input: the dataset's normalization, dataset.augment."""
    loss_sum_batch: int = 100
    """Batch size of the summed test loss (tracking.loss_sum_batch)."""
    train_loss_every: int = 1
    """Score training losses at every N-th evaluation, 0: never (tracking.train_loss)."""
    train_sizes: tuple[int, ...] | None = None
    """The distinct training-split sizes of the run's clients: vectorized batches are padded to no more samples
    than one of them needs at that step (VectorizedTrainer.train_sizes; the same for every host, so results do not
    depend on the hosts)."""
    batches: AuthorsBatchPlan | None = None
    """clients.batches = authors: the run's clients' mini-batches are the FLAME authors' code's (every host replays
    their streams for all clients, raysim.training.authors_batches); None: from the clients' seeded streams."""

    @classmethod
    def from_config(cls, config: ExperimentConfig, problem: Problem) -> HostSettings:
        """The hosts' settings of a run of `config` on the prepared `problem` (model, attackers, inputs, clients)."""
        runtime = config.runtime
        return cls(
            config.algorithm, problem.model_spec, config.seed, runtime.torch_threads, problem.attack,
            config.aggregation.active, config.tracking.auc_single_label, runtime.on_nonfinite, runtime.state_memory_mb,
            runtime.spill_dir, runtime.client_training, runtime.vectorize_chunk, runtime.host_gpus, problem.inputs,
            config.tracking.loss_sum_batch, config.tracking.train_loss_every,
            tuple(sorted({info.num_train for info, _ in problem.clients})), authors_batches(config, problem),
        )  # fmt: skip


def authors_batches(config: ExperimentConfig, problem: Problem) -> AuthorsBatchPlan | None:
    """What replaying the authors' mini-batches needs (clients.batches = authors), else None. Their 80/20 split
    shuffled each client's n samples and left one out: n = train + test + 1 (raysim.data.authors_draw.split)."""
    if config.clients.batches != "authors":
        return None
    draws = ALGORITHMS.get(config.algorithm.name).code_draws(config.algorithm)
    splits = [split for _, split in problem.clients]
    return AuthorsBatchPlan(
        config.seed, tuple(len(s.train) + len(s.test) + 1 for s in splits), tuple(len(s.train) for s in splits),
        config.algorithm.batch_size, draws.passes, draws.picks,
    )  # fmt: skip


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


@dataclass(frozen=True)
class _Chunk:
    """The update of a chunk of clients, stacked over them (a chunk of one for a step run alone), and how to
    commit their new states once their uploads are summed (`commit(kept)`: kept[i], whether client i's upload was
    kept; a dropped client keeps its old state)."""

    ids: list[int]
    update: ClientUpdate
    commit: Callable[[np.ndarray], None]


def _own_arrays(state: Any) -> Any:
    """A client state whose vectors are copies (a row view would keep the whole chunk's array alive)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    copies = {name: np.array(value) for name, value in fields.items() if isinstance(value, np.ndarray)}
    return dataclasses.replace(state, **copies)


def _keep_freed_memory() -> None:
    """Tell glibc's allocator (where there is one) to keep freed memory for reuse instead of returning it to the
    system. Client state stays in its StateTable rows, but a round still allocates and frees temporaries of MBs
    (a chunk's batches, activations and gradients, an algorithm's non-stacked state arrays); returned to the
    system, each would come back page by page, and those page faults cost more than the arithmetic (FLAME's
    update of one MLP client: 0.24 ms instead of 0.1). A host process then holds its peak round's memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: large arrays from the heap, not from fresh mappings
    libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never give the heap's free top back


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
        mode = settings.client_training
        if mode == "auto":
            mode = "vectorized" if self.model.perceptron or device.type == "cuda" else "sequential"
        self.vectorized = (
            VectorizedTrainer(self.model, settings.vectorize_chunk, device, settings.train_sizes)
            if mode == "vectorized"
            else None
        )
        """runtime.client_training = vectorized (or auto, for a perceptron or on a GPU): the trainer of the selected
        clients' LocalSGD requests."""
        self.stacked = self.vectorized is not None and self.algorithm.stacks
        """Whether a chunk's client steps run as one step over their stacked states (Algorithm.stacks)."""
        self.tables: dict[int, StateTable] = {}
        """Stacked steps without a state budget: each block's states as a StateTable (made at its first step)."""
        self.seed = settings.seed
        plan = settings.batches
        self.authors_streams = None if plan is None else AuthorsStreams(plan, settings.model.build().module)
        """clients.batches = authors: the authors' streams of mini-batch draws, replayed for this host's clients."""
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
        longest_first = sorted(self.info, key=lambda c: (-self.info[c].num_train, c))
        size = settings.vectorize_chunk if self.vectorized is not None else 1
        self.blocks = [longest_first[i : i + size] for i in range(0, len(longest_first), size)]
        """The host's clients in fixed blocks of `vectorize_chunk` (1 without vectorized training), longest training
        split first; a round's chunks are the selected clients of each block, so that a block selected whole keeps
        its clients' states as the rows of one array per field from round to round (stacked without a copy)."""
        _keep_freed_memory()

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
        for chunk in self._chunks(round_index, client_ids, broadcast):
            ids, update = chunk.ids, chunk.update
            if self.settings.send_messages or any(self._byzantine(c) for c in ids):
                # each upload on its own: forged by an attacker, or its message kept for robust aggregation
                total, rejected, uploads = self._add_one_by_one(total, round_index, ids, update, broadcast)
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

    def _add_one_by_one(
        self, total: PartialSum | None, round_index: int, ids: list[int], update: ClientUpdate, broadcast: object
    ) -> tuple[PartialSum | None, list[int], list[Any]]:
        """Add each client's upload of a (stacked) update to the sum, as sent (`_outgoing`: a Byzantine client's
        forged); with robust aggregation its message too. Returns the sum, the clients left out, the uploads."""
        rejected, uploads = [], []
        for client_id, single in zip(ids, unstack_update(update, len(ids)), strict=True):
            upload, message = self._outgoing(client_id, round_index, single, broadcast)
            uploads.append(upload)
            total, refused = add_rows(total, one_row(upload), [client_id], self.num_clients)
            rejected += refused
            if message is not None and not refused:
                total.messages[client_id] = message  # type: ignore[union-attr]
        return total, rejected, uploads

    def _chunks(self, round_index: int, client_ids: list[int], broadcast: object) -> Iterator[_Chunk]:
        """The updates of the selected clients, a chunk at a time: the selected clients of a block (`blocks`).
        With vectorized training a chunk steps as one step over its stacked states when the algorithm stacks
        (`_stacked_chunk`), else in lockstep, one update per client; sequentially each client steps alone. A
        Byzantine client that skips training runs alone, untrained, and keeps its state."""
        selected = set(client_ids)
        for index, block in enumerate(self.blocks):
            chosen = [c for c in block if c in selected]
            for client_id in (c for c in chosen if self._idle(c)):
                state = self.states[client_id]
                update = run_client_step(self.algorithm, self.info[client_id], state, broadcast, _untrained)
                yield _Chunk([client_id], one_row(dataclasses.replace(update, metrics={})), lambda kept: None)
            chunk = [c for c in chosen if not self._idle(c)]
            if not chunk:
                continue
            if self.stacked:
                yield self._stacked_chunk(round_index, index, chunk, broadcast)
                continue
            states = [self.states[c] for c in chunk]
            infos = [self.info[c] for c in chunk]
            if self.vectorized is not None:
                executor = self._execute_many(round_index, self.vectorized)
                updates = run_client_steps(self.algorithm, infos, states, broadcast, executor)
            else:
                updates = [
                    run_client_step(self.algorithm, info, state, broadcast, self._executor(c, round_index))
                    for c, info, state in zip(chunk, infos, states, strict=True)
                ]
            for client_id, update in zip(chunk, updates, strict=True):
                yield _Chunk([client_id], one_row(update), self._store(client_id, update.state))

    def _store(self, client_id: int, state: Any) -> Callable[[np.ndarray], None]:
        """Commit a single client's new state, if its upload was kept."""

        def commit(kept: np.ndarray) -> None:
            if kept[0]:
                self.states[client_id] = state

        return commit

    def _stacked_chunk(self, round_index: int, block: int, chunk: list[int], broadcast: object) -> _Chunk:
        """One step over the stacked states of a chunk of block `block` (Algorithm.stacks). Without a state budget
        the block's states live in a StateTable: the chunk's rows are donated to the step (ClientChunk.in_place),
        which updates them where they are, unless a dropped upload must leave its client's state as it was
        (on_nonfinite = drop_client); a chunk of rows that are not consecutive is a copy, written back."""
        infos = [self.info[c] for c in chunk]
        executor = self._rows_executor(round_index, chunk)
        in_place = self.settings.on_nonfinite != "drop_client"
        if isinstance(self.states, ClientStateStore):  # states spill one by one: no table, each client its own copy
            update = run_stacked_step(
                self.algorithm, infos, stack([self.states[c] for c in chunk]), broadcast, executor, in_place
            )

            def commit_own(kept: np.ndarray) -> None:
                for client_id, state, ok in zip(chunk, unstack(update.state, len(chunk)), kept, strict=True):
                    if ok:
                        self.states[client_id] = _own_arrays(state)

            return _Chunk(chunk, update, commit_own)
        table = self.tables.get(block)
        if table is None:  # the block's first step (or the first after a restore): its states become one table
            members = self.blocks[block]
            table = self.tables[block] = StateTable(members, [self.states[c] for c in members])
            self.states.update({c: table.state(c) for c in members})
        update = run_stacked_step(self.algorithm, infos, table.rows(chunk), broadcast, executor, in_place)

        def commit(kept: np.ndarray) -> None:
            table.store(chunk, update.state, kept)
            self.states.update({c: table.state(c) for c in chunk})

        return _Chunk(chunk, update, commit)

    def _idle(self, client_id: int) -> bool:
        """A Byzantine client that skips training (attack.training = skip)."""
        return self.attack is not None and self.attack.skips_training(client_id)

    def _byzantine(self, client_id: int) -> bool:
        return self.attack is not None and self.attack.byzantine(client_id)

    def _outgoing(self, client_id: int, round_index: int, update, broadcast) -> tuple[object, tuple | None]:
        """The upload actually sent (a Byzantine client's carries its forged message) and, for robust
        aggregation, (message, previous message)."""
        byzantine = self._byzantine(client_id)
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
    ) -> Iterator[Draws]:
        """The generators of a client's successive requests, keyed by (seed, stream, client, round, request number);
        with clients.batches = authors their training batches are the authors' (one RoundDraws for the round)."""
        generators = (rng(self.seed, stream, client_id, round_index, number) for number in itertools.count())
        if self.authors_streams is None or stream != Stream.CLIENT_TRAINING:
            return generators
        draws = self.authors_streams.round_draws(client_id, round_index)
        return (ReplayedBatches(draws, generator) for generator in generators)

    def _executor(self, client_id: int, round_index: int, stream: Stream = Stream.CLIENT_TRAINING):
        """Runs a client's requests with randomness keyed by (seed, stream, client, round, request number)."""
        generators = self._generators(client_id, round_index, stream)

        def execute(request: LocalSGD | FullGradient) -> SGDResult | GradientResult:
            generator = next(generators)
            if isinstance(request, FullGradient):
                return self.trainer.full_gradient(request, self.data[client_id], generator)
            return self.trainer.sgd(request, self.data[client_id], generator)

        return execute

    def _rows_executor(self, round_index: int, client_ids: list[int]) -> Callable[[Request], Result]:
        """Runs a chunk's stacked requests (row i: client `client_ids[i]`): SGD on the vectorized trainer, all rows
        at once; gradients one row at a time. Each row's randomness is keyed as `_executor` keys it."""
        generators = {c: self._generators(c, round_index) for c in client_ids}
        data = [self.data[c] for c in client_ids]

        def execute(request: Request) -> Result:
            drawn = [next(generators[c]) for c in client_ids]
            if isinstance(request, FullGradient):
                rows = unstack(request, len(client_ids))
                return stack([self.trainer.full_gradient(*job) for job in zip(rows, data, drawn, strict=True)])
            return self.vectorized.sgd_rows(request, data, drawn)  # type: ignore[union-attr]

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
        execute = self._executor(client_id, self.evaluations, Stream.ADAPTATION)
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
        tree = {"states": self.states, "sent": dict(self.sent), "evaluations": self.evaluations}
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
                self.sent.update({c: m for c, m in tree.decode(parts["sent"]).items() if c in owned})
                self.evaluations = tree.decode(parts["evaluations"])
        if found != owned:
            raise checkpoint.CheckpointError(f"{directory}: no state for clients {sorted(owned - found)[:10]}")
        self.tables.clear()  # the restored states are the clients' own arrays; tables are made again when stepped

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()

    def client_states(self, client_ids: list[int] | None = None) -> dict[int, object]:
        """A copy of the current state of the given (default: all) clients, for inspection and tests (all in memory
        at once; copies, as a table's rows change in place)."""
        return {c: _own_arrays(self.states[c]) for c in (self.client_ids if client_ids is None else client_ids)}

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
