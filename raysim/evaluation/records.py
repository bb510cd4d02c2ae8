"""Per-client evaluation records: the scores of a client's models.

Three models per client (the specs' metrics sections): the personalized model (PM), the global model (GM)
and the hybrid model (HM), the better of the two for that client. HM picks by test accuracy, as the papers'
authors do (an oracle choice); HM-val picks by accuracy on a held-out validation split instead
(leakage-free; needs `partition.val_fraction > 0`) and reports the chosen model's test scores.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


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
