"""`raysim bench`: how fast is a simulated round, against the simplest program that computes the same thing.

One fixed FLAME workload (Fashion-MNIST, IID, full participation, H = 1 epoch, batch 100, lambda = 1,
rho = 0.1, lr = 0.01) is run three ways, in one process run, for each client count:

1. `reference`: the same clients, the same mini-batches (drawn from the same seeded streams), the same
   math, as a plain sequential torch loop over `nn.Module`s with `torch.optim.SGD`: no Ray, no MLflow;
2. `sequential`: `run_experiment` (local Ray, one host actor per CPU, MLflow in a temporary sqlite file) with
   `runtime.client_training = sequential`, each host training its clients one at a time;
3. `vectorized`: the same with `runtime.client_training = vectorized`, `chunk` clients at a time
   (`runtime.vectorize_chunk`: 16 suits a CPU, a GPU wants hundreds), a stacking algorithm such as FLAME
   updating each chunk's states as rows in place. The default, `auto`, is this for mlr, mlp and linear models.

Reported per way: seconds per round (median over the rounds after the first, the last excluded as it
evaluates), client updates per second, start-up time (to the end of round 1, minus round 1's own `time/round`:
data, Ray, actors, the round-0 evaluation), peak RSS (summed over the processes of the way, which runs in a fresh
process: that process and every process it started), and the ratio of the seconds per round to the
reference's (`ratio vs reference`, < 1 is faster). `max |w - w_ref|` checks
that every way computed the reference's global model. Results go to a table and to JSON. `--set
algorithm.name=fedavg` (any `--set key.path=value`) changes the workload; the reference loop is FLAME's, so
another algorithm is measured without it; `--set model.name=har_classifier --set dataset.name=kuhar_synthetic`
measures another model on its data (a model with dropout, such as FedAPM's multimodal ones, without the reference
loop, which trains without dropout).

On a GPU machine the raysim ways run once per `host_gpus` share asked for (0.25: four hosts per GPU), and
nvidia-smi, asked every 200 ms, gives each way's mean GPU utilisation and peak GPU memory over the measured
rounds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from raysim.algorithms.families.consensus import paper_message, paper_update
from raysim.algorithms.flame import FlameSettings
from raysim.config import ExperimentConfig, apply_overrides, validate_config
from raysim.errors import RaysimError
from raysim.models.flat import FlatModel
from raysim.runtime.driver import run_experiment
from raysim.runtime.problem import Problem, prepare
from raysim.seeding import Stream, rng
from raysim.studies.procmem import PeakMemory, wait_for_children
from raysim.training.local import model_inputs

WAYS = ("reference", "sequential", "vectorized")
T = TypeVar("T")


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
    ratio_vs_reference: float | None
    """None: the reference was not run (`--ways` without it)."""
    max_abs_diff_vs_reference: float | None
    host_gpus: float = 0.0
    device: str = "cpu"
    gpu_utilisation_percent: float | None = None
    """Mean over the nvidia-smi samples of the measured rounds (None: no GPU was sampled)."""
    gpu_memory_mib: float | None = None
    """Peak used memory of a GPU over the measured rounds, all processes."""
    chunk: int | None = None
    """runtime.vectorize_chunk of the vectorized way (None: the way trains one client at a time)."""
    evaluation_seconds: float | None = None
    """`--eval`: median seconds of one evaluation of every client (PM, GM, HM), the rounds after the first."""
    evaluation_vs_round: float | None = None
    """evaluation_seconds / seconds_per_round (the target is at most 1)."""
    algorithm: str = "flame"
    dataset: str = "fashion_mnist"
    """dataset.name (`--set dataset.name=...` with a model for that data, e.g. FedAPM's multimodal models)."""
    per_round: int | None = None
    """Clients a round (`--participation`); None: all of them."""
    state_store: str = "auto"
    """runtime.state_store (`--state`), as the run resolved `auto` (hosts, memory or disk); the reference loop keeps
    its states in memory-mapped files with `memory` or `disk` named, or with partial participation."""
    state_disk_mib: float | None = None
    """Disk the clients' states took at the end (allocated blocks of the store's files; the reference's likewise)."""


NVIDIA_SMI = ("nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits")

GpuSample = tuple[float, float, float]
"""(seconds since the epoch, utilisation %, used memory MiB) of one GPU."""


def read_gpus(output: str) -> list[tuple[float, float]]:
    """(utilisation %, used memory MiB) per GPU from NVIDIA_SMI's output; unreadable lines ([N/A]) left out."""
    readings = []
    for line in output.splitlines():
        try:
            utilisation, memory = (float(part) for part in line.split(","))
        except ValueError:
            continue
        readings.append((utilisation, memory))
    return readings


def gpu_usage(samples: Iterable[GpuSample], start: float, end: float) -> tuple[float, float] | None:
    """(mean utilisation %, peak memory MiB) over the samples taken between `start` and `end` (seconds since
    the epoch); None without a sample in the window."""
    inside = [(utilisation, memory) for stamp, utilisation, memory in samples if start <= stamp <= end]
    if not inside:
        return None
    return statistics.fmean(u for u, _ in inside), max(m for _, m in inside)


class GpuSampler:
    """Asks nvidia-smi for every GPU's utilisation and memory every `period` seconds while a `with` block runs
    (one query at a time from a thread, each stamped when it returns), where asked for and nvidia-smi exists."""

    def __init__(self, enabled: bool, period: float = 0.2):
        self.enabled = enabled and shutil.which(NVIDIA_SMI[0]) is not None
        self.period = period
        self.samples: list[GpuSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-sampler", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            try:
                output = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            stamp = time.time()
            self.samples.extend((stamp, utilisation, memory) for utilisation, memory in read_gpus(output))

    def __enter__(self) -> GpuSampler:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()

    def usage(self, start: float, end: float) -> tuple[float | None, float | None]:
        """(mean utilisation %, peak memory MiB) between two epoch times, (None, None) if nothing was sampled."""
        found = gpu_usage(self.samples, start, end)
        return (None, None) if found is None else found


def workload(
    clients: int,
    rounds: int,
    model: str,
    hosts: int | None,
    folder: Path,
    vectorized: bool,
    host_gpus: float = 0.0,
    chunk: int | None = None,
    evaluate: bool = False,
    overrides: Sequence[str] = (),
) -> ExperimentConfig:
    """The benchmark's FLAME experiment: evaluation before round 1 and after the last, or with `evaluate` after
    every round; `chunk` None keeps runtime.vectorize_chunk's default; `overrides` are `--set key.path=value`."""
    chunking = {} if chunk is None else {"vectorize_chunk": chunk}
    tree = {
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
            **chunking,
        },
        "tracking": {
            "uri": f"sqlite:///{folder}/mlflow.db",
            "experiment": "bench",
            "eval_every": 1 if evaluate else rounds,
        },
    }
    apply_overrides(tree, tuple(overrides))
    runtime: dict[str, Any] = tree["runtime"]  # type: ignore[assignment]  # the dict literal above
    if runtime.get("state_store") == "disk" and runtime.get("spill_dir") is None:
        runtime["spill_dir"] = str(folder)  # the measurement's folder: removed with it
    return validate_config(tree)


EVAL_SAMPLE = 1000
"""Clients an evaluation of a cross-device row scores past 10,000 clients (tracking.eval_sample)."""


def scale_overrides(clients: int, participation: float, state: str, samples_per_client: int | None) -> list[str]:
    """The `--set`s of the cross-device rows (issue 49): `participation` of the clients a round, client state in
    runtime.state_store = `state`, and past 10,000 clients (fewer than 7 Fashion-MNIST images each) every client
    drawing `samples_per_client` (default 10) images of its own (partition.samples_per_client) and each evaluation
    scoring a seeded sample of EVAL_SAMPLE clients (tracking.eval_sample), as a cross-device paper reports its
    accuracy, not all of them (`--set tracking.eval_sample=null`: all)."""
    overrides = [f"runtime.state_store={state}"]
    if participation < 1:
        overrides.append(f"clients.fraction={participation}")
    if samples_per_client is not None or clients > 10_000:
        overrides.append(f"partition.samples_per_client={samples_per_client or 10}")
    if clients > 10_000:
        overrides.append(f"tracking.eval_sample={EVAL_SAMPLE}")
    return overrides


def _round_seconds(ends: list[float]) -> float:
    """Median of the round times after the first (warm-up); the last round, which evaluates, is left out."""
    gaps = np.diff(ends[:-1]) if len(ends) > 2 else np.diff(ends)
    return float(statistics.median(gaps)) if len(gaps) else float("nan")


def reference_loop(
    config: ExperimentConfig, problem: Problem, device: str = "cpu", disk: list[int] | None = None
) -> tuple[list[float], np.ndarray]:
    """FLAME (eqs. (11)-(14)) as a researcher would write it without raysim's runtime (torch training, the
    paper's closed forms (12)-(13) from raysim.algorithms.flame); returns the end time of every round and the final
    global model. Uses one torch thread, like each raysim host, and `device`. With partial participation or client
    state off the hosts named (runtime.state_store memory or disk), `_reference_sampled` (which appends to `disk`
    the bytes its state files took)."""
    torch.set_num_threads(1)
    s = config.algorithm
    assert isinstance(s, FlameSettings), "run_bench runs the reference loop for FLAME only"
    model = FlatModel(config.model.name, problem.model_spec.input_shape, problem.model_spec.outputs)
    if model.stochastic:
        raise RaysimError(
            f"--set model.name={config.model.name}: the reference loop trains without dropout, which this model has; "
            "run the other ways alone (--ways sequential vectorized)"
        )
    module = model.module.to(device)
    params = list(module.parameters())
    features = model_inputs(problem.x, problem.inputs.mean, problem.inputs.std)  # uint8 images: normalized once
    x, y = torch.from_numpy(features).to(device), torch.from_numpy(problem.y).to(device)
    w = torch.from_numpy(problem.init_params.copy()).to(device)
    m = len(problem.clients)
    if config.clients.per_round_count() < m or config.runtime.state_store in ("memory", "disk"):
        return _reference_sampled(config, problem, module, x, y, w, device, disk)
    theta = [w.clone() for _ in range(m)]
    w_local = [w.clone() for _ in range(m)]
    pi = [torch.zeros_like(w) for _ in range(m)]
    ends: list[float] = []
    for round_index in range(config.rounds):
        sum_u = torch.zeros_like(w, dtype=torch.float64)
        for info, split in problem.clients:
            i = info.id
            theta[i] = _local_sgd(
                module, params, theta[i], w_local[i], split.train, x, y, s, config.seed, i, round_index
            )
            lam_alpha = s.lam * info.weight
            w_local[i], pi[i] = paper_update(theta[i], w_local[i], pi[i], w, lam_alpha, s.rho)  # (12), (13)
            sum_u += paper_message(w_local[i], pi[i], s.rho).double()
        w = (sum_u / m).float()
        if device != "cpu":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return ends, w.cpu().numpy()


FLAME_ROWS = ("theta", "w_local", "pi")


def _reference_sampled(
    config: ExperimentConfig,
    problem: Problem,
    module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    device: str,
    disk: list[int] | None,
) -> tuple[list[float], np.ndarray]:
    """`reference_loop` for the cross-device rows: each round only its sampled clients (raysim.runtime.problem's
    draw), the server's running sum of every client's latest message u_i (14) updated by the sampled clients'
    changes, and the clients' theta, w_i, pi_i as rows of three memory-mapped [m, d] files (a client never sampled
    has theta = w_i = w^0, pi_i = 0), as simple a way as any to keep 100,000 clients' state."""
    from raysim.runtime.problem import sample_clients

    s = config.algorithm
    assert isinstance(s, FlameSettings), "run_bench runs the reference loop for FLAME only"
    params = list(module.parameters())
    m, d = len(problem.clients), w.numel()
    initial = w.cpu().numpy()
    folder = Path(tempfile.mkdtemp(prefix="reference-states-", dir=config.runtime.spill_dir))
    try:
        files = {
            name: np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=np.float32, shape=(m, d))
            for name in FLAME_ROWS
        }
        seen = np.zeros(m, bool)
        running = (m * initial.astype(np.float64)).copy()
        ends: list[float] = []
        for round_index in range(config.rounds):
            chosen = sample_clients(
                config.seed, round_index, m, config.clients.per_round_count(), config.clients.sampling
            )
            change = np.zeros(d, np.float64)
            for i in chosen:
                info, split = problem.clients[i]
                if seen[i]:
                    rows = {name: torch.from_numpy(np.array(array[i])).to(device) for name, array in files.items()}
                else:
                    rows = {"theta": w.clone(), "w_local": w.clone(), "pi": torch.zeros_like(w)}
                theta = _local_sgd(
                    module, params, rows["theta"], rows["w_local"], split.train, x, y, s, config.seed, i, round_index
                )
                old = paper_message(rows["w_local"], rows["pi"], s.rho)
                w_local, pi = paper_update(theta, rows["w_local"], rows["pi"], w, s.lam * info.weight, s.rho)
                change += (paper_message(w_local, pi, s.rho) - old).double().cpu().numpy()
                for name, value in (("theta", theta), ("w_local", w_local), ("pi", pi)):
                    files[name][i] = value.cpu().numpy()
                seen[i] = True
            running += change
            w = torch.from_numpy((running / m).astype(np.float32)).to(device)
            del files  # let go of the mapped pages: they would stay in this process's RSS
            files = {name: np.lib.format.open_memmap(folder / f"{name}.npy", mode="r+") for name in FLAME_ROWS}
            if device != "cpu":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
        if disk is not None:
            disk.append(sum(os.stat(folder / f"{name}.npy").st_blocks * 512 for name in files))
        del files
        return ends, w.cpu().numpy()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _local_sgd(
    module: nn.Module,
    params: list[nn.Parameter],
    start: torch.Tensor,
    center_at: torch.Tensor,
    train: np.ndarray,
    x: torch.Tensor,
    y: torch.Tensor,
    s: Any,
    seed: int,
    client: int,
    round_index: int,
) -> torch.Tensor:
    """One epoch of FLAME's local problem in plain torch (eq. 11: CE + lambda/2 ||theta - w_i||^2, SGD from
    `start`), the client's batches drawn from its own stream as raysim draws them; theta after it."""
    nn.utils.vector_to_parameters(start, params)
    center = [p.detach().clone() for p in _views(center_at, params)]
    optimizer = torch.optim.SGD(params, lr=s.lr)
    generator = rng(seed, Stream.CLIENT_TRAINING, client, round_index, 0)
    order = train[generator.permutation(len(train))]
    for first in range(0, len(order), s.batch_size):
        batch = torch.from_numpy(order[first : first + s.batch_size]).to(x.device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(module(x[batch]), y[batch])
        prox = sum(((p - c) ** 2).sum() for p, c in zip(params, center, strict=True))
        (loss + s.lam / 2 * prox).backward()
        optimizer.step()
    return nn.utils.parameters_to_vector(params).detach().clone()


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(p) for part, p in zip(flat.split([p.numel() for p in like]), like, strict=True)]


def _epoch(perf_time: float) -> float:
    """A time.perf_counter() reading as seconds since the epoch (GpuSampler stamps its samples so)."""
    return time.time() - (time.perf_counter() - perf_time)


def _measured_window(ends: list[float]) -> tuple[float, float]:
    """Epoch times of the rounds that `_round_seconds` measures."""
    last = -2 if len(ends) > 2 else -1
    return _epoch(ends[0]), _epoch(ends[last])


def _measure_reference(
    clients: int, rounds: int, model: str, folder: Path, device: str, overrides: Sequence[str] = ()
) -> tuple[Measurement, np.ndarray]:
    config = workload(clients, rounds, model, None, folder, vectorized=False, overrides=overrides)
    disk: list[int] = []
    with PeakMemory() as memory, GpuSampler(device != "cpu") as gpu:
        start = time.perf_counter()
        problem = prepare(config)
        ready = time.perf_counter()
        ends, w = reference_loop(config, problem, device, disk)
    seconds = _round_seconds(ends)
    per_round = config.clients.per_round_count()
    measured = Measurement(
        "reference",
        clients,
        config.model.name,
        rounds,
        1,
        seconds,
        per_round / seconds,
        ready - start,
        memory.peak_mib,
        1.0,
        0.0,
        0.0,
        device,
        *gpu.usage(*_measured_window(ends)),
        algorithm=config.algorithm.name,
        dataset=config.dataset.name,
        per_round=per_round if per_round < clients else None,
        state_store=config.runtime.state_store,
        state_disk_mib=disk[0] / 2**20 if disk else None,
    )
    return measured, w


def _measure_raysim(config: ExperimentConfig, reference: Measurement | None, w_ref: np.ndarray | None) -> Measurement:
    """Run the `workload` config once; its round times, memory and GPU use against the reference's (None: the
    reference was not run: no ratios)."""
    clients, rounds, runtime = config.clients.count, config.rounds, config.runtime
    vectorized = runtime.client_training == "vectorized"
    ends: list[float] = []
    final: dict[str, np.ndarray] = {}
    used_hosts, store = [0], [runtime.state_store]

    def inspect(round_index: int, simulation) -> None:
        ends.append(time.perf_counter())
        used_hosts[0] = len(simulation.hosts)
        store[0] = simulation.config.runtime.state_store  # `auto` resolved
        if round_index == rounds - 1:
            final["w"] = np.asarray(simulation.global_model())  # any algorithm's, not a server state's `w`

    with PeakMemory() as memory, GpuSampler(runtime.host_gpus > 0) as gpu:
        start = time.perf_counter()
        result = run_experiment(config, show_progress=False, inspect=inspect)
    wait_for_children()
    seconds = _round_seconds(ends)
    evaluation = None
    if config.tracking.eval_every == 1:  # --eval: each round's time without its evaluation, and the evaluation's
        steps = [result.history[step] for step in range(2, rounds + 1)]
        seconds = statistics.median(m["time/round"] - m["time/evaluation"] for m in steps)
        evaluation = statistics.median(m["time/evaluation"] for m in steps)
    ratio = seconds / reference.seconds_per_round if reference is not None else None
    difference = float(np.max(np.abs(final["w"] - w_ref))) if w_ref is not None else None
    per_round = config.clients.per_round_count()
    disk = result.history[rounds].get("state/disk_bytes")
    return Measurement(
        WAYS[2] if vectorized else WAYS[1],
        clients,
        config.model.name,
        rounds,
        used_hosts[0],
        seconds,
        per_round / seconds,
        ends[0] - start - result.history[1]["time/round"],  # round 1's own time: rounds differ (sampling)
        memory.peak_mib,
        ratio,
        difference,
        runtime.host_gpus,
        "cuda" if vectorized and runtime.host_gpus > 0 else "cpu",  # the sequential path trains on the CPU
        *gpu.usage(*_measured_window(ends)),
        runtime.vectorize_chunk if vectorized else None,
        evaluation,
        None if evaluation is None else evaluation / seconds,
        config.algorithm.name,
        config.dataset.name,
        per_round if per_round < clients else None,
        store[0],
        None if disk is None or store[0] == "hosts" else disk / 2**20,
    )


def run_bench(
    client_counts: list[int],
    rounds: int,
    model: str,
    hosts: int | None = None,
    ways: tuple[str, ...] = WAYS,
    host_gpus: Sequence[float] = (0.0,),
    reference_device: str = "cpu",
    chunk: int | None = None,
    evaluate: bool = False,
    overrides: Sequence[str] = (),
    participation: float = 1.0,
    state: str = "auto",
    samples_per_client: int | None = None,
) -> list[Measurement]:
    """Measure every way for every client count (see the module docstring), the raysim ways once per
    `host_gpus` share; the reference loop runs on `reference_device` (only when `ways` has it: without it no
    ratios), the vectorized way `chunk` clients at a time. `evaluate`: evaluate after every round and
    time it apart from training; `overrides`: `--set key.path=value` on the workload; `participation`, `state`,
    `samples_per_client`: the cross-device rows' (`scale_overrides`)."""
    if not 0 < participation <= 1:
        raise RaysimError(f"--participation {participation}: a fraction of the clients, in (0, 1]")
    if rounds < 3:
        raise RaysimError(f"--rounds {rounds}: at least 3 are needed (the first warms up, the last evaluates)")
    if chunk is not None and chunk < 1:
        raise RaysimError(f"--chunk {chunk}: at least 1 client must train at a time")
    if reference_device != "cpu" and not torch.cuda.is_available():
        raise RaysimError(f"--reference-device {reference_device}: torch sees no CUDA device here (allowed: cpu)")
    scaled = {
        clients: (*scale_overrides(clients, participation, state, samples_per_client), *overrides)
        for clients in client_counts
    }
    for clients in client_counts:  # refuse a bad --set before anything runs
        algorithm = workload(clients, rounds, model, hosts, Path("."), False, overrides=scaled[clients]).algorithm.name
        if algorithm != "flame" and "reference" in ways:
            raise RaysimError(
                f"--set algorithm.name={algorithm}: the reference loop is FLAME's; "
                "run the other ways alone (--ways sequential vectorized)"
            )
    results = []
    for clients in client_counts:
        with tempfile.TemporaryDirectory() as folder:
            reference, w_ref = None, None
            if "reference" in ways:
                reference, w_ref = _isolated(
                    _measure_reference, clients, rounds, model, Path(folder), reference_device, scaled[clients]
                )
                results.append(reference)
            for share in host_gpus:
                for vectorized, way in ((False, WAYS[1]), (True, WAYS[2])):
                    if way in ways:
                        config = workload(
                            clients,
                            rounds,
                            model,
                            hosts,
                            Path(folder),
                            vectorized,
                            share,
                            chunk,
                            evaluate,
                            scaled[clients],
                        )
                        results.append(_isolated(_measure_raysim, config, reference, w_ref))
    return results


def _isolated(measure: Callable[..., T], *arguments: Any) -> T:
    """Run one way's measurement in a fresh process, so that memory an earlier way leaves in this process (freed
    but kept by the allocator) never counts in a later way's peak RSS."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, *arguments).result()


def report(results: list[Measurement], json_path: Path | None, console: Console | None = None) -> None:
    """Print the table (GPU columns when a GPU was used) and write the JSON (with the machine's CPU count and
    torch version)."""
    console = console or Console(width=200)
    gpus = any(r.host_gpus or r.device != "cpu" for r in results)
    algorithms = ", ".join(sorted({r.algorithm for r in results}))  # algorithm.name
    datasets = ", ".join(sorted({r.dataset for r in results}))  # dataset.name
    table = Table(title=f"{algorithms} round on {datasets} ({os.cpu_count()} CPUs, torch {torch.__version__})")
    columns = [
        "clients",
        "model",
        "way",
        "hosts",
        "chunk",
        "s/round",
        "updates/s",
        "start-up s",
        "peak RSS MiB",
        "ratio vs reference",
        "max |w - w_ref|",
    ]
    evaluated = any(r.evaluation_seconds is not None for r in results)
    scaled = any(r.per_round is not None or r.state_store == "disk" for r in results)
    if scaled:
        columns[1:1] = ["per round", "state"]
        columns.append("state disk MiB")
    if gpus:
        gpu_at = 7 if scaled else 5
        columns[gpu_at:gpu_at] = ["GPU/host", "device"]
        columns += ["GPU util %", "GPU MiB"]
    if evaluated:
        columns += ["eval s", "eval / round"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "way", "device", "state") else "right")
    for r in results:
        row = [
            str(r.clients),
            r.model,
            r.way,
            str(r.hosts),
            _optional(r.chunk),
            f"{r.seconds_per_round:.3f}",
            f"{r.updates_per_second:.0f}",
            f"{r.startup_seconds:.1f}",
            f"{r.peak_rss_mib:.0f}",
            _optional(r.ratio_vs_reference, ".2f"),
            _optional(r.max_abs_diff_vs_reference, ".1e"),
        ]
        if scaled:
            row[1:1] = [_optional(r.per_round if r.per_round is not None else r.clients), r.state_store]
            row.append(_optional(r.state_disk_mib))
        if gpus:
            gpu_at = 7 if scaled else 5
            row[gpu_at:gpu_at] = [f"{r.host_gpus:g}", r.device]
            row += [_optional(r.gpu_utilisation_percent), _optional(r.gpu_memory_mib)]
        if evaluated:
            row += [_optional(r.evaluation_seconds, ".3f"), _optional(r.evaluation_vs_round, ".2f")]
        table.add_row(*row)
    console.print(table)
    if json_path is not None:
        payload = {"cpus": os.cpu_count(), "torch": torch.__version__, "results": [asdict(r) for r in results]}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(json_path)
        console.print(f"written {json_path}")


def _optional(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)
