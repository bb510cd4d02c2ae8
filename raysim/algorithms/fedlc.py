"""FedLC: FedAvg whose local loss calibrates the logits by the client's label counts (Zhang, Li, Li, Xu and Cui,
"Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022, arXiv:2209.00189, eq. 9).

A client whose labels are skewed pushes its model towards its frequent classes. FedLC trains on the calibrated
cross-entropy

    L = -log( exp(f_y(x) - tau n_y^{-1/4}) / sum_j exp(f_j(x) - tau n_j^{-1/4}) )

with n_j the client's training samples of class j (a class it lacks counts 1e-8, so its logit is pushed far down,
as FL-bench's implementation does), tau the calibration strength. It is cross-entropy on the logits shifted by a
per-class margin, larger for rare classes. The server averages the models by n_i (FedAvg's); every client deploys
the global model, whose logits are not calibrated. Default tau = 1 (FL-bench's; the paper tunes it). tau = 0 is
FedAvg. The loss is a term beside the method (`LogitCalibration`), so the method is this one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.averaging import (
    Averaging,
    AveragingSettings,
    ClientState,
    WeightedUpload,
    upload_weight,
)
from raysim.algorithms.interface import ALGORITHMS, ClientChunk, ClientInfo, ClientStep, ClientUpdate
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.terms import Term
from raysim.jit import distances

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

ABSENT = 1e-8
"""The count a class the client lacks stands for (FL-bench's), so that n^{-1/4} is finite: 100."""


@dataclass(frozen=True, eq=False)
class LogitCalibration(Term):
    """In place of f_i on a batch: cross-entropy of the logits minus tau n_j^{-1/4} per class j (eq. 9)."""

    counts: np.ndarray
    """n_j: the client's training samples of each class."""
    tau: float
    rows: ClassVar[tuple[str, ...]] = ("counts",)
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def margins(self) -> np.ndarray:
        """tau n_j^{-1/4} per class (float32)."""
        return (self.tau * np.maximum(np.asarray(self.counts, np.float64), ABSENT) ** -0.25).astype(np.float32)

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if model.task != "classification":
            raise ValueError(f"FedLC calibrates class logits; model {model.name!r} is trained for {model.task}")
        with model.dropout(seed):
            logits = model.forward(point, x)
        return functional.cross_entropy(logits - torch.from_numpy(self.margins()), y)


class FedLcSettings(AveragingSettings):
    name: Literal["fedlc"] = "fedlc"
    tau: float = Field(1.0, ge=0, description="tau: the calibration strength (0: FedAvg)")

    @model_validator(mode="after")
    def _no_shared_only(self) -> FedLcSettings:
        if self.shared_only:
            raise ValueError("algorithm.shared_only is the FedAPM authors' FedAvg; fedlc trains the whole model")
        return self


@ALGORITHMS.register()
class FedLc(Averaging):
    name = "fedlc"
    Settings = FedLcSettings
    settings: FedLcSettings
    stacks = False

    def client_step(self, client: ClientInfo | ClientChunk, state: ClientState, broadcast: Vector) -> ClientStep:
        """The client's label counts (they draw nothing), then FedAvg's local SGD on the calibrated loss."""
        s = self.settings
        counts = (yield from class_means(ClassMeans(None))).counts
        term = LogitCalibration(counts, s.tau)
        result = yield from train(s.scaled(s.local_sgd(broadcast, terms=(term,)), client.num_clients))
        params = np.asarray(result.params, np.float32)
        weight = upload_weight(client.num_train, s.aggregation)
        metrics = {"train_loss": result.mean_loss, "update_norm": distances(params, broadcast)}
        return ClientUpdate(state, WeightedUpload(weight * params, weight), metrics)
