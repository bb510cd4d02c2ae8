"""Ditto's GM when the global copy is never resynced: a full local epoch (`global_steps: epoch`) against the FLAME
authors' one SGD step on one mini-batch (`one_batch`), FLAME's paper setting on Fashion-MNIST (flame.md 2.4, 11).

    python benchmarks/ditto_global_copy.py [--rounds 100] [--every 10]

10 clients with 2 label shards each, MLP, lr 0.01, global lr 0.1, momentum 0.5, weight decay 0.01, one local
epoch, in one process (no Ray, no MLflow). Prints the mean GM (the average of the copies) and PM test accuracy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raysim.config import validate_config
from raysim.runtime.coordinator import Coordinator
from raysim.runtime.host import ClientHost, HostSettings
from raysim.runtime.problem import prepare
from raysim.tracking.metrics import client_evaluations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="evaluate every N rounds")
    args = parser.parse_args()
    for steps in ("one_batch", "epoch"):
        config = validate_config(
            {
                "algorithm": {"name": "ditto", "lr": 0.01, "global_lr": 0.1, "global_resync": False,
                              "global_steps": steps, "batch_size": 100, "momentum": 0.5, "weight_decay": 0.01},
                "partition": {"scheme": "q_label", "q": 2},
                "clients": {"count": 10},
            }
        )  # fmt: skip
        problem = prepare(config)
        settings = HostSettings.from_config(config, problem)
        host = ClientHost(settings, problem.x, problem.y, problem.clients, problem.init_params)
        coordinator = Coordinator(config.algorithm, problem.params, problem.init_params, problem.num_training)
        start = time.perf_counter()
        everyone = list(range(problem.num_training))
        for round_index in range(args.rounds):
            partial, _ = host.train(round_index, everyone, coordinator.broadcast())
            coordinator.aggregate(partial)
            if (round_index + 1) % args.every == 0 or round_index + 1 == args.rounds:
                scores = client_evaluations(host.evaluate(coordinator.global_model()))
                gm = np.mean([s.gm.test_acc for s in scores])
                pm = np.mean([s.pm.test_acc for s in scores])
                print(f"global_steps={steps:9s} round {round_index + 1:4d}  GM {gm:.3f}  PM {pm:.3f}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
