"""Pretrain AugFL's PM on the reserved pool of the `meta` partition (augfl.md 4.1), which no client holds.

    raysim pretrain EXPERIMENT.yaml [--epochs 5] [--lr 0.05] [--cache ~/.cache/raysim/pm]
    (or python -m raysim.pretrain ...)

trains the experiment's model architecture (the l2 regularizer needs the same one) with mini-batch SGD on
the reserved samples and caches the flat float32 parameters as a .npy keyed by dataset, model, seed and
pool size; it prints the path, for `algorithm.pm_path`. Rerunning with the same key reuses the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from raysim.algorithms.base import LocalSGD
from raysim.config import ExperimentConfig, load_config
from raysim.data.meta_partition import MetaSettings, reserved_indices
from raysim.errors import ConfigError
from raysim.runtime.driver import prepare
from raysim.seeding import Stream, rng
from raysim.training.local import ClientData, LocalTrainer

DEFAULT_CACHE = Path("~/.cache/raysim/pm")


def pretrain_pm(config: ExperimentConfig, epochs: int = 5, lr: float = 0.05, cache: Path = DEFAULT_CACHE) -> Path:
    """Train (or reuse) the PM of `config` and return the path of its parameters."""
    if not isinstance(config.partition, MetaSettings):
        raise ConfigError(
            f"partition.scheme: pretraining needs 'meta' (its reserved pool), not '{config.partition.scheme}'"
        )
    path = cache.expanduser() / (
        f"{config.dataset.name}-{config.model.name}-seed{config.seed}-pool{config.partition.reserved}-e{epochs}.npy"
    )
    if path.exists():
        return path
    problem = prepare(config)
    pool = reserved_indices(len(problem.y), config.partition, config.seed)
    trainer = LocalTrainer(problem.model_spec.build())
    data = ClientData(problem.x, problem.y, pool, np.arange(0), np.arange(0))
    request = LocalSGD(problem.init_params, epochs, lr, 64, momentum=0.9)
    result = trainer.sgd(request, data, rng(config.seed, Stream.CLIENT_TRAINING, 10**9))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, result.params.astype(np.float32))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    print(pretrain_pm(load_config(args.config), args.epochs, args.lr, args.cache))


if __name__ == "__main__":
    main()
