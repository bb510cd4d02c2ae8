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
from raysim.config import ExperimentConfig
from raysim.data import ClientSplit, load_dataset, partition_dataset
from raysim.errors import ConfigError
from raysim.metrics import ClientEvaluation, mean_client_metrics, summarize
from raysim.runtime.coordinator import Coordinator
from raysim.runtime.host import ClientHost, ModelSpec
from raysim.seeding import Stream, rng, torch_seed
from raysim.tracking.mlflow_writer import MlflowWriter, git_commit, resolve_tracking_uri
from raysim.tracking.reports import write_client_table, write_convergence_plot


@dataclass
class Problem:
    """Everything prepared in the driver before any Ray work: data, clients, initial model."""

    x: np.ndarray
    y: np.ndarray
    model_spec: ModelSpec
    clients: list[tuple[ClientInfo, ClientSplit]]
    init_params: np.ndarray


@dataclass
class RunResult:
    run_id: str | None
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Metrics logged at each step (round number, 0 = before training)."""
    final: list[ClientEvaluation] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    """Final and best-round summaries (`final/...`, `best/...`), logged at the last step."""


def prepare(config: ExperimentConfig) -> Problem:
    """Load and partition the data and draw the initial model; raises RaysimError on bad input."""
    dataset = load_dataset(config.dataset.name, config.dataset.root, config.dataset.download, config.seed)
    splits = partition_dataset(dataset.y, config.clients.count, config.partition, config.seed)
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
    return Problem(dataset.x, dataset.y, spec, clients, init)


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
        runtime = config.runtime
        num_hosts = runtime.num_hosts or max(1, int(ray.available_resources().get("CPU", 1) // runtime.host_cpus))
        self.host_clients = assign_to_hosts(problem.clients, min(num_hosts, len(problem.clients)))
        by_id = {info.id: (info, split) for info, split in problem.clients}
        x_ref, y_ref, init_ref = ray.put(problem.x), ray.put(problem.y), ray.put(problem.init_params)
        host_actor = ray.remote(ClientHost).options(num_cpus=runtime.host_cpus, num_gpus=runtime.host_gpus)
        self.hosts = [
            host_actor.remote(
                config.algorithm,
                problem.model_spec,
                x_ref,
                y_ref,
                [by_id[c] for c in ids],
                init_ref,
                config.seed,
                runtime.torch_threads,
            )
            for ids in self.host_clients
        ]
        self.coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=runtime.coordinator_cpus, num_gpus=runtime.coordinator_gpus)
            .remote(config.algorithm, problem.model_spec, init_ref, config.clients.count, runtime.torch_threads)
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
            **mean_client_metrics(records),
            **{f"server/{k}": v for k, v in server_metrics.items()},
            "clients/selected": float(len(selected)),
            "time/clients": trained - start,
            "time/aggregation": aggregated - trained,
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


def run_experiment(config: ExperimentConfig, show_progress: bool = True, inspect=None) -> RunResult:
    """Run one experiment end to end and log it to MLflow.

    `inspect(round_index, simulation)`, if given, is called after every round (tests use it to check
    invariants on live state).
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
            "git_commit": git_commit(),
        },
    )
    result = RunResult(run_id)
    console = Console(stderr=True) if show_progress else None
    if console:
        console.print(
            f"[bold]raysim[/] {config.algorithm.name} on {config.dataset.name}: run {run_id} at {writer.tracking_uri}"
        )
    try:
        with ray_session(config):
            simulation = Simulation(config, problem)
            try:
                _run_rounds(config, simulation, writer, result, console, inspect)
            finally:
                simulation.close()
        _write_artifacts(config, problem, writer, result)
    except BaseException:
        writer.finish("FAILED" if result.history else "KILLED")
        raise
    writer.finish("FINISHED")
    return result


def _run_rounds(config, simulation: Simulation, writer, result: RunResult, console, inspect) -> None:
    evaluations = simulation.evaluate()
    result.history[0] = summarize(evaluations)
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
                metrics |= summarize(evaluations)
                metrics["time/evaluation"] = time.perf_counter() - evaluated
            metrics["time/round"] = time.perf_counter() - start
            writer.log_metrics(step, metrics)
            result.history[step] = metrics
            if inspect is not None:
                inspect(round_index, simulation)
            shown = {k: f"{metrics[f'{k}/acc']:.4f}" for k in ("pm", "gm", "hm") if f"{k}/acc" in metrics}
            progress.update(task, advance=1, **shown, secs=f"{metrics['time/round']:.2f}s/round")
    result.final = evaluations
    finals = summarize(evaluations)
    evaluated_rounds = [r for r in result.history if "pm/acc" in result.history[r]]
    best = {f"best/{k}": max(result.history[r][k] for r in evaluated_rounds) for k in ("pm/acc", "gm/acc", "hm/acc")}
    result.summary = {f"final/{k}": v for k, v in finals.items()} | best
    writer.log_metrics(config.rounds, result.summary)


def _write_artifacts(config: ExperimentConfig, problem: Problem, writer: MlflowWriter, result: RunResult) -> None:
    sizes = {info.id: {"num_train": info.num_train, "num_test": len(split.test)} for info, split in problem.clients}
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        (folder / "config.yaml").write_text(config.to_yaml())
        write_client_table(result.final, sizes, folder / "clients.parquet")
        write_convergence_plot(
            result.history, f"{config.algorithm.name} on {config.dataset.name}", folder / "convergence.png"
        )
        for name in ("config.yaml", "clients.parquet", "convergence.png"):
            writer.log_artifact(folder / name)
