"""Multimodal samples (raysim.data.modalities), FedAPM's three multimodal models (raysim.models.multimodal) and the
offline substitutes (raysim.data.substitutes), up to a FedAPM run on a real local Ray (issue 31)."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.data_files import SMALL_CRISIS
from tests.support.experiments import tiny_config
from tests.support.logged import check_logged
from tests.support.stores import fresh_store


@pytest.mark.slow
def test_fedapm_runs_on_the_crisismmd_substitute_on_ray(ray_local, tmp_path):
    """FedAPM with ImageTextClassifier, input personalization (image projection + text GRU personal, fedapm.md 2),
    2 rounds on a real local Ray through run_experiment: finished, every metric finite and logged once a step."""
    uri = fresh_store(tmp_path / "mlflow.db")
    config = tiny_config(
        algorithm={
            "name": "fedapm",
            "lr": 0.5,
            "rho": 0.01,
            "epochs": 1,
            "batch_size": 20,
            "personal": ["img_proj.*", "text_rnn.*"],
        },
        dataset={**SMALL_CRISIS, "samples": 200},
        partition={"scheme": "dirichlet", "beta": 1.0},
        model={"name": "image_text_classifier"},
        rounds=2,
        tracking={"uri": uri, "experiment": "multimodal"},
    )
    result = run_experiment(validate_config(config), show_progress=False)
    check_logged(MlflowClient(uri), result.run_id, config)
    assert all(0 <= result.history[step]["pm/acc"] <= 1 for step in (0, 1, 2))
