"""Experiment configuration: one pydantic model, loaded from YAML with `--set key.path=value` overrides.

Every layer declares its own settings and this module composes them. The choice sections (`algorithm`, `dataset`,
`partition`) and the named parts (`model.name`, `attack.kind`, `aggregation.rule`) are looked up in their registries
(raysim.registry) when a config is validated, so that the plugins a config lists (`plugins:`, `--plugin`, installed
entry points; raysim.plugins), imported first, join them. Validation errors become one `ConfigError` line naming the
key path, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import yaml
from pydantic import Field, ValidationError, model_validator

import raysim.plugins as plugins
from raysim.algorithms import ALGORITHMS, AlgorithmSettings, SGDSettings
from raysim.credentials import redact
from raysim.data import DATASETS, PARTITIONS, DatasetSettings, SchemeSettings
from raysim.data.fashion_mnist import FashionMnistSettings
from raysim.data.partitions import QLabelSettings
from raysim.errors import ConfigError
from raysim.executors import EXECUTORS
from raysim.models.spec import ModelSettings
from raysim.registry import UNKNOWN, OneOf, Registry
from raysim.seeding import Kernels
from raysim.settings import Settings, field_keys
from raysim.threats.attacks import AttackSettings
from raysim.threats.robust import RobustSettings

CHOICES: dict[str, Registry[Any]] = {"algorithm": ALGORITHMS, "partition": PARTITIONS, "dataset": DATASETS}
"""The sections one key chooses the settings of (`algorithm.name`, `partition.scheme`, `dataset.name`)."""
CHOICE_DEFAULTS = {"dataset": "fashion_mnist"}
"""The choice a section that names none makes (the others must name theirs)."""
SWITCHES = {section: registry.field for section, registry in CHOICES.items()}
"""Sections whose settings depend on one key: switching it with --set drops the old choice's settings."""

if TYPE_CHECKING:  # what a type checker sees: the base settings of each choice
    AlgorithmChoice = AlgorithmSettings
    DatasetChoice = DatasetSettings
    PartitionChoice = SchemeSettings
else:  # validated by the chosen entry's settings when a config is validated (Registry.choice)
    AlgorithmChoice = ALGORITHMS.choice(AlgorithmSettings)
    DatasetChoice = DATASETS.choice(DatasetSettings, CHOICE_DEFAULTS["dataset"])
    PartitionChoice = PARTITIONS.choice(SchemeSettings)


class _Section(Settings):
    """One section of an experiment config."""


class ClientsSettings(_Section):
    count: int = Field(10, ge=1, description="m: number of simulated clients")
    per_round: int | None = Field(None, ge=1, description="s: clients sampled per round (uniform, no replacement)")
    fraction: float | None = Field(None, gt=0, le=1, description="or: this fraction of m per round")
    sampling: Literal["uniform", "bernoulli"] = Field(
        "uniform",
        description="uniform: exactly s of the m training clients, without replacement (the papers); bernoulli: each "
        "joins independently with probability s/m, the draw repeated while nobody joins, so |S^t| varies around s "
        "(FedSLR's authors' code, for their Alg. 2, App. A.4)",
    )
    weighting: Literal["uniform", "samples", "all_splits"] = Field(
        "uniform",
        description="alpha_i = 1/m (all FLAME experiments) or n_i/n, over the training clients, n_i counting the "
        "client's train split (samples) or all its splits, train, val and test (all_splits: AugFL's authors' code, "
        "w_i = (|D_i^s| + |D_i^q|) / sum_j, AugFL, eqs. (2)-(3))",
    )
    heldout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of clients (the last ids) that never train and are only evaluated, after the "
        "algorithm's fast adaptation (AugFL's target clients: 0.2, AugFL, Sec. VI)",
    )

    batches: Literal["raysim", "authors"] = Field(
        "raysim",
        description="each client's mini-batches: from raysim's seeded streams, or replayed as the FLAME authors' code "
        "draws them for the run's seed (their DataLoader shuffles and Ditto's random.choice, "
        "raysim.training.authors_batches); authors needs partition.draw and model.init authors, full participation, "
        "no attack, no quality-skew noise, no augmentation",
    )

    @model_validator(mode="after")
    def _check_sampling(self) -> ClientsSettings:
        if self.per_round is not None and self.fraction is not None:
            raise ValueError("set at most one of clients.per_round and clients.fraction")
        if self.training_count < 1:
            raise ValueError(f"clients.heldout={self.heldout} leaves no training client of clients.count={self.count}")
        if self.per_round is not None and self.per_round > self.training_count:
            raise ValueError(
                f"clients.per_round={self.per_round} exceeds the {self.training_count} training clients "
                f"(clients.count={self.count}, clients.heldout={self.heldout})"
            )
        return self

    @property
    def heldout_count(self) -> int:
        return int(round(self.heldout * self.count))

    @property
    def training_count(self) -> int:
        """m: the clients that train (ids 0..m-1); the held-out ones follow them."""
        return self.count - self.heldout_count

    def per_round_count(self) -> int:
        """How many clients take part in each round (all training clients by default: full participation)."""
        if self.per_round is not None:
            return self.per_round
        if self.fraction is not None:
            return max(1, int(self.fraction * self.training_count))
        return self.training_count


class RuntimeSettings(_Section):
    actors: Literal["ray", "in_process"] = Field(
        "ray",
        description="where the hosts and the coordinator run: Ray actors, or objects of the driver's process "
        "(in_process: no Ray starts and the hosts run one after another, the same results as on Ray; for a "
        "debugger, a profiler or a quick test)",
    )
    address: str | None = Field(None, description="Ray cluster address; default: RAY_ADDRESS or a new local Ray")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a new local Ray instance (default: all)")
    num_gpus: int | None = Field(None, ge=0, description="GPUs of a new local Ray instance (default: all detected)")
    num_hosts: int | None = Field(
        None, ge=1, description="client-host actors (default: CPUs / host_cpus, at most GPUs / host_gpus)"
    )
    host_cpus: float = Field(1.0, gt=0, description="CPUs reserved per host actor (fractions allowed)")
    host_gpus: float = Field(0.0, ge=0, description="GPUs per host actor (fractions allowed)")
    coordinator_cpus: float = Field(0.0, ge=0, description="CPUs reserved for the coordinator actor (0: shares them)")
    coordinator_gpus: float = Field(0.0, ge=0, description="GPUs for the coordinator actor (its server step)")
    placement: Literal["pack", "spread"] = Field(
        "pack", description="host actors in one placement group: packed onto few nodes or spread over nodes"
    )
    host_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="custom Ray resources each host actor needs (e.g. {worker: 1})"
    )
    coordinator_resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="custom Ray resources of the coordinator (e.g. {gpu_node: 1})"
    )
    torch_threads: int = Field(1, ge=1, description="torch threads per actor (same value => same results)")
    deterministic: Kernels = Field(
        "cudnn",
        description="torch kernels in every process that trains (hosts, coordinator, the driver's server-data "
        "training): cudnn: deterministic cuDNN convolutions, no benchmarking (the FLAME authors' "
        "code); all: also torch.use_deterministic_algorithms (an op without a deterministic kernel then fails, "
        "naming itself); fast: cuDNN benchmarks and picks its fastest kernels, so GPU runs may differ in the last "
        "bits. On a CPU the cuDNN choice changes nothing",
    )
    object_store_mb: int = Field(1024, ge=64, description="object store size of a new local Ray instance")
    reuse_actors: bool = Field(
        False,
        description="after a finished run, keep its hosts and coordinator for the next run of this driver process "
        "on the same Ray that needs the same resources (a notebook's or test's many short runs skip seconds of "
        "actor start each; renewed actors give the same results as new ones)",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="times a dead host/coordinator actor is replaced by a new one (per actor); the run then redoes "
        "rounds from the last checkpoint (needs tracking.checkpoint_every > 0)",
    )
    on_nonfinite: Literal["stop", "drop_client"] = Field(
        "stop", description="a NaN/inf client upload stops the run (run marked FAILED) or that upload is dropped"
    )
    max_empty_rounds: int = Field(
        0,
        ge=0,
        description="on_nonfinite=drop_client: consecutive rounds in which every upload was dropped that the run "
        "tolerates; one more stops it as on_nonfinite=stop would (0: the first such round stops it)",
    )
    restore_timeout_s: float = Field(
        300.0,
        gt=0,
        description="after an actor died, how long to wait for Ray to restart it before the run gives up (naming "
        "the actor)",
    )
    state_memory_mb: float | None = Field(
        None,
        ge=0,
        description="client state each host keeps in memory (MiB of arrays); with state_store=hosts the least "
        "recently used clients' states beyond it spill to disk and are read back exactly; with auto the shared store "
        "goes to disk when its columns exceed it times the hosts (None: no limit)",
    )
    spill_dir: str | None = Field(
        None,
        description="folder for client state on disk (removed when the run ends): the shared store's columns "
        "(state_store disk, or auto, which then chooses disk here; on a cluster a folder every node shares), or "
        "with state_store=hosts each host's spilled states, a path on each host's node; default: the system temp "
        "folder",
    )
    state_store: Literal["auto", "hosts", "memory", "disk"] = Field(
        "auto",
        description="where client state lives: `memory` or `disk`, one store addressed by client id, a file per "
        "state field in /dev/shm or in spill_dir, that every host of the node reads and writes, so a round's "
        "clients are dealt to the hosts by their cost (training samples), longest first, and no host idles while "
        "another has work (issue 49); `hosts`, each host keeps its own clients' (in memory, or spilled past "
        "state_memory_mb), for a cluster without a shared folder; `auto`: disk in spill_dir when it is set, else "
        "memory when the columns fit in half of /dev/shm's free space (and state_memory_mb times the hosts, if "
        "set), else disk in the temp folder (one line says so); on a Ray cluster of several nodes without "
        "spill_dir, hosts (one line says why). Same results bit for bit; the run's raysim.state_store tag names "
        "the store chosen",
    )
    memory_limit_mb: float | None = Field(
        None,
        gt=0,
        description="memory (MiB) the run's data, partition and client state may take on this machine, estimated "
        "before anything is loaded (raysim.runtime.memory): a run past it is refused in one line naming the setting "
        "to lower (None: what the machine has available, /proc/meminfo's MemAvailable or, when lower, its cgroup's "
        "memory.max less its usage)",
    )
    client_training: Annotated[str, OneOf(EXECUTORS, also=("auto",))] = Field(
        "auto",
        description="the executor that runs a host's selected clients' requests (raysim.executors, a plugin's too): "
        "one client at a time, or a chunk of them together "
        "(parameters stacked per layer, one batched step for all; same results up to float rounding, 2-3x faster "
        "for mlr, mlp and linear models; a stacking algorithm such as FLAME then updates a chunk's states as rows in "
        "place); auto: vectorized for Flatten/Linear/ReLU models and on hosts with GPUs, else sequential (a CNN "
        "trains faster one client at a time on a CPU)",
    )
    vectorize_chunk: int = Field(
        16,
        ge=1,
        description="client_training=vectorized: at most this many clients train together (bounds memory; on a "
        "CPU 8-16 keeps a chunk's batches in cache and is fastest, a GPU wants hundreds)",
    )

    @model_validator(mode="after")
    def _check_actors(self) -> RuntimeSettings:
        if self.actors == "in_process" and self.address is not None:
            raise ValueError(
                f"runtime.address={self.address!r}: runtime.actors=in_process runs the hosts in the driver's process "
                "and joins no Ray cluster; leave one of them out"
            )
        if self.state_store in ("memory", "disk") and self.state_memory_mb is not None:
            raise ValueError(
                f"runtime.state_memory_mb={self.state_memory_mb:g} budgets each host's own client state: it applies "
                f"to runtime.state_store=hosts, not {self.state_store} (the page cache holds a shared store's hot rows)"
            )
        return self


class TrackingSettings(_Section):
    uri: str | None = Field(None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite)")
    experiment: str = Field("raysim", description="the MLflow experiment the run is logged in (made if new)")
    artifact_root: str | None = Field(
        None,
        description="where to write a new experiment's artifacts: `<artifact_root>/<experiment>`, a folder "
        "(relative to the working folder of the command that makes the experiment) or a URI (file:///..., "
        "s3://bucket/path); an existing experiment keeps its own. Default: `mlartifacts/<experiment>` beside a "
        "sqlite database file, a tracking server's own artifact store (http://); required for a new experiment on "
        "another database store (postgresql://), where MLflow would use ./mlruns of whatever folder the run started in",
    )
    run_name: str | None = Field(
        None, description="the MLflow run's name (default: algorithm-dataset-partition-seed, e.g. flame-fmnist-q2-s1)"
    )
    eval_every: int = Field(1, ge=1, description="evaluate every N rounds (and always after the last)")
    eval_sample: int | None = Field(
        None,
        ge=1,
        description="score this many clients at each evaluation, a sample drawn once from the seed (the same clients "
        "every time, whatever the hosts), as a cross-device paper reports its accuracy: the summaries (pm/acc, ...) "
        "and the final client table are the sample's (held-out clients, clients.heldout, are always scored); None "
        "(or at least clients.count): every client. 100,000 "
        "clients' round-0 evaluation is most of a cross-device run's start-up",
    )
    auc_single_label: Literal["zero", "nan"] = Field(
        "zero", description="AUC of a test split with one label: 0 (FedAPM's code) or left out of the means"
    )
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N rounds (0: never); see `raysim resume`")
    checkpoint_dir: str = Field("checkpoints", description="folder of the checkpoints (one subfolder per run)")
    checkpoint_keep: int = Field(2, ge=1, description="complete checkpoints kept per run (older ones deleted)")
    flush_timeout_s: float = Field(
        600.0, ge=0, description="at the end, wait this long for metrics buffered during an MLflow outage"
    )
    connect_timeout_s: float = Field(
        10.0,
        gt=0,
        description="at the start, how long to try reaching the tracking server before the run fails (before Ray "
        "starts); once the run has started, outages are ridden out (see flush_timeout_s)",
    )
    gm_scored: Literal["after_aggregation", "before_aggregation"] = Field(
        "after_aggregation",
        description="score the global model made by the round's server step, or the one broadcast at the round's "
        "start, as the FLAME authors' clients score it (their GM series lags one round)",
    )
    loss_sum_batch: int = Field(
        100,
        ge=1,
        description="batch size of the FLAME authors' fairness unit: per client, the sum over test batches of the "
        "batch-mean loss (logged as */loss_sum_var, the variance of that sum across clients); also of the "
        "training loss with train_loss_unit batch_sum",
    )
    train_loss_unit: Literal["mean", "batch_sum"] = Field(
        "mean",
        description="unit of the scored training loss (*/train_loss): the mean over the training split, or the "
        "FedAPM authors' unit, the sum over its batches of loss_sum_batch samples of the batch-mean loss "
        "(set loss_sum_batch to their batch size, 50 on CIFAR-10)",
    )
    system_metrics: bool = Field(
        True,
        description="MLflow's system metrics (CPU, memory, disk, network, GPU) of the driver's machine every 10 s "
        "($MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL), in the run's System metrics tab",
    )
    color: str | None = Field(
        None,
        pattern=r"^#[0-9a-fA-F]{6}$",
        description="the run's colour (#rrggbb) in MLflow's charts and raysim's study figures; a suite or sweep "
        "gives each of its settings a colour of its own (all seeds of a setting share it) unless this is set",
    )
    group: str | None = Field(
        None,
        description="the setting this run belongs to (run tag raysim.group): MLflow's comparison view of a study "
        "groups its children by it, each setting's mean over seeds; a suite or sweep names each of its settings",
    )
    figures: list[Literal["png", "pdf", "svg"]] = Field(
        ["png", "pdf", "svg"],
        description="formats of the run's figures (convergence, partition): PNG for MLflow's UI, PDF and SVG for a "
        "paper; [] draws none, about a second saved per run (a sweep of many short trials)",
    )
    train_loss: bool | int = Field(
        True,
        description="score every client's training loss at every evaluation (true), never (false), or at every "
        "N-th evaluation (an integer N >= 1); the pass over the training data is 40-50 % of a small round",
    )
    save_models: Literal["all", "global", "none"] = Field(
        "all",
        description="the final models saved with a finished run: `all` the global model (artifact `global_model`, "
        "an MLflow PyTorch model: mlflow.pytorch.load_model) and every client's model its final scores are of, its "
        "personalized model or, without one (FedAvg), the global model (`client_models.npz`: client_id, params "
        "[clients x parameters] float32; clients x parameters x 4 bytes, gathered in the driver's memory: 4.4 MB "
        "for 10 clients of the quickstart's MLP, 4.5 GB for 100 of ResNet-18: see client_models_max_mb); "
        "`global` the global model only (parameters x 4 bytes); `none` neither",
    )
    client_models_max_mb: float = Field(
        1024.0,
        gt=0,
        description="with save_models = all, the clients' models are saved only when they take at most this many "
        "MB (clients x parameters x 4 bytes); a larger run saves the global model only and logs a warning naming "
        "this setting (a suite of 100 ResNet-18 clients would otherwise store 4.5 GB per run)",
    )

    @model_validator(mode="after")
    def _check_train_loss(self) -> TrackingSettings:
        if not isinstance(self.train_loss, bool) and self.train_loss < 1:
            raise ValueError(
                f"tracking.train_loss: must be true, false or an integer N >= 1 (every N-th evaluation), "
                f"got {self.train_loss}"
            )
        return self

    @property
    def train_loss_every(self) -> int:
        """Evaluations between training-loss passes: 1 every time, 0 never."""
        return int(self.train_loss) if isinstance(self.train_loss, bool) else self.train_loss


class NetworkSettings(_Section):
    """A simulated network that turns each round's bytes into a communication time (a stand-in for
    the WLAN wall time of FedSLR's Fig. 5); off until `bandwidth_mbps` is set."""

    bandwidth_mbps: float | None = Field(
        None, gt=0, description="link bandwidth in Mbit/s; set it to log traffic/round_seconds each round"
    )
    latency_ms: float = Field(0.0, ge=0, description="latency added once to each direction's transfer")
    link: Literal["shared", "per_client"] = Field(
        "shared",
        description="shared: the selected clients' transfers share one link (a WLAN; all bytes / bandwidth); "
        "per_client: each has its own link of that bandwidth, in parallel (the largest transfer / bandwidth)",
    )

    def seconds(self, transfers: list[float]) -> float:
        """Time to move one direction's transfers (bytes each): latency + bytes / bandwidth, over the link."""
        if self.bandwidth_mbps is None or not transfers:
            return 0.0
        moved = sum(transfers) if self.link == "shared" else max(transfers)
        return self.latency_ms / 1e3 + 8.0 * moved / (self.bandwidth_mbps * 1e6)


class ExperimentConfig(Settings):
    plugins: list[str] = Field(
        default_factory=list,
        description="modules or .py files (relative to the config file) imported before the config is validated, so "
        "that the algorithms, models, datasets, schemes, attacks and rules they register can be named here",
    )
    algorithm: AlgorithmChoice
    dataset: DatasetChoice = FashionMnistSettings()
    partition: PartitionChoice = QLabelSettings()
    model: ModelSettings = ModelSettings()
    clients: ClientsSettings = ClientsSettings()
    rounds: int = Field(100, ge=1, description="communication rounds T, each evaluated as tracking.eval_every says")
    seed: int = Field(
        1, ge=0, description="the seed of everything drawn: the partition, the model's start, each client's stream"
    )
    runtime: RuntimeSettings = RuntimeSettings()
    tracking: TrackingSettings = TrackingSettings()
    attack: AttackSettings = AttackSettings()
    aggregation: RobustSettings = RobustSettings()
    network: NetworkSettings = NetworkSettings()

    @model_validator(mode="after")
    def _check_messages(self) -> ExperimentConfig:
        """Byzantine attacks and robust aggregation act on the algorithm's message (see base.Upload)."""
        for key, used in (("attack.kind", self.attack.byzantine), ("aggregation.rule", self.aggregation.active)):
            if used and not ALGORITHMS.get(self.algorithm.name).Upload.carries_message():
                raise ValueError(
                    f"{key}: algorithm {self.algorithm.name!r} does not name the message it uploads "
                    "(Upload.message_field), so it supports only attack.kind none/label_poisoning and "
                    "aggregation.rule mean"
                )
        return self

    @model_validator(mode="after")
    def _check_diagnostics(self) -> ExperimentConfig:
        """The diagnostics' extra pass (algorithm.diagnostics) scores a client's loss, which a Byzantine client that
        skips training reports as NaN: its upload would be refused and the attack changed."""
        if getattr(self.algorithm, "diagnostics", False) and self.attack.byzantine and self.attack.training == "skip":
            raise ValueError(
                "algorithm.diagnostics: true needs attack.training train (Byzantine clients of training skip report "
                "no loss); allowed: diagnostics false, or attack.training train"
            )
        return self

    @model_validator(mode="after")
    def _check_loss_scale(self) -> ExperimentConfig:
        """loss_scale 1/m only where the client step applies it (Algorithm.scales_loss)."""
        if getattr(self.algorithm, "loss_scale", "1") != "1" and not ALGORITHMS.get(self.algorithm.name).scales_loss:
            raise ValueError(
                f"algorithm.loss_scale: algorithm {self.algorithm.name!r} does not scale its loss (FedAPM weights it "
                "by algorithm.alpha instead); allowed with loss_scale 1/m: "
                + ", ".join(name for name, entry in ALGORITHMS.items() if entry.scales_loss)
            )
        return self

    @model_validator(mode="after")
    def _check_authors_batches(self) -> ExperimentConfig:
        """Replaying the authors' mini-batches needs their stream of draws: their partition and model, every client
        training every round, and none of their draws that raysim makes elsewhere (raysim.training.authors_batches)."""
        if self.clients.batches != "authors":
            return self
        name = self.algorithm.name
        needs = [
            (
                ALGORITHMS.get(name).code_draws(self.algorithm) is None,
                "an algorithm and settings the authors' code has (flame; pfedme; ditto with global_resync false, "
                f"global_steps one_batch, epochs 1), not {name!r} with these settings",
            ),
            (getattr(self.partition, "draw", None) != "authors", "partition.draw: authors (their dealing and split)"),
            (self.model.init != "authors", "model.init: authors (their model's draws come first)"),
            (
                getattr(self.algorithm, "random_epochs", False),
                "algorithm.random_epochs: false (their random.randint draw of the epochs is not replayed)",
            ),
            (
                self.clients.per_round_count() != self.clients.count,
                "every client training every round (no clients.per_round, fraction or heldout)",
            ),
            (self.attack.kind != "none", "attack.kind: none (their attacks draw from the same streams)"),
            (
                self.partition.scheme == "quality",
                "no quality-skew partition (their noise is drawn from torch's stream at every sample access)",
            ),
            (self.dataset.augment != "none", "dataset.augment: none"),
        ]
        for missing, what in needs:
            if missing:
                raise ValueError(f"clients.batches=authors needs {what}; or use clients.batches: raysim")
        return self

    def shown(self) -> dict[str, Any]:
        """The resolved config as stored and shown anywhere (params, artifacts, manifests, jobs): the tracking
        URI's credentials redacted (raysim.credentials)."""
        tree = self.model_dump(mode="json", by_alias=True)
        tree["tracking"]["uri"] = redact(tree["tracking"]["uri"])
        return tree

    def flat(self) -> dict[str, Any]:
        """The resolved config as dotted keys (MLflow params), credentials redacted, and for local SGD the step on
        the unweighted loss f_i, `algorithm.effective_lr` (lr times the loss weight: loss_scale, FedAPM's alpha_i),
        which tells whether two methods compared run at matched steps."""
        flat = flatten(self.shown())
        if isinstance(self.algorithm, SGDSettings):
            flat["algorithm.effective_lr"] = self.algorithm.effective_lr(
                self.clients.training_count, self.clients.weighting
            )
        return flat

    def to_yaml(self) -> str:
        """The resolved config as YAML, credentials redacted."""
        return yaml.safe_dump(self.shown(), sort_keys=False)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


MAX_DEPTH = 50
"""Levels of nested lists and mappings a config may have: far more than any real one, far fewer than what
exhausts Python's recursion (in the YAML parser, copies, JSON dumps)."""


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and mappings more than `limit` levels deep (or refers to itself, as YAML
    anchors allow); without recursion, and linear in the size of a tree whose anchors repeat subtrees."""
    deepest: dict[int, int] = {}
    stack = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, dict | list | tuple | set):
            continue
        if level >= limit:
            return True
        if deepest.get(id(node), -1) >= level:
            continue
        deepest[id(node)] = level
        stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML was built with it: ten times faster than the pure-Python one (a suite of
hundreds of children reads its base files once per child)."""


def _parse_yaml(text: str, where: str, limit: int = MAX_DEPTH) -> Any:
    """YAML text as data; a ConfigError starting with `where` when it is not YAML or nested too deeply."""
    too_deep = ConfigError(f"{where}: nested too deeply (at most {MAX_DEPTH} levels of lists and mappings)")
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(error).split())})") from None
    except RecursionError:
        raise too_deep from None
    if _too_deep(data, limit):
        raise too_deep
    return data


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one `key.path=value` override in place. A text field's value (a name, a path, a URI, one of a
    field's choices: `tracking.experiment`, `dataset.root`) is taken as typed; any other value is parsed as YAML
    (3, 0.1, true, [a], {scheme: iid}), and one that holds a YAML comment (` #...`, which YAML would drop
    silently) is refused."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key.path=value")
    path, raw = assignment.split("=", 1)
    keys = _key_path(path)
    if _text_field(keys, tree):
        value: Any = raw
    else:
        value = _parse_yaml(raw, f"--set {path}", MAX_DEPTH - len(keys))
        comment = _yaml_comment(raw)
        if comment is not None:
            raise ConfigError(
                f"--set {path}: {comment!r} would be a YAML comment and dropped from the value "
                f"{raw!r}; quote the text that holds it, or leave the comment out"
            )
    set_value(tree, path, value)


def set_value(tree: dict[str, Any], path: str, value: Any) -> None:
    """Set `key.path` to a value that is already data (a suite run's or a sweep setting's YAML value) in place;
    the sections on the way are made when missing."""
    keys = _key_path(path)
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{path}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def _key_path(path: str) -> list[str]:
    keys = path.strip().split(".")
    if len(keys) > MAX_DEPTH:
        raise ConfigError(
            f"--set {'.'.join(keys[:3])}...: a key path of {len(keys)} keys is nested too deeply "
            f"(at most {MAX_DEPTH} levels)"
        )
    return keys


def _yaml_comment(text: str) -> str | None:
    """The comment in a YAML text (from its `#` to the end of its line), or None; a `#` inside a quoted or plain
    scalar (`"a #b"`, `a#b`) is not one. Comments are what lies between YAML's tokens besides white space."""
    try:
        tokens = list(yaml.scan(text))
    except yaml.YAMLError:
        return None
    for before, after in zip(tokens, tokens[1:], strict=False):
        gap = text[before.end_mark.index : after.start_mark.index]
        if "#" in gap:
            return gap[gap.index("#") :].splitlines()[0]
    return None


def _text_field(keys: list[str], tree: dict[str, Any]) -> bool:
    """Whether `keys` names a field whose values are text: `str`, a Literal of strings, or either or None. In a
    choice section (`algorithm`, `dataset`, `partition`) the fields are those of the settings the section chooses
    now (a plugin's included); the key that chooses (`algorithm.name`) is a name whatever the choice."""
    if len(keys) == 2 and SWITCHES.get(keys[0]) == keys[1]:
        return True
    model: Any = ExperimentConfig
    node: Any = tree
    for key in keys[:-1]:
        node = node.get(key, {}) if isinstance(node, dict) else {}
        if model is ExperimentConfig and key in SWITCHES:
            model = _chosen_model(key, node)
        else:
            field = _field(model, key)
            model = field.annotation if field is not None else None
        if not hasattr(model, "model_fields"):
            return False
    field = _field(model, keys[-1])
    return field is not None and _is_text(field.annotation)


def _chosen_model(section: str, node: Any) -> type[Settings] | None:
    """The settings model a choice section's raw settings choose, or None (no such name, or not a mapping)."""
    name = chosen(section, node) if isinstance(node, dict) else None
    return CHOICES[section].settings_of(name) if isinstance(name, str) and name in CHOICES[section] else None


def _field(model: Any, key: str) -> Any:
    """The pydantic field of `model` named or aliased `key` (an old name included), or None."""
    for name, field in getattr(model, "model_fields", {}).items():
        if key in field_keys(name, field):
            return field
    return None


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in arguments)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return len(arguments) == 1 and _is_text(arguments[0])
    return False


def choice_models(section: str) -> dict[str, type[Settings]]:
    """The settings model of each choice of a SWITCHES section (`algorithm`: name -> its Settings, `partition`:
    scheme -> its settings class, `dataset`: name -> its source's settings), from its registry."""
    registry = CHOICES[section]
    return {name: registry.settings_of(name) for name in registry}


def chosen(section: str, node: dict[str, Any]) -> str | None:
    """The choice a SWITCHES section's raw settings make (its key, else the section's default)."""
    return node.get(SWITCHES[section], CHOICE_DEFAULTS.get(section))


def apply_overrides(tree: dict[str, Any], assignments: list[str] | tuple[str, ...]) -> None:
    """Apply `--set` overrides in order. One that switches `partition.scheme`, `algorithm.name` or `dataset.name`
    drops the section's settings the new choice does not have (`q` when q_label becomes iid), unless another
    override sets them too (then they are refused as unknown keys)."""
    before = {
        section: (tree.get(section) or {}).get(key)
        for section, key in SWITCHES.items()
        if isinstance(tree.get(section), dict)
    }
    explicit: set[tuple[str, ...]] = set()
    for assignment in assignments:
        apply_override(tree, assignment)
        explicit.add(tuple(assignment.split("=", 1)[0].strip().split(".")))
    for section, key in SWITCHES.items():
        node = tree.get(section)
        if not isinstance(node, dict) or section not in before or node.get(key) == before[section]:
            continue
        allowed = set(_allowed_keys((section, key), tree))
        if not allowed:  # an unknown scheme or algorithm: validation names the allowed ones
            continue
        for name in [name for name in node if name not in allowed and (section, name) not in explicit]:
            del node[name]


def _allowed_keys(loc: tuple[Any, ...], data: dict[str, Any]) -> list[str]:
    """Field names valid at the parent of `loc` (for "did you mean" hints)."""
    model: Any = ExperimentConfig
    node: Any = data
    for key in loc[:-1]:
        node = node.get(key, {}) if isinstance(node, dict) else {}
        if model is ExperimentConfig and key in SWITCHES:
            name = chosen(key, node)
            model = None if name is None else choice_models(key).get(name)
        elif model is not None and key in getattr(model, "model_fields", {}):
            model = model.model_fields[key].annotation
        else:
            model = None
        if model is None or not hasattr(model, "model_fields"):
            return []
    return [f.alias or name for name, f in model.model_fields.items()]


def _key_text(key: Any) -> str:
    """A key as shown in an error: quoted when it is empty or has spaces or control characters, so the
    message stays one readable line."""
    text = str(key)
    return text if text and text.isprintable() and " " not in text else repr(text)


def _field_level(error: Mapping[str, Any]) -> Mapping[str, Any]:
    """The error with a refusal of raysim.settings (a bool for a number, a key given twice: raised for the whole
    model) located at its key, as pydantic locates its own field errors."""
    if error["type"] == "key_given_twice":
        return {**error, "loc": (*error["loc"], error["ctx"]["key"])}
    if error["type"] != "bool_for_number":
        return error
    ctx = error["ctx"]
    message = f"must be {ctx['kind']}, not a bool (got {ctx['value']})"
    return {**error, "loc": (*error["loc"], ctx["key"]), "msg": message}


def _format(error: Mapping[str, Any], data: dict[str, Any]) -> str:
    error = _field_level(error)
    loc = tuple(error["loc"])
    path = ".".join(_key_text(k) for k in loc) or "config"
    kind = error["type"]
    if kind == UNKNOWN:  # a name no registry entry has: the registry's own line, with close matches
        return f"{error['ctx']['config_key'] or path}: {error['msg']}"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc, data)
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        return f"{path}: unknown key{suggestion} (allowed: {', '.join(allowed)})"
    message = error["msg"]
    if kind == "value_error":
        return message.removeprefix("Value error, ")
    if kind in ("literal_error", "enum"):
        message = message.replace("Input should be", "must be")
    shown = "" if kind in ("missing", "bool_for_number", "key_given_twice") else f" (got {error['input']!r})"
    return f"{path}: {message}{shown}"


def with_plugins(data: dict[str, Any], base: Path | None, extra: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A raw config tree whose `plugins` (files relative to `base`, else the current directory) and `extra` plugins
    (resolved already, e.g. `--plugin`) are imported, listed as stored (raysim.plugins.resolve); a PluginError line
    for one that cannot be imported."""
    specs = plugins.resolve(data.get("plugins"), base, "plugins")
    specs += [spec for spec in extra if spec not in specs]
    plugins.load_all(specs)
    return {**data, "plugins": specs}


def validate_config(data: dict[str, Any]) -> ExperimentConfig:
    """A raw config tree as a validated ExperimentConfig, its plugins imported first; the first error as one
    ConfigError line naming the key."""
    if not isinstance(data, dict):
        raise ConfigError("config: the top level must be a mapping of sections")
    data = with_plugins(data, None)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format(error.errors()[0], data)) from None


def read_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A YAML file whose top level is a mapping; a ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read {what} ({error.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: {what} is not UTF-8 text (byte 0x{raw[error.start]:02x} at position {error.start})"
        ) from None
    data = _parse_yaml(text, str(path))
    if data is None:  # an empty file (or comments only) validated as every default, and named no field
        raise ConfigError(f"{path}: the {what} file is empty (no settings)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a {what} must be a mapping")
    return data


def top_level_keys(path: str | Path) -> set[str]:
    """The top-level keys of a YAML file (empty if it is unreadable), to tell experiments, suites and sweeps apart."""
    try:
        return set(read_mapping(path))
    except ConfigError:
        return set()


def is_suite_file(path: str | Path) -> bool:
    """Whether a YAML file is a suite (it has a top-level `runs:`) rather than one experiment."""
    return "runs" in top_level_keys(path)


def is_sweep_file(path: str | Path) -> bool:
    """Whether a YAML file is a sweep (it has a top-level `grid:` or `random:`)."""
    return bool({"grid", "random"} & top_level_keys(path))


def load_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), extra_plugins: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Read a YAML experiment, import its plugins and `extra_plugins` (`--plugin`, relative to the current
    directory), apply `--set` overrides, validate."""
    data = with_plugins(read_mapping(path), Path(path).parent, plugins.resolve(extra_plugins, None, "--plugin"))
    apply_overrides(data, overrides)
    return validate_config(data)


class ExperimentFamily(Settings):
    """A file of several experiments derived from one base experiment (suites and sweeps)."""

    kind: ClassVar[str] = "family"
    """What the file is called in error messages ("suite", "sweep")."""
    name: str = Field(min_length=1, description="name of the parent MLflow run")
    plugins: list[str] = Field(
        default_factory=list,
        description="plugins every child imports (module names or .py files relative to this file)",
    )
    base: dict[str, Any] | None = Field(None, description="the base experiment config, inline")
    base_config: str | None = Field(None, description="or: path of the base experiment YAML")

    @model_validator(mode="after")
    def _one_base(self) -> ExperimentFamily:
        if (self.base is None) == (self.base_config is None):
            raise ValueError("set exactly one of `base` and `base_config`")
        return self

    def base_tree(self) -> dict[str, Any]:
        """The base experiment as a raw config tree (a copy), with this file's plugins added to its own."""
        if self.base is not None:
            tree = copy.deepcopy(self.base)
        else:
            assert self.base_config is not None  # _one_base: one of the two is set
            base_config = Path(self.base_config)
            tree = with_plugins(read_mapping(base_config, "base_config"), base_config.parent)
        return with_plugins(tree, None, self.plugins)

    @classmethod
    def load(
        cls,
        path: str | Path,
        overrides: list[str] | tuple[str, ...] = (),
        extra_plugins: list[str] | tuple[str, ...] = (),
    ):
        """Read the file (`base_config` and plugin files are relative to it) and import its plugins and
        `extra_plugins` (`--plugin`); `--set` overrides apply to the base experiment."""
        path = Path(path)
        data = with_plugins(read_mapping(path, cls.kind), path.parent, plugins.resolve(extra_plugins, None, "--plugin"))
        if data.get("base_config") is not None:
            data["base_config"] = str(path.parent / data["base_config"])
        if isinstance(data.get("base"), dict):
            data["base"] = with_plugins(data["base"], path.parent)
        family = cls.parse(data, str(path))
        if not overrides:
            return family
        base = family.base_tree()
        apply_overrides(base, overrides)
        return family.model_copy(update={"base": base, "base_config": None})

    @classmethod
    def parse(cls, data: dict[str, Any], where: str):
        """Validate a raw tree; the first error as one ConfigError line naming `where` and the key."""
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            first = _field_level(error.errors()[0])
            key = ".".join(str(k) for k in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{where}: {key}: {message}" if key else f"{where}: {message}") from None
