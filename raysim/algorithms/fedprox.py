"""FedProx: FedAvg whose local objective adds mu/2 ||theta - w||^2 towards the received model (FLAME, Sec. IV-E).

FedAPM's experiments grid-search mu (their code hard-codes 0.1); FLAME's reading of FedADMM
with pi = 0 is the same step with mu = rho / alpha_i. The server is FedAvg's (weighted mean of the
selected clients' models), or with `shared_only` the authors' code's: the shared part trained with the
prox term 0.1 (w - w^start) on it, the mean over all m clients' latest shared parts; with `shared_start: local`
w^start is the client's own previous model (their unimodal path).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from raysim.algorithms.families.averaging import Averaging, AveragingSettings
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import LocalSGD, Vector
from raysim.algorithms.terms import Prox


class FedProxSettings(AveragingSettings):
    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(
        0.1, ge=0, description="proximal weight towards the round's starting model (the received global model)"
    )


@ALGORITHMS.register()
class FedProx(Averaging):
    name = "fedprox"
    Settings = FedProxSettings
    settings: FedProxSettings

    def local_request(self, start: Vector) -> LocalSGD:
        plain = super().local_request(start)  # FedAvg's, shared-part mask included
        return dataclasses.replace(plain, terms=(*plain.terms, Prox(start, self.settings.mu)))
