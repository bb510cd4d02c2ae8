"""Per-client evaluation records and their summaries across clients.

Three models per client (the specs' metrics sections): the personalized model (PM), the global model (GM)
and the hybrid model (HM), the better of the two for that client. HM picks by test accuracy, as the papers'
authors do (an oracle choice); HM-val picks by accuracy on a held-out validation split instead
(leakage-free; needs `partition.val_fraction > 0`) and reports the chosen model's test scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa

SingleLabelAuc = Literal["zero", "nan"]


@dataclass(frozen=True)
class ModelScores:
    test_acc: float
    test_loss: float
    train_loss: float
    val_acc: float = math.nan
    test_f1: float = math.nan
    """F1 averaged over classes weighted by their test support (as the specs' F1 is defined)."""
    test_auc: float = math.nan
    """One-vs-rest ROC AUC, macro over the classes present in the test split (see `classification_scores`)."""
    test_loss_sum: float = math.nan
    """The FLAME authors' fairness unit: the sum over test batches (tracking.loss_sum_batch) of the batch-mean loss."""


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


@dataclass(frozen=True)
class ClientEvaluation:
    client_id: int
    pm: ModelScores
    gm: ModelScores
    extra: dict[str, ModelScores] = field(default_factory=dict)
    """Scores of the algorithm's further models (Algorithm.extra_models), by name."""

    def hybrid(self) -> ModelScores:
        """HM: per client, the model with the higher test accuracy (loss: the lower of the two; F1 and AUC:
        those of the more accurate model)."""
        chosen = self.pm if self.pm.test_acc >= self.gm.test_acc else self.gm
        return ModelScores(
            test_acc=max(self.pm.test_acc, self.gm.test_acc),
            test_loss=min(self.pm.test_loss, self.gm.test_loss),
            train_loss=min(self.pm.train_loss, self.gm.train_loss),
            test_f1=chosen.test_f1,
            test_auc=chosen.test_auc,
            test_loss_sum=min(self.pm.test_loss_sum, self.gm.test_loss_sum),
        )

    def hybrid_by_validation(self) -> ModelScores | None:
        """HM-val: the model with the higher validation accuracy, scored on the test split."""
        if math.isnan(self.pm.val_acc):
            return None
        return self.pm if self.pm.val_acc >= self.gm.val_acc else self.gm

    def row(self) -> dict[str, float]:
        """A flat record for the per-client table."""
        record: dict[str, float] = {"client_id": self.client_id}
        models = (("pm", self.pm), ("gm", self.gm), ("hm", self.hybrid()), *self.extra.items())
        for kind, scores in models:
            record.update({f"{kind}_{k}": v for k, v in asdict(scores).items() if k != "val_acc" or kind != "hm"})
        val = self.hybrid_by_validation()
        if val is not None:
            record.update({"hm_val_test_acc": val.test_acc, "hm_val_test_loss": val.test_loss})
        return record


LAGGING_GAP = 0.10
"""A client lags when its test accuracy is more than 10 points below the mean over clients."""


SCORE_FIELDS = ("test_acc", "test_loss", "train_loss", "val_acc", "test_f1", "test_auc", "test_loss_sum")
"""ModelScores' fields: a model's scores of a client are the columns `<model>_<field>` of an evaluation table."""

Columns = dict[str, np.ndarray]
"""One model's scores over clients: SCORE_FIELDS -> one value per client (NaN: not scored)."""


def evaluation_batch(evaluations: Sequence[ClientEvaluation]) -> pa.RecordBatch:
    """Clients' evaluations as columns (what a host sends): `client_id`, then `pm_<field>`, `gm_<field>` and
    `<name>_<field>` for each further model (null for a client without it), by client id."""
    ordered = sorted(evaluations, key=lambda e: e.client_id)
    columns: dict[str, pa.Array] = {"client_id": pa.array([e.client_id for e in ordered], pa.int64())}
    for kind in ("pm", "gm"):
        for name in SCORE_FIELDS:
            columns[f"{kind}_{name}"] = pa.array([getattr(getattr(e, kind), name) for e in ordered], pa.float64())
    for extra in sorted({name for e in ordered for name in e.extra}):
        for name in SCORE_FIELDS:
            values = [getattr(e.extra[extra], name) if extra in e.extra else None for e in ordered]
            columns[f"{extra}_{name}"] = pa.array(values, pa.float64())
    return pa.RecordBatch.from_pydict(columns)


def evaluation_table(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    """The hosts' evaluation batches as one table, by client id (a further model one host lacks is null there)."""
    table = _joined_batches(batches, evaluation_batch([]))
    return table.take(pa.array(np.argsort(table["client_id"].to_numpy(), kind="stable")))


def client_evaluations(evaluations: pa.Table | pa.RecordBatch) -> list[ClientEvaluation]:
    """The per-client objects of an evaluation table (`evaluation_batch` undone)."""
    rows = evaluations.to_pylist()

    def scores(row: dict, kind: str) -> ModelScores:
        return ModelScores(**{name: row[f"{kind}_{name}"] for name in SCORE_FIELDS})

    extras = _extra_models(evaluations)
    return [
        ClientEvaluation(
            row["client_id"],
            scores(row, "pm"),
            scores(row, "gm"),
            {name: scores(row, name) for name in extras if row[f"{name}_test_acc"] is not None},
        )
        for row in rows
    ]


def _extra_models(evaluations: pa.Table | pa.RecordBatch) -> list[str]:
    """The further models (Algorithm.extra_models) an evaluation table has columns of."""
    suffix = "_test_acc"
    names = [c.removesuffix(suffix) for c in evaluations.column_names if c.endswith(suffix)]
    return sorted(name for name in names if name not in ("pm", "gm"))


def _columns(evaluations: pa.Table | pa.RecordBatch, kind: str) -> Columns:
    return {
        name: evaluations.column(f"{kind}_{name}").to_numpy(zero_copy_only=False).astype(np.float64)
        for name in SCORE_FIELDS
    }


def score_columns(scores: Sequence[ModelScores]) -> Columns:
    """Per-client ModelScores as columns."""
    return {name: np.array([getattr(s, name) for s in scores], np.float64) for name in SCORE_FIELDS}


def hybrid(pm: Columns, gm: Columns) -> Columns:
    """HM (ClientEvaluation.hybrid) of every client at once: the better test accuracy, the lower losses, the F1 and
    AUC of the more accurate model; no validation accuracy."""
    chosen = pm["test_acc"] >= gm["test_acc"]
    return {
        "test_acc": np.maximum(pm["test_acc"], gm["test_acc"]),
        "test_loss": np.minimum(pm["test_loss"], gm["test_loss"]),
        "train_loss": np.minimum(pm["train_loss"], gm["train_loss"]),
        "val_acc": np.full(len(chosen), np.nan),
        "test_f1": np.where(chosen, pm["test_f1"], gm["test_f1"]),
        "test_auc": np.where(chosen, pm["test_auc"], gm["test_auc"]),
        "test_loss_sum": np.minimum(pm["test_loss_sum"], gm["test_loss_sum"]),
    }


def summarize_scores(prefix: str, scores: Columns) -> dict[str, float]:
    """Mean over clients, plus fairness: sample variance of test loss (the papers' measure; also of the FLAME
    authors' summed loss, `loss_sum_var`) and of accuracy, accuracy std, min, 10th percentile and the share of
    clients lagging by more than 10 points. Scores left out of an evaluation (NaN) are not logged."""
    acc, loss, train = scores["test_acc"], scores["test_loss"], scores["train_loss"]
    if not len(acc):
        return {}
    ddof = 1 if len(acc) > 1 else 0
    summary = {
        f"{prefix}/acc": float(acc.mean()),
        f"{prefix}/loss": float(loss.mean()),
        f"{prefix}/train_loss": float(train.mean()),
        f"{prefix}/loss_var": float(loss.var(ddof=ddof)),
        f"{prefix}/acc_var": float(acc.var(ddof=ddof)),
        f"{prefix}/acc_min": float(acc.min()),
        f"{prefix}/acc_p10": float(np.percentile(acc, 10)),
        f"{prefix}/acc_std": float(acc.std(ddof=ddof)),
        f"{prefix}/loss_std": float(loss.std(ddof=ddof)),
        f"{prefix}/lagging_share": float(np.mean(acc < acc.mean() - LAGGING_GAP)),
    }
    for name in ("f1", "auc"):
        values = scores[f"test_{name}"]
        if np.isfinite(values).any():
            summary[f"{prefix}/{name}"] = float(np.nanmean(values))
    sums = scores["test_loss_sum"]
    if np.isfinite(sums).all():
        summary[f"{prefix}/loss_sum_var"] = float(sums.var(ddof=ddof))
    return {k: v for k, v in summary.items() if not math.isnan(v)}


def summarize(evaluations: pa.Table | pa.RecordBatch) -> dict[str, float]:
    """All across-client summaries of one evaluation round (unweighted over clients, as the papers), from its
    table (`evaluation_batch`), in a few array operations per model."""
    pm, gm = _columns(evaluations, "pm"), _columns(evaluations, "gm")
    summary = summarize_scores("pm", pm) | summarize_scores("gm", gm) | summarize_scores("hm", hybrid(pm, gm))
    if len(pm["test_acc"]):
        summary["hm/pm_chosen_share"] = float(np.mean(pm["test_acc"] >= gm["test_acc"]))
    if len(pm["val_acc"]) and not np.isnan(pm["val_acc"]).any():  # HM-val: chosen by validation accuracy
        by_val = pm["val_acc"] >= gm["val_acc"]
        summary |= summarize_scores("hm_val", {k: np.where(by_val, pm[k], gm[k]) for k in SCORE_FIELDS})
    for name in _extra_models(evaluations):
        having = np.asarray(evaluations.column(f"{name}_test_acc").is_valid())
        summary |= summarize_scores(name, {k: v[having] for k, v in _columns(evaluations, name).items()})
    return summary


RECORD_COLUMNS = ("client_id", "uplink_bytes", "dropped")
"""The columns every round's client records have; the client steps' metrics follow, one column each."""


class ClientRecords:
    """What a host reports of its selected clients' round, built chunk by chunk as columns: client id, bytes
    sent (0 when the upload was dropped), whether the upload was dropped (NaN/inf, runtime.on_nonfinite =
    drop_client), and one column per metric the client steps reported (null where a client reported none)."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._uplink: list[np.ndarray] = []
        self._dropped: list[np.ndarray] = []
        self._metrics: dict[str, list[tuple[int, np.ndarray]]] = {}
        self._count = 0

    def add(
        self,
        client_ids: Sequence[int],
        uplink_bytes: Sequence[float] | np.ndarray,
        metrics: dict[str, np.ndarray] | None = None,
        dropped: bool = False,
    ) -> None:
        """Records of some clients: their bytes sent and their metrics, one value per client each."""
        count = len(client_ids)
        self._ids.append(np.asarray(client_ids, np.int64))
        self._uplink.append(np.asarray(uplink_bytes, np.float64).reshape(count))
        self._dropped.append(np.full(count, dropped))
        for name, values in (metrics or {}).items():
            column = np.broadcast_to(np.asarray(values, np.float64), (count,))
            self._metrics.setdefault(name, []).append((self._count, column))
        self._count += count

    def batch(self) -> pa.RecordBatch:
        """The records as one Arrow record batch, by client id."""
        columns: dict[str, pa.Array] = {
            "client_id": pa.array(_joined(self._ids, np.int64)),
            "uplink_bytes": pa.array(_joined(self._uplink, np.float64)),
            "dropped": pa.array(_joined(self._dropped, bool)),
        }
        for name in sorted(self._metrics):
            values, reported = np.full(self._count, np.nan), np.zeros(self._count, bool)
            for start, part in self._metrics[name]:
                values[start : start + len(part)] = part
                reported[start : start + len(part)] = True
            columns[name] = pa.array(values, mask=~reported)
        batch = pa.RecordBatch.from_pydict(columns)
        return batch.take(pa.array(np.argsort(_joined(self._ids, np.int64), kind="stable")))


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def round_records(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    """The hosts' record batches of one round as one table (a metric column one host lacks is null there)."""
    return _joined_batches(batches, ClientRecords().batch())


def _joined_batches(batches: Sequence[pa.RecordBatch], empty: pa.RecordBatch) -> pa.Table:
    """The hosts' batches as one table, a column some batch lacks null there (`empty`: the table of no batch)."""
    tables = [pa.Table.from_batches([batch]) for batch in batches or [empty]]
    return pa.concat_tables(tables, promote_options="default")


def mean_client_metrics(records: pa.Table | pa.RecordBatch) -> dict[str, float]:
    """Mean over the selected clients of each metric their client steps reported (`update/<name>`) and its
    spread across them (`update/<name>_std`, sample std; 0 for one client), e.g. the non-zeros of a sparse
    personal part; a client that reported none (null) is left out."""
    summary = {}
    for name in sorted(set(records.column_names) - set(RECORD_COLUMNS)):
        column = records.column(name)
        values = column.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
        if not len(values):
            continue
        summary[f"update/{name}"] = float(values.mean())
        summary[f"update/{name}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return summary


def benign_summary(
    evaluations: pa.Table | pa.RecordBatch, malicious: frozenset[int], heldout: frozenset[int] = frozenset()
) -> dict[str, float]:
    """Across-client summaries over the benign training clients (attackers are not scored, as in the specs'
    robustness settings), and over the held-out clients (`clients.heldout`) as `heldout/...`."""
    ids = evaluations.column("client_id").to_numpy()
    held = np.isin(ids, list(heldout))
    summary = summarize(evaluations.filter(pa.array(~(held | np.isin(ids, list(malicious))))))
    if held.any():
        summary |= {f"heldout/{k}": v for k, v in summarize(evaluations.filter(pa.array(held))).items()}
    return summary
