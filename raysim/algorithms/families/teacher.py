"""The teacher family: a model pretrained on the server's own held-back samples, or read from a weights file, verified
either way (AugFL, Secs. V-VI): AugFL's teacher and the encoders of the PM-aided baselines (FedLP, FedPCL).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import AliasChoices, ConfigDict, Field

from raysim.algorithms.interface import ServerContext
from raysim.algorithms.requests import SGDResult, TrainModel
from raysim.errors import ConfigError
from raysim.models.weights import WeightsHeader, check_model, checksum, read_weights, write_weights
from raysim.seeding import Stream, torch_seed
from raysim.settings import Settings

if TYPE_CHECKING:
    from raysim.models.flat import FlatModel


class PretrainingSettings(Settings):
    """The pretrained model theta_p (`algorithm.teacher_*`): a weights file that `raysim pretrain` wrote
    (`teacher_weights`, verified on load), or pretrained on the first pool the `meta` partition keeps back with the
    recipe below and cached (raysim.algorithms.augfl.teacher); shared by AugFL and the PM-aided baselines. The
    recipe's defaults are the authors' (train_teacher_model.py: SGD, rate 0.05, momentum 0.9, weight
    decay 5e-4, batch 64, 240 epochs, the rate x0.1 at epochs 150, 180 and 210); shorten it with `teacher_epochs`."""

    model_config = ConfigDict(populate_by_name=True)

    teacher_weights: str | None = Field(
        None,
        validation_alias=AliasChoices("teacher_weights", "teacher_path", "pm_path"),
        description="weights file of the teacher theta_p written by `raysim pretrain` (checksum, model and classes "
        "verified); default: pretrained with the recipe below on first use and cached",
    )
    teacher_epochs: int = Field(
        240, ge=1, validation_alias=AliasChoices("teacher_epochs", "pm_epochs"), description="pretraining epochs"
    )
    teacher_lr: float = Field(
        0.05, gt=0, validation_alias=AliasChoices("teacher_lr", "pm_lr"), description="pretraining SGD rate"
    )
    teacher_momentum: float = Field(0.9, ge=0, lt=1, description="pretraining SGD momentum")
    teacher_weight_decay: float = Field(5e-4, ge=0, description="pretraining weight decay (added to the gradient)")
    teacher_batch_size: int = Field(64, ge=1, description="pretraining batch size")
    teacher_lr_steps: tuple[int, ...] = Field(
        (150, 180, 210),
        description="epochs (0-based) at whose start the pretraining rate is multiplied by "
        "teacher_lr_decay; steps beyond teacher_epochs never come",
    )
    teacher_lr_decay: float = Field(0.1, gt=0, description="factor of each pretraining rate step")


CACHE = "teacher"
"""The teachers' subfolder of raysim's cache folder (`ServerContext.cache`)."""


def teacher_model(architecture: str, context: ServerContext) -> FlatModel:
    from raysim.models.flat import FlatModel  # in the driver, which prepares the server data

    try:
        return FlatModel(architecture, context.input_shape, context.num_classes, context.task)
    except ValueError as error:
        raise ConfigError(f"algorithm.teacher_model: {error}") from None


def check_pools(context: ServerContext, purpose: str) -> None:
    """The partition keeps back the two pools AugFL's server needs (the teacher's and the transfer set)."""
    if len(context.pools) != 2:
        raise ConfigError(
            f"partition.scheme={context.partition}: {purpose} needs 'meta' (its held-back pools feed the "
            "teacher and the server's transfer set)"
        )


KEY = "algorithm.teacher_weights"
"""The config field of a teacher's weights file, which starts every refusal of one."""


def recipe(settings: PretrainingSettings, context: ServerContext) -> dict[str, Any]:
    """The pretraining recipe as a weights file records it: the SGD settings, the seed and the pool trained on."""
    return {
        "optimizer": "sgd",
        "epochs": settings.teacher_epochs,
        "lr": settings.teacher_lr,
        "momentum": settings.teacher_momentum,
        "weight_decay": settings.teacher_weight_decay,
        "batch_size": settings.teacher_batch_size,
        "lr_steps": list(settings.teacher_lr_steps),
        "lr_decay": settings.teacher_lr_decay,
        "seed": context.seed,
        "pool": f"partition {context.partition}: the first held-back pool",
        "pool_samples": len(context.pools[0].y),
        "held_back_samples": sum(len(p.y) for p in context.pools),
    }


def pretrained_cache_path(folder: Path, context: ServerContext, architecture: str, trained: dict[str, Any]) -> Path:
    """The cached teacher of this dataset, architecture, seed, pool sizes and recipe `trained` in `folder`."""
    digest = hashlib.sha256(json.dumps(trained, sort_keys=True).encode()).hexdigest()[:12]
    pool, held = trained["pool_samples"], trained["held_back_samples"]
    name = f"{context.dataset}-{architecture}-seed{context.seed}-pool{pool}-held{held}-{digest}.npz"
    return folder.expanduser() / name


def pretrain(
    settings: PretrainingSettings, context: ServerContext, architecture: str, out: Path | None = None
) -> Generator[TrainModel, SGDResult, Path]:
    """Train the teacher on the first held-back pool (AugFL, Sec. VI) with the recipe of `settings` and write it as a
    weights file to `out`; without `out`, to the cache (`pretrained_cache_path`), where a file already there is
    reused. The training is one `TrainModel` request (from an initialization of its own), yielded only when a file
    is to be written; returns the file's path."""
    check_pools(context, "pretraining")
    trained = recipe(settings, context)
    path = out or pretrained_cache_path(context.cache / CACHE, context, architecture, trained)
    if out is None and path.exists():
        return path
    model = teacher_model(architecture, context)
    pool = context.pools[0]
    result = yield TrainModel(
        architecture,
        pool.x,
        pool.y,
        model.initial_parameters(torch_seed(context.seed, Stream.MODEL_INIT, 1)),
        settings.teacher_epochs,
        settings.teacher_lr,
        settings.teacher_batch_size,
        settings.teacher_momentum,
        settings.teacher_weight_decay,
        settings.teacher_lr_steps,
        settings.teacher_lr_decay,
    )
    params = np.asarray(result.params, np.float32)
    trained["mean_loss"] = float(result.mean_loss)
    write_weights(path, params, weights_header(model, context, trained, params))
    return path


def weights_header(
    model: FlatModel, context: ServerContext, trained: dict[str, Any], params: np.ndarray
) -> WeightsHeader:
    import torch

    layers = tuple(zip(model.spec.names, model.spec.shapes, strict=True))
    return WeightsHeader(
        model=model.name,
        input_shape=tuple(context.input_shape),
        outputs=context.num_classes,
        task=context.task,
        layers=layers,
        dataset=context.dataset,
        classes=context.num_classes,
        recipe=trained,
        parameters=params.size,
        sha256=checksum(params),
        torch=torch.__version__,
    )


def load_weights(path: str | Path, key: str, architecture: str, context: ServerContext) -> np.ndarray:
    """The verified parameters of a weights file for a model of `architecture` in this context (`key`: the config
    field that named it, which starts the one-line refusal of a corrupted or mismatched file)."""
    params, header = read_weights(path, key)
    model = teacher_model(architecture, context)
    layers = tuple(zip(model.spec.names, model.spec.shapes, strict=True))
    check_model(header, key, path, architecture, tuple(context.input_shape), context.num_classes, layers)
    return params


def pretrained_parameters(
    settings: PretrainingSettings, context: ServerContext, architecture: str
) -> Generator[TrainModel, SGDResult, np.ndarray]:
    """theta_p, the flat float32 parameters of a model of `architecture`: from the weights file `teacher_weights`,
    or pretrained on the first held-back pool (`pretrain`, cached); verified (`load_weights`) either way."""
    if settings.teacher_weights:
        return load_weights(settings.teacher_weights, KEY, architecture, context)
    path = yield from pretrain(settings, context, architecture)
    return load_weights(path, KEY, architecture, context)
