"""Per-host busy time of a round: hosts that own fixed halves of the clients against a round dealt by cost (issue 49.2).

    python benchmarks/balanced_rounds.py [--model cnn] [--rounds 3] [--set KEY.PATH=VALUE ...]

FedSLR's ResNet-18-GN setting (100 Fashion-MNIST clients split IID, 10 a round, batch 20, seed 1, 2 hosts, one
epoch of FLAME) run twice in this process, side by side: `runtime.state_store = hosts` (each host trains the sampled
clients it owns) and `memory` (the sampled clients dealt to the hosts, longest processing time first). The hosts run
in process (runtime.actors = in_process: one after another, so each host's busy time is its own, whatever else the
machine runs). Prints, per round, each host's clients and busy seconds and the busiest host's time over the balanced
one (all hosts' busy time / hosts), and checks that both runs end with the same global model, bit for bit.
`--model resnet18_gn` is the issue's row (about 3 minutes a round per host on a quiet 2-core machine).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from raysim.config import apply_overrides, validate_config
from raysim.runtime.driver import run_experiment


def config(store: str, model: str, rounds: int, folder: Path, overrides: list[str]):
    tree = {
        "algorithm": {"name": "flame", "lambda": 1.0, "rho": 0.1, "epochs": 1, "lr": 0.01, "batch_size": 20},
        "dataset": {"name": "fashion_mnist"},
        "partition": {"scheme": "iid"},
        "model": {"name": model},
        "clients": {"count": 100, "per_round": 10},
        "rounds": rounds,
        "seed": 1,
        "runtime": {"actors": "in_process", "num_hosts": 2, "state_store": store, "client_training": "sequential"},
        "tracking": {
            "uri": f"sqlite:///{folder}/mlflow.db",
            "experiment": "balanced",
            "eval_every": rounds,
            "train_loss": False,
        },
    }
    apply_overrides(tree, tuple(overrides))
    return validate_config(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = parser.parse_args()
    finals = {}
    with tempfile.TemporaryDirectory() as folder:
        for store in ("hosts", "memory"):
            run = config(store, args.model, args.rounds, Path(folder), args.set)
            seen: list[tuple[list[int], list[float]]] = []

            def inspect(round_index, simulation, seen=seen, store=store):
                counts = [len(clients) for clients in simulation.dealt]
                busy = [
                    host.instance.train_seconds if n else 0.0 for host, n in zip(simulation.hosts, counts, strict=True)
                ]
                seen.append((counts, busy))
                finals[store] = np.asarray(simulation.global_model())

            run_experiment(run, show_progress=False, inspect=inspect)
            for round_index, (counts, busy) in enumerate(seen, start=1):
                balanced = sum(busy) / len(busy)
                split = " and ".join(str(c) for c in counts)
                hosts_s = ", ".join(f"{b:.1f}" for b in busy)
                print(
                    f"{store:6s} round {round_index}: clients {split}; busy s {hosts_s}; "
                    f"max / balanced {max(busy) / balanced:.2f}",
                    flush=True,
                )
    same = np.array_equal(finals["hosts"], finals["memory"])
    print(f"global models after round {args.rounds}: {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
