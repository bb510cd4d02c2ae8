"""The algorithm interface: a client step and a server step over typed state.

An algorithm is plain Python over flat numpy vectors and knows nothing of Ray. The runtime only moves
its state and messages:

    broadcast = algorithm.broadcast(server)                       # coordinator, once per round
    update = client_step(client, state, broadcast)                # hosts, for each selected client
    total = sum of update.upload over the selected clients        # hosts sum, coordinator merges
    server, metrics = algorithm.server_step(server, total, n)     # coordinator

`client_step` is a generator: every piece of local training it needs (e.g. "H epochs of SGD on
f_i(theta) + lambda/2 ||theta - w_i||^2") is *yielded* as a `LocalSGD` request and the result is sent
back. The algorithm thereby states *what* to optimise; the executor decides *how* (one client at a
time, or many clients at once). `run_client_step` drives the generator with any executor;
`run_client_steps` drives several clients' generators in lockstep, handing an executor every pending
request of a turn together.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from pydantic import ConfigDict, Field

from raysim.models.flat import ParamSpec
from raysim.settings import Settings

Vector = np.ndarray
"""A flat float32 parameter vector (see raysim.models.flat.ParamSpec for its layout)."""


class AlgorithmSettings(Settings):
    """Hyperparameters of one algorithm; subclasses add theirs. Validated from the config's `algorithm`."""

    model_config = ConfigDict(populate_by_name=True)
    name: str


class SGDSettings(AlgorithmSettings):
    """Local mini-batch SGD, shared by the algorithms that train locally."""

    epochs: int = Field(1, ge=1, description="H: local passes over the client's training split per round")
    lr: float = Field(0.01, gt=0, description="eta: local learning rate")
    batch_size: int = Field(100, ge=1)
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (0.5 in the FLAME authors' code)")
    weight_decay: float = Field(0.0, ge=0, description="extra L2 term mu*theta (0.01 in the FLAME authors' code)")

    def local_sgd(self, start: Vector, epochs: int | None = None, **objective: Any) -> LocalSGD:
        """A LocalSGD request with these hyperparameters; `objective` sets the prox/linear terms."""
        return LocalSGD(
            start=start,
            epochs=self.epochs if epochs is None else epochs,
            lr=self.lr,
            batch_size=self.batch_size,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **objective,
        )


@dataclass(frozen=True)
class ClientInfo:
    """What a client step may know about its client."""

    id: int
    num_train: int
    weight: float
    """alpha_i: 1/m or n_i/n, from the config's `clients.weighting` (0 for a held-out client)."""
    num_clients: int
    """m, the number of training clients (ids 0..m-1)."""

    @property
    def heldout(self) -> bool:
        """A held-out (target) client: it never trains and is only evaluated (`clients.heldout`)."""
        return self.id >= self.num_clients


@dataclass(frozen=True)
class ClientChunk:
    """Several clients taken as one by a client step written over stacked state (`Algorithm.stacks`).

    Their vectors are the rows of [clients, n] arrays and a per-client number is a [clients, 1] column, so
    that the step's equations, written with broadcasting and reductions over the last axis, run on one
    client's vectors (a ClientInfo) or on a chunk's rows alike."""

    clients: tuple[ClientInfo, ...]

    @property
    def weight(self) -> np.ndarray:
        """alpha_i of each client as a float32 column (the dtype of the vectors it scales)."""
        return np.array([[c.weight] for c in self.clients], np.float32)


@dataclass(frozen=True, eq=False)
class LocalSGD:
    """Request: mini-batch SGD from `start` on the client's training split, minimising

        f_i(offset + x) + (prox_weight/2) ||x - prox_center||^2 + <linear, x> + (weight_decay/2) ||x||^2
            + l1 ||x||_1

    for `epochs` passes of shuffled mini-batches (the last batch may be smaller), moving only the
    coordinates in `mask` when one is given.
    """

    start: Vector
    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_weight: float = 0.0
    prox_center: Vector | None = None
    linear: Vector | None = None
    mask: np.ndarray | None = None
    """Boolean, parameter-sized: only these coordinates move (partial personalization phases, fedapm.md 1.5)."""
    offset: Vector | None = None
    """If given, f_i is evaluated at offset + x (FedSLR Phase II trains p with w_t frozen, fedslr.md eq. 7)."""
    l1: float | Vector | None = None
    """If given, proximal SGD for + l1 ||x||_1: soft-threshold at lr * l1 after every step (scalar or per entry)."""
    max_steps: int | None = None
    """If given, stop after this many steps: the first batches of the first epoch's shuffle, so one step is one
    uniformly random mini-batch of `batch_size` samples (the whole split if it is smaller)."""

    def __post_init__(self) -> None:
        if self.prox_weight and self.prox_center is None:
            raise ValueError("LocalSGD: prox_weight > 0 needs a prox_center")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"LocalSGD: max_steps must be at least 1, got {self.max_steps}")


@dataclass(frozen=True, eq=False)
class SGDResult:
    params: Vector
    mean_loss: float
    """Mean data loss f_i over the mini-batches seen (before each step)."""
    steps: int


class Upload:
    """Base of the message types a client sends up.

    Subclasses are dataclasses whose fields are vectors or numbers. The runtime sums them field by
    field over the selected clients (exactly, in any order) and hands the server step that sum.

    Byzantine attacks and robust aggregation act on the *message* the paper says a client uploads
    (FLAME u_i, FedAvg the local model; flame.md 4.2). A subclass names the field that carries it:
    with `weight_field` (or none, weight 1) the field is weight * message (averaging servers); with
    `delta = True` it is message - previous message (running-sum servers whose global model is the
    mean of the m clients' latest messages, as FLAME's (14)).
    """

    message_field: ClassVar[str | None] = None
    weight_field: ClassVar[str | None] = None
    delta: ClassVar[bool] = False


U = TypeVar("U", bound=Upload)
C = TypeVar("C")  # client state
S = TypeVar("S")  # server state
B = TypeVar("B")  # broadcast
P = TypeVar("P", bound=AlgorithmSettings)


@dataclass
class ClientUpdate(Generic[C, U]):
    state: C
    upload: U
    metrics: dict[str, float] = field(default_factory=dict)
    message: Vector | None = None
    """The message this update sends, when the upload holds only a change of it (Upload.delta)."""


@dataclass(frozen=True, eq=False)
class FullGradient:
    """Request: the loss f_i and its full-batch gradient at `point` over one split of the client's data
    (AugFL's closed-form client step needs exact gradients on its support and query sets, augfl.md 1.6)."""

    point: Vector
    split: str = "train"
    """"train", "val" or "test": the ClientData index set the loss averages over."""


@dataclass(frozen=True, eq=False)
class GradientResult:
    grad: Vector
    loss: float


ClientStep = Generator[LocalSGD | FullGradient, SGDResult | GradientResult, ClientUpdate[C, U]]
AdaptStep = Generator[LocalSGD | FullGradient, SGDResult | GradientResult, Vector]
Request = LocalSGD | FullGradient
Result = SGDResult | GradientResult


@dataclass(frozen=True, eq=False)
class ServerSamples:
    """Samples that no client holds, kept back by the partition for the server's own use."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, eq=False)
class ServerContext:
    """What the runtime tells an algorithm preparing its server data (`Algorithm.server_data`), in the driver
    before any Ray work."""

    partition: str
    """The partition's scheme (`partition.scheme`)."""
    pools: tuple[ServerSamples, ...]
    """The pools of samples the partition keeps back from every client for the server, in the scheme's order
    (see its `server_pools`); empty for a scheme that keeps none back."""
    dataset: str
    """The dataset's name (`dataset.name`), e.g. to key cached files."""
    model: str
    """The clients' (and global) model architecture, a raysim.models.zoo name."""
    input_shape: tuple[int, ...]
    num_classes: int
    """The models' output size (the number of classes for classification)."""
    task: str
    seed: int
    """The experiment seed (`seed`)."""
    cache: Path
    """raysim's cache folder ($RAYSIM_CACHE, default ~/.cache/raysim); an algorithm keeps its files in a
    subfolder of its own."""


@dataclass(frozen=True, eq=False)
class TrainModel:
    """Request (server data only): `sgd` on a fresh model of architecture `model` over the samples (x, y) instead
    of a client's training split, e.g. pretraining a model on a pool of `ServerContext.pools`."""

    model: str
    """A raysim.models.zoo name; it may differ from the clients' model. Input shape and output size are the
    context's."""
    x: np.ndarray
    y: np.ndarray
    sgd: LocalSGD


ServerDataStep = Generator[TrainModel, SGDResult, Any]
"""`Algorithm.server_data`: yields TrainModel requests, receives their results, returns the server data."""


class Algorithm(ABC, Generic[P, C, S, B, U]):
    """One federated algorithm. Subclasses set `name` and `Settings` and implement the steps."""

    name: ClassVar[str]
    Settings: ClassVar[type[AlgorithmSettings]]
    Upload: ClassVar[type[Upload]]
    stacks: ClassVar[bool] = False
    """`client_step` also runs on a ClientChunk whose state is stacked (see ClientChunk and `run_stacked_step`):
    a vectorized host then updates a chunk of clients in a few array operations instead of one client at a time."""

    def __init__(self, settings: P, params: ParamSpec):
        self.settings = settings
        self.params = params
        """Layout of the flat parameter vector (names, shapes), for algorithms that act per layer."""

    @abstractmethod
    def init_server(self, init_params: Vector, num_clients: int) -> S:
        """Server state before round 0; every client starts from the same `init_params`."""

    @abstractmethod
    def init_client(self, client: ClientInfo, init_params: Vector) -> C:
        """Client state before round 0."""

    @abstractmethod
    def broadcast(self, server: S) -> B:
        """What the server sends to the selected clients this round."""

    @abstractmethod
    def client_step(self, client: ClientInfo, state: C, broadcast: B) -> ClientStep:
        """The local update of a selected client (a generator; see the module docstring)."""

    @abstractmethod
    def server_step(self, server: S, total: U, num_selected: int) -> tuple[S, dict[str, float]]:
        """The server update from the sum of the selected clients' uploads."""

    @abstractmethod
    def global_model(self, server: S) -> Vector:
        """The global model (GM) evaluated on every client."""

    def personalized_model(self, state: C) -> Vector | None:
        """The client's personalized model (PM); None means the client deploys the global model."""
        return None

    def evaluated_model(self, state: C, global_params: Vector) -> Vector | None:
        """The PM scored at evaluation, given the current global model (default: `personalized_model`)."""
        return self.personalized_model(state)

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep | None:
        """How a held-out client (`clients.heldout`: it never trains) gets its model from the current global
        one at evaluation, as a generator of requests like `client_step` (AugFL: one gradient step on its
        support set, augfl.md 2.3); None: it deploys the global model."""
        return None

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        """The data only the coordinator holds (e.g. a pretrained model and its transfer set), prepared once in
        the driver before any Ray work, as a generator that yields `TrainModel` requests (the runtime runs them
        with the local trainer and sends the results back) and returns the algorithm's own server-data object;
        it reaches `setup_server` on the coordinator and never a client host. None (default): no server data."""
        return None

    def setup_server(self, data: Any) -> None:
        """Take the server data that `server_data` returned (called once, on the coordinator only)."""

    def extra_models(self, state: C, global_params: Vector) -> dict[str, Vector]:
        """Further per-client models to score at evaluation, by name (FedSLR: `personal`, p_i alone); each is
        summarized as `<name>/acc`, `<name>/loss`, ... like PM and GM. Default: none."""
        return {}

    def uplink_bytes(self, upload: U) -> int:
        """Bytes one client sends for `upload`: its vectors and numbers as float32 (override for compression)."""
        return payload_bytes(upload)

    def downlink_bytes(self, broadcast: B) -> int:
        """Bytes each selected client receives for `broadcast`, as float32 (override for factorized models)."""
        return payload_bytes(broadcast)

    @classmethod
    def sends_messages(cls) -> bool:
        """Whether attacks and robust aggregation can act on this algorithm's uploads (see Upload)."""
        return cls.Upload.message_field is not None

    def message_coordinates(self, params: Vector) -> Vector:
        """The part of a full parameter vector that messages carry (all of it, unless the algorithm shares
        only part of the model); the coordinator uses it for the initial messages and the clipping centre."""
        return params

    def message(self, update: ClientUpdate) -> Vector:
        """The message an update sends: `update.message`, else the weighted upload field / its weight."""
        upload = update.upload
        if update.message is not None:
            return update.message
        if upload.message_field is None or upload.delta:
            raise NotImplementedError(f"algorithm {self.name!r}: set Upload.message_field and ClientUpdate.message")
        weight = getattr(upload, upload.weight_field) if upload.weight_field else 1.0
        return np.asarray(getattr(upload, upload.message_field), dtype=np.float64) / weight

    def previous_message(self, update: ClientUpdate) -> Vector | None:
        """For delta uploads, the message the server held for this client before the update."""
        upload = update.upload
        return self.message(update) - getattr(upload, upload.message_field) if upload.delta else None

    def upload_from_message(self, upload: U, message: Vector, previous: Vector | None = None) -> U:
        """`upload` changed to send `message` instead; `previous` is the client's last sent message (delta)."""
        if upload.delta:
            value = np.asarray(message, dtype=np.float64) - previous
        else:
            weight = getattr(upload, upload.weight_field) if upload.weight_field else 1.0
            value = weight * np.asarray(message, dtype=np.float64)
        return dataclasses.replace(upload, **{upload.message_field: value})  # type: ignore[type-var]


def payload_bytes(payload: object) -> int:
    """Size of a message sent as float32: arrays, numbers, and dataclasses / sequences of them; None is 0."""
    if payload is None:
        return 0
    if isinstance(payload, np.ndarray):
        return 4 * payload.size
    if isinstance(payload, int | float | np.number):
        return 4
    if dataclasses.is_dataclass(payload):
        return sum(payload_bytes(getattr(payload, f.name)) for f in dataclasses.fields(payload))
    if isinstance(payload, tuple | list):
        return sum(payload_bytes(item) for item in payload)
    raise TypeError(f"payload_bytes: cannot size a {type(payload).__name__}; override uplink/downlink_bytes")


def stack(items: Sequence[Any]) -> Any:
    """Dataclasses of vectors and numbers (client states, uploads, requests' results) as one of the same type whose
    vectors are [len(items), n] arrays and whose numbers are [len(items)] arrays; None fields stay None."""
    first = items[0]
    values = {}
    for f in dataclasses.fields(first):
        column = [getattr(item, f.name) for item in items]
        values[f.name] = None if column[0] is None else _stacked([np.asarray(v) for v in column])
    return dataclasses.replace(first, **values)


def _stacked(vectors: list[np.ndarray]) -> np.ndarray:
    """The vectors as rows of one array: a view when they are already consecutive rows of one (a chunk's states
    from its previous stacked step), else a stacked copy."""
    base = vectors[0].base
    if isinstance(base, np.ndarray) and base.ndim == 2 and base.flags.c_contiguous and vectors[0].ndim == 1:
        row_bytes, begin = base.strides[0], vectors[0].ctypes.data - base.ctypes.data
        start = begin // row_bytes
        consecutive = all(
            v.base is base and v.ctypes.data == base.ctypes.data + (start + i) * row_bytes and v.shape == base.shape[1:]
            for i, v in enumerate(vectors)
        )
        if consecutive and begin % row_bytes == 0 and start + len(vectors) <= len(base):
            return base[start : start + len(vectors)]
    return np.stack(vectors)


def unstack(stacked: Any, count: int) -> list[Any]:
    """The `count` rows of a stacked dataclass (see `stack`): vectors become views of their row, numbers floats or
    ints; a one-dimensional vector field of a request (one vector shared by every row) is shared by every row."""
    request = isinstance(stacked, LocalSGD | FullGradient)
    columns = {}
    for f in dataclasses.fields(stacked):
        value = getattr(stacked, f.name)
        if isinstance(value, np.ndarray) and value.ndim == 2:
            columns[f.name] = list(value)
        elif isinstance(value, np.ndarray) and value.ndim == 1 and not request:
            columns[f.name] = value.tolist()
        else:
            columns[f.name] = [value] * count
    kind = type(stacked)
    return [kind(**{name: column[i] for name, column in columns.items()}) for i in range(count)]


def run_stacked_step(
    algorithm: Algorithm,
    clients: Sequence[ClientInfo],
    states: Sequence[Any],
    broadcast: Any,
    execute_many: Callable[[list[tuple[int, Request]]], Sequence[Result]],
) -> list[ClientUpdate]:
    """The client steps of several clients as ONE step over their stacked states (`Algorithm.stacks`): each
    request it yields is split into the clients' own (rows, in the order of `clients`) for `execute_many`, as
    `run_client_steps` hands them over, and their results are stacked back. Returns each client's update, its
    vectors views of the rows of the step's arrays and its metrics numbers."""
    chunk = ClientChunk(tuple(clients))
    ids = [c.id for c in clients]
    count = len(ids)

    def execute(request: Request) -> Result:
        return stack(execute_many(list(zip(ids, unstack(request, count), strict=True))))

    update: ClientUpdate = drive(algorithm.client_step(chunk, stack(states), broadcast), execute)  # type: ignore[arg-type]
    metrics = {name: np.broadcast_to(value, (count,)).tolist() for name, value in update.metrics.items()}
    messages = [None] * count if update.message is None else list(update.message)
    return [
        ClientUpdate(state, upload, {name: float(values[i]) for name, values in metrics.items()}, message)
        for i, (state, upload, message) in enumerate(
            zip(unstack(update.state, count), unstack(update.upload, count), messages, strict=True)
        )
    ]


def drive(step: Generator, execute: Callable[[Any], Any]) -> Any:
    """Run a generator of requests (a client step, an adaptation) to completion; returns its value."""
    try:
        request = next(step)
        while True:
            request = step.send(execute(request))
    except StopIteration as finished:
        return finished.value


def run_client_step(
    algorithm: Algorithm,
    client: ClientInfo,
    state: Any,
    broadcast: Any,
    execute: Callable[[Any], Any],
) -> ClientUpdate:
    """Drive a client step to completion, executing each yielded request with `execute`."""
    return _with_float_metrics(drive(algorithm.client_step(client, state, broadcast), execute))


def _with_float_metrics(update: ClientUpdate) -> ClientUpdate:
    """The update with its metrics as Python floats (a step may compute them as numpy numbers)."""
    update.metrics = {name: float(value) for name, value in update.metrics.items()}
    return update


def run_client_steps(
    algorithm: Algorithm,
    clients: Sequence[ClientInfo],
    states: Sequence[Any],
    broadcast: Any,
    execute_many: Callable[[list[tuple[int, Request]]], Sequence[Result]],
) -> list[ClientUpdate]:
    """Drive the client steps of several clients together, so that an executor can run their requests at once.

    Every turn, the pending request of each unfinished client goes to `execute_many` in one list of
    (client id, request), in the order of `clients`; it returns their results in the same order, and each
    result is sent back to its client's step. A client's own requests come and go in the order that
    `run_client_step` gives them, so an executor that keys its randomness by client and request number
    gives the same results either way. Returns the updates in the order of `clients`.
    """
    steps = [algorithm.client_step(c, s, broadcast) for c, s in zip(clients, states, strict=True)]
    updates: list[ClientUpdate | None] = [None] * len(steps)
    pending: dict[int, Request] = {}

    def advance(position: int, result: Result | None) -> None:
        """Send a result (None: start) to a client's step; keep its next request, or its update when it ends."""
        try:
            pending[position] = steps[position].send(result)
        except StopIteration as finished:
            updates[position] = _with_float_metrics(finished.value)

    for position in range(len(steps)):
        advance(position, None)
    while pending:
        turn = sorted(pending)
        results = execute_many([(clients[p].id, pending.pop(p)) for p in turn])
        if len(results) != len(turn):
            raise ValueError(f"run_client_steps: {len(turn)} requests but {len(results)} results")
        for position, result in zip(turn, results, strict=True):
            advance(position, result)
    return updates  # type: ignore[return-value]
