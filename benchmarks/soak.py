"""Soak: many clients for many rounds, with the memory (RSS) of every process of the run sampled each round.

    python benchmarks/soak.py [--clients 1000] [--rounds 200] [--per-round 100] [--warmup 20] [--hosts 2]

Runs FedAvg-style FLAME on Fashion-MNIST (IID, MLR model) on a local Ray started by this script, samples
the resident memory of the driver and of every process it started (GCS, raylet, host and coordinator
actors, ...) from /proc after every round, and prints per process the RSS after warm-up, at the end and the
growth per 100 rounds; checkpoints every `--checkpoint-every` rounds so that path is soaked too. A leak
shows as steady growth after warm-up; the last line is the total over all processes.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rich.console import Console
from rich.table import Table

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from raysim.studies.procmem import sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=100, help="clients sampled per round")
    parser.add_argument("--warmup", type=int, default=20, help="rounds before the reference sample")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    args = parser.parse_args()
    samples: dict[int, dict[str, float]] = {}

    def inspect(round_index: int, simulation) -> None:
        samples[round_index + 1] = sample()

    with tempfile.TemporaryDirectory() as folder:
        config = validate_config(
            {
                "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.1, "lr": 0.01, "batch_size": 50},
                "dataset": {"name": "fashion_mnist"},
                "partition": {"scheme": "iid"},
                "model": {"name": "mlr"},
                "clients": {"count": args.clients, "per_round": args.per_round},
                "rounds": args.rounds,
                "runtime": {"num_hosts": args.hosts, "num_cpus": args.hosts},
                "tracking": {
                    "uri": f"sqlite:///{folder}/mlflow.db",
                    "experiment": "soak",
                    "eval_every": args.eval_every,
                    "checkpoint_every": args.checkpoint_every,
                    "checkpoint_dir": f"{folder}/ckpt",
                },
            }
        )
        start = time.perf_counter()
        result = run_experiment(config, show_progress=False, inspect=inspect)
        seconds = time.perf_counter() - start
    warm, end = samples[min(args.warmup, args.rounds)], samples[args.rounds]
    span = max(args.rounds - args.warmup, 1)
    table = Table(title=f"RSS (MiB): {args.clients} clients, {args.rounds} rounds, {seconds:.0f} s")
    for column in ("process", f"after round {args.warmup}", f"after round {args.rounds}", "growth / 100 rounds"):
        table.add_column(column, justify="left" if column == "process" else "right", no_wrap=True)
    for name in sorted(set(warm) & set(end), key=lambda n: -end[n]):
        table.add_row(name, f"{warm[name]:.1f}", f"{end[name]:.1f}", f"{(end[name] - warm[name]) * 100 / span:+.1f}")
    both = set(warm) & set(end)
    total_warm, total_end = sum(warm[n] for n in both), sum(end[n] for n in both)
    table.add_row("total", f"{total_warm:.1f}", f"{total_end:.1f}", f"{(total_end - total_warm) * 100 / span:+.1f}")
    Console().print(table)
    print(f"final PM acc {result.summary['final/pm/acc']:.4f}; processes only at one end: {len(set(warm) ^ set(end))}")


if __name__ == "__main__":
    main()
