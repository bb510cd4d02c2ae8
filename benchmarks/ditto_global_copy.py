"""Ditto's GM in FLAME's Table III setting against the authors' code: the suite's `ditto/q<q>` run (FLAME's
Ditto baseline).

    python benchmarks/ditto_global_copy.py [--q 2] [--seed 1] [--rounds 100] [--at 0,1,10,20,50,100]
        [--set clients.batches=raysim] [--set algorithm.global_steps=epoch]

Runs the run `ditto/q<q>` of configs/paper/suites/flame_table3_fmnist.yaml at one seed (`--set` applies after the
run's own settings) in one process (the real host and coordinator, no Ray, no MLflow), and prints the mean GM and
PM test accuracy at the steps `--at`, the GM scored as the suite scores it (before the round's aggregation, as the
authors' logging does: step r is the model after r - 1 aggregations).

Measured (seed 1, the suite's switches, clients.batches: authors): the authors' code's GM to four digits,
0.0936 / 0.0936 / 0.3242 / 0.3944 / 0.4247 / 0.4393 at steps 0 / 1 / 10 / 20 / 50 / 100 (docs/reproducing.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from raysim.config import apply_override, validate_config
from raysim.evaluation.columns import client_evaluations
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.host import ClientHost
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.problem import prepare
from raysim.studies.suite import load_suite

SUITE = Path(__file__).resolve().parents[1] / "configs" / "paper" / "suites" / "flame_table3_fmnist.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q", type=int, default=2, help="#label = q (the suite's ditto/q2 .. ditto/q6)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--at", default="0,1,10,20,50,100", help="steps to score (comma-separated)")
    parser.add_argument("--set", action="append", default=[], help="key.path=value on the run's settings")
    args = parser.parse_args()
    steps = {int(step) for step in args.at.split(",")}
    suite = load_suite(SUITE, [f"rounds={args.rounds}", f"seed={args.seed}"])
    name = f"ditto/q{args.q}"
    tree = suite.base_tree()
    run = next(r for r in suite.runs if r.name == name)
    for assignment in [f"{key}={json.dumps(value)}" for key, value in run.overrides.items()] + args.set:
        apply_override(tree, assignment)
    config = validate_config(tree)
    print(
        f"{name} seed {args.seed}: algorithm {config.algorithm.model_dump(by_alias=True)}, "
        f"clients.batches {config.clients.batches}",
        flush=True,
    )
    problem = prepare(config)
    host = ClientHost(
        HostSettings.from_config(config, problem), problem.x, problem.y, problem.clients, problem.init_params
    )
    coordinator = Coordinator(
        CoordinatorSettings(config.algorithm, problem.params, problem.num_training), problem.init_params
    )
    everyone = list(range(problem.num_training))
    start = time.perf_counter()

    def report(step: int, global_params: np.ndarray) -> None:
        scores = client_evaluations(host.evaluate(global_params))
        gm, pm = np.mean([s.gm.test_acc for s in scores]), np.mean([s.pm.test_acc for s in scores])
        print(f"step {step:4d}  GM {gm:.4f}  PM {pm:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)

    if 0 in steps:
        report(0, coordinator.global_model())
    for round_index in range(args.rounds):
        broadcast = coordinator.broadcast()
        partial, _ = host.train(round_index, everyone, broadcast)
        if round_index + 1 in steps:
            report(round_index + 1, coordinator.global_model())  # before this round's aggregation
        coordinator.aggregate(partial)


if __name__ == "__main__":
    main()
