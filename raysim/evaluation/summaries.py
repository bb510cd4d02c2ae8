"""Summaries across clients of one evaluation round: PM, GM, HM (and HM-val, the further models, the held-out
clients) means and fairness, and the clients' update metrics (raysim.evaluation.records says what each model is)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from raysim.evaluation.columns import RECORD_COLUMNS, SCORE_FIELDS, Columns, extra_model_names, model_columns

LAGGING_GAP = 0.10
"""A client lags when its test accuracy is more than 10 points below the mean over clients."""


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
    pm, gm = model_columns(evaluations, "pm"), model_columns(evaluations, "gm")
    summary = summarize_scores("pm", pm) | summarize_scores("gm", gm) | summarize_scores("hm", hybrid(pm, gm))
    if len(pm["test_acc"]):
        summary["hm/pm_chosen_share"] = float(np.mean(pm["test_acc"] >= gm["test_acc"]))
    if len(pm["val_acc"]) and not np.isnan(pm["val_acc"]).any():  # HM-val: chosen by validation accuracy
        by_val = pm["val_acc"] >= gm["val_acc"]
        summary |= summarize_scores("hm_val", {k: np.where(by_val, pm[k], gm[k]) for k in SCORE_FIELDS})
    for name in extra_model_names(evaluations):
        having = np.asarray(evaluations.column(f"{name}_test_acc").is_valid())
        summary |= summarize_scores(name, {k: v[having] for k, v in model_columns(evaluations, name).items()})
    return summary


def mean_client_metrics(records: pa.Table | pa.RecordBatch) -> dict[str, float]:
    """Mean over the selected clients of each metric their client steps reported (`update/<name>`), its
    spread across them (`update/<name>_std`, sample std; 0 for one client) and its largest value
    (`update/<name>_max`, e.g. the worst primal residual of an ADMM method), e.g. the non-zeros of a sparse
    personal part; a client that reported none (null) is left out."""
    summary = {}
    for name in sorted(set(records.column_names) - set(RECORD_COLUMNS)):
        column = records.column(name)
        values = column.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)
        if not len(values):
            continue
        summary[f"update/{name}"] = float(values.mean())
        summary[f"update/{name}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        summary[f"update/{name}_max"] = float(values.max())
    return summary


def benign_summary(
    evaluations: pa.Table | pa.RecordBatch,
    malicious: frozenset[int],
    heldout: frozenset[int] = frozenset(),
    test_sizes: dict[int, int] | None = None,
) -> dict[str, float]:
    """Across-client summaries over the benign training clients (attackers are not scored, as in the specs'
    robustness settings), and over the held-out clients (`clients.heldout`) as `heldout/...`; with the clients'
    `test_sizes` also `heldout/{pm,gm}/acc_weighted`, their accuracy weighted by test (query) samples, as the AugFL
    authors' target_test2 reports it (AugFL, Sec. VI)."""
    ids = evaluations.column("client_id").to_numpy()
    held = np.isin(ids, list(heldout))
    summary = summarize(evaluations.filter(pa.array(~(held | np.isin(ids, list(malicious))))))
    if held.any():
        target = evaluations.filter(pa.array(held))
        summary |= {f"heldout/{k}": v for k, v in summarize(target).items()}
        if test_sizes is not None:
            sizes = np.array([test_sizes[int(i)] for i in target.column("client_id").to_numpy()], np.float64)
            for model in ("pm", "gm"):
                acc = model_columns(target, model)["test_acc"]
                if sizes.sum() > 0 and np.isfinite(acc).all():
                    summary[f"heldout/{model}/acc_weighted"] = float(sizes @ acc / sizes.sum())
    return summary
