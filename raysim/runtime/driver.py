"""The round driver: prepares data and clients, runs the rounds on Ray, and is the only MLflow writer.

Per round: sample clients; the coordinator's broadcast goes to the hosts through the object store (one
copy); each host runs its selected clients and sends the exact sum of their uploads straight to the
coordinator, only per-client metrics come back to the driver; the coordinator runs the server step;
every `eval_every` rounds the hosts evaluate PM and GM on every client; one `log_batch` per round.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch
import yaml
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.algorithms.base import ServerData
from raysim.attacks import AttackPlan, attack_plan
from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.data import ClientSplit, partition_dataset
from raysim.data.meta_partition import MetaSettings, server_indices
from raysim.data.partitions import label_counts
from raysim.data.sources import Dataset
from raysim.errors import ConfigError, Interrupted, RaysimError, sigterm_interrupts
from raysim.metrics import ClientEvaluation, mean_client_metrics, summarize
from raysim.runtime import checkpoint
from raysim.runtime.coordinator import Coordinator
from raysim.runtime.exact_sum import UploadRangeError
from raysim.runtime.host import DROPPED, UPLINK_BYTES, ClientHost, ModelSpec
from raysim.runtime.placement import HostPlacement, check_capacity, default_num_hosts
from raysim.seeding import Stream, rng, torch_seed
from raysim.tracking.credentials import connect_uri, redact, redact_text
from raysim.tracking.mlflow_writer import MlflowWriter, git_commit, resolve_tracking_uri
from raysim.tracking.reports import (
    write_client_table,
    write_convergence_plot,
    write_partition_heatmap,
    write_partition_table,
)


@dataclass
class Problem:
    """Everything prepared in the driver before any Ray work: data, clients, initial model."""

    x: np.ndarray
    y: np.ndarray
    model_spec: ModelSpec
    clients: list[tuple[ClientInfo, ClientSplit]]
    init_params: np.ndarray
    attack: AttackPlan | None = None
    """Who is malicious (drawn once per run from the seed) and how; None without an attack."""
    server_data: ServerData | None = None
    """The coordinator's private data (AugFL's PM and transfer set), if the algorithm needs any."""
    num_training: int | None = None
    """m: clients 0..m-1 train; the rest are held out (evaluated only, `clients.heldout`). Default: all."""

    def __post_init__(self) -> None:
        if self.num_training is None:
            self.num_training = len(self.clients)

    @property
    def malicious(self) -> frozenset[int]:
        return self.attack.malicious if self.attack is not None else frozenset()

    @property
    def heldout(self) -> frozenset[int]:
        return frozenset(info.id for info, _ in self.clients if info.id >= self.num_training)


@dataclass
class RunResult:
    run_id: str | None
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics logged at each step (round number, 0 = before training)."""
    final: list[ClientEvaluation] = field(default_factory=list)
    """Every client's final scores, attackers included (the summaries exclude them)."""
    summary: dict[str, float] = field(default_factory=dict)
    """Final and best-round summaries (`final/...`, `best/...`) over benign clients, logged at the last step."""
    malicious: list[int] = field(default_factory=list)


def prepare(config: ExperimentConfig) -> Problem:
    """Load and partition the data and draw the initial model; raises RaysimError on bad input."""
    dataset = config.dataset.load(config.seed)
    splits = partition_dataset(dataset.y, config.clients.count, config.partition, config.seed, dataset.groups)
    spec = ModelSpec(config.model.name, dataset.input_shape, dataset.output_dim, dataset.task)
    try:
        model = spec.build()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    init = model.initial_parameters(torch_seed(config.seed, Stream.MODEL_INIT))
    m = config.clients.training_count
    total_train = sum(len(s.train) for s in splits[:m])

    def weight(split: ClientSplit) -> float:
        """alpha_i over the training clients; held-out clients never enter a server sum."""
        if split.client_id >= m:
            return 0.0
        return 1.0 / m if config.clients.weighting == "uniform" else len(split.train) / total_train

    clients = [(ClientInfo(s.client_id, len(s.train), weight(s), m), s) for s in splits]
    algorithm = build_algorithm(config.algorithm, model.spec)
    server_data = _server_data(config, dataset) if algorithm.uses_server_data() else None
    if config.attack.kind == "label_poisoning" and dataset.task != "classification":
        raise ConfigError(f"attack.kind=label_poisoning needs class labels; dataset {config.dataset.name} has none")
    attack = attack_plan(config.attack, m, config.seed) if config.attack.kind != "none" else None
    return Problem(dataset.x, dataset.y, spec, clients, init, attack, server_data, m)


def _server_data(config: ExperimentConfig, dataset: Dataset) -> ServerData:
    """The pretrained model (cached, trained on first use) and the transfer set D_s, both from the held-back
    pools of the `meta` partition that no client holds."""
    from raysim.pretrain import load_pm

    if not isinstance(config.partition, MetaSettings):
        raise ConfigError(
            f"partition.scheme={config.partition.scheme}: algorithm {config.algorithm.name!r} with a pretrained "
            "model needs 'meta' (its held-back pools feed the PM and the server's transfer set)"
        )
    pm, architecture = load_pm(config, dataset)
    pool = server_indices(len(dataset.y), config.partition, config.seed)
    return ServerData(
        dataset.x[pool], dataset.y[pool], pm, architecture, config.model.name, dataset.input_shape,
        dataset.output_dim, config.seed,
    )  # fmt: skip


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


def new_local_ray(runtime: RuntimeSettings) -> dict[str, float] | None:
    """The CPUs and GPUs of the local Ray this run will start, or None when it joins a running Ray or a
    cluster (whose capacity is known only once connected)."""
    if ray.is_initialized() or runtime.address or os.environ.get("RAY_ADDRESS"):
        return None
    cpus = runtime.num_cpus or len(os.sched_getaffinity(0))
    gpus = runtime.num_gpus if runtime.num_gpus is not None else torch.cuda.device_count()
    return {"CPU": float(cpus), "GPU": float(gpus)}


def sample_clients(seed: int, round_index: int, num_clients: int, per_round: int) -> list[int]:
    """S^t: uniform without replacement from a stream keyed by the round (full participation if s = m)."""
    if per_round >= num_clients:
        return list(range(num_clients))
    chosen = rng(seed, Stream.SAMPLING, round_index).choice(num_clients, per_round, replace=False)
    return sorted(int(c) for c in chosen)


@contextmanager
def ray_session(config: ExperimentConfig) -> Iterator[None]:
    """Connect to `runtime.address` / $RAY_ADDRESS, or start a local Ray; leave Ray as it was found."""
    if ray.is_initialized():
        yield
        return
    address = config.runtime.address or os.environ.get("RAY_ADDRESS")
    local = new_local_ray(config.runtime)
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    if local is None:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(
            address="local",
            num_cpus=int(local["CPU"]),
            num_gpus=config.runtime.num_gpus,
            object_store_memory=config.runtime.object_store_mb * 2**20,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    try:
        with sigterm_interrupts():  # ray.init installed a SIGTERM handler that exits on the spot
            yield
    finally:
        ray.shutdown()
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


class NoUsableUpload(RaysimError):
    """Every selected client's upload was dropped for too many rounds in a row (runtime.max_empty_rounds)."""


class RecoveryError(RaysimError):
    """An actor that died was not back within runtime.restore_timeout_s; the message names it."""


class Simulation:
    """The actors of one run and the round loop over them."""

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        """`host_clients`: the clients each host owns (`host_layout`)."""
        self.config = config
        self.uplink_total = 0
        self.downlink_total = 0
        self.empty_rounds = 0
        """Consecutive rounds in which every selected upload was dropped (runtime.on_nonfinite = drop_client)."""
        runtime = config.runtime
        self.host_clients = host_clients
        by_id = {info.id: (info, split) for info, split in problem.clients}
        x_ref, y_ref, init_ref = ray.put(problem.x), ray.put(problem.y), ray.put(problem.init_params)
        server_ref = ray.put(problem.server_data)
        clients_refs = [ray.put([by_id[c] for c in ids]) for ids in host_clients]
        # Every constructor argument is a reference the driver keeps alive: Ray re-runs a restarted actor's
        # constructor with its original arguments, and a large inline argument (a host's client list is
        # ~280 KB on Fashion-MNIST) would have been freed after the first construction.
        self._refs = (x_ref, y_ref, init_ref, server_ref, *clients_refs)
        self.placement = HostPlacement.reserve(runtime, len(self.host_clients))
        host_actor = ray.remote(ClientHost)
        self.hosts = [
            host_actor.options(
                num_cpus=runtime.host_cpus,
                num_gpus=runtime.host_gpus,
                resources=runtime.host_resources,
                scheduling_strategy=self.placement.strategy(index),
                max_restarts=runtime.max_restarts,
                max_task_retries=0,
            ).remote(
                config.algorithm,
                problem.model_spec,
                x_ref,
                y_ref,
                clients_refs[index],
                init_ref,
                config.seed,
                runtime.torch_threads,
                attack=problem.attack,
                send_messages=config.aggregation.active,
                auc_single_label=config.tracking.auc_single_label,
                on_nonfinite=runtime.on_nonfinite,
                state_memory_mb=runtime.state_memory_mb,
                spill_dir=runtime.spill_dir,
                client_training=runtime.client_training,
                vectorize_chunk=runtime.vectorize_chunk,
                gpus=runtime.host_gpus,
            )
            for index, ids in enumerate(self.host_clients)
        ]
        self.coordinator = (
            ray.remote(Coordinator)
            .options(
                num_cpus=runtime.coordinator_cpus,
                num_gpus=runtime.coordinator_gpus,
                resources=runtime.coordinator_resources,
                max_restarts=runtime.max_restarts,
                max_task_retries=0,
            )
            .remote(
                config.algorithm,
                problem.model_spec,
                init_ref,
                problem.num_training,
                runtime.torch_threads,
                robust=config.aggregation,
                attack=config.attack,
                server_data=server_ref,
            )
        )

    def train_round(self, round_index: int) -> dict[str, float]:
        """One round of client steps and the server step; returns the round's metrics."""
        start = time.perf_counter()
        selected = set(
            sample_clients(
                self.config.seed,
                round_index,
                self.config.clients.training_count,
                self.config.clients.per_round_count(),
            )
        )
        broadcast = self.coordinator.broadcast.remote()
        downlink = self.coordinator.broadcast_bytes.remote()
        partials, record_refs = [], []
        for host, owned in zip(self.hosts, self.host_clients, strict=True):
            chosen = [c for c in owned if c in selected]
            if chosen:
                partial, records = host.train.options(num_returns=2).remote(round_index, chosen, broadcast)
                partials.append(partial)
                record_refs.append(records)
        records = [r for host_records in ray.get(record_refs) for r in host_records]
        self.dropped = [r["client_id"] for r in records if r.pop(DROPPED, 0.0)]
        self._check_usable(round_index, len(selected))
        trained = time.perf_counter()
        server_metrics = ray.get(self.coordinator.aggregate.remote(*partials))
        aggregated = time.perf_counter()
        return {
            **self._communication(records, ray.get(downlink) * len(selected)),
            **mean_client_metrics(records),
            **{f"server/{k}": v for k, v in server_metrics.items()},
            "clients/selected": float(len(selected)),
            **({"clients/dropped_nonfinite": float(len(self.dropped))} if self.dropped else {}),
            **self._state_memory(),
            "time/clients": trained - start,
            "time/aggregation": aggregated - trained,
        }

    def _check_usable(self, round_index: int, selected: int) -> None:
        """A round whose every upload was dropped moves nothing: after runtime.max_empty_rounds of them in a
        row the run stops, as a non-finite upload stops it with on_nonfinite = stop."""
        self.empty_rounds = self.empty_rounds + 1 if len(self.dropped) == selected else 0
        limit = self.config.runtime.max_empty_rounds
        if self.empty_rounds > limit:
            raise NoUsableUpload(
                f"round {round_index}: all {selected} selected uploads were non-finite and dropped"
                + (f", {self.empty_rounds} rounds in a row" if limit else "")
            )

    def _state_memory(self) -> dict[str, float]:
        """The hosts' state/* counts summed (runtime.state_memory_mb set: how many client states spilled)."""
        if self.config.runtime.state_memory_mb is None:
            return {}
        totals: dict[str, float] = {}
        for counts in ray.get([host.state_memory.remote() for host in self.hosts]):
            for key, value in counts.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def _communication(self, records: list[dict], downlink: int) -> dict[str, float]:
        """Bytes sent this round (uplink: each selected client's upload; downlink: broadcast x selected) and
        since the start; takes the per-client byte counts out of `records`."""
        uplink = sum(r.pop(UPLINK_BYTES) for r in records)
        self.uplink_total += uplink
        self.downlink_total += downlink
        return {
            "comm/uplink_bytes": float(uplink),
            "comm/downlink_bytes": float(downlink),
            "comm/uplink_bytes_total": float(self.uplink_total),
            "comm/downlink_bytes_total": float(self.downlink_total),
        }

    def evaluate(self) -> list[ClientEvaluation]:
        global_params = self.coordinator.global_model.remote()
        evaluations = [
            e for host_evals in ray.get([h.evaluate.remote(global_params) for h in self.hosts]) for e in host_evals
        ]
        return sorted(evaluations, key=lambda e: e.client_id)

    def client_states(self) -> dict[int, object]:
        return {c: s for states in ray.get([h.client_states.remote() for h in self.hosts]) for c, s in states.items()}

    def server_state(self) -> object:
        return ray.get(self.coordinator.server_state.remote())

    def save_checkpoint(self, directory: Path) -> None:
        """Every host writes its own clients' file in parallel; the coordinator writes the server state."""
        directory.mkdir(parents=True, exist_ok=True)
        ray.get(
            [host.save_checkpoint.remote(str(directory / f"host-{i}.npz")) for i, host in enumerate(self.hosts)]
            + [self.coordinator.save_checkpoint.remote(str(directory / "coordinator.npz"))]
        )

    def restore_checkpoint(self, directory: Path) -> None:
        """Load a checkpoint into every actor, waiting up to runtime.restore_timeout_s for the actors Ray is
        restarting (runtime.max_restarts); a RecoveryError names those that did not come back."""
        wait_s = self.config.runtime.restore_timeout_s
        actors = {f"host {i}": host for i, host in enumerate(self.hosts)} | {"coordinator": self.coordinator}

        def restore(name: str) -> ray.ObjectRef:
            if name == "coordinator":
                return self.coordinator.restore_checkpoint.remote(str(directory / "coordinator.npz"))
            return actors[name].restore_checkpoint.remote(str(directory))

        pending = {name: restore(name) for name in actors}
        deadline = time.monotonic() + wait_s
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            for name, ref in list(pending.items()):
                if ref not in done:
                    continue
                try:
                    ray.get(ref)
                    del pending[name]
                except ray.exceptions.RayActorError:  # still restarting: ask again shortly
                    time.sleep(0.5)
                    pending[name] = restore(name)
            if pending and time.monotonic() > deadline:
                raise RecoveryError(
                    f"{', '.join(pending)} not back {wait_s:g} s after dying (Ray restarts an actor at most "
                    f"runtime.max_restarts={self.config.runtime.max_restarts} times; wait longer with "
                    "runtime.restore_timeout_s)"
                )

    def close(self, wait_s: float = 10.0) -> None:
        """End the actors; hosts first remove their spilled client state (ray.kill skips Python's cleanup)."""
        if self.config.runtime.state_memory_mb is not None:
            ray.wait([host.close.remote() for host in self.hosts], num_returns=len(self.hosts), timeout=wait_s)
        for actor in [*self.hosts, self.coordinator]:
            ray.kill(actor)
        self.placement.release()


def _progress(console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("PM {task.fields[pm]}  GM {task.fields[gm]}  HM {task.fields[hm]}  {task.fields[secs]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=console is None,
    )


DRIVER_TAG = "raysim.driver"
"""Run tag: `host:pid` of the driver process that writes the run."""


class DivergenceError(RaysimError):
    """A client's upload had NaN/inf (runtime.on_nonfinite = stop); the message names the round and client."""


def run_experiment(
    config: ExperimentConfig,
    show_progress: bool = True,
    inspect=None,
    parent: str | None = None,
    resume: Path | None = None,
    tracking_uri: str | None = None,
) -> RunResult:
    """Run one experiment end to end and log it to MLflow.

    `inspect(round_index, simulation)`, if given, is called after every round (tests use it to check
    invariants on live state). `parent` is the MLflow run id to nest this run under (raysim.suite).
    `resume` is a checkpoint folder: the same MLflow run continues from it (see `resume_experiment`), logged
    to `tracking_uri` if given, else to the URI the checkpoint names.

    Everything that can be refused is checked before Ray or MLflow work: the data and partition, the hosts
    against a new local Ray's CPUs and GPUs, and the tracking store's reachability (joining a cluster, the
    hosts are checked once connected, still before the MLflow run is created).
    """
    problem = prepare(config)
    local = new_local_ray(config.runtime)
    if local is not None:
        host_layout(config.runtime, problem.clients, local, local)
    manifest = checkpoint.read_manifest(resume) if resume is not None else None
    uri = tracking_uri or (manifest["tracking_uri"] if manifest else resolve_tracking_uri(config.tracking.uri))
    writer = MlflowWriter(uri, config.tracking.experiment, connect_timeout_s=config.tracking.connect_timeout_s)
    result = RunResult(None, malicious=sorted(problem.malicious))
    console = Console(stderr=True) if show_progress else None
    rounds: _Rounds | None = None
    timeout = config.tracking.flush_timeout_s
    try:
        with ray_session(config):
            layout = host_layout(config.runtime, problem.clients, ray.available_resources(), ray.cluster_resources())
            result.run_id = _open_run(config, problem, writer, manifest, parent)
            if console:
                verb = f"resuming from {resume}" if resume else "run"
                console.print(
                    f"[bold]raysim[/] {config.algorithm.name} on {config.dataset.name}: {verb} {result.run_id} "
                    f"at {writer.shown_uri}"
                )
            rounds = _Rounds(config, writer, result, console, inspect, problem, resume)
            if manifest is None:
                _write_partition_summary(config, problem, writer)
            simulation = Simulation(config, problem, layout)
            writer.set_tags({"raysim.hosts": str(len(simulation.hosts))})
            try:
                rounds.run(simulation)
            finally:
                simulation.close()
        _write_artifacts(config, problem, writer, result)
    except (UploadRangeError, NoUsableUpload) as error:
        message = str(getattr(error, "cause", None) or error).strip().splitlines()[-1]
        writer.set_tags({"raysim.error": message})
        writer.finish("FAILED", timeout)
        kept = f"; last good checkpoint {rounds.latest}" if rounds is not None and rounds.latest else ""
        switch = "runtime.on_nonfinite=stop"
        if isinstance(error, NoUsableUpload):
            switch = f"runtime.on_nonfinite=drop_client, runtime.max_empty_rounds={config.runtime.max_empty_rounds}"
        raise DivergenceError(f"run {result.run_id} stopped: {message}{kept} ({switch})") from None
    except KeyboardInterrupt as interrupt:
        raise _interrupted(interrupt, config, writer, result, rounds) from None
    except BaseException as error:
        if result.run_id is not None:
            writer.set_tags({"raysim.error": redact_text(str(error).strip().splitlines()[-1] if str(error) else
                                                         type(error).__name__)})  # fmt: skip
        writer.finish("FAILED", timeout)
        raise
    writer.finish("FINISHED", timeout)
    return result


def _open_run(
    config: ExperimentConfig, problem: Problem, writer: MlflowWriter, manifest: dict | None, parent: str | None
) -> str:
    """Create the MLflow run (or reopen a resumed one), tagged with this driver's host and process id so that a
    run whose driver was killed outright (it stays RUNNING) can be told apart (`raysim resume` lists them)."""
    if manifest is not None:
        run_id = manifest["run_id"]
        writer.reopen(run_id)
    else:
        run_id = writer.start(
            config.tracking.run_name,
            config.flat(),
            {
                "algorithm": config.algorithm.name,
                "dataset": config.dataset.name,
                "partition": config.partition.scheme,
                "attack": config.attack.kind,
                "aggregation": config.aggregation.rule,
                "malicious_clients": ",".join(str(c) for c in sorted(problem.malicious)),
                "git_commit": git_commit(),
            },
            parent=parent,
        )
    writer.set_tags({DRIVER_TAG: f"{socket.gethostname()}:{os.getpid()}"})
    return run_id


def _interrupted(
    interrupt: KeyboardInterrupt, config: ExperimentConfig, writer: MlflowWriter, result: RunResult, rounds
) -> Interrupted:
    """Ctrl-C or SIGTERM: the run is marked KILLED (what it had logged stays) and the user is told how to go
    on; one line, no traceback (raysim.cli)."""
    number = getattr(interrupt, "signal_number", signal.SIGINT)
    name = signal.Signals(number).name
    done = max(result.history, default=0)
    if result.run_id is None:
        writer.finish("KILLED", 0)
        return Interrupted(f"interrupted by {name} before the run started", number)
    writer.set_tags({"raysim.error": f"interrupted by {name} after round {done}"})
    writer.finish("KILLED", config.tracking.flush_timeout_s)
    latest = rounds.latest if rounds is not None else None
    hint = f"; continue with `raysim resume {result.run_id}`" if latest else ""
    return Interrupted(
        f"run {result.run_id} interrupted by {name} after round {done} of {config.rounds}: marked KILLED{hint}", number
    )


def resume_experiment(target: str, tracking_uri: str | None = None, show_progress: bool = True, inspect=None):
    """Continue a run from its last complete checkpoint: `target` is a checkpoint folder (a run's or one
    round's) or an MLflow run id whose `raysim.checkpoint` tag names one. `tracking_uri` is where to look the
    run id up and, if given, where the run is logged (a checkpoint stores its URI with credentials redacted:
    give them in MLflow's variables, or here)."""
    path = Path(target)
    if not path.exists():
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = resolve_tracking_uri(tracking_uri)
        try:
            tags = MlflowClient(connect_uri(uri)).get_run(target).data.tags
        except MlflowException:
            raise checkpoint.CheckpointError(
                f"{target}: neither a checkpoint folder nor a run id in {redact(uri)}"
            ) from None
        if "raysim.checkpoint" not in tags:
            raise checkpoint.CheckpointError(f"run {target} has no checkpoint (tracking.checkpoint_every was 0)")
        path = Path(tags["raysim.checkpoint"]).parent
    directory = checkpoint.latest_checkpoint(path)
    from raysim.config import validate_config

    config = validate_config(yaml.safe_load(checkpoint.read_manifest(directory)["config"]))
    return run_experiment(config, show_progress, inspect, resume=directory, tracking_uri=tracking_uri)


@dataclass(frozen=True)
class ResumableRun:
    """A run that did not finish and has a checkpoint to continue from."""

    run_id: str
    experiment: str
    status: str
    driver: str
    """`alive (host:pid)`, `gone (host:pid)` (killed outright: the run still says RUNNING), or `on host` when
    the driver ran on another machine."""
    checkpoint: str
    started: float


def resumable_runs(tracking_uri: str | None = None) -> list[ResumableRun]:
    """Every run of the tracking store that has a checkpoint and is not FINISHED, newest first. A driver
    killed with SIGKILL cannot mark its run: it stays RUNNING, and `driver` says whether its process is gone."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(connect_uri(resolve_tracking_uri(tracking_uri)))
    experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    found = []
    for run in client.search_runs(list(experiments), "attributes.status != 'FINISHED'", max_results=1000):
        tags = run.data.tags
        if "raysim.checkpoint" not in tags:
            continue
        found.append(
            ResumableRun(
                run.info.run_id, experiments[run.info.experiment_id], run.info.status,
                _driver_state(tags.get(DRIVER_TAG, "")), tags["raysim.checkpoint"], run.info.start_time / 1000,
            )
        )  # fmt: skip
    return sorted(found, key=lambda r: -r.started)


def _driver_state(tag: str) -> str:
    host, _, pid = tag.rpartition(":")
    if not pid.isdigit():
        return "unknown"
    if host != socket.gethostname():
        return f"on {host}"
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return f"gone ({tag})"
    except PermissionError:
        pass
    return f"alive ({tag})"


def benign_summary(
    evaluations: list[ClientEvaluation], malicious: frozenset[int], heldout: frozenset[int] = frozenset()
) -> dict[str, float]:
    """Across-client summaries over the benign training clients (flame.md 4.1: attackers are not scored), and
    over the held-out clients (`clients.heldout`) as `heldout/...`."""
    summary = summarize([e for e in evaluations if e.client_id not in malicious | heldout])
    held = [e for e in evaluations if e.client_id in heldout]
    return summary | ({f"heldout/{k}": v for k, v in summarize(held).items()} if held else {})


class _Rounds:
    """The round loop with checkpoints, recovery from dead actors, and resume."""

    def __init__(self, config, writer, result: RunResult, console, inspect, problem: Problem, resume: Path | None):
        self.config, self.writer, self.result = config, writer, result
        self.console, self.inspect = console, inspect
        self.malicious, self.heldout = problem.malicious, problem.heldout
        self.resume = resume
        tracking = config.tracking
        self.folder = Path(tracking.checkpoint_dir).resolve() / result.run_id if tracking.checkpoint_every else None
        if resume is not None:  # keep writing next to the checkpoint resumed from, wherever it was started
            self.folder = resume.resolve().parent
        self.latest: Path | None = resume
        self.logged_through = -1
        """Steps up to this one are in MLflow already (not logged again after a recovery or resume)."""

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.logged_through:
            self.writer.log_metrics(step, metrics)
            self.logged_through = step

    def _checkpoint(self, simulation: Simulation, step: int) -> None:
        directory = checkpoint.round_dir(self.folder.parent, self.folder.name, step)
        simulation.save_checkpoint(directory)
        checkpoint.write_manifest(
            directory,
            {
                "run_id": self.result.run_id,
                "round": step,
                "tracking_uri": self.writer.shown_uri,
                "config": self.config.to_yaml(),
                "history": self.result.history,
                "uplink_total": simulation.uplink_total,
                "downlink_total": simulation.downlink_total,
                "hosts": len(simulation.hosts),
                "sampler": "none: clients are drawn from a stream keyed by (seed, round), no RNG state to keep",
                "written": time.time(),
            },
        )
        self.latest = directory
        self.writer.set_tags({"raysim.checkpoint": str(directory)})
        checkpoint.prune(self.folder, self.config.tracking.checkpoint_keep)

    def _restore(self, simulation: Simulation, directory: Path) -> int:
        """Every actor takes its state from the checkpoint; the driver its history; returns the round."""
        simulation.restore_checkpoint(directory)
        manifest = checkpoint.read_manifest(directory)
        self.result.history = {int(k): v for k, v in manifest["history"].items()}
        simulation.uplink_total = manifest["uplink_total"]
        simulation.downlink_total = manifest["downlink_total"]
        return int(manifest["round"])

    def run(self, simulation: Simulation) -> None:
        config, result = self.config, self.result
        evaluations: list[ClientEvaluation] = []
        if self.resume is not None:
            round_index = self._restore(simulation, self.resume)
            self.logged_through = max(self.writer.last_step("time/round"), self.writer.last_step("pm/acc"))
            for step in sorted(result.history):  # what the dead driver had not yet sent
                self._log(step, result.history[step])
        else:
            evaluations = simulation.evaluate()
            result.history[0] = benign_summary(evaluations, self.malicious, self.heldout)
            self._log(0, result.history[0])
            round_index = 0
            if self.folder is not None:
                self._checkpoint(simulation, 0)
        with _progress(self.console) as progress:
            task = progress.add_task("round", total=config.rounds, pm="-", gm="-", hm="-", secs="")
            progress.update(task, completed=round_index)
            while round_index < config.rounds:
                step = round_index + 1
                try:
                    metrics, evaluated = self._round(simulation, round_index)
                    if self.folder is not None and (step % config.tracking.checkpoint_every == 0):
                        self._checkpoint(simulation, step)
                except ray.exceptions.RayActorError as error:
                    if self.latest is None:
                        raise
                    if self.console:
                        self.console.print(f"[yellow]round {step}: actor lost ({type(error).__name__}); "
                                           f"restoring {self.latest}[/]")  # fmt: skip
                    round_index = self._restore(simulation, self.latest)
                    progress.update(task, completed=round_index)
                    continue
                evaluations = evaluated or evaluations
                if self.inspect is not None:
                    self.inspect(round_index, simulation)
                shown = {k: f"{metrics[f'{k}/acc']:.4f}" for k in ("pm", "gm", "hm") if f"{k}/acc" in metrics}
                progress.update(task, advance=1, **shown, secs=f"{metrics['time/round']:.2f}s/round")
                round_index += 1
        result.final = evaluations
        finals = benign_summary(evaluations, self.malicious, self.heldout)
        evaluated_rounds = [r for r in result.history if "pm/acc" in result.history[r]]
        best = {
            f"best/{k}": max(result.history[r][k] for r in evaluated_rounds) for k in ("pm/acc", "gm/acc", "hm/acc")
        }
        result.summary = {f"final/{k}": v for k, v in finals.items()} | best
        self.writer.log_metrics(config.rounds, result.summary)

    def _round(self, simulation: Simulation, round_index: int) -> tuple[dict[str, float], list[ClientEvaluation]]:
        start = time.perf_counter()
        metrics = simulation.train_round(round_index)
        step = round_index + 1
        evaluations: list[ClientEvaluation] = []
        if step % self.config.tracking.eval_every == 0 or step == self.config.rounds:
            evaluated = time.perf_counter()
            evaluations = simulation.evaluate()
            metrics |= benign_summary(evaluations, self.malicious, self.heldout)
            metrics["time/evaluation"] = time.perf_counter() - evaluated
        metrics["time/round"] = time.perf_counter() - start
        self.result.history[step] = metrics
        self._log(step, metrics)
        return metrics, evaluations


def _write_partition_summary(config: ExperimentConfig, problem: Problem, writer: MlflowWriter) -> None:
    """partition.parquet (per client and label: train/test/val counts) and partition.png (label shares)."""
    if problem.model_spec.task != "classification":
        return
    splits = [split for _, split in problem.clients]
    counts = label_counts(splits, problem.y, problem.model_spec.outputs)
    extra = {s.client_id: {"noise_std": s.noise_std, "malicious": s.client_id in problem.malicious} for s in splits}
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        write_partition_table(counts, extra, folder / "partition.parquet")
        write_partition_heatmap(
            counts, f"{config.partition.scheme} partition of {config.dataset.name}", folder / "partition.png"
        )
        for name in ("partition.parquet", "partition.png"):
            writer.log_artifact(folder / name)


def _write_artifacts(config: ExperimentConfig, problem: Problem, writer: MlflowWriter, result: RunResult) -> None:
    sizes = {
        info.id: {
            "num_train": info.num_train,
            "num_test": len(split.test),
            "malicious": info.id in problem.malicious,
            "heldout": info.heldout,
        }
        for info, split in problem.clients
    }
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        (folder / "config.yaml").write_text(config.to_yaml())
        write_client_table(result.final, sizes, folder / "clients.parquet")
        write_convergence_plot(
            result.history, f"{config.algorithm.name} on {config.dataset.name}", folder / "convergence.png"
        )
        for name in ("config.yaml", "clients.parquet", "convergence.png"):
            writer.log_artifact(folder / name)
