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
time, or many clients at once). `run_client_step` drives the generator with any executor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from raysim.models.flat import ParamSpec

Vector = np.ndarray
"""A flat float32 parameter vector (see raysim.models.flat.ParamSpec for its layout)."""


class AlgorithmSettings(BaseModel):
    """Hyperparameters of one algorithm; subclasses add theirs. Validated from the config's `algorithm`."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
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
    """alpha_i: 1/m or n_i/n, from the config's `clients.weighting`."""
    num_clients: int


@dataclass(frozen=True, eq=False)
class LocalSGD:
    """Request: mini-batch SGD from `start` on the client's training split, minimising

        f_i(x) + (prox_weight/2) ||x - prox_center||^2 + <linear, x> + (weight_decay/2) ||x||^2

    for `epochs` passes of shuffled mini-batches (the last batch may be smaller).
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

    def __post_init__(self) -> None:
        if self.prox_weight and self.prox_center is None:
            raise ValueError("LocalSGD: prox_weight > 0 needs a prox_center")


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
    """


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


ClientStep = Generator[LocalSGD, SGDResult, ClientUpdate[C, U]]


class Algorithm(ABC, Generic[P, C, S, B, U]):
    """One federated algorithm. Subclasses set `name` and `Settings` and implement the steps."""

    name: ClassVar[str]
    Settings: ClassVar[type[AlgorithmSettings]]
    Upload: ClassVar[type[Upload]]

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


def run_client_step(
    algorithm: Algorithm,
    client: ClientInfo,
    state: Any,
    broadcast: Any,
    execute: Callable[[LocalSGD], SGDResult],
) -> ClientUpdate:
    """Drive a client step to completion, executing each yielded request with `execute`."""
    step = algorithm.client_step(client, state, broadcast)
    try:
        request = next(step)
        while True:
            request = step.send(execute(request))
    except StopIteration as finished:
        return finished.value
