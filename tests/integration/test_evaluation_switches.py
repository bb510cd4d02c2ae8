"""Evaluation switches for the FLAME authors' numbers (flame.md 4.3, 4.4, 11): when the GM is scored, their
fairness unit, the optional training-loss pass, and progress lines when the console is not a terminal."""

from __future__ import annotations

import pytest

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.stores import fresh_store


def _history(mlflow_uri: str, **tracking) -> dict[int, dict[str, float]]:
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.1, "batch_size": 16},
            rounds=3,
            tracking={"uri": mlflow_uri, "experiment": "switches", **tracking},
            runtime=IN_PROCESS,
        )
    )
    return run_experiment(config, show_progress=False).history


@pytest.mark.slow
def test_gm_scored_before_aggregation_is_the_previous_rounds_gm(tmp_path):
    """Round t's GM before its server step is round t-1's GM after it: the two series are shifted by one
    round exactly, and nothing else changes (FLAME's PM theta_i does not depend on when the GM is scored)."""
    after = _history(fresh_store(tmp_path / "a.db"))
    before = _history(fresh_store(tmp_path / "b.db"), gm_scored="before_aggregation")
    assert before[0]["gm/acc"] == after[0]["gm/acc"]
    for step in (1, 2, 3):
        for key in ("gm/acc", "gm/loss", "gm/loss_sum_var"):
            assert before[step][key] == after[step - 1][key]
        assert before[step]["pm/acc"] == after[step]["pm/acc"]
    assert after[3]["gm/acc"] != after[2]["gm/acc"]  # the shift is visible


@pytest.mark.slow
def test_train_loss_false_never_scores_it_and_n_scores_every_nth_evaluation(tmp_path):
    never = _history(fresh_store(tmp_path / "n.db"), train_loss=False)
    scored = [k for step in never.values() for k in step if k.endswith("/train_loss") and not k.startswith("update/")]
    assert not scored  # update/train_loss is the training epoch's own mean loss, which costs nothing extra
    assert all("pm/acc" in never[step] for step in range(4))
    second = _history(fresh_store(tmp_path / "s.db"), train_loss=2)
    scored = [step for step in range(4) if "pm/train_loss" in second[step]]
    assert scored == [0, 2]  # evaluations 1 and 3 of steps 0..3
    assert all("gm/train_loss" in second[step] for step in scored)
