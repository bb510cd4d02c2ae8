"""The round driver: prepares data and clients, runs the rounds on Ray, and is the only MLflow writer.

Per round: sample clients; the coordinator's broadcast goes to the hosts through the object store (one
copy); each host runs its selected clients and sends the exact sum of their uploads straight to the
coordinator, only per-client metrics come back to the driver; the coordinator runs the server step;
every `eval_every` rounds the hosts evaluate PM and GM on every client; one `log_batch` per round.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from raysim.algorithms import ClientInfo
from raysim.attacks import AttackPlan, attack_plan
from raysim.config import ExperimentConfig
from raysim.data import ClientSplit, load_dataset, partition_dataset
from raysim.data.partitions import label_counts
from raysim.errors import ConfigError
from raysim.metrics import ClientEvaluation, mean_client_metrics, summarize
from raysim.runtime.coordinator import Coordinator
from raysim.runtime.host import UPLINK_BYTES, ClientHost, ModelSpec
from raysim.runtime.placement import HostPlacement
from raysim.seeding import Stream, rng, torch_seed
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

    @property
    def malicious(self) -> frozenset[int]:
        return self.attack.malicious if self.attack is not None else frozenset()


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
    dataset = load_dataset(config.dataset.name, config.dataset.root, config.dataset.download, config.seed)
    splits = partition_dataset(dataset.y, config.clients.count, config.partition, config.seed, dataset.groups)
    spec = ModelSpec(config.model.name, dataset.input_shape, dataset.output_dim, dataset.task)
    try:
        model = spec.build()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    init = model.initial_parameters(torch_seed(config.seed, Stream.MODEL_INIT))
    total_train = sum(len(s.train) for s in splits)
    m = config.clients.count
    clients = [
        (
            ClientInfo(
                id=s.client_id,
                num_train=len(s.train),
                weight=1.0 / m if config.clients.weighting == "uniform" else len(s.train) / total_train,
                num_clients=m,
            ),
            s,
        )
        for s in splits
    ]
    if config.attack.kind == "label_poisoning" and dataset.task != "classification":
        raise ConfigError(f"attack.kind=label_poisoning needs class labels; dataset {config.dataset.name} has none")
    attack = attack_plan(config.attack, m, config.seed) if config.attack.kind != "none" else None
    return Problem(dataset.x, dataset.y, spec, clients, init, attack)


def assign_to_hosts(clients: list[tuple[ClientInfo, ClientSplit]], num_hosts: int) -> list[list[int]]:
    """Balance work: largest clients first, each to the host with the least training data so far."""
    loads = [0] * num_hosts
    owned: list[list[int]] = [[] for _ in range(num_hosts)]
    for info, _ in sorted(clients, key=lambda c: (-c[0].num_train, c[0].id)):
        target = loads.index(min(loads))
        owned[target].append(info.id)
        loads[target] += info.num_train
    return [sorted(ids) for ids in owned if ids]


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
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(
            address="local",
            num_cpus=config.runtime.num_cpus,
            object_store_memory=config.runtime.object_store_mb * 2**20,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    try:
        yield
    finally:
        ray.shutdown()


class Simulation:
    """The actors of one run and the round loop over them."""

    def __init__(self, config: ExperimentConfig, problem: Problem):
        self.config = config
        self.uplink_total = 0
        self.downlink_total = 0
        runtime = config.runtime
        cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
        num_hosts = runtime.num_hosts or max(1, int(ray.available_resources().get("CPU", 1) // runtime.host_cpus))
        self.host_clients = assign_to_hosts(problem.clients, min(num_hosts, len(problem.clients)))
        needed = len(self.host_clients) * runtime.host_cpus + runtime.coordinator_cpus
        if needed > cluster_cpus:
            raise ConfigError(
                f"runtime.num_hosts={len(self.host_clients)} x runtime.host_cpus={runtime.host_cpus} (+ coordinator) "
                f"needs {needed:g} CPUs but the Ray cluster has {cluster_cpus:g}; lower runtime.host_cpus "
                "(fractions allowed) or runtime.num_hosts"
            )
        by_id = {info.id: (info, split) for info, split in problem.clients}
        x_ref, y_ref, init_ref = ray.put(problem.x), ray.put(problem.y), ray.put(problem.init_params)
        self.placement = HostPlacement.reserve(runtime, len(self.host_clients))
        host_actor = ray.remote(ClientHost)
        self.hosts = [
            host_actor.options(
                num_cpus=runtime.host_cpus,
                num_gpus=runtime.host_gpus,
                resources=runtime.host_resources,
                scheduling_strategy=self.placement.strategy(index),
            ).remote(
                config.algorithm,
                problem.model_spec,
                x_ref,
                y_ref,
                [by_id[c] for c in ids],
                init_ref,
                config.seed,
                runtime.torch_threads,
                attack=problem.attack,
                send_messages=config.aggregation.active,
                auc_single_label=config.tracking.auc_single_label,
            )
            for index, ids in enumerate(self.host_clients)
        ]
        self.coordinator = (
            ray.remote(Coordinator)
            .options(
                num_cpus=runtime.coordinator_cpus,
                num_gpus=runtime.coordinator_gpus,
                resources=runtime.coordinator_resources,
            )
            .remote(
                config.algorithm,
                problem.model_spec,
                init_ref,
                config.clients.count,
                runtime.torch_threads,
                robust=config.aggregation,
                byzantine=len(problem.malicious),
            )
        )

    def train_round(self, round_index: int) -> dict[str, float]:
        """One round of client steps and the server step; returns the round's metrics."""
        start = time.perf_counter()
        selected = set(
            sample_clients(
                self.config.seed,
                round_index,
                self.config.clients.count,
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
        trained = time.perf_counter()
        server_metrics = ray.get(self.coordinator.aggregate.remote(*partials))
        aggregated = time.perf_counter()
        return {
            **self._communication(records, ray.get(downlink) * len(selected)),
            **mean_client_metrics(records),
            **{f"server/{k}": v for k, v in server_metrics.items()},
            "clients/selected": float(len(selected)),
            "time/clients": trained - start,
            "time/aggregation": aggregated - trained,
        }

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

    def close(self) -> None:
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


def run_experiment(
    config: ExperimentConfig, show_progress: bool = True, inspect=None, parent: str | None = None
) -> RunResult:
    """Run one experiment end to end and log it to MLflow.

    `inspect(round_index, simulation)`, if given, is called after every round (tests use it to check
    invariants on live state). `parent` is the MLflow run id to nest this run under (raysim.suite).
    """
    problem = prepare(config)
    writer = MlflowWriter(resolve_tracking_uri(config.tracking.uri), config.tracking.experiment)
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
    result = RunResult(run_id, malicious=sorted(problem.malicious))
    console = Console(stderr=True) if show_progress else None
    if console:
        console.print(
            f"[bold]raysim[/] {config.algorithm.name} on {config.dataset.name}: run {run_id} at {writer.tracking_uri}"
        )
    try:
        _write_partition_summary(config, problem, writer)
        with ray_session(config):
            simulation = Simulation(config, problem)
            try:
                _run_rounds(config, simulation, writer, result, console, inspect, problem.malicious)
            finally:
                simulation.close()
        _write_artifacts(config, problem, writer, result)
    except BaseException:
        writer.finish("FAILED" if result.history else "KILLED")
        raise
    writer.finish("FINISHED")
    return result


def benign_summary(evaluations: list[ClientEvaluation], malicious: frozenset[int]) -> dict[str, float]:
    """Across-client summaries over the benign clients only (flame.md 4.1: attackers are not scored)."""
    return summarize([e for e in evaluations if e.client_id not in malicious])


def _run_rounds(config, simulation: Simulation, writer, result: RunResult, console, inspect, malicious) -> None:
    evaluations = simulation.evaluate()
    result.history[0] = benign_summary(evaluations, malicious)
    writer.log_metrics(0, result.history[0])
    with _progress(console) as progress:
        task = progress.add_task("round", total=config.rounds, pm="-", gm="-", hm="-", secs="")
        for round_index in range(config.rounds):
            start = time.perf_counter()
            metrics = simulation.train_round(round_index)
            step = round_index + 1
            if step % config.tracking.eval_every == 0 or step == config.rounds:
                evaluated = time.perf_counter()
                evaluations = simulation.evaluate()
                metrics |= benign_summary(evaluations, malicious)
                metrics["time/evaluation"] = time.perf_counter() - evaluated
            metrics["time/round"] = time.perf_counter() - start
            writer.log_metrics(step, metrics)
            result.history[step] = metrics
            if inspect is not None:
                inspect(round_index, simulation)
            shown = {k: f"{metrics[f'{k}/acc']:.4f}" for k in ("pm", "gm", "hm") if f"{k}/acc" in metrics}
            progress.update(task, advance=1, **shown, secs=f"{metrics['time/round']:.2f}s/round")
    result.final = evaluations
    finals = benign_summary(evaluations, malicious)
    evaluated_rounds = [r for r in result.history if "pm/acc" in result.history[r]]
    best = {f"best/{k}": max(result.history[r][k] for r in evaluated_rounds) for k in ("pm/acc", "gm/acc", "hm/acc")}
    result.summary = {f"final/{k}": v for k, v in finals.items()} | best
    writer.log_metrics(config.rounds, result.summary)


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
        info.id: {"num_train": info.num_train, "num_test": len(split.test), "malicious": info.id in problem.malicious}
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
