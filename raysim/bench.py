"""`raysim bench`: how fast is a simulated round, against the simplest program that computes the same thing.

One fixed FLAME workload (Fashion-MNIST, IID, full participation, H = 1 epoch, batch 100, lambda = 1,
rho = 0.1, lr = 0.01) is run three ways, in one process run, for each client count:

1. `reference`: the same clients, the same mini-batches (drawn from the same seeded streams), the same
   math, as a plain sequential torch loop over `nn.Module`s with `torch.optim.SGD`: no Ray, no MLflow;
2. `raysim`: `run_experiment` with the default runtime (local Ray, one host actor per CPU, MLflow in a
   temporary sqlite file);
3. `vectorized`: raysim the same with `runtime.client_training = vectorized`.

Reported per way: seconds per round (median over the rounds after the first, the last excluded as it
evaluates), client updates per second, start-up time (to the end of round 1, minus one round: data, Ray,
actors, the round-0 evaluation), peak RSS of this process and every process it started, and the ratio of
the seconds per round to the reference's (`ratio vs reference`, < 1 is faster). `max |w - w_ref|` checks
that every way computed the reference's global model. Results go to a table and to JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from raysim.config import ExperimentConfig, validate_config
from raysim.errors import RaysimError
from raysim.models.flat import FlatModel
from raysim.procmem import PeakMemory, wait_for_children
from raysim.runtime.driver import Problem, prepare, run_experiment
from raysim.seeding import Stream, rng

WAYS = ("reference", "raysim", "vectorized")


@dataclass
class Measurement:
    way: str
    clients: int
    model: str
    rounds: int
    hosts: int
    seconds_per_round: float
    updates_per_second: float
    startup_seconds: float
    peak_rss_mib: float
    ratio_vs_reference: float
    max_abs_diff_vs_reference: float


def workload(
    clients: int, rounds: int, model: str, hosts: int | None, folder: Path, vectorized: bool, host_gpus: float = 0.0
) -> ExperimentConfig:
    """The benchmark's FLAME experiment (evaluation only before round 1 and after the last)."""
    return validate_config(
        {
            "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.1, "epochs": 1, "lr": 0.01, "batch_size": 100},
            "dataset": {"name": "fashion_mnist"},
            "partition": {"scheme": "iid"},
            "model": {"name": model},
            "clients": {"count": clients},
            "rounds": rounds,
            "seed": 1,
            "runtime": {
                "num_hosts": hosts,
                "host_gpus": host_gpus,
                "client_training": "vectorized" if vectorized else "sequential",
            },
            "tracking": {"uri": f"sqlite:///{folder}/mlflow.db", "experiment": "bench", "eval_every": rounds},
        }
    )


def _round_seconds(ends: list[float]) -> float:
    """Median of the round times after the first (warm-up); the last round, which evaluates, is left out."""
    gaps = np.diff(ends[:-1]) if len(ends) > 2 else np.diff(ends)
    return float(statistics.median(gaps)) if len(gaps) else float("nan")


def reference_loop(config: ExperimentConfig, problem: Problem) -> tuple[list[float], np.ndarray]:
    """FLAME (flame.md eqs. 11-14) as a researcher would write it without raysim; returns the end time of
    every round and the final global model. Uses one torch thread, like each raysim host."""
    torch.set_num_threads(1)
    s = config.algorithm
    module = FlatModel(config.model.name, problem.model_spec.input_shape, problem.model_spec.outputs).module
    params = list(module.parameters())
    x, y = torch.from_numpy(problem.x), torch.from_numpy(problem.y)
    w = torch.from_numpy(problem.init_params.copy())
    m = len(problem.clients)
    theta = [w.clone() for _ in range(m)]
    w_local = [w.clone() for _ in range(m)]
    pi = [torch.zeros_like(w) for _ in range(m)]
    ends: list[float] = []
    for round_index in range(config.rounds):
        sum_u = torch.zeros_like(w, dtype=torch.float64)
        for info, split in problem.clients:
            i = info.id
            nn.utils.vector_to_parameters(theta[i], params)
            center = [p.detach().clone() for p in _views(w_local[i], params)]
            optimizer = torch.optim.SGD(params, lr=s.lr)
            generator = rng(config.seed, Stream.CLIENT_TRAINING, i, round_index, 0)
            order = split.train[generator.permutation(len(split.train))]
            for start in range(0, len(order), s.batch_size):
                batch = torch.from_numpy(order[start : start + s.batch_size])
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(module(x[batch]), y[batch])
                prox = sum(((p - c) ** 2).sum() for p, c in zip(params, center, strict=True))
                (loss + s.lam / 2 * prox).backward()
                optimizer.step()
            theta[i] = nn.utils.parameters_to_vector(params).detach().clone()
            lam_alpha = s.lam * info.weight
            w_local[i] = (lam_alpha * theta[i] + s.rho * w - pi[i]) / (lam_alpha + s.rho)
            pi[i] = pi[i] + s.rho * (w_local[i] - w)
            sum_u += (w_local[i] + pi[i] / s.rho).double()
        w = (sum_u / m).float()
        ends.append(time.perf_counter())
    return ends, w.numpy()


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in like]), like, strict=True)]


def _measure_reference(clients: int, rounds: int, model: str, folder: Path) -> tuple[Measurement, np.ndarray]:
    config = workload(clients, rounds, model, None, folder, vectorized=False)
    with PeakMemory() as memory:
        start = time.perf_counter()
        problem = prepare(config)
        ready = time.perf_counter()
        ends, w = reference_loop(config, problem)
    seconds = _round_seconds(ends)
    measured = Measurement("reference", clients, model, rounds, 1, seconds, clients / seconds, ready - start,
                           memory.peak_mib, 1.0, 0.0)  # fmt: skip
    return measured, w


def _measure_raysim(clients: int, rounds: int, model: str, hosts: int | None, folder: Path, vectorized: bool,
                    reference: Measurement, w_ref: np.ndarray, host_gpus: float) -> Measurement:  # fmt: skip
    config = workload(clients, rounds, model, hosts, folder, vectorized, host_gpus)
    ends: list[float] = []
    final: dict[str, np.ndarray] = {}
    used_hosts = [0]

    def inspect(round_index: int, simulation) -> None:
        ends.append(time.perf_counter())
        used_hosts[0] = len(simulation.hosts)
        if round_index == rounds - 1:
            final["w"] = np.asarray(simulation.server_state().w)

    with PeakMemory() as memory:
        start = time.perf_counter()
        run_experiment(config, show_progress=False, inspect=inspect)
    wait_for_children()
    seconds = _round_seconds(ends)
    return Measurement(
        WAYS[2] if vectorized else WAYS[1],
        clients,
        model,
        rounds,
        used_hosts[0],
        seconds,
        clients / seconds,
        ends[0] - start - seconds,
        memory.peak_mib,
        seconds / reference.seconds_per_round,
        float(np.max(np.abs(final["w"] - w_ref))),
    )


def run_bench(
    client_counts: list[int],
    rounds: int,
    model: str,
    hosts: int | None = None,
    ways: tuple[str, ...] = WAYS,
    host_gpus: float = 0.0,
) -> list[Measurement]:
    """Measure every way for every client count (see the module docstring); `host_gpus` per raysim host."""
    if rounds < 3:
        raise RaysimError(f"--rounds {rounds}: at least 3 are needed (the first warms up, the last evaluates)")
    results = []
    for clients in client_counts:
        with tempfile.TemporaryDirectory() as folder:
            reference, w_ref = _measure_reference(clients, rounds, model, Path(folder))
            if "reference" in ways:
                results.append(reference)
            for vectorized, way in ((False, WAYS[1]), (True, WAYS[2])):
                if way in ways:
                    results.append(_measure_raysim(clients, rounds, model, hosts, Path(folder), vectorized,
                                                   reference, w_ref, host_gpus))  # fmt: skip
    return results


def report(results: list[Measurement], json_path: Path | None, console: Console | None = None) -> None:
    """Print the table and write the JSON (with the machine's CPU count and torch version)."""
    console = console or Console(width=160)
    table = Table(title=f"FLAME round on Fashion-MNIST ({os.cpu_count()} CPUs, torch {torch.__version__})")
    columns = ("clients", "model", "way", "hosts", "s/round", "updates/s", "start-up s", "peak RSS MiB",
               "ratio vs reference", "max |w - w_ref|")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "way") else "right")
    for r in results:
        table.add_row(str(r.clients), r.model, r.way, str(r.hosts), f"{r.seconds_per_round:.3f}",
                      f"{r.updates_per_second:.0f}", f"{r.startup_seconds:.1f}", f"{r.peak_rss_mib:.0f}",
                      f"{r.ratio_vs_reference:.2f}", f"{r.max_abs_diff_vs_reference:.1e}")  # fmt: skip
    console.print(table)
    if json_path is not None:
        payload = {"cpus": os.cpu_count(), "torch": torch.__version__, "results": [asdict(r) for r in results]}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(json_path)
        console.print(f"written {json_path}")
