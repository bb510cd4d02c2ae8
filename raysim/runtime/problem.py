"""Everything a run prepares in the driver before any Ray work: the data, its partition into clients, the
initial model, who attacks, the coordinator's private data (`Algorithm.server_data`, whose training requests run
here); and which clients each host owns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.interface import ServerContext, ServerSamples
from raysim.algorithms.requests import ServerDataStep, SGDResult, TrainModel
from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.data import ClientSplit, partition_dataset
from raysim.data.dataset import Dataset
from raysim.data.decoded import cache_folder
from raysim.data.partition_file import write_partition
from raysim.data.partitions import authors_attackers, check_classes
from raysim.errors import ConfigError
from raysim.execution.drivers import drive
from raysim.models.flat import FlatModel, ModelSpec
from raysim.models.parts import check_parts
from raysim.models.spec import ParamSpec
from raysim.runtime.memory import check_client_state, check_data
from raysim.runtime.placement import check_capacity, default_num_hosts
from raysim.runtime.state_store import state_nbytes
from raysim.seeding import Stream, rng, torch_seed, use_kernels
from raysim.threats.attacks import AttackPlan, attack_plan
from raysim.training.local import ClientData, Inputs, LocalTrainer

SERVER_ID = 10**9
"""The id under which the server's own requests draw from the client-training stream (SERVER_ID + the request's
number), beyond any client's id, so that they never share a client's randomness."""


@dataclass
class Problem:
    """Everything prepared in the driver before any Ray work: data, clients, initial model."""

    x: np.ndarray
    """The features as the dataset stores them (uint8 images for some); `inputs` makes rows model input."""
    y: np.ndarray
    model_spec: ModelSpec
    clients: list[tuple[ClientInfo, ClientSplit]]
    init_params: np.ndarray
    attack: AttackPlan | None = None
    """Who is malicious (drawn once per run from the seed) and how; None without an attack."""
    server_data: Any = None
    """The coordinator's private data (`Algorithm.server_data`), if the algorithm needs any."""
    num_training: int | None = None
    """m: clients 0..m-1 train; the rest are held out (evaluated only, `clients.heldout`). Default: all."""
    inputs: Inputs = Inputs()
    """The dataset's normalization (Dataset.mean/std) and dataset.augment, for the hosts."""
    params: ParamSpec | None = None
    """The layout of the model's flat parameter vector (what the coordinator needs of the model)."""
    state_bytes: int = 0
    """Bytes of one client's initial state (runtime.state_store = auto sizes the shared store's columns by it)."""

    def __post_init__(self) -> None:
        if self.num_training is None:
            self.num_training = len(self.clients)
        if self.params is None:
            self.params = self.model_spec.build().spec

    @property
    def malicious(self) -> frozenset[int]:
        return self.attack.malicious if self.attack is not None else frozenset()

    @property
    def heldout(self) -> frozenset[int]:
        assert self.num_training is not None  # __post_init__ sets it
        return frozenset(info.id for info, _ in self.clients if info.id >= self.num_training)


def prepare(config: ExperimentConfig) -> Problem:
    """Load and partition the data and draw the initial model; raises RaysimError on bad input, and refuses a run
    whose data, partition and client state will not fit in memory before loading anything (raysim.runtime.memory)."""
    budget = check_data(config)
    dataset = config.dataset.loaded(config.seed)
    check_classes(config.partition, dataset.y)
    splits = partition_dataset(
        dataset.y, config.clients.count, config.partition, config.seed, dataset.groups, dataset.test_start
    )
    spec = ModelSpec(config.model.name, dataset.input_shape, dataset.output_dim, dataset.task)
    try:
        model = spec.build()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.model.init == "zeros":  # the parameters; running statistics (BatchNorm) start as built
        init = np.where(model.spec.statistics_mask(), model.initial_parameters(0), 0.0).astype(np.float32)
    else:
        init_seed = config.seed if config.model.init == "authors" else torch_seed(config.seed, Stream.MODEL_INIT)
        init = model.initial_parameters(init_seed)
    if config.dataset.augment != "none" and len(dataset.input_shape) != 3:
        raise ConfigError(
            f"dataset.augment={config.dataset.augment} crops and flips images (channels, height, width); "
            f"dataset {config.dataset.name} has samples of shape {dataset.input_shape}"
        )
    inputs = Inputs(
        dataset.mean,
        dataset.std,
        config.dataset.augment,
        config.dataset.crop_padding,
        config.dataset.crop_probability,
        dataset.modalities.length_columns if dataset.modalities is not None else (),
    )
    m = config.clients.training_count

    def size(split: ClientSplit) -> int:
        """n_i of `clients.weighting`: the train split's samples, or all the client's (all_splits)."""
        return split.num_samples if config.clients.weighting == "all_splits" else len(split.train)

    total = sum(size(s) for s in splits[:m])

    def weight(split: ClientSplit) -> float:
        """alpha_i over the training clients; held-out clients never enter a server sum."""
        if split.client_id >= m:
            return 0.0
        return 1.0 / m if config.clients.weighting == "uniform" else size(split) / total

    clients = [(ClientInfo(s.client_id, len(s.train), weight(s), m), s) for s in splits]
    check_parts(config.algorithm, model.spec)  # layer counts, parameter patterns, presets: against this model
    algorithm = build_algorithm(config.algorithm, model.spec)
    data_bytes = sum(a.nbytes for a in (dataset.x, dataset.y, dataset.groups) if a is not None)
    one_state = algorithm.init_client(clients[0][0], init)
    check_client_state(config, budget, data_bytes, len(dataset.y), one_state, len(clients))
    context = server_context(config, dataset)
    step = algorithm.server_data(context)  # the coordinator's private data, prepared here before any Ray work
    server_data = None
    if step is not None:  # the driver trains the coordinator's data: with the run's kernels and threads
        use_kernels(config.runtime.deterministic)
        with torch_threads(config.runtime.torch_threads):
            server_data = run_server_requests(step, context)
    if config.attack.kind == "label_poisoning" and dataset.task != "classification":
        raise ConfigError(f"attack.kind=label_poisoning needs class labels; dataset {config.dataset.name} has none")
    attack = attack_of(config, dataset)
    return Problem(
        dataset.x, dataset.y, spec, clients, init, attack, server_data, m, inputs, model.spec, state_nbytes(one_state)
    )


def attack_of(config: ExperimentConfig, dataset: Dataset) -> AttackPlan | None:
    """Who attacks: the clients a partition file marks, else with `partition.draw: authors` the authors' next
    draw, else a draw from the seed; None without an attack."""
    count, m = config.clients.count, config.clients.training_count
    marked = config.partition.malicious(dataset.y, count)
    if marked and config.attack.kind == "none":
        where = f"partition.path={config.partition.path}" if hasattr(config.partition, "path") else "the partition"
        raise ConfigError(
            f"{where} marks clients {sorted(marked)[:10]} malicious, but attack.kind is none; set attack.kind, or "
            "write the partition without an attack"
        )
    if config.attack.kind == "none":
        return None
    attackers = config.attack.num_malicious(m)
    marked = marked or authors_attackers(config.partition, dataset.y, count, config.seed, attackers, dataset.groups, m)
    return attack_plan(config.attack, m, config.seed, marked)


def server_context(config: ExperimentConfig, dataset: Dataset) -> ServerContext:
    """What an algorithm may use to prepare its server data: the samples the partition keeps back from every
    client (`server_pools`, none for most schemes) as model input (normalized, never augmented), the models'
    shapes, the seed and the cache folder."""
    pools = config.partition.server_pools(len(dataset.y), config.seed)
    inputs = Inputs(dataset.mean, dataset.std)
    return ServerContext(
        partition=config.partition.scheme,
        val_fraction=getattr(config.partition, "val_fraction", 0.0),
        pools=tuple(ServerSamples(inputs.rows(dataset.x, pool), dataset.y[pool]) for pool in pools),
        dataset=config.dataset.name,
        model=config.model.name,
        input_shape=dataset.input_shape,
        num_classes=dataset.output_dim,
        task=dataset.task,
        seed=config.seed,
        cache=cache_folder(),
    )


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` (`runtime.torch_threads`, a host's) within the block, restored after:
    the driver's server-data training as a host would train (same value, same results), and no thread oversubscription
    of a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TrainingProgress(Protocol):
    """What `run_server_requests` tells of each TrainModel request it runs (raysim.tracking.progress.TrainingBar)."""

    def begin(self, request: TrainModel, steps: int) -> None:
        """A request of `steps` SGD steps starts."""

    def step(self, epoch: int, loss: float) -> None:
        """One step of epoch `epoch` (0-based) was taken, at mini-batch loss `loss`."""


def run_server_requests(step: ServerDataStep, context: ServerContext, progress: TrainingProgress | None = None) -> Any:
    """Drive a server-data generator (`Algorithm.server_data`) to completion in this process: each `TrainModel`
    request runs on the local trainer over the request's samples, reported to `progress` step by step."""
    number = 0

    def execute(request: TrainModel) -> SGDResult:
        nonlocal number
        model = FlatModel(request.model, context.input_shape, context.num_classes, context.task)
        none = np.arange(0)
        data = ClientData(request.x, request.y, np.arange(len(request.y)), none, none)
        generator = rng(context.seed, Stream.CLIENT_TRAINING, SERVER_ID + number)
        number += 1
        if progress is None:
            return LocalTrainer(model).train_model(request, data, generator)
        progress.begin(request, request.epochs * -(-len(request.y) // request.batch_size))
        return LocalTrainer(model).train_model(request, data, generator, progress.step)

    return drive(step, execute)


def assign_to_hosts(clients: list[tuple[ClientInfo, ClientSplit]], num_hosts: int) -> list[list[int]]:
    """Balance work: largest clients first, each to the host with the least training data so far."""
    loads = [0] * num_hosts
    owned: list[list[int]] = [[] for _ in range(num_hosts)]
    for info, _ in sorted(clients, key=lambda c: (-c[0].num_train, c[0].id)):
        target = loads.index(min(loads))
        owned[target].append(info.id)
        loads[target] += info.num_train
    return [sorted(ids) for ids in owned if ids]


def host_layout(
    runtime: RuntimeSettings,
    clients: list[tuple[ClientInfo, ClientSplit]],
    available: dict[str, float],
    cluster: dict[str, float],
) -> list[list[int]]:
    """The clients each host actor owns: `runtime.num_hosts` hosts (default: as many as the `available`
    resources hold), refused with one line naming the keys when the `cluster` cannot hold them all."""
    num_hosts = runtime.num_hosts or default_num_hosts(runtime, available)
    layout = assign_to_hosts(clients, min(num_hosts, len(clients)))
    check_capacity(runtime, len(layout), cluster)
    return layout


def sample_clients(
    seed: int, round_index: int, num_clients: int, per_round: int, sampling: str = "uniform"
) -> list[int]:
    """S^t from a stream keyed by the round (full participation if s = m): `uniform`, s clients without replacement;
    `bernoulli`, each client with probability s/m, drawn again while nobody is drawn (ClientsSettings.sampling)."""
    if per_round >= num_clients:
        return list(range(num_clients))
    generator = rng(seed, Stream.SAMPLING, round_index)
    if sampling == "bernoulli":
        while not (joined := generator.random(num_clients) < per_round / num_clients).any():
            pass
        return [int(c) for c in np.flatnonzero(joined)]
    chosen = generator.choice(num_clients, per_round, replace=False)
    return sorted(int(c) for c in chosen)


def save_partition(config: ExperimentConfig, out: Path) -> tuple[list[ClientSplit], frozenset[int]]:
    """`raysim partition`: the config's partition (and attacker set) written as a Parquet file that
    `partition: {scheme: file, path: OUT}` replays exactly; returns the clients and the attackers."""
    check_data(config)
    dataset = config.dataset.loaded(config.seed)
    check_classes(config.partition, dataset.y)
    splits = partition_dataset(
        dataset.y, config.clients.count, config.partition, config.seed, dataset.groups, dataset.test_start
    )
    attack = attack_of(config, dataset)
    malicious = attack.malicious if attack is not None else frozenset()
    description = {
        "dataset": config.dataset.name,
        "scheme": config.partition.scheme,
        "seed": config.seed,
        "clients": config.clients.count,
        "config": config.to_yaml(),
    }
    write_partition(out, splits, dataset.y, malicious, description)
    return splits, malicious
