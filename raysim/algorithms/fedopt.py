"""FedOpt: FedAvg with an adaptive server optimizer, FedAdagrad, FedAdam or FedYogi (Reddi, Charles, Zaheer,
Garrett, Rush, Konecny, Kumar and McMahan, "Adaptive Federated Optimization", ICLR 2021, arXiv:2003.00295,
Algorithm 2).

Clients train as in FedAvg; the server takes the round's mean change Delta_t = x_avg - x_t as a pseudo-gradient:
m_t = beta1 m_{t-1} + (1 - beta1) Delta_t, v_t by Adagrad's, Adam's or Yogi's rule, x_{t+1} = x_t + eta m_t /
(sqrt(v_t) + tau) (raysim.algorithms.families.server_optimizers). Defaults: adam, beta1 = 0.9, beta2 = 0.99 (the
paper's), eta = 0.01 and tau = 1e-3 (within the paper's grids; FL-bench's defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raysim.algorithms.families.averaging import Averaging, AveragingSettings
from raysim.algorithms.families.server_optimizers import ServerOptimizerSettings
from raysim.algorithms.interface import ALGORITHMS


class FedOptSettings(AveragingSettings):
    name: Literal["fedopt"] = "fedopt"
    server_optimizer: ServerOptimizerSettings = Field(
        default_factory=lambda: ServerOptimizerSettings(kind="adam", lr=0.01),
        description="the adaptive server optimizer: kind adagrad, adam (default) or yogi, lr (eta, 0.01), beta1 "
        "(0.9), beta2 (0.99), tau (1e-3)",
    )

    @field_validator("server_optimizer")
    @classmethod
    def _adaptive(cls, value: ServerOptimizerSettings) -> ServerOptimizerSettings:
        if value.kind not in ("adagrad", "adam", "yogi"):
            raise ValueError(
                f"algorithm.server_optimizer.kind={value.kind}: fedopt's server optimizer is adagrad, adam or yogi "
                "(fedavgm takes momentum)"
            )
        return value


@ALGORITHMS.register()
class FedOpt(Averaging):
    name = "fedopt"
    Settings = FedOptSettings
