"""What a run no longer pays on its way out (issue 49, section 3), checked against what it skips: the final model
saved without MLflow's scan of every installed distribution."""

from __future__ import annotations

from importlib.metadata import version

import numpy as np
from mlflow.utils import environment, requirements_utils

from raysim.models.flat import ModelSpec
from raysim.tracking.models import save_global_model


def test_the_global_model_is_saved_with_its_pinned_requirements_without_scanning_the_installed_packages(
    tmp_path, monkeypatch
):
    """MLflow's mismatch check maps every installed distribution to its modules (requirements_utils'
    `_MODULES_TO_PACKAGES`, built on first use); the save leaves that map unbuilt, writes the pins the check would
    have passed, and puts MLflow's check back afterwards."""
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)
    check = environment.warn_dependency_requirement_mismatches
    spec = ModelSpec("mlp", (1, 28, 28), 10, "classification")
    save_global_model(spec, np.zeros(spec.build().size, np.float32), tmp_path / "global_model")
    assert requirements_utils._MODULES_TO_PACKAGES is None  # no scan of the installed distributions
    assert environment.warn_dependency_requirement_mismatches is check
    pins = (tmp_path / "global_model" / "requirements.txt").read_text().split()
    assert f"cloudpickle=={version('cloudpickle')}" in pins
    assert any(pin.startswith("torch==") and "+" not in pin for pin in pins)
    check(pins)  # the check itself, run on the pins: it finds nothing to warn about
    assert requirements_utils._MODULES_TO_PACKAGES is not None  # ...and it is what builds the map
