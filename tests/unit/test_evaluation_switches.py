"""Evaluation switches for the FLAME authors' numbers (flame.md 4.3, 4.4, 11): when the GM is scored, their
fairness unit, the optional training-loss pass, and progress lines when the console is not a terminal."""

from __future__ import annotations

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
from tests.support.experiments import tiny_config


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


@pytest.mark.parametrize(("value", "message"), [(0, "got 0"), (-2, "got -2"), ("often", "tracking.train_loss")])
def test_train_loss_refuses_anything_but_true_false_or_a_positive_integer(value, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(tracking={"train_loss": value}))


def test_gm_scored_refuses_an_unknown_value():
    with pytest.raises(ConfigError, match="tracking.gm_scored: must be 'after_aggregation' or 'before_aggregation'"):
        validate_config(tiny_config(tracking={"gm_scored": "later"}))
