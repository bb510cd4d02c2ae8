"""FedNTD: FedAvg whose local loss distils the global model's knowledge of the not-true classes (Lee, Jeong, Kim
and Yun, "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning", NeurIPS 2022,
arXiv:2106.03097, eq. 3-4).

A selected client trains from the received w^t on, per mini-batch,

    L = CE(q_l, y) + beta * tau^2 * KL(qtilde_g^tau || qtilde_l^tau)

where qtilde^tau is the softmax at temperature tau of the logits with the true class y left out (the not-true
classes), q_l the local model's and q_g the received global model's (a constant). Only the not-true classes are
distilled, so the local model keeps learning its own classes while it forgets less of the others. The server
averages the models by n_i (FedAvg's). Defaults: beta = 1, tau = 1 (the paper's). beta = 0 is FedAvg. The loss is a
term beside the method (`NotTrueDistillation`), so the method is this one file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import Averaging, AveragingSettings
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import LocalSGD, Vector
from raysim.algorithms.terms import Term, tempered_kl

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The logits [N, C] without each sample's true class: [N, C - 1], the others in class order."""
    import torch

    keep = torch.arange(logits.shape[1], device=logits.device)[None, :] != y[:, None]
    return logits[keep].reshape(len(logits), logits.shape[1] - 1)


@dataclass(frozen=True, eq=False)
class NotTrueDistillation(Term):
    """In place of f_i on a batch: CE(logits, y) + beta tau^2 KL(softmax(g~/tau) || softmax(l~/tau)) over the
    not-true classes (eq. 3-4), g the global model's logits (a constant), l the trained point's."""

    global_model: np.ndarray
    """w^t, shared by every client of a chunk."""
    beta: float
    tau: float
    shared: ClassVar[tuple[str, ...]] = ("global_model",)
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if model.task != "classification":
            raise ValueError(f"FedNTD distils class probabilities; model {model.name!r} is trained for {model.task}")
        with torch.no_grad():
            global_logits = model.forward(self.tensor("global_model"), x)
        with model.dropout(seed):
            logits = model.forward(point, x)
        distilled = tempered_kl(not_true(logits, y), not_true(global_logits, y), self.tau)
        return functional.cross_entropy(logits, y) + self.beta * self.tau**2 * distilled


class FedNtdSettings(AveragingSettings):
    name: Literal["fedntd"] = "fedntd"
    beta: float = Field(1.0, ge=0, description="beta: weight of the not-true distillation (0: FedAvg)")
    tau: float = Field(1.0, gt=0, description="tau: the distillation's temperature")


@ALGORITHMS.register()
class FedNtd(Averaging):
    name = "fedntd"
    Settings = FedNtdSettings
    settings: FedNtdSettings

    def local_request(self, start: Vector) -> LocalSGD:
        """FedAvg's local SGD with the not-true distillation from the received model in place of f_i."""
        plain = super().local_request(start)
        term = NotTrueDistillation(start, self.settings.beta, self.settings.tau)
        return dataclasses.replace(plain, terms=(*plain.terms, term))
