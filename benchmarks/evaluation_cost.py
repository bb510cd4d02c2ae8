"""What an evaluation of every client costs next to a training round, with and without the training-loss pass.

    python benchmarks/evaluation_cost.py [CONFIG] [--rounds R]

Runs the config's clients (default configs/quickstart.yaml: FLAME, 10 Fashion-MNIST clients, MLP) in one
process on one host (no Ray, no MLflow), and after each round times `ClientHost.evaluate` of the same global
model twice, with the training-loss pass (`tracking.train_loss: true`) and without it (`false`), side by side.
Prints the medians over the rounds after the first and their ratios to a training round.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from raysim.config import load_config
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.host import ClientHost
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.problem import prepare, sample_clients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/quickstart.yaml")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    config = load_config(args.config, [])
    problem = prepare(config)
    settings = HostSettings.from_config(config, problem)
    host = ClientHost(settings, problem.x, problem.y, problem.clients, problem.init_params)
    coordinator = Coordinator(
        CoordinatorSettings(config.algorithm, problem.params, problem.num_training), problem.init_params
    )
    timings: dict[str, list[float]] = {"training round": [], "evaluation with train loss": [], "evaluation without": []}
    per_round = config.clients.per_round_count()
    for round_index in range(args.rounds):
        start = time.perf_counter()
        selected = sample_clients(config.seed, round_index, problem.num_training, per_round)
        partial, _ = host.train(round_index, selected, coordinator.broadcast())
        coordinator.aggregate(partial)
        timings["training round"].append(time.perf_counter() - start)
        global_model = coordinator.global_model()
        for name, every in (("evaluation with train loss", 1), ("evaluation without", 0)):
            host.settings = dataclasses.replace(settings, train_loss_every=every)
            start = time.perf_counter()
            host.evaluate(global_model)
            timings[name].append(time.perf_counter() - start)
    train = statistics.median(timings["training round"][1:])
    print(f"{args.config}: {len(problem.clients)} clients, {args.rounds} rounds (medians after the first)")
    for name, values in timings.items():
        median = statistics.median(values[1:])
        print(f"  {name:28s} {median:7.3f} s   {median / train:5.2f} x a training round")


if __name__ == "__main__":
    main()
