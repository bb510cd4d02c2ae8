"""The algorithm interface: a client step and a server step over typed state, in plain Python over flat numpy vectors;
an algorithm knows nothing of Ray, and the runtime only moves its state and messages:

    broadcast = algorithm.broadcast(server)                       # coordinator, once per round
    update = client_step(client, state, broadcast)                # hosts, for each selected client
    total = sum of update.upload over the selected clients        # hosts sum, coordinator merges
    server, metrics = algorithm.server_step(server, total, n)     # coordinator

`client_step` yields requests (raysim.algorithms.requests) for its local work. `Algorithm` groups its hooks by what
they are for: the steps every algorithm writes; what evaluation scores; the message attacks and robust aggregation act
on; the server's own data; communication; the settings an example run needs and the authors' draws it replays. An
algorithm registers with `@ALGORITHMS.register()` (its `name`), a plugin's too.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np

from raysim.algorithms.requests import (
    Number,
    Request,
    Result,
    ServerDataStep,
    Vector,
)
from raysim.algorithms.settings import AlgorithmSettings
from raysim.examples import ExampleContext, Fragment
from raysim.models.composed import ComposedNetwork
from raysim.models.spec import ParamSpec
from raysim.registry import Registry

if TYPE_CHECKING:
    from typing_extensions import Self

    from raysim.data.dataset import Task


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

    @property
    def in_place(self) -> bool:
        """A single client's step never writes into its state's arrays (see ClientChunk.in_place)."""
        return False

    def may_write(self, keep: bool = False) -> bool:
        """Never: a single client's state is not donated (see ClientChunk.may_write)."""
        return False

    def writable(self, *arrays: np.ndarray, keep: bool = False) -> tuple[np.ndarray, ...]:
        """Copies of the state's `arrays` to write the new state into (see ClientChunk.writable)."""
        return tuple(array.copy() for array in arrays)


@dataclass(frozen=True)
class ClientChunk:
    """Several clients taken as one by a client step written over stacked state (`Algorithm.stacks`).

    Their vectors are the rows of [clients, n] arrays and each per-client number is a [clients] array (`per_row`
    shapes one to scale rows), so that the step's equations, written with broadcasting and reductions over the
    last axis (or with raysim.jit kernels over rows), run on one client's vectors (a ClientInfo) or on a chunk's
    rows alike."""

    clients: tuple[ClientInfo, ...]
    in_place: bool = False
    """The stacked state's arrays belong to this step: it may write the new state into them (and train in them,
    LocalSGD.in_place) instead of new arrays, as the runtime needs the old values no more (buffer donation)."""

    @property
    def id(self) -> np.ndarray:
        return np.array([c.id for c in self.clients], np.int64)

    @property
    def num_train(self) -> np.ndarray:
        return np.array([c.num_train for c in self.clients], np.int64)

    @property
    def weight(self) -> np.ndarray:
        """alpha_i of each client (float64, as exact as a ClientInfo's)."""
        return np.array([c.weight for c in self.clients], np.float64)

    @property
    def num_clients(self) -> int:
        return self.clients[0].num_clients

    def may_write(self, keep: bool = False) -> bool:
        """Whether the step may write into its state's arrays (and train in them, LocalSGD.in_place): the runtime
        donated them (`in_place`) and the step does not `keep` their old values to its end."""
        return self.in_place and not keep

    def writable(self, *arrays: np.ndarray, keep: bool = False) -> tuple[np.ndarray, ...]:
        """The state's `arrays`, to write the new state into: the arrays themselves when the step `may_write` into
        them, else copies."""
        return arrays if self.may_write(keep) else tuple(array.copy() for array in arrays)


def per_row(value: Number) -> np.ndarray:
    """A client's number, or a chunk's numbers [k], as float32 shaped to scale that client's vector or each row of
    the chunk's [k, n] arrays (a trailing axis of 1)."""
    return np.asarray(value, np.float32)[..., None]


@dataclass(frozen=True)
class CodeDraws:
    """A client's mini-batch draws per round in the FLAME authors' code (zsk66/FLAME update.py):
    passes over its training split (a local epoch, or the `list(trainloader)` of a Ditto copy step) and
    `random.choice` picks among a pass's batches (raysim.training.authors_batches)."""

    passes: int
    picks: int = 0


@dataclass
class Upload:
    """Base of the message types a client sends up.

    Subclasses are dataclasses whose fields are vectors or numbers. The runtime sums them field by
    field over the selected clients (exactly, in any order) and hands the server step that sum.

    Byzantine attacks and robust aggregation act on the *message* the paper says a client uploads
    (FLAME u_i, FedAvg the local model; FLAME's Sec. VI attacks). A subclass names the field that carries it:
    with `weight_field` (or none, weight 1) the field is weight * message (averaging servers); with
    `delta = True` it is message - previous message (running-sum servers whose global model is the
    mean of the m clients' latest messages, as FLAME's (14)).
    """

    message_field: ClassVar[str | None] = None
    weight_field: ClassVar[str | None] = None
    delta: ClassVar[bool] = False

    @classmethod
    def carries_message(cls) -> bool:
        """Whether attacks and robust aggregation can act on this upload (it names its message's field)."""
        return cls.message_field is not None

    def with_message(self, message: Vector, previous: Vector | None = None) -> Self:
        """This upload changed to send `message` instead; `previous`: the client's last sent message (delta)."""
        if self.message_field is None:
            raise NotImplementedError(f"{type(self).__name__} names no message_field")
        if self.delta:
            if previous is None:
                raise ValueError(f"{type(self).__name__} is a delta upload: it needs the client's previous message")
            value = np.asarray(message, dtype=np.float64) - previous
        else:
            weight = getattr(self, self.weight_field) if self.weight_field else 1.0
            value = weight * np.asarray(message, dtype=np.float64)
        return dataclasses.replace(self, **{self.message_field: value})


U = TypeVar("U", bound=Upload)


C = TypeVar("C")  # client state


S = TypeVar("S")  # server state


B = TypeVar("B")  # broadcast


P = TypeVar("P", bound=AlgorithmSettings)


@dataclass
class ClientUpdate(Generic[C, U]):
    state: C
    upload: U
    metrics: Mapping[str, Number] = field(default_factory=dict)
    """Python floats once a driver has run the step (raysim.execution); [clients] float64 arrays in a chunk's."""


ClientStep = Generator[Request, Result, ClientUpdate[C, U]]


AdaptStep = Generator[Request, Result, Vector]


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
    val_fraction: float
    """The share of each client's samples the partition holds out as its validation split (`partition.val_fraction`;
    a partition file may also list a client's validation samples itself)."""
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
    task: Task
    seed: int
    """The experiment seed (`seed`)."""
    cache: Path
    """raysim's cache folder ($RAYSIM_CACHE, default ~/.cache/raysim); an algorithm keeps its files in a
    subfolder of its own."""


@dataclass(frozen=True)
class FeatureData:
    """What a PM scored from features (Algorithm.feature_outputs) is computed from, all at the current global model:
    the host computes it with FlatModel.features and hands over numpy arrays only."""

    memory_features: np.ndarray
    """[n, d]: the features f(x) (the head's input) of the client's training samples."""
    memory_labels: np.ndarray
    """[n] int: their labels."""
    features: np.ndarray
    """[m, d]: the features of the samples scored (the client's evaluation block: test, train when scored, val)."""
    logits: np.ndarray
    """[m, C]: the global model's outputs on them."""
    rng: np.random.Generator | None = None
    """The client's draws at this evaluation."""


class Algorithm(ABC, Generic[P, C, S, B, U]):
    """One federated algorithm. Subclasses set `name` and `Settings` and implement the six abstract methods of the
    round; the other hooks, grouped below by what they are for, have defaults that most methods keep."""

    name: ClassVar[str]
    Settings: ClassVar[type[AlgorithmSettings]]
    Upload: ClassVar[type[Upload]]
    stacks: ClassVar[bool] = False
    """`client_step` also runs on a ClientChunk whose state is stacked (ClientChunk; raysim.execution.drivers):
    a vectorized host then updates a chunk of clients in a few array operations instead of one client at a time."""
    scales_loss: ClassVar[bool] = False
    """Its client step weights every local loss by `SGDSettings.loss_scale` (`SGDSettings.scaled`); the config
    refuses loss_scale 1/m for the others (FedAPM, FLAME and FedADMM weight their loss by alpha_i instead)."""

    # Construction.

    def __init__(self, settings: P, params: ParamSpec):
        self.settings = settings
        self.params = params
        """Layout of the flat parameter vector (names, shapes), for algorithms that act per layer."""

    def at_round(self, round_index: int) -> Self:
        """This algorithm as the client steps of round `round_index` run it: with `settings.at_round` (the round's
        learning rates, LrSchedule); itself when they are unchanged. The runtime steps every client with it."""
        settings = self.settings.at_round(round_index)
        if settings is self.settings:
            return self
        at_round = copy.copy(self)
        at_round.settings = settings
        return at_round

    # The round: state, what is sent, the two steps and the global model (the abstract methods).

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

    # A server that reads each client's message (robust aggregation's rules need them one by one).

    @classmethod
    def reads_messages(cls, settings: P) -> bool:
        """Whether, with these settings, the server step needs each selected client's own message by client id
        (`server_step_by_client`; FedSLR's per-client dual mirrors, Alg. 1/2): the hosts then send them beside the
        sum. Default: no, the sum is all the server reads."""
        return False

    def server_step_by_client(
        self, server: S, total: U, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[S, dict[str, float]]:
        """The server step of settings that `reads_messages`: `messages` maps each selected client's id to the
        message it sent (Algorithm.message). Default: `server_step`."""
        return self.server_step(server, total, num_selected)

    # Evaluation: the models each client is scored with.

    def personalized_model(self, state: C) -> Vector | None:
        """The client's personalized model (PM); None means the client deploys the global model."""
        return None

    def evaluated_model(self, state: C, global_params: Vector) -> Vector | None:
        """The PM scored at evaluation, given the current global model (default: `personalized_model`)."""
        return self.personalized_model(state)

    def personalized_network(self) -> ComposedNetwork | None:
        """What the PMs are when they are not vectors of the network's parameters: a personalized model built around
        the network (raysim.models.composed: FedCP's GatedHeads, GPFL's FeatureValve), whose vectors `composed_model`
        gives in place of `evaluated_model` and the hosts score with FlatModel.composed. Default None: the PM is the
        network's."""
        return None

    def composed_model(self, state: C, global_params: Vector, context: Any = None) -> Vector:
        """The PM as a vector of `personalized_network` (only asked of an algorithm that has one), given the current
        global model and `evaluation_context`."""
        raise NotImplementedError(f"algorithm {self.name!r} has no personalized network")

    def extra_models(self, state: C, global_params: Vector, context: Any = None) -> dict[str, Vector]:
        """Further per-client models to score at evaluation, by name (FedSLR: `personal`, p_i alone), given the
        global model and `evaluation_context`; each is summarized as `<name>/acc`, `<name>/loss`, ... like PM and
        GM. Default: none."""
        return {}

    def evaluation_context(self, server: S) -> Any:
        """What the clients' models at evaluation need of the server state besides the global model (FedProto: the
        global prototypes, for nearest-prototype inference); the runtime sends it to every host with the global
        model and it reaches `extra_models`. Default: None."""
        return None

    scores_from_features: ClassVar[bool] = False
    """Its PMs are scored from outputs computed from the global model's features (`feature_outputs`: kNN-Per's
    mixture with a kNN model over the client's training features), not from a parameter vector."""

    def feature_outputs(self, client: ClientInfo, state: C, data: FeatureData, context: Any = None) -> np.ndarray:
        """The PM's outputs [m, C] on the scored samples (scored as logits: softmax cross-entropy, argmax), from
        `data` and `evaluation_context` (only asked of an algorithm that `scores_from_features`)."""
        raise NotImplementedError(f"algorithm {self.name!r} scores no PM from features")

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep | None:
        """How a held-out client (`clients.heldout`: it never trains) gets its model from the current global
        one at evaluation, as a generator of requests like `client_step` (AugFL: one gradient step on its
        support set, AugFL, Sec. VI); None: it deploys the global model."""
        return None

    def model_tables(self, global_params: Vector) -> dict[str, dict[str, list]]:
        """Tables describing the final global model, by name, each as columns (name -> equally long lists): the run
        logs each as the artifacts `<name>.parquet` and `<name>.json` (an MLflow table) when it ends (FedSLR:
        `spectra`, the singular values of every matrixized layer of the GKR). Default: none."""
        return {}

    # Data only the server holds (a pretrained model, a transfer set).

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        """The data only the coordinator holds (e.g. a pretrained model and its transfer set), prepared once in
        the driver before any Ray work, as a generator that yields `TrainModel` requests (the runtime runs them
        with the local trainer and sends the results back) and returns the algorithm's own server-data object;
        it reaches `setup_server` on the coordinator and never a client host. None (default): no server data."""
        return None

    def setup_server(self, data: Any) -> None:
        """Take the server data that `server_data` returned (called once, on the coordinator only)."""

    # Communication and threats: bytes on the wire, and the message attacks and robust rules act on.

    def uplink_bytes(self, upload: U) -> int:
        """Bytes one client sends for `upload`: its vectors and numbers as float32 (override for compression)."""
        return payload_bytes(upload)

    def downlink_bytes(self, broadcast: B) -> int:
        """Bytes each selected client receives for `broadcast`, as float32 (override for factorized models)."""
        return payload_bytes(broadcast)

    def message(self, update: ClientUpdate) -> Vector:
        """The message an update sends (asked for only by attacks and robust aggregation): the upload's message
        field over its weight. The one way to supply it otherwise: an algorithm whose upload is a change of its
        message (Upload.delta) overrides this, computing the message from the new state."""
        upload = update.upload
        if upload.message_field is None or upload.delta:
            raise NotImplementedError(
                f"algorithm {self.name!r}: set Upload.message_field, and override Algorithm.message for a delta upload"
            )
        weight = getattr(upload, upload.weight_field) if upload.weight_field else 1.0
        return np.asarray(getattr(upload, upload.message_field), dtype=np.float64) / weight

    def message_coordinates(self, params: Vector) -> Vector:
        """The part of a full parameter vector that messages carry (all of it, unless the algorithm shares
        only part of the model); the coordinator uses it for the initial messages and the clipping centre."""
        return params

    # The configuration matrix and the authors' batches.

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """The config sections under which this algorithm runs in a small experiment (raysim.examples): its default
        settings; an algorithm that cannot run without other settings (a partition, a dataset) names them too."""
        return {"algorithm": {"name": cls.name}}

    @classmethod
    def code_draws(cls, settings: P) -> CodeDraws | None:
        """The mini-batch draws a client makes per round in the FLAME authors' code for these settings, in the
        order this algorithm's requests make them (`clients.batches: authors` replays them); None (default): no
        such code, or settings whose draws differ from it."""
        return None


class ServerReadsEachMessage(Algorithm[P, C, S, B, U]):
    """An algorithm whose server always reads each selected client's message (`server_step_by_client`: CFL's
    clusters, FedAMP's attention, the hypernetworks of pFedHN and pFedLA, ...), never the sum of uploads alone."""

    @classmethod
    def reads_messages(cls, settings: P) -> bool:
        return True

    def server_step(self, server: S, total: U, num_selected: int) -> tuple[S, dict[str, float]]:
        raise NotImplementedError(f"{self.name}'s server reads each client's message (server_step_by_client)")


def previous_message(algorithm: Algorithm, update: ClientUpdate) -> Vector | None:
    """For a delta upload, the message the server held for this client before the update (its new message minus
    the change it uploads); None otherwise."""
    upload = update.upload
    return algorithm.message(update) - getattr(upload, upload.message_field) if upload.delta else None


def _check_algorithm(name: str, entry: type[Algorithm]) -> None:
    """An algorithm class whose Settings answer to its name (`algorithm.name` chooses them)."""
    if not (isinstance(entry, type) and issubclass(entry, Algorithm)):
        raise TypeError(f"algorithm {name!r}: {entry!r} is not a subclass of raysim.algorithms.interface.Algorithm")
    settings = getattr(entry, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, AlgorithmSettings)):
        raise TypeError(f"algorithm {name!r}: {entry.__name__}.Settings must subclass AlgorithmSettings")
    if settings.model_fields["name"].default != name:
        raise TypeError(
            f"algorithm {name!r}: {entry.__name__}.Settings must declare name: Literal[{name!r}] = {name!r}"
        )


ALGORITHMS: Registry[type[Algorithm]] = Registry(
    "algorithm", "algorithm.name", settings=lambda entry: entry.Settings, check=_check_algorithm
)
"""The algorithms by `algorithm.name`: each registers with `@ALGORITHMS.register()` (its `name`), a plugin's too."""


NOT_SENT = {"sent": False}
"""Dataclass field metadata of a field that rides in an upload for the runtime to sum but is not communication
(`field(metadata=NOT_SENT)`: e.g. a diagnostic); payload_bytes does not count it."""


def payload_bytes(payload: object) -> int:
    """Size of a message sent as float32: arrays, numbers, and dataclasses (but their NOT_SENT fields) / sequences
    of them; None is 0."""
    if payload is None:
        return 0
    if isinstance(payload, np.ndarray):
        return 4 * payload.size
    if isinstance(payload, int | float | np.number):
        return 4
    if dataclasses.is_dataclass(payload):
        fields = [f for f in dataclasses.fields(payload) if f.metadata.get("sent", True)]
        return sum(payload_bytes(getattr(payload, f.name)) for f in fields)
    if isinstance(payload, tuple | list):
        return sum(payload_bytes(item) for item in payload)
    raise TypeError(f"payload_bytes: cannot size a {type(payload).__name__}; override uplink/downlink_bytes")


def server_metrics(model: Vector, previous: Vector) -> dict[str, float]:
    """What every server step logs: how far the global model moved this round."""
    return {"global_change": float(np.linalg.norm(model - previous))}
