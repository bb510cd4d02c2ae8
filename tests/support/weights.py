"""Weights files of given parameters for tests (raysim.models.weights): what `raysim pretrain` writes, with
parameters chosen by the test instead of trained."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from raysim.algorithms.families.teacher import teacher_model, weights_header
from raysim.config import ExperimentConfig
from raysim.models.weights import write_weights
from raysim.runtime.problem import server_context


def weights_file(path: Path, config: ExperimentConfig, params: np.ndarray, architecture: str | None = None) -> Path:
    """`params` for a model of `architecture` (default: the config's) on the config's dataset, written to `path`."""
    context = server_context(config, config.dataset.load(config.seed))
    model = teacher_model(architecture or config.model.name, context)
    params = np.asarray(params, np.float32)
    return write_weights(path, params, weights_header(model, context, {"made_by": "a test"}, params))
