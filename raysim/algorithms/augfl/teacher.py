"""AugFL's teacher: the pretrained model theta_p, its architecture, and its pretraining on the first pool that the
`meta` partition keeps back from every client (AugFL, Sec. VI) with the authors' recipe
(`PretrainingSettings`), written as a versioned weights file (raysim.models.weights): by `raysim pretrain CONFIG
--out FILE` (`pretraining`), for runs to load with `algorithm.teacher_weights: FILE`, or by a run without that
field on first use, cached under $RAYSIM_CACHE/teacher/ (default ~/.cache/raysim/teacher/), one file per dataset,
architecture, seed, pool sizes and recipe. Either way the run verifies the file's checksum, model and classes."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

from raysim.algorithms.augfl.settings import AugFlSettings, TransferStepSettings
from raysim.algorithms.families.teacher import PretrainingSettings
from raysim.algorithms.interface import ServerContext
from raysim.algorithms.requests import SGDResult, TrainModel
from raysim.algorithms.settings import AlgorithmSettings
from raysim.errors import ConfigError

if TYPE_CHECKING:
    pass
from raysim.algorithms.families.teacher import pretrain

LARGER = {
    "mlr": "mlp",
    "linear": "mlp",
    "mlp": "cnn",
    "cnn": "resnet18_gn",
    "resnet18_gn": "resnet18_gn",
    "resnet8x4": "resnet32x4",
    "resnet32x4": "resnet32x4",
    "resnet8x4_bn": "resnet32x4_bn",
    "resnet32x4_bn": "resnet32x4_bn",
}
"""The default architecture of the teacher for each client model: the next larger network of the zoo, and the
paper's pair (a ResNet32x4 distilled into a ResNet8x4, AugFL, Sec. VI; with BatchNorm, as the authors built them)."""


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
