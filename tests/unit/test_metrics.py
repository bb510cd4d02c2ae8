"""raysim's F1 and AUC against scikit-learn's, on random and tie-heavy inputs (the evaluation computes them
itself, for every client's test split, at a fraction of scikit-learn's per-call cost)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.evaluation.classification import classification_scores, classification_scores_many
from raysim.evaluation.columns import ClientRecords, round_records
from raysim.evaluation.summaries import mean_client_metrics


@st.composite
def splits(draw):
    classes = draw(st.integers(2, 6))
    size = draw(st.integers(1, 40))
    labels = np.array(draw(st.lists(st.integers(0, classes - 1), min_size=size, max_size=size)))
    # a few distinct logit values, so that ties (within a column and across rows) are common
    levels = draw(st.integers(1, 5))
    logits = np.array(
        draw(st.lists(st.integers(0, levels), min_size=size * classes, max_size=size * classes)), dtype=np.float64
    ).reshape(size, classes)
    return logits, labels


@settings(max_examples=300, deadline=None)
@given(splits())
def test_f1_and_auc_equal_scikit_learns(split):
    from sklearn.metrics import f1_score, roc_auc_score  # here: a 2 s import for the worker that runs this test only

    logits, labels = split
    f1, auc = classification_scores(logits, labels, "nan")
    assert np.isclose(f1, f1_score(labels, logits.argmax(axis=1), average="weighted", zero_division=0), atol=1e-12)
    present = np.unique(labels)
    if len(present) < 2:
        assert np.isnan(auc)
        return
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    expected = np.mean([roc_auc_score(labels == c, probs[:, c]) for c in present])
    assert np.isclose(auc, expected, atol=1e-12)


def test_scores_on_a_hand_checked_split():
    """Predictions 0,1,1,1. Labels 0,0,1,1: class 0 has F1 2/3, class 1 4/5, weighted (2/3 + 4/5)/2, and
    both classes' probabilities rank every positive above every negative (AUC 1). Labels 0,1,0,1: the same
    F1; class 1's positives (0.6, 0.8) beat 3 of the 4 negative pairs (0.1, 0.7): AUC 3/4 for both classes."""
    logits = np.log(np.array([[0.9, 0.1], [0.4, 0.6], [0.3, 0.7], [0.2, 0.8]]))
    f1, auc = classification_scores(logits, np.array([0, 0, 1, 1]), "zero")
    assert np.isclose(f1, (2 / 3 + 4 / 5) / 2) and np.isclose(auc, 1.0)
    f1, auc = classification_scores(logits, np.array([0, 1, 0, 1]), "zero")
    assert np.isclose(f1, (2 / 3 + 4 / 5) / 2) and np.isclose(auc, 0.75)


@settings(max_examples=100, deadline=None)
@given(st.lists(splits(), min_size=1, max_size=6), st.sampled_from(["zero", "nan"]))
def test_scores_of_many_splits_together_are_each_splits_own(parts, single_label):
    """A host scores a chunk of clients' test splits in one call (classification_scores_many): each split's F1
    and AUC must be exactly its own, whatever splits it is computed with (empty ones included)."""
    classes = max(logits.shape[1] for logits, _ in parts)
    parts = [(np.pad(logits, ((0, 0), (0, classes - logits.shape[1])), constant_values=-1.0), y) for logits, y in parts]
    empty = len(parts) // 2
    parts.insert(empty, (np.zeros((0, classes)), np.zeros(0, np.int64)))
    together = classification_scores_many(
        np.concatenate([logits for logits, _ in parts]),
        np.concatenate([y for _, y in parts]),
        [len(y) for _, y in parts],
        single_label,
    )
    alone = [classification_scores(logits, y, single_label) for logits, y in parts]
    assert np.array_equal(np.array(together), np.array(alone), equal_nan=True)
    assert np.isnan(together[empty]).all()


def test_client_records_are_columns_whose_missing_metrics_are_null_and_left_out_of_the_means():
    """A host's records of a round (chunk by chunk, by client id) as Arrow columns; the driver's table of all hosts
    has every metric column, null where a client (a dropped one, another host's) reported none."""
    first = ClientRecords()
    first.add([5, 3], [40.0, 40.0], {"loss": np.array([1.0, 3.0]), "norm": np.array([2.0, 2.0])})
    first.add([9], [0.0], dropped=True)
    second = ClientRecords()
    second.add([4], [40.0], {"loss": np.array([5.0])})
    batch = first.batch()
    assert batch["client_id"].to_pylist() == [3, 5, 9] and batch["dropped"].to_pylist() == [False, False, True]
    assert batch["loss"].to_pylist() == [3.0, 1.0, None]
    table = round_records([batch, second.batch()])
    assert table.num_rows == 4 and table["norm"].to_pylist() == [2.0, 2.0, None, None]
    summary = mean_client_metrics(table)
    assert summary == {
        "update/loss": 3.0,
        "update/loss_std": 2.0,
        "update/loss_max": 5.0,
        "update/norm": 2.0,
        "update/norm_std": 0.0,
        "update/norm_max": 2.0,
    }
    assert mean_client_metrics(round_records([])) == {}


def _reference_summary(evaluations: list) -> dict[str, float]:
    """The across-client summaries computed client by client from the objects (ClientEvaluation.hybrid and
    hybrid_by_validation), to check the columnar `summarize` against."""
    from raysim.evaluation.columns import score_columns
    from raysim.evaluation.summaries import summarize_scores

    summary = summarize_scores("pm", score_columns([e.pm for e in evaluations]))
    summary |= summarize_scores("gm", score_columns([e.gm for e in evaluations]))
    summary |= summarize_scores("hm", score_columns([e.hybrid() for e in evaluations]))
    summary["hm/pm_chosen_share"] = float(np.mean([e.pm.test_acc >= e.gm.test_acc for e in evaluations]))
    by_val = [e.hybrid_by_validation() for e in evaluations]
    if all(v is not None for v in by_val):
        summary |= summarize_scores("hm_val", score_columns(by_val))
    for name in sorted({n for e in evaluations for n in e.extra}):
        summary |= summarize_scores(name, score_columns([e.extra[name] for e in evaluations if name in e.extra]))
    return summary


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 12),
    with_val=st.booleans(),
    extra_share=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_evaluations_as_columns_round_trip_and_summarize_as_the_objects_do(count, with_val, extra_share, seed):
    """A host sends its clients' evaluations as columns (evaluation_batch); the driver's summaries, HM and HM-val
    computed over the columns, equal those computed client by client from the objects, and the objects come back
    (client_evaluations), a further model only for the clients that have one."""
    from raysim.evaluation.columns import client_evaluations, evaluation_batch
    from raysim.evaluation.records import ClientEvaluation, ModelScores
    from raysim.evaluation.summaries import summarize

    generator = np.random.default_rng(seed)

    def scores() -> ModelScores:
        acc = float(generator.choice([0.25, 0.5, 0.75, generator.random()]))  # ties between PM and GM too
        val = float(generator.random()) if with_val else float("nan")
        return ModelScores(acc, *generator.random(2).tolist(), val, *generator.random(3).tolist())

    evaluations = [
        ClientEvaluation(c, scores(), scores(), {"personal": scores()} if generator.random() < extra_share else {})
        for c in generator.permutation(40)[:count].tolist()
    ]
    batch = evaluation_batch(evaluations)
    assert batch["client_id"].to_pylist() == sorted(e.client_id for e in evaluations)
    assert repr(client_evaluations(batch)) == repr(sorted(evaluations, key=lambda e: e.client_id))
    got, want = summarize(batch), _reference_summary(evaluations)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-12, atol=1e-12)
