"""A host's client steps: the two paths a chunk of selected clients steps by, over the run's executor.

A chunk (the selected clients of one block of the executor's `clients_at_once`) steps in lockstep
(`run_client_steps`: each turn's requests go to the executor together; with `sequential` a chunk is one client),
or, for an algorithm that stacks on an executor that stacks, as one step over its stacked states
(`run_stacked_step`, requests run for all rows at once). Whichever path, a chunk's states come from and go back to
the host's ClientStates, whichever container holds them, and every request gets the generator of its client's
next request number from here (raysim.training.executors).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from raysim.algorithms.interface import Algorithm, ClientInfo, ClientUpdate, previous_message
from raysim.algorithms.requests import (
    BatchGradients,
    BatchGradientsResult,
    ClassMeans,
    ClassMeansResult,
    FullGradient,
    GradientResult,
    Request,
    Result,
    SGDResult,
    Vector,
    draws_randomness,
)
from raysim.execution.drivers import run_client_step, run_client_steps, run_stacked_step
from raysim.execution.stacking import one_row, unstack_update
from raysim.executors import ExecutorContext, Job, build_executor
from raysim.models.flat import FlatModel
from raysim.runtime.exact_sum import PartialSum, add_rows
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.state_store import ClientStateStore, StoreStats
from raysim.runtime.state_table import StateTables
from raysim.seeding import Stream, rng
from raysim.training.authors_batches import AuthorsStreams, ReplayedBatches
from raysim.training.local import ClientData, Draws


class ClientStates(Protocol):
    """A host's client states, whichever container holds them (StateTables in memory, ClientStateStore past
    runtime.state_memory_mb; both mappings, written to checkpoints as such): one client's state by id, the stacked
    state of a chunk of one block's clients as rows (`rows`), and its new rows stored back (`store`: only the rows
    kept)."""

    def __getitem__(self, client: int) -> Any: ...

    def __setitem__(self, client: int, state: Any) -> None: ...

    def __iter__(self) -> Iterator[int]: ...

    def rows(self, clients: Sequence[int]) -> Any: ...

    def store(self, clients: Sequence[int], new: Any, kept: np.ndarray | None = None) -> None: ...

    def stats(self) -> StoreStats | None:
        """Where the states are (None: all in memory, nothing spills)."""
        ...

    def close(self) -> None:
        """Forget every state (and remove spilled ones)."""
        ...


@dataclass(frozen=True)
class ChunkUpdate:
    """The update of a chunk of clients, stacked over them (a chunk of one for a step run alone), and how to
    commit their new states once their uploads are summed (`commit(kept)`: kept[i], whether client i's upload was
    kept; a dropped client keeps its old state)."""

    ids: list[int]
    update: ClientUpdate
    commit: Callable[[np.ndarray], None]


def untrained(request: Request) -> Result:
    """Executor of a Byzantine client that skips training: every SGD request returns its start point, every
    gradient is zero, every class count zero (it reports no data)."""
    if isinstance(request, FullGradient):
        return GradientResult(np.zeros_like(request.point), float("nan"))
    if isinstance(request, BatchGradients):
        points = np.asarray(request.points, np.float32)
        return BatchGradientsResult(np.zeros_like(points), np.full(points.shape[:-1], np.nan))
    if isinstance(request, ClassMeans):
        return ClassMeansResult(np.zeros(0), None)
    return SGDResult(np.array(request.start, copy=True), float("nan"), 0)


def keep_freed_memory() -> None:
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


class ClientSteps:
    """Steps a host's selected clients, a chunk at a time, over their states (`states`), and adds their uploads to
    the sum as sent (`add_one_by_one`: a Byzantine client's forged)."""

    def __init__(
        self,
        settings: HostSettings,
        model: FlatModel,
        algorithm: Algorithm,
        data: Mapping[int, ClientData],
        info: dict[int, ClientInfo],
        shared: ClientStates | None = None,
    ):
        """`data`, `info`: the host's clients' data and ClientInfo by id; `shared`: the run's shared state store
        (raysim.runtime.state_columns), else the host keeps its clients' states itself."""
        self.settings = settings
        self.algorithm = algorithm
        self.data = data
        self.info = info
        device = torch.device("cuda" if settings.gpus > 0 and torch.cuda.is_available() else "cpu")
        context = ExecutorContext(model, device, settings.vectorize_chunk, settings.train_sizes)
        self.executor = build_executor(settings.client_training, context)
        """runtime.client_training: what runs the selected clients' requests (raysim.training.executors)."""
        self.stacked = self.executor.stacks and algorithm.stacks
        """Whether a chunk's client steps run as one step over their stacked states (Algorithm.stacks)."""
        self.seed = settings.seed
        plan = settings.batches
        self.authors_streams = None if plan is None else AuthorsStreams(plan, settings.model.build().module)
        """clients.batches = authors: the authors' streams of mini-batch draws, replayed for this host's clients."""
        self.attack = settings.attack
        self.sent: dict[int, Vector] = {}
        """The last message each Byzantine client sent (delta uploads must be relative to it)."""
        self.num_clients = next(iter(info.values())).num_clients if info else 0
        longest_first = sorted(info, key=lambda c: (-info[c].num_train, c))
        size = self.executor.clients_at_once
        self.shared = shared is not None
        self.blocks = [] if self.shared else [longest_first[i : i + size] for i in range(0, len(longest_first), size)]
        """The host's clients in fixed blocks of the executor's `clients_at_once` (1 for sequential), longest training
        split first; a round's chunks are the selected clients of each block, so that a block selected whole keeps
        its clients' states as the rows of one array per field from round to round (stacked without a copy). With a
        shared store none: a round's blocks are its selected clients, longest first (`round_blocks`)."""
        self.states: ClientStates = (
            shared
            if shared is not None
            else StateTables(self.blocks)
            if settings.state_memory_mb is None
            else ClientStateStore(int(settings.state_memory_mb * 2**20), settings.spill_dir)
        )

    def chunks(self, round_index: int, client_ids: list[int], broadcast: object) -> Iterator[ChunkUpdate]:
        """The updates of the selected clients, a chunk at a time: the selected clients of a block (`blocks`), each
        stepped by the algorithm of this round (`Algorithm.at_round`: its learning rates decayed to round t).
        With vectorized training a chunk steps as one step over its stacked states when the algorithm stacks
        (`_stacked_chunk`), else in lockstep, one update per client; sequentially each client steps alone. A
        Byzantine client that skips training runs alone, untrained, and keeps its state."""
        selected = set(client_ids)
        algorithm = self.algorithm.at_round(round_index)  # the round's settings (its learning rates)
        for block in self.round_blocks(client_ids):
            chosen = [c for c in block if c in selected]
            for client_id in (c for c in chosen if self._idle(c)):
                state = self.states[client_id]
                update = run_client_step(algorithm, self.info[client_id], state, broadcast, untrained)
                yield ChunkUpdate([client_id], one_row(dataclasses.replace(update, metrics={})), lambda kept: None)
            chunk = [c for c in chosen if not self._idle(c)]
            if not chunk:
                continue
            if self.stacked:
                yield self._stacked_chunk(algorithm, round_index, chunk, broadcast)
                continue
            states = [self.states[c] for c in chunk]
            infos = [self.info[c] for c in chunk]
            updates = run_client_steps(algorithm, infos, states, broadcast, self._turns(round_index))
            for client_id, update in zip(chunk, updates, strict=True):
                yield ChunkUpdate([client_id], one_row(update), self._store(client_id, update.state))

    def round_blocks(self, client_ids: Sequence[int]) -> list[list[int]]:
        """The blocks a round's chunks are taken from: the host's fixed blocks, or with a shared store the selected
        clients themselves, longest training split first, `clients_at_once` at a time (the same chunks a host that
        owns exactly them would make)."""
        if not self.shared:
            return self.blocks
        longest_first = sorted(client_ids, key=lambda c: (-self.info[c].num_train, c))
        size = self.executor.clients_at_once
        return [longest_first[i : i + size] for i in range(0, len(longest_first), size)]

    def _store(self, client_id: int, state: Any) -> Callable[[np.ndarray], None]:
        """Commit a single client's new state, if its upload was kept."""

        def commit(kept: np.ndarray) -> None:
            if kept[0]:
                self.states[client_id] = state

        return commit

    def _stacked_chunk(
        self, algorithm: Algorithm, round_index: int, chunk: list[int], broadcast: object
    ) -> ChunkUpdate:
        """One step over the stacked states of a chunk, the selected clients of one block (Algorithm.stacks).
        Without a state budget the block's states live in a StateTable: the chunk's rows are donated to the step
        (ClientChunk.in_place), which updates them where they are, unless a dropped upload must leave its client's
        state as it was (on_nonfinite = drop_client); a chunk of rows that are not consecutive is a copy, written
        back. Past a budget (ClientStateStore) the rows are a copy and each client stores its own."""
        infos = [self.info[c] for c in chunk]
        executor = self._rows_executor(round_index, chunk)
        in_place = self.settings.on_nonfinite != "drop_client"
        update = run_stacked_step(algorithm, infos, self.states.rows(chunk), broadcast, executor, in_place)

        def commit(kept: np.ndarray) -> None:
            self.states.store(chunk, update.state, kept)

        return ChunkUpdate(chunk, update, commit)

    def _idle(self, client_id: int) -> bool:
        """A Byzantine client that skips training (attack.training = skip)."""
        return self.attack is not None and self.attack.skips_training(client_id)

    def byzantine(self, client_id: int) -> bool:
        return self.attack is not None and self.attack.byzantine(client_id)

    def add_one_by_one(
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
            if message is not None and total is not None and not refused:  # an added upload: a sum exists
                total.messages[client_id] = message
        return total, rejected, uploads

    def _outgoing(self, client_id: int, round_index: int, update, broadcast) -> tuple[object, tuple | None]:
        """The upload actually sent (a Byzantine client's carries its forged message) and, for robust
        aggregation, (message, previous message)."""
        byzantine = self.byzantine(client_id)
        if not (byzantine or self.settings.send_messages):
            return update.upload, None
        message = self.algorithm.message(update)
        previous = self.sent.get(client_id)
        if previous is None:
            previous = previous_message(self.algorithm, update)
        upload = update.upload
        if byzantine:
            assert self.attack is not None  # a Byzantine client is the attack's
            message = self.attack.corrupt(client_id, round_index, message, broadcast)
            upload = upload.with_message(message, previous)
            self.sent[client_id] = message
        return upload, ((np.asarray(message, np.float32), previous) if self.settings.send_messages else None)

    def _generators(self, client_id: int, round_index: int, stream: Stream = Stream.CLIENT_TRAINING) -> Iterator[Draws]:
        """The generators of a client's successive requests, keyed by (seed, stream, client, round, request number);
        with clients.batches = authors their training batches are the authors' (one RoundDraws for the round)."""
        generators = (rng(self.seed, stream, client_id, round_index, number) for number in itertools.count())
        if self.authors_streams is None or stream != Stream.CLIENT_TRAINING:
            return generators
        draws = self.authors_streams.round_draws(client_id, round_index)
        return (ReplayedBatches(draws, generator) for generator in generators)

    def client_executor(self, client_id: int, round_index: int, stream: Stream = Stream.CLIENT_TRAINING):
        """Runs a client's requests alone, with randomness keyed by (seed, stream, client, round, request number)."""
        generators = self._generators(client_id, round_index, stream)

        def execute(request: Request) -> Result:
            draws = next(generators) if draws_randomness(request) else None
            return self.executor.run(request, self.data[client_id], draws)

        return execute

    def _rows_executor(self, round_index: int, client_ids: list[int]) -> Callable[[Request], Result]:
        """Runs a chunk's stacked requests (row i: client `client_ids[i]`), each row's randomness keyed as
        `client_executor` keys it."""
        generators = {c: self._generators(c, round_index) for c in client_ids}
        data = [self.data[c] for c in client_ids]

        def execute(request: Request) -> Result:
            draws = [next(generators[c]) if draws_randomness(request) else None for c in client_ids]
            return self.executor.run_rows(request, data, draws)

        return execute

    def _turns(self, round_index: int) -> Callable[[list[tuple[int, Request]]], list[Result]]:
        """Runs a chunk's turns in lockstep (one request per unfinished client), each client's randomness keyed as
        `client_executor` keys it."""
        generators: dict[int, Iterator[Draws]] = {}

        def execute_many(requests: list[tuple[int, Request]]) -> list[Result]:
            jobs: list[Job] = []
            for client_id, request in requests:
                if client_id not in generators:
                    generators[client_id] = self._generators(client_id, round_index)
                draws = next(generators[client_id]) if draws_randomness(request) else None
                jobs.append((request, self.data[client_id], draws))
            return self.executor.run_turn(jobs)

        return execute_many
