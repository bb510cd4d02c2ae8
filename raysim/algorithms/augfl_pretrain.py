"""`raysim pretrain`: AugFL's pretrained model (the teacher), trained ahead of a run on the `meta` partition's
reserved pool, which no client holds (augfl.md 4.1), and cached.

    raysim pretrain EXPERIMENT.yaml [--epochs E] [--lr LR] [--cache ~/.cache/raysim/pm]
    (or python -m raysim.algorithms.augfl_pretrain ...; the cache folder defaults to $RAYSIM_CACHE/pm)

The architecture is `algorithm.pm_model`, by default a larger network than the clients' (the paper distils a
ResNet32x4 into a ResNet8x4): mlr -> mlp, mlp -> cnn (image input), cnn -> resnet18_gn; with the L2 regularizer
it must be the clients' own model (and for a config of another algorithm it is the clients' model). It is
trained with mini-batch SGD (momentum 0.9, batch 64) for `algorithm.pm_epochs` at `algorithm.pm_lr` and cached
as flat float32 parameters, keyed by dataset, architecture, seed, pool sizes, epochs and rate; a second call (or
run) reuses the file. A run that needs the pretrained model and has no `algorithm.pm_path` trains it on first
use the same way (`AugFl.server_data`); only the coordinator ever receives it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raysim.algorithms.augfl import AugFlSettings, pretrain, teacher_architecture
from raysim.config import ExperimentConfig, load_config
from raysim.data.sources import Dataset
from raysim.runtime.problem import run_server_requests, server_context


def pm_architecture(config: ExperimentConfig, input_shape: tuple[int, ...]) -> str:
    """The pretrained model's architecture for `config`: `algorithm.pm_model`, or the default (the clients' model
    for L2, else the next larger one); the clients' model when the algorithm is not AugFL."""
    if not isinstance(config.algorithm, AugFlSettings):
        return config.model.name
    return teacher_architecture(config.algorithm, config.model.name, input_shape)


def pretrain_pm(
    config: ExperimentConfig,
    epochs: int | None = None,
    lr: float | None = None,
    cache: Path | None = None,
    dataset: Dataset | None = None,
) -> Path:
    """Train (or reuse) the pretrained model of `config` and return the path of its parameters; `epochs` and `lr`
    default to `algorithm.pm_epochs` and `algorithm.pm_lr`, `cache` to $RAYSIM_CACHE/pm."""
    if dataset is None:
        dataset = config.dataset.load(config.seed)
    context = server_context(config, dataset)
    settings = config.algorithm if isinstance(config.algorithm, AugFlSettings) else AugFlSettings()
    epochs = settings.pm_epochs if epochs is None else epochs
    lr = settings.pm_lr if lr is None else lr
    folder = context.cache / "pm" if cache is None else cache
    step = pretrain(context, pm_architecture(config, dataset.input_shape), epochs, lr, folder)
    return run_server_requests(step, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--cache", type=Path, default=None, help="default: $RAYSIM_CACHE/pm or ~/.cache/raysim/pm")
    args = parser.parse_args()
    print(pretrain_pm(load_config(args.config), args.epochs, args.lr, args.cache))


if __name__ == "__main__":
    main()
