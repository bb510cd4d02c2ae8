"""AugFL's teacher: the pretrained model theta_p, its architecture, and its pretraining on the first pool that the
`meta` partition keeps back from every client (augfl.md 4.1), cached under $RAYSIM_CACHE/teacher/ (default
~/.cache/raysim/teacher/), one flat float32 .npy per dataset, architecture, seed, pool sizes, epochs and rate.
A run pretrains it on first use (`AugFl.server_data`); `raysim pretrain CONFIG` (`pretraining`) does it ahead."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raysim.algorithms.augfl.settings import AugFlSettings, PretrainingSettings, TransferStepSettings
from raysim.algorithms.base import AlgorithmSettings, LocalSGD, ServerContext, SGDResult, TrainModel
from raysim.errors import ConfigError
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


def pretrained_cache_path(folder: Path, context: ServerContext, architecture: str, epochs: int, lr: float) -> Path:
    """The cached teacher of this dataset, architecture, seed, pool sizes, epochs and rate in `folder`."""
    pool, held = len(context.pools[0].y), sum(len(p.y) for p in context.pools)
    name = f"{context.dataset}-{architecture}-seed{context.seed}-pool{pool}-held{held}-e{epochs}-lr{lr:g}.npy"
    return folder.expanduser() / name


def check_pools(context: ServerContext, purpose: str) -> None:
    """The partition keeps back the two pools AugFL's server needs (the teacher's and the transfer set)."""
    if len(context.pools) != 2:
        raise ConfigError(
            f"partition.scheme={context.partition}: {purpose} needs 'meta' (its held-back pools feed the "
            "teacher and the server's transfer set)"
        )


def pretrain(
    context: ServerContext, architecture: str, epochs: int, lr: float, folder: Path
) -> Generator[TrainModel, SGDResult, Path]:
    """Train (or reuse) the teacher on the first held-back pool (augfl.md 4.1) and return the path of its flat
    float32 parameters in `folder`: the training is one `TrainModel` request (mini-batch SGD, momentum 0.9, batch
    64, from an initialization of its own), yielded only when the file is not cached yet."""
    check_pools(context, "pretraining")
    path = pretrained_cache_path(folder, context, architecture, epochs, lr)
    if path.exists():
        return path
    model = teacher_model(architecture, context)
    start = model.initial_parameters(torch_seed(context.seed, Stream.MODEL_INIT, 1))
    pool = context.pools[0]
    result = yield TrainModel(architecture, pool.x, pool.y, LocalSGD(start, epochs, lr, 64, momentum=0.9))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp.npy")
    np.save(temporary, result.params.astype(np.float32))
    temporary.replace(path)  # never a half-written file under the final name
    return path


def pretrained_parameters(
    settings: PretrainingSettings, context: ServerContext, architecture: str
) -> Generator[TrainModel, SGDResult, np.ndarray]:
    """theta_p, the flat float32 parameters of a model of `architecture`: read from `teacher_path`, or pretrained on
    the first held-back pool (`pretrain`, cached); checked against the architecture's size."""
    if settings.teacher_path:
        path = Path(settings.teacher_path).expanduser()
    else:
        path = yield from pretrain(
            context, architecture, settings.teacher_epochs, settings.teacher_lr, context.cache / CACHE
        )
    try:
        params = np.load(path).astype(np.float32)
    except (OSError, ValueError) as error:
        raise ConfigError(f"algorithm.teacher_path: cannot read {path} ({error})") from None
    expected = teacher_model(architecture, context).size
    if params.shape != (expected,):
        raise ConfigError(
            f"algorithm.teacher_path: {path} holds {params.size} parameters, the teacher's architecture "
            f"{architecture} has {expected} (set algorithm.teacher_model to its architecture)"
        )
    return params


def pretraining(
    settings: AlgorithmSettings,
    context: ServerContext,
    epochs: int | None = None,
    lr: float | None = None,
    folder: Path | None = None,
) -> Generator[TrainModel, SGDResult, Path]:
    """`raysim pretrain`: the teacher of a config's algorithm `settings`, pretrained (or reused) as a run would
    (`pretrain`), returning its path. `epochs` and `lr` default to `algorithm.teacher_epochs` and
    `algorithm.teacher_lr`, `folder` to $RAYSIM_CACHE/teacher. For an algorithm other than AugFL: a model of the
    clients' architecture, with its own pretraining settings (FedLP) or AugFL's defaults; KD only's is AugFL's."""
    augfl = settings if isinstance(settings, TransferStepSettings) else None
    defaults = settings if isinstance(settings, PretrainingSettings) else AugFlSettings()
    architecture = teacher_architecture(augfl, context.model, context.input_shape) if augfl else context.model
    epochs = defaults.teacher_epochs if epochs is None else epochs
    lr = defaults.teacher_lr if lr is None else lr
    return pretrain(context, architecture, epochs, lr, context.cache / CACHE if folder is None else folder)
