"""F1 and AUC of classifiers on clients' test splits, as the specs define them (one client, or many at once)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

SingleLabelAuc = Literal["zero", "nan"]


def classification_scores(logits: np.ndarray, labels: np.ndarray, single_label: SingleLabelAuc) -> tuple[float, float]:
    """(weighted F1, one-vs-rest macro AUC) of a client's test split, as the specs define them.

    F1 is averaged over the classes with their test support as weights; a class with no true and no predicted
    sample scores 0 (scikit-learn's f1_score(average="weighted", zero_division=0)). AUC averages, over the
    classes present in the split, the ROC AUC of that class's softmax probability against the rest, by the
    rank-sum (Mann-Whitney) identity with ties counting one half (the area scikit-learn's roc_auc_score
    integrates). A split holding one label has no negatives, so AUC is undefined: `zero` scores it 0 as the
    authors' code does (it drags means down), `nan` leaves it out of the means.
    """
    return classification_scores_many(logits, labels, [len(labels)], single_label)[0]


def classification_scores_many(
    logits: np.ndarray, labels: np.ndarray, sizes: Sequence[int], single_label: SingleLabelAuc
) -> list[tuple[float, float]]:
    """`classification_scores` of consecutive groups of `sizes` rows (clients' test splits) in a few array
    operations over all of them. Every sum stays within its group (ranks are exact half-integers), so a group's
    scores do not depend on the groups computed with it."""
    labels = np.asarray(labels, dtype=np.int64)
    groups = len(sizes)
    group = np.repeat(np.arange(groups), sizes)
    predicted = logits.argmax(axis=1)
    classes = max(logits.shape[1], int(labels.max(initial=-1)) + 1)
    cells = groups * classes

    def counts(index: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(group * classes + index, weights, minlength=cells).reshape(groups, classes)

    support = counts(labels)
    true_positives = counts(labels, (labels == predicted).astype(np.float64))
    denominator = support + counts(predicted)
    f1 = np.divide(2.0 * true_positives, denominator, out=np.zeros(support.shape), where=denominator > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        weighted_f1 = (f1 * support).sum(axis=1) / support.sum(axis=1)
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = shifted / shifted.sum(axis=1, keepdims=True)
    ranks = _ranks_within(probs, group, np.concatenate([[0], np.cumsum(sizes)]))
    rank_sum = counts(labels, ranks[np.arange(len(labels)), labels])  # the ranks of each class's positives
    negatives = np.asarray(sizes)[:, None] - support
    with np.errstate(invalid="ignore", divide="ignore"):
        auc = (rank_sum - support * (support + 1) / 2) / (support * negatives)
    results = []
    for g, size in enumerate(sizes):
        present = support[g] > 0
        if size == 0:
            results.append((math.nan, math.nan))
        elif present.sum() < 2:
            results.append((float(weighted_f1[g]), 0.0 if single_label == "zero" else math.nan))
        else:
            results.append((float(weighted_f1[g]), float(np.mean(auc[g][present]))))
    return results


def _ranks_within(scores: np.ndarray, group: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Ranks 1..n_g of each column's entries within their group (`group` ascending, group g's rows from
    `starts[g]`), tied entries sharing their mean rank (scipy.stats.rankdata's "average" per group and column).
    The sort keeps groups in place, so a sorted position and the row at that position share a group."""
    n = len(scores)
    if n == 0:
        return np.zeros(scores.shape)
    by_score = np.argsort(scores, axis=0, kind="stable")
    order = np.take_along_axis(by_score, np.argsort(group[by_score], axis=0, kind="stable"), axis=0)
    ordered = np.take_along_axis(scores, order, axis=0)
    changes = (ordered[1:] != ordered[:-1]) | (group[1:] != group[:-1])[:, None]
    edge = np.ones((1, scores.shape[1]), bool)
    position = np.arange(n)[:, None]
    first = np.maximum.accumulate(np.where(np.concatenate([edge, changes]), position, 0), axis=0)
    last = np.minimum.accumulate(np.where(np.concatenate([changes, edge]), position, n)[::-1], axis=0)[::-1]
    ranks = np.empty(scores.shape)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1 - starts[group][:, None], axis=0)
    return ranks
