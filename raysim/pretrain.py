"""AugFL's pretrained model (PM): trained on the `meta` partition's reserved pool, which no client holds
(augfl.md 4.1), and cached.

    raysim pretrain EXPERIMENT.yaml [--epochs E] [--lr LR] [--cache ~/.cache/raysim/pm]
    (or python -m raysim.pretrain ...; the cache folder defaults to $RAYSIM_CACHE/pm)

The PM's architecture is `algorithm.pm_model`, by default a larger network than the clients' (the paper
distils a ResNet32x4 into a ResNet8x4): mlr -> mlp, mlp -> cnn (image input), cnn -> resnet18_gn; with the
L2 regularizer it must be the clients' own model. It is trained with mini-batch SGD (momentum 0.9, batch
64) for `algorithm.pm_epochs` at `algorithm.pm_lr` and cached as flat float32 parameters, keyed by dataset,
architecture, seed, pool size, epochs and rate; a second call (or run) reuses the file. Runs that need a PM
and have no `algorithm.pm_path` train it on first use in the driver. Only the coordinator ever receives it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from raysim.algorithms.augfl import AugFlSettings
from raysim.algorithms.base import LocalSGD
from raysim.config import ExperimentConfig, load_config
from raysim.data.meta_partition import MetaSettings, reserved_indices
from raysim.data.sources import Dataset
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.seeding import Stream, rng, torch_seed
from raysim.training.local import ClientData, LocalTrainer

CACHE_VARIABLE = "RAYSIM_CACHE"
"""Environment variable naming raysim's cache folder (default ~/.cache/raysim); PMs go to its `pm/`."""


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE, "~/.cache/raysim")).expanduser() / "pm"


LARGER = {"mlr": "mlp", "linear": "mlp", "mlp": "cnn", "cnn": "resnet18_gn", "resnet18_gn": "resnet18_gn"}
"""The default PM architecture for each client model: the next larger network of the zoo."""


def pm_architecture(config: ExperimentConfig, input_shape: tuple[int, ...]) -> str:
    """`algorithm.pm_model`, or the default: the clients' model for L2, else the next larger one."""
    settings = config.algorithm
    if not isinstance(settings, AugFlSettings):
        return config.model.name
    explicit = settings.pm_model
    if settings.regularizer == "l2":
        if explicit not in (None, config.model.name):
            raise ConfigError(
                f"algorithm.pm_model={explicit}: regularizer l2 compares parameters, so the PM must be the "
                f"clients' model ({config.model.name}); use regularizer crd for a different architecture"
            )
        return config.model.name
    if explicit is not None:
        return explicit
    larger = LARGER[config.model.name]
    return larger if len(input_shape) == 3 or larger in ("mlp", "mlr") else "mlp"


def _pretraining(config: ExperimentConfig, epochs: int | None, lr: float | None) -> tuple[int, float]:
    settings = config.algorithm
    if isinstance(settings, AugFlSettings):
        return (settings.pm_epochs if epochs is None else epochs), (settings.pm_lr if lr is None else lr)
    return (5 if epochs is None else epochs), (0.05 if lr is None else lr)


def pm_cache_path(config: ExperimentConfig, architecture: str, epochs: int, lr: float, cache: Path) -> Path:
    partition = config.partition
    assert isinstance(partition, MetaSettings)
    name = (
        f"{config.dataset.name}-{architecture}-seed{config.seed}-pool{partition.reserved}"
        f"-held{partition.reserved + partition.server_samples}-e{epochs}-lr{lr:g}.npy"
    )
    return cache.expanduser() / name


def pretrain_pm(
    config: ExperimentConfig,
    epochs: int | None = None,
    lr: float | None = None,
    cache: Path | None = None,
    dataset: Dataset | None = None,
) -> Path:
    """Train (or reuse) the PM of `config` and return the path of its parameters."""
    if not isinstance(config.partition, MetaSettings):
        raise ConfigError(
            f"partition.scheme: pretraining needs 'meta' (its reserved pool), not '{config.partition.scheme}'"
        )
    if dataset is None:
        dataset = config.dataset.load(config.seed)
    architecture = pm_architecture(config, dataset.input_shape)
    epochs, lr = _pretraining(config, epochs, lr)
    path = pm_cache_path(config, architecture, epochs, lr, default_cache() if cache is None else cache)
    if path.exists():
        return path
    try:
        model = FlatModel(architecture, dataset.input_shape, dataset.output_dim, dataset.task)
    except ValueError as error:
        raise ConfigError(f"algorithm.pm_model: {error}") from None
    pool = reserved_indices(len(dataset.y), config.partition, config.seed)
    data = ClientData(dataset.x, dataset.y, pool, np.arange(0), np.arange(0))
    start = model.initial_parameters(torch_seed(config.seed, Stream.MODEL_INIT, 1))
    request = LocalSGD(start, epochs, lr, 64, momentum=0.9)
    result = LocalTrainer(model).sgd(request, data, rng(config.seed, Stream.CLIENT_TRAINING, 10**9))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp.npy")
    np.save(temporary, result.params.astype(np.float32))
    temporary.replace(path)  # never a half-written PM under the final name
    return path


def load_pm(config: ExperimentConfig, dataset: Dataset) -> tuple[np.ndarray, str]:
    """The PM's flat parameters and architecture: `algorithm.pm_path` if set, else the cached (or freshly
    pretrained) one."""
    architecture = pm_architecture(config, dataset.input_shape)
    explicit = config.algorithm.pm_path if isinstance(config.algorithm, AugFlSettings) else None
    path = Path(explicit).expanduser() if explicit else pretrain_pm(config, dataset=dataset)
    try:
        params = np.load(path).astype(np.float32)
    except (OSError, ValueError) as error:
        raise ConfigError(f"algorithm.pm_path: cannot read {path} ({error})") from None
    expected = FlatModel(architecture, dataset.input_shape, dataset.output_dim, dataset.task).size
    if params.shape != (expected,):
        raise ConfigError(
            f"algorithm.pm_path: {path} holds {params.size} parameters, the PM architecture {architecture} has "
            f"{expected} (set algorithm.pm_model to the PM's architecture)"
        )
    return params, architecture


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
