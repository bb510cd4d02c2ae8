"""FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification", arXiv:1909.06335; Reddi et al. 2021's FedAvgM).

Clients train as in FedAvg; the server keeps a momentum of the round's mean change, m_t = beta1 m_{t-1} + Delta_t
with Delta_t = x_avg - x_t, and moves x_{t+1} = x_t + eta m_t (raysim.algorithms.families.server_optimizers).
beta1 = 0 and eta = 1 is FedAvg. Defaults: beta1 = 0.9, eta = 1 (Hsu et al.'s best on CIFAR-10 for one local epoch,
FL-bench's values). FL-bench's FedAvgM steps with Nesterov's momentum (torch's SGD with nesterov=True): that is
`server_optimizer.nesterov: true` (benchmarks/reference: with it off, raysim's curve follows FL-bench's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raysim.algorithms.families.averaging import Averaging, AveragingSettings
from raysim.algorithms.families.server_optimizers import ServerOptimizerSettings
from raysim.algorithms.interface import ALGORITHMS


class FedAvgMSettings(AveragingSettings):
    name: Literal["fedavgm"] = "fedavgm"
    server_optimizer: ServerOptimizerSettings = Field(
        default_factory=lambda: ServerOptimizerSettings(kind="momentum"),
        description="the server momentum: kind momentum, beta1 (0.9) and lr (eta, 1.0)",
    )

    @field_validator("server_optimizer")
    @classmethod
    def _momentum(cls, value: ServerOptimizerSettings) -> ServerOptimizerSettings:
        if value.kind != "momentum":
            raise ValueError(
                f"algorithm.server_optimizer.kind={value.kind}: fedavgm's server optimizer is momentum (fedopt takes "
                "adagrad, adam and yogi)"
            )
        return value


@ALGORITHMS.register()
class FedAvgM(Averaging):
    name = "fedavgm"
    Settings = FedAvgMSettings
