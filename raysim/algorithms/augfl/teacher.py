"""AugFL's teacher: the pretrained model theta_p, its architecture, and its pretraining on the first pool that the
`meta` partition keeps back from every client (augfl.md 4.1) with the authors' recipe (augfl.md 2.2;
`PretrainingSettings`), written as a versioned weights file (raysim.models.weights): by `raysim pretrain CONFIG
--out FILE` (`pretraining`), for runs to load with `algorithm.teacher_weights: FILE`, or by a run without that
field on first use, cached under $RAYSIM_CACHE/teacher/ (default ~/.cache/raysim/teacher/), one file per dataset,
architecture, seed, pool sizes and recipe. Either way the run verifies the file's checksum, model and classes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.algorithms.augfl.settings import AugFlSettings, PretrainingSettings, TransferStepSettings
from raysim.algorithms.interface import ServerContext
from raysim.algorithms.requests import SGDResult, TrainModel
from raysim.algorithms.settings import AlgorithmSettings
from raysim.errors import ConfigError
from raysim.models.weights import WeightsHeader, check_model, checksum, read_weights, write_weights
from raysim.seeding import Stream, torch_seed

if TYPE_CHECKING:
    from raysim.models.flat import FlatModel

LARGER = {
    "mlr": "mlp",
    "linear": "mlp",
    "mlp": "cnn",
    "cnn": "resnet18_gn",
    "resnet18_gn": "resnet18_gn",
    "resnet8x4": "resnet32x4",
    "resnet32x4": "resnet32x4",
}
"""The default architecture of the teacher for each client model: the next larger network of the zoo, and the
paper's pair (a ResNet32x4 distilled into a ResNet8x4, augfl.md 4.2)."""

CACHE = "teacher"
"""The teachers' subfolder of raysim's cache folder (`ServerContext.cache`)."""


def teacher_architecture(settings: TransferStepSettings, model: str, input_shape: tuple[int, ...]) -> str:
    """The teacher's architecture: `teacher_model`, or by default the clients' `model` for the L2 regularizer (it
    compares parameters) and the next larger network for CRD (mlp on non-image input)."""
    explicit = settings.teacher_model
    if settings.regularizer == "l2":
        if explicit not in (None, model):
            raise ConfigError(
                f"algorithm.teacher_model={explicit}: regularizer l2 compares parameters, so the teacher must be "
                f"the clients' model ({model}); use regularizer crd for a different architecture"
            )
        return model
    if explicit is not None:
        return explicit
    if model not in LARGER:
        raise ConfigError(
            f"algorithm.teacher_model: model.name={model} has no default teacher architecture (defaults exist for "
            f"{', '.join(LARGER)}); set algorithm.teacher_model"
        )
    larger = LARGER[model]
    return larger if len(input_shape) == 3 or larger in ("mlp", "mlr") else "mlp"


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
    """Train the teacher on the first held-back pool (augfl.md 4.1) with the recipe of `settings` and write it as a
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


def pretraining(
    settings: AlgorithmSettings, context: ServerContext, out: Path | None = None
) -> Generator[TrainModel, SGDResult, Path]:
    """`raysim pretrain`: the teacher of a config's algorithm `settings`, pretrained as a run would (`pretrain`) with
    its recipe, written to `out` (default: the cache a run reads). For an algorithm other than AugFL: a model of the
    clients' architecture, with its own pretraining settings (FedLP) or AugFL's defaults; KD only's is AugFL's."""
    augfl = settings if isinstance(settings, TransferStepSettings) else None
    defaults = settings if isinstance(settings, PretrainingSettings) else AugFlSettings()
    architecture = teacher_architecture(augfl, context.model, context.input_shape) if augfl else context.model
    return pretrain(defaults, context, architecture, out)
