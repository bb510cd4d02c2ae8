"""The GPU check's steps (benchmarks/gpu_check.sh): each GPU path of docs/performance.md against the CPU path.

    python benchmarks/gpu_check.py run --side device --device cuda --out DIR [--dry] [--fp32]
    python benchmarks/gpu_check.py run --side cpu --out DIR [--dry]
    python benchmarks/gpu_check.py compare DEVICE_FILE CPU_FILE     # or: compare HOSTS_JSON (raysim bench's)
    python benchmarks/gpu_check.py table DIR

`run` computes every check of one side and writes one result file per check (`<check>.<side>.npz`):

- `vmap-mlp`, `vmap-cnn`: one FLAME-style local round (SGD with the prox pull lambda/2 ||theta - w_i||^2 to each
  client's own w_i, FLAME, eq. (11)) of 1,000 clients of 60 samples in batches of 20 (3 steps), the MLP on
  Fashion-MNIST shapes and the CIFAR CNN on CIFAR-10 shapes (random data, as benchmarks/vectorized_training.py).
  The device side runs the vectorized executor (vmap, or the perceptron's batched products) on `--device` in
  chunks of 250; the CPU side runs what `runtime.client_training: auto` runs on a CPU host (the MLP vectorized in
  chunks of 16, the CNN one client at a time);
- `resnet8x4-round`: the same round of AugFL's 50 clients (40 samples, batches of 20) with ResNet8x4 on CIFAR-100
  shapes;
- `fedslr-dense`, `fedslr-factorized`: FedSLR's ResNet-18-GN cut to a quarter of every layer's rank (Table 3's
  5.5 M parameters at lambda = 1e-4), its logits on a CIFAR-shaped batch of 20 through the dense network and the
  factorized one (benchmarks/fedslr_latency.py, Table 9).

`--dry` runs the same checks at 2-8 clients, FedSLR's on the CIFAR CNN (ResNet-18-GN's 21 SVDs alone take 6 s of a
CPU), with the CPU standing in for the device.

`compare` decides one check: the largest difference of the device side's trained parameters (rows of 8 clients
spread over the chunks, and the mean over all clients) from the CPU side's, relative to the CPU side's update
(max |theta_dev - theta_cpu| / max |theta_cpu - start|; logits: relative to max |logit|), must be at most the
tolerance, and every client must have taken the same number of steps. The tolerance is 1e-4 where the device
computes in float32: a product summed in another order (cuBLAS, cuDNN or a batched kernel against one client's)
rounds differently by a few units of 2^-24 = 6e-8, and three SGD steps carry that to about 1e-6 of the update
(the CPU ways of `raysim bench` differ from its torch loop by 4.5e-5 of w after 56 steps). It is 1e-2 for the
convolutional models where the device side ran with TF32 convolutions, torch's default on NVIDIA GPUs since Ampere
(`torch.backends.cudnn.allow_tf32`, which raysim's hosts leave as it is): their inputs are rounded to 10 bits of
mantissa, 2^-11 = 5e-4 relative, so a gradient differs by about 1e-3. A fault of the device path (a client's
rows, data or state in another client's place, a step or a term left out) moves the update by far more: leaving
out the prox pull alone changes it by 5-30 % here. The `hosts` rows read raysim bench's JSON, where every raysim
way's global model is compared with the plain torch loop's on the CPU (`max |w - w_ref|`, absolute: at most 1e-4;
the CPU ways differ from it by 2e-8 at 1,000 clients, docs/performance.md, and 2e-5 at 8 in a dry run).

`table` compares every check found in DIR and prints one Markdown table (also written to DIR/table.md); it exits
with 1 if a check failed or a result is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SIDES = ("device", "cpu")
TRAINING = ("vmap-mlp", "vmap-cnn", "resnet8x4-round")
FEDSLR = ("fedslr-dense", "fedslr-factorized")
CHECKS = (*TRAINING, *FEDSLR)
SHARES = (0.0, 0.25, 0.5, 1.0)
"""runtime.host_gpus of the `hosts` rows (gpu_check.sh's raysim bench): 0 is the CPU runtime, the baseline (not in
a dry run, where every share runs on the CPU)."""
CONVOLUTIONAL = {"vmap-cnn", "resnet8x4-round", *FEDSLR}
FLOAT32_TOLERANCE = 1e-4
TF32_TOLERANCE = 1e-2
HOSTS_TOLERANCE = 1e-4
COMPARED_ROWS = 8
"""Clients whose whole trained vectors are compared, spread evenly over the clients (so over the chunks)."""


@dataclass(frozen=True)
class Training:
    """One local round: `clients` clients of `samples` random samples each, SGD in batches of `batch` with the prox
    pull to a center of their own, `chunk` clients at a time on the device side."""

    title: str
    model: str
    shape: tuple[int, int, int]
    classes: int
    clients: int
    samples: int
    batch: int
    chunk: int

    @property
    def size(self) -> str:
        return f"{self.clients} clients x {self.samples} samples, batch {self.batch}, chunk {self.chunk}"


FULL = {
    "vmap-mlp": Training("vmap executor, MLP", "mlp", (1, 28, 28), 10, 1000, 60, 20, 250),
    "vmap-cnn": Training("vmap executor, CIFAR CNN", "cnn", (3, 32, 32), 10, 1000, 60, 20, 250),
    "resnet8x4-round": Training("ResNet8x4 round (AugFL)", "resnet8x4", (3, 32, 32), 100, 50, 40, 20, 50),
}
DRY = {
    "vmap-mlp": Training("vmap executor, MLP", "mlp", (1, 28, 28), 10, 8, 12, 4, 4),
    "vmap-cnn": Training("vmap executor, CIFAR CNN", "cnn", (3, 32, 32), 10, 4, 8, 4, 2),
    "resnet8x4-round": Training("ResNet8x4 round (AugFL)", "resnet8x4", (3, 32, 32), 100, 2, 4, 2, 2),
}
FEDSLR_SIZES: dict[str, dict[str, Any]] = {
    "full": {"model": "resnet18_gn", "batch": 20, "repeats": {"device": 20, "cpu": 5}},
    "dry": {"model": "cnn", "batch": 2, "repeats": {"device": 1, "cpu": 1}},  # ResNet-18-GN's SVDs take 6 s of a CPU
}
FEDSLR_FRACTION = 0.25
LR, LAMBDA = 0.05, 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="compute every check of one side, one result file each")
    run.add_argument("--side", choices=SIDES, required=True)
    run.add_argument("--device", default="cpu", help="the device side's torch device (cuda; cpu with --dry)")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--dry", action="store_true", help="the smallest sizes (the CPU stands in for the GPU)")
    run.add_argument("--fp32", action="store_true", help="no TF32 on the device side (tolerance 1e-4 for all)")
    run.add_argument("--only", nargs="+", choices=CHECKS, help="these checks alone")
    preflight = commands.add_parser("preflight", help="one line and exit 1 if this Python cannot run a side")
    preflight.add_argument("--device", default="cpu")
    preflight.add_argument("--runtime", action="store_true", help="also raysim's runtime (Ray, MLflow)")
    compare = commands.add_parser("compare", help="decide one check from its two result files")
    compare.add_argument("device_file", type=Path)
    compare.add_argument("cpu_file", type=Path, nargs="?", help="not for raysim bench's JSON (its reference is in it)")
    table = commands.add_parser("table", help="compare every check in a folder and print one table")
    table.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run_side(args.side, args.device, args.out, args.dry, args.fp32, args.only or CHECKS)
        return 0
    if args.command == "preflight":
        return check_imports(args.device, args.runtime)
    if args.command == "compare":
        if args.cpu_file is None:
            verdicts = [verdict for _, verdict in compare_hosts(args.device_file)]
        else:
            verdicts = [compare_files(args.device_file, args.cpu_file)]
        for verdict in verdicts:
            print(verdict.line)
        return 0 if all(verdict.passed for verdict in verdicts) else 1
    rows = table_rows(args.folder)
    text = markdown(rows, machine(args.folder))
    print(text)
    (args.folder / "table.md").write_text(text + "\n")
    failed = [row.check for row in rows if row.result not in ("pass", "skipped")]
    if failed:
        print(f"gpu check failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def check_imports(device: str, runtime: bool) -> int:
    """What a side needs, said in one line: raysim's training code and torch, a CUDA device for `cuda`, and for the
    `hosts` rows raysim's runtime."""
    try:
        import torch

        import raysim.executors  # noqa: F401  the training side: torch, numpy, pydantic, numba
    except ImportError as error:
        print(f"gpu check: this Python ({sys.executable}) cannot import raysim's training code: {error}")
        return 1
    if device != "cpu" and not torch.cuda.is_available():
        print(f"gpu check: torch {torch.__version__} sees no CUDA device; without a GPU run gpu_check.sh --dry")
        return 1
    if runtime:
        try:
            import mlflow  # noqa: F401
            import ray  # noqa: F401
        except ImportError as error:
            print(f"the hosts rows need raysim's runtime: {error}")
            return 1
    return 0


def run_side(side: str, device: str, out: Path, dry: bool, fp32: bool, checks: tuple[str, ...]) -> None:
    """Every check of `side` into `out`; the device side on `device` (a warm-up first on CUDA), the CPU side on the
    CPU path; both on one torch thread, as a raysim host (runtime.torch_threads)."""
    import torch

    from raysim.config import RuntimeSettings
    from raysim.seeding import use_kernels

    torch.set_num_threads(1)
    use_kernels(RuntimeSettings().deterministic)  # as every host does
    target = torch.device(device if side == "device" else "cpu")
    if fp32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    tf32 = target.type == "cuda" and torch.backends.cudnn.allow_tf32
    out.mkdir(parents=True, exist_ok=True)
    sizes = DRY if dry else FULL
    for check in (c for c in TRAINING if c in checks):
        size = sizes[check]
        arrays, seconds, gpu_mib = _measured(round_of(size, side, target), target)
        save(out / f"{check}.{side}.npz", arrays, _meta(check, side, target, dry, tf32, seconds, gpu_mib, size))
    if any(check in checks for check in FEDSLR):
        forward = FEDSLR_SIZES["dry" if dry else "full"]
        for check, (arrays, seconds, gpu_mib) in fedslr_logits(forward, forward["repeats"][side], target).items():
            if check in checks:
                about = f"{forward['model']}, batch {forward['batch']}, rank fraction {FEDSLR_FRACTION}"
                title = f"FedSLR GKR forward, {check.removeprefix('fedslr-')}"
                meta = _meta(check, side, target, dry, tf32, seconds, gpu_mib, about, title)
                save(out / f"{check}.{side}.npz", arrays, meta)


def _meta(
    check: str,
    side: str,
    target: Any,
    dry: bool,
    tf32: bool,
    seconds: float,
    gpu_mib: float | None,
    size: Training | str,
    title: str = "",
) -> dict[str, Any]:
    import torch

    return {
        "check": check,
        "side": side,
        "device": str(target),
        "device_name": torch.cuda.get_device_name(target) if target.type == "cuda" else platform.processor() or "CPU",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "dry": dry,
        "tf32": bool(tf32),
        "seconds": seconds,
        "gpu_mib": gpu_mib,
        "size": size.size if isinstance(size, Training) else size,
        "title": size.title if isinstance(size, Training) else title,
    }


Run = Callable[[], dict[str, np.ndarray]]


def _measured(setup: Callable[[], Run], device: Any) -> tuple[dict[str, np.ndarray], float, float | None]:
    """The arrays of one run that `setup` prepares, its seconds (the run alone; on CUDA after a warm-up run, which
    pays for loading the kernels) and its peak allocated GPU memory in MiB (None on the CPU)."""
    import torch

    if device.type == "cuda":
        setup()()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    run = setup()
    start = time.perf_counter()
    arrays = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return arrays, seconds, gpu_mib


def round_of(size: Training, side: str, device: Any) -> Callable[[], Run]:
    """One local round of every client from the same start with the prox pull to its own center (FLAME, eq. (11)),
    run by the executor a raysim host builds: `vectorized` on the device side, `auto` on the CPU side. The data are
    drawn once; each setup builds the executor and the requests with fresh generators (not timed)."""
    from raysim.algorithms.requests import LocalSGD, SGDResult
    from raysim.algorithms.terms import Prox
    from raysim.config import RuntimeSettings
    from raysim.executors.base import ExecutorContext, build_executor
    from raysim.models.flat import FlatModel
    from raysim.training.local import ClientData

    model = FlatModel(size.model, size.shape, size.classes)
    source = np.random.default_rng(0)
    total = size.clients * size.samples
    x = source.normal(size=(total, *size.shape)).astype(np.float32)
    y = source.integers(0, size.classes, total).astype(np.int64)
    empty = np.array([], np.int64)
    data = [
        ClientData(x, y, np.sort(owned), empty, empty) for owned in source.permutation(total).reshape(size.clients, -1)
    ]
    start = model.initial_parameters(0)
    noise = 0.01 * source.standard_normal(start.shape, dtype=np.float32)
    centers = [start + np.roll(noise, 7919 * i) for i in range(size.clients)]  # each client's own, drawn once
    rows = np.unique(np.linspace(0, size.clients - 1, COMPARED_ROWS).round().astype(np.int64))
    chunk = size.chunk if side == "device" else RuntimeSettings().vectorize_chunk

    def setup() -> Run:
        executor = build_executor("vectorized" if side == "device" else "auto", ExecutorContext(model, device, chunk))
        jobs = [
            (LocalSGD(start, 1, LR, size.batch, terms=(Prox(center, LAMBDA),)), client, np.random.default_rng(i))
            for i, (center, client) in enumerate(zip(centers, data, strict=True))
        ]

        def run() -> dict[str, np.ndarray]:
            results = [result for result in executor.run_turn(jobs) if isinstance(result, SGDResult)]
            assert len(results) == len(jobs), "every LocalSGD request gives an SGDResult"
            params = np.stack([np.asarray(result.params) for result in results])
            return {
                "start": start,
                "params": params[rows],
                "mean": params.mean(axis=0, dtype=np.float64).astype(np.float32),
                "steps": np.array([result.steps for result in results], np.int64),
                "rows": rows,
            }

        return run

    return setup


def fedslr_logits(
    size: dict[str, Any], repeats: int, device: Any
) -> dict[str, tuple[dict[str, np.ndarray], float, Any]]:
    """Logits of FedSLR's low-rank ResNet-18-GN (dry: the CIFAR CNN), dense and factorized
    (benchmarks/fedslr_latency.py's networks), on one batch, with the median seconds of `repeats` forward passes
    (after a warm-up)."""
    import torch

    from raysim.models.factorized import factorized_network
    from raysim.models.flat import FlatModel

    latency = _beside("fedslr_latency")
    model = FlatModel(size["model"], (3, 32, 32), 10)
    flat, factors = latency.truncated(model, FEDSLR_FRACTION)
    generator = np.random.default_rng(0)
    batch = torch.from_numpy(generator.normal(size=(size["batch"], 3, 32, 32)).astype(np.float32)).to(device)
    found = {}
    for check, kept in (("fedslr-dense", {}), ("fedslr-factorized", factors)):
        network = factorized_network(model.module, model.spec, flat, kept).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        latency.timed(network, batch, device.type)  # warm-up
        milliseconds = statistics.median(latency.timed(network, batch, device.type) for _ in range(repeats))
        with torch.no_grad():
            logits = network(batch).cpu().numpy()
        gpu_mib = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        found[check] = ({"start": np.zeros_like(logits), "logits": logits}, milliseconds / 1000, gpu_mib)
    return found


def _beside(name: str) -> Any:
    """A benchmark script beside this one, as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None, f"benchmarks/{name}.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """The arrays and, as a string array `meta`, the JSON of what ran where and how long it took."""
    stored: dict[str, Any] = {**arrays, "meta": np.array(json.dumps(meta))}
    np.savez(path, **stored)


def load(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path) as stored:
        arrays = {key: stored[key] for key in stored.files if key != "meta"}
        return arrays, json.loads(str(stored["meta"]))


def load_meta(path: Path) -> dict[str, Any]:
    """A result file's `meta` alone (np.load reads an .npz's arrays as they are asked for)."""
    with np.load(path) as stored:
        return json.loads(str(stored["meta"]))


@dataclass(frozen=True)
class Verdict:
    check: str
    difference: float
    tolerance: float
    passed: bool
    reason: str = ""

    @property
    def line(self) -> str:
        word = "pass" if self.passed else "FAIL"
        told = f" ({self.reason})" if self.reason else ""
        return f"{self.check}: max difference {self.difference:.1e}, tolerance {self.tolerance:.0e}: {word}{told}"


def tolerance(check: str, tf32: bool) -> float:
    """FLOAT32_TOLERANCE, or TF32_TOLERANCE for a convolutional check whose device side ran TF32 convolutions
    (see the module docstring)."""
    return TF32_TOLERANCE if tf32 and check in CONVOLUTIONAL else FLOAT32_TOLERANCE


def compare_files(device_file: Path, cpu_file: Path) -> Verdict:
    """The device side's result against the CPU side's: every client's step count equal, and every compared array's
    largest difference relative to the CPU side's change from the start at most the tolerance."""
    device, device_meta = load(device_file)
    cpu, cpu_meta = load(cpu_file)
    check = device_meta["check"]
    limit = tolerance(check, device_meta["tf32"])
    if cpu_meta["check"] != check or device.keys() != cpu.keys():
        return Verdict(
            check, math.inf, limit, False, f"{cpu_file.name} holds check {cpu_meta['check']!r}, not {check!r}"
        )
    if "steps" in cpu and not np.array_equal(device["steps"], cpu["steps"]):
        return Verdict(check, math.inf, limit, False, "the clients took different numbers of steps")
    difference = 0.0
    for key in sorted(set(cpu) - {"start", "steps", "rows"}):
        if device[key].shape != cpu[key].shape:
            return Verdict(check, math.inf, limit, False, f"{key} has shape {device[key].shape}, not {cpu[key].shape}")
        scale = float(np.max(np.abs(cpu[key].astype(np.float64) - cpu["start"])))
        gap = float(np.max(np.abs(device[key].astype(np.float64) - cpu[key])))
        difference = max(difference, gap / scale if scale > 0 else math.inf if gap > 0 else 0.0)
    return Verdict(check, difference, limit, difference <= limit)


def compare_hosts(path: Path) -> list[tuple[dict[str, Any], Verdict]]:
    """raysim bench's rows, each raysim way with its verdict: its global model against the reference loop's on the
    CPU (`max |w - w_ref|`) at most HOSTS_TOLERANCE."""
    results = json.loads(path.read_text())["results"]
    found = []
    for row in results:
        if row["way"] == "reference":
            continue
        check = f"hosts-{row['host_gpus']:g}"
        difference = row["max_abs_diff_vs_reference"]
        if difference is None:
            found.append((row, Verdict(check, math.inf, HOSTS_TOLERANCE, False, "the reference way did not run")))
        else:
            found.append((row, Verdict(check, difference, HOSTS_TOLERANCE, difference <= HOSTS_TOLERANCE)))
    return found


@dataclass(frozen=True)
class Row:
    check: str
    title: str
    size: str
    device: str
    device_time: str
    cpu_time: str
    speedup: str
    gpu_mib: str
    difference: str
    tolerance: str
    result: str


COLUMNS = (
    "check",
    "what",
    "size",
    "device",
    "device time",
    "CPU path time",
    "CPU / device",
    "GPU MiB",
    "max difference",
    "tolerance",
    "result",
)


def table_rows(folder: Path) -> list[Row]:
    """One row per check, in CHECKS' order, then the hosts rows; a check without both result files fails."""
    dry = any(load_meta(path)["dry"] for path in folder.glob("*.npz"))
    rows = []
    for check in CHECKS:
        device_file, cpu_file = (folder / f"{check}.{side}.npz" for side in SIDES)
        if not (device_file.exists() and cpu_file.exists()):
            rows.append(Row(check, "", "", "", "-", "-", "-", "-", "-", "-", "missing"))
            continue
        verdict = compare_files(device_file, cpu_file)
        device, cpu = load_meta(device_file), load_meta(cpu_file)
        unit = "ms" if check in FEDSLR else "s"
        scale = 1000 if unit == "ms" else 1
        rows.append(
            Row(
                check,
                device["title"],
                device["size"],
                _device(device["device"], device["tf32"] and check in CONVOLUTIONAL, dry),
                f"{device['seconds'] * scale:.3g} {unit}",
                f"{cpu['seconds'] * scale:.3g} {unit}",
                f"{cpu['seconds'] / device['seconds']:.2f}",
                "-" if device["gpu_mib"] is None else f"{device['gpu_mib']:.0f}",
                f"{verdict.difference:.1e}",
                f"{verdict.tolerance:.0e}",
                _result(verdict),
            )
        )
    rows.extend(_hosts_rows(folder, dry))
    return rows


def _hosts_rows(folder: Path, dry: bool) -> list[Row]:
    skipped = folder / "hosts.skipped"
    path = folder / "hosts.json"
    names = [f"hosts-{share:g}" for share in SHARES if share or not dry]
    if skipped.exists():
        reason = skipped.read_text().strip() or "skipped"
        return [Row(name, reason, "", "", "-", "-", "-", "-", "-", "-", "skipped") for name in names]
    if not path.exists():
        return [Row(name, "", "", "", "-", "-", "-", "-", "-", "-", "missing") for name in names]
    results = json.loads(path.read_text())["results"]
    reference = next((row for row in results if row["way"] == "reference"), None)
    found = {verdict.check: (row, verdict) for row, verdict in compare_hosts(path)}
    rows = []
    for name in names:
        if name not in found:
            rows.append(Row(name, "", "", "", "-", "-", "-", "-", "-", "-", "missing"))
            continue
        row, verdict = found[name]
        share = row["host_gpus"]
        title = "FLAME rounds, CPU hosts" if share == 0 else f"FLAME rounds, {share:g} GPU a host"
        cpu_seconds = reference["seconds_per_round"] if reference else math.nan
        rows.append(
            Row(
                name,
                f"{title} (raysim bench, vectorized way)",
                f"{row['clients']} {row['model']} clients, {row['hosts']} host(s), chunk {row['chunk']}",
                "cpu" if share == 0 else _device(row["device"], False, dry),
                f"{row['seconds_per_round']:.3g} s/round",
                f"{cpu_seconds:.3g} s/round",
                f"{cpu_seconds / row['seconds_per_round']:.2f}",
                "-" if row["gpu_memory_mib"] is None else f"{row['gpu_memory_mib']:.0f}",
                f"{verdict.difference:.1e}",
                f"{verdict.tolerance:.0e}",
                _result(verdict),
            )
        )
    return rows


def _device(device: str, tf32: bool, dry: bool) -> str:
    if dry:
        return "cpu (dry)"
    return f"{device}{' (TF32 conv)' if tf32 else ''}"


def _result(verdict: Verdict) -> str:
    return "pass" if verdict.passed else f"FAIL{': ' + verdict.reason if verdict.reason else ''}"


def machine(folder: Path) -> str:
    """What the device side ran on, from its result files."""
    for check in CHECKS:
        path = folder / f"{check}.device.npz"
        if path.exists():
            meta = load_meta(path)
            dry = " (a dry run: the CPU stands in for the GPU)" if meta["dry"] else ""
            return f"{meta['device_name']}{dry}, torch {meta['torch']}, {meta['cpus']} CPUs"
    return "no device results"


def markdown(rows: list[Row], header: str) -> str:
    lines = [f"GPU check ({header})", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = (
            row.check,
            row.title,
            row.size,
            row.device,
            row.device_time,
            row.cpu_time,
            row.speedup,
            row.gpu_mib,
            row.difference,
            row.tolerance,
            row.result,
        )
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
