"""Evaluation switches for the FLAME authors' numbers (flame.md 4.3, 4.4, 11): when the GM is scored, their
fairness unit, the optional training-loss pass, and progress lines when the console is not a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.evaluation.batched import Scorer
from raysim.evaluation.columns import score_columns
from raysim.evaluation.records import ClientEvaluation, ModelScores
from raysim.evaluation.summaries import summarize_scores
from raysim.models.flat import FlatModel
from raysim.runtime.driver import run_experiment
from tests.support.experiments import tiny_config

REPO = Path(__file__).resolve().parents[1]


def _history(mlflow_uri: str, **tracking) -> dict[int, dict[str, float]]:
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.1, "batch_size": 16},
            rounds=3,
            tracking={"uri": mlflow_uri, "experiment": "switches", **tracking},
        )
    )
    return run_experiment(config, show_progress=False).history


@pytest.mark.slow
def test_gm_scored_before_aggregation_is_the_previous_rounds_gm(ray_local, tmp_path):
    """Round t's GM before its server step is round t-1's GM after it: the two series are shifted by one
    round exactly, and nothing else changes (FLAME's PM theta_i does not depend on when the GM is scored)."""
    after = _history(f"sqlite:///{tmp_path / 'a.db'}")
    before = _history(f"sqlite:///{tmp_path / 'b.db'}", gm_scored="before_aggregation")
    assert before[0]["gm/acc"] == after[0]["gm/acc"]
    for step in (1, 2, 3):
        for key in ("gm/acc", "gm/loss", "gm/loss_sum_var"):
            assert before[step][key] == after[step - 1][key]
        assert before[step]["pm/acc"] == after[step]["pm/acc"]
    assert after[3]["gm/acc"] != after[2]["gm/acc"]  # the shift is visible


def test_loss_sum_is_the_sum_of_batch_mean_losses_by_hand():
    """n = 250 test samples, batch 100: batches of 100, 100 and 50; the sum of their mean cross-entropies, computed
    here with torch alone, against the one forward pass that also gives the mean loss and the accuracy."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((250, 5)).astype(np.float32)
    y = rng.integers(0, 3, 250).astype(np.int64)
    model = FlatModel("mlr", (5,), 3, "classification")
    scorer = Scorer(model)
    flat = rng.standard_normal(model.size).astype(np.float32)
    scores = scorer.scores(flat, x, y, 100, keep_outputs=True, chunk=64)
    loss, accuracy, loss_sum = scores.loss, scores.accuracy, scores.loss_sum
    logits = torch.from_numpy(x) @ torch.from_numpy(flat[:15]).reshape(3, 5).T + torch.from_numpy(flat[15:])
    targets = torch.from_numpy(y)
    batches = ((0, 100), (100, 200), (200, 250))
    by_hand = sum(float(torch.nn.functional.cross_entropy(logits[a:b], targets[a:b])) for a, b in batches)
    assert loss_sum == pytest.approx(by_hand, rel=1e-6)
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, targets)), rel=1e-6)
    assert (loss, accuracy) == scorer.evaluate(flat, x, y, chunk=64)
    assert np.isnan(scorer.scores(flat, x, y).loss_sum)
    assert np.array_equal(scores.outputs, model.predict(flat, x))  # F1 and AUC read the same logits


def test_loss_sum_variance_is_the_sample_variance_and_hm_takes_the_smaller_sum():
    def scores(loss_sum: float, acc: float) -> ModelScores:
        return ModelScores(acc, 1.0, 1.0, test_loss_sum=loss_sum)

    clients = [
        ClientEvaluation(0, scores(3.0, 0.9), scores(5.0, 0.5)),
        ClientEvaluation(1, scores(7.0, 0.4), scores(4.0, 0.6)),
        ClientEvaluation(2, scores(2.0, 0.8), scores(9.0, 0.3)),
    ]
    pm = summarize_scores("pm", score_columns([c.pm for c in clients]))
    assert pm["pm/loss_sum_var"] == pytest.approx(np.var([3, 7, 2], ddof=1))
    hybrid = [c.hybrid() for c in clients]
    assert [h.test_loss_sum for h in hybrid] == [3.0, 4.0, 2.0]
    assert summarize_scores("hm", score_columns(hybrid))["hm/loss_sum_var"] == pytest.approx(np.var([3, 4, 2], ddof=1))


@pytest.mark.slow
def test_train_loss_false_never_scores_it_and_n_scores_every_nth_evaluation(ray_local, tmp_path):
    never = _history(f"sqlite:///{tmp_path / 'n.db'}", train_loss=False)
    scored = [k for step in never.values() for k in step if k.endswith("/train_loss") and not k.startswith("update/")]
    assert not scored  # update/train_loss is the training epoch's own mean loss, which costs nothing extra
    assert all("pm/acc" in never[step] for step in range(4))
    second = _history(f"sqlite:///{tmp_path / 's.db'}", train_loss=2)
    scored = [step for step in range(4) if "pm/train_loss" in second[step]]
    assert scored == [0, 2]  # evaluations 1 and 3 of steps 0..3
    assert all("gm/train_loss" in second[step] for step in scored)


@pytest.mark.parametrize(("value", "message"), [(0, "got 0"), (-2, "got -2"), ("often", "tracking.train_loss")])
def test_train_loss_refuses_anything_but_true_false_or_a_positive_integer(value, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(tracking={"train_loss": value}))


def test_gm_scored_refuses_an_unknown_value():
    with pytest.raises(ConfigError, match="tracking.gm_scored: must be 'after_aggregation' or 'before_aggregation'"):
        validate_config(tiny_config(tracking={"gm_scored": "later"}))


@pytest.mark.slow
def test_without_a_terminal_progress_prints_a_line_every_few_rounds(tmp_path):
    """`raysim run` with stdout and stderr going to files (as in Ray job logs, CI or nohup)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "raysim.cli",
        "run",
        str(REPO / "configs/quickstart.yaml"),
        "--set",
        "rounds=3",
        "--set",
        f"tracking.uri=sqlite:///{tmp_path / 'm.db'}",
        "--set",
        "dataset.name=digits",
        "--set",
        "model.name=mlr",
    ]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        done = subprocess.run(command, cwd=tmp_path, env=env, stdout=out, stderr=err, timeout=600)
    shown = (tmp_path / "err").read_text()
    assert done.returncode == 0, shown
    lines = [line for line in shown.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], shown
    assert all("PM 0." in line and "GM 0." in line and "HM 0." in line and "s/round" in line for line in lines)
    assert "final PM" in (tmp_path / "out").read_text()
