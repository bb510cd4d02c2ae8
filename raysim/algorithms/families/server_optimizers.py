"""Server optimizers: the averaged model taken as a pseudo-gradient step (Reddi et al., "Adaptive Federated
Optimization", ICLR 2021, arXiv:2003.00295, Algorithm 2; FedAvgM: Hsu, Qi and Brown 2019, arXiv:1909.06335).

With x_t the global model and x_avg this round's weighted mean of the selected clients' models, the server's
pseudo-gradient is Delta_t = x_avg - x_t (Reddi et al.'s Delta_t, the mean client change), and

    momentum (FedAvgM):  m_t = beta1 m_{t-1} + Delta_t,                               x_{t+1} = x_t + eta m_t
                         (`nesterov`: x_{t+1} = x_t + eta (Delta_t + beta1 m_t), torch's SGD on -Delta_t, FL-bench's)
    adagrad  (FedAdagrad): m_t = beta1 m_{t-1} + (1 - beta1) Delta_t,  v_t = v_{t-1} + Delta_t^2
    adam     (FedAdam):    m_t as adagrad,  v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
    yogi     (FedYogi):    m_t as adagrad,  v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
                           x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)      (the three adaptive ones)

with m_{-1} = 0 and v_{-1} = tau^2 (Algorithm 2: v_{-1} >= tau^2), no bias correction (as the paper). `none` is the
plain mean, x_{t+1} = x_avg. Running statistics (BatchNorm's, ParamSpec.statistics) are no parameters: they take
the mean whatever the optimizer (an adaptive step could make a variance negative). Any averaging method takes one
with `algorithm.server_optimizer`; FedAvgM and FedOpt are FedAvg with one (raysim.algorithms.fedavgm, fedopt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.requests import Vector
from raysim.settings import Settings


class ServerOptimizerSettings(Settings):
    """The server's step from this round's mean (Reddi et al. 2021): `none` takes the mean as the new model."""

    kind: Literal["none", "momentum", "adagrad", "adam", "yogi"] = Field(
        "none",
        description="none: the mean; momentum: FedAvgM (Hsu et al. 2019); adagrad, adam, yogi: FedAdagrad, "
        "FedAdam, FedYogi (Reddi et al. 2021, Algorithm 2)",
    )
    lr: float = Field(1.0, gt=0, description="eta, the server's learning rate")
    beta1: float = Field(0.9, ge=0, lt=1, description="the momentum (FedAvgM) or first-moment decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="the second-moment decay (adam, yogi)")
    tau: float = Field(1e-3, gt=0, description="the adaptivity: added to sqrt(v), and v starts at tau^2")
    nesterov: bool = Field(
        False, description="momentum: Nesterov's step, as torch's SGD(nesterov=True) and FL-bench's FedAvgM take it"
    )


@dataclass
class ServerOptimizerState:
    """The server optimizer's moments (float32, model-sized): m, and v for the adaptive kinds."""

    m: Vector
    v: Vector | None = None


def start_server_optimizer(settings: ServerOptimizerSettings, model: Vector) -> ServerOptimizerState | None:
    """The moments before the first round (m = 0, v = tau^2), or None for `none`."""
    if settings.kind == "none":
        return None
    zeros = np.zeros_like(model, dtype=np.float32)
    adaptive = settings.kind != "momentum"
    return ServerOptimizerState(zeros, np.full_like(zeros, settings.tau**2) if adaptive else None)


def server_optimizer_step(
    settings: ServerOptimizerSettings,
    state: ServerOptimizerState | None,
    model: Vector,
    mean: Vector,
    statistics: np.ndarray | None = None,
) -> tuple[Vector, ServerOptimizerState | None]:
    """The new global model from the current one and this round's mean, and the new moments (see the module);
    `statistics`: a mask of coordinates that take the mean."""
    if state is None:
        return mean, None
    new, moments = _step(settings, state, model, mean)
    if statistics is not None and statistics.any():
        new[statistics] = mean[statistics]
    return new, moments


def _step(
    settings: ServerOptimizerSettings, state: ServerOptimizerState, model: Vector, mean: Vector
) -> tuple[Vector, ServerOptimizerState]:
    delta = np.asarray(mean, np.float32) - np.asarray(model, np.float32)
    if settings.kind == "momentum":
        m = (settings.beta1 * state.m + delta).astype(np.float32)
        step = delta + settings.beta1 * m if settings.nesterov else m
        return (model + settings.lr * step).astype(np.float32), ServerOptimizerState(m)
    assert state.v is not None
    m = (settings.beta1 * state.m + (1 - settings.beta1) * delta).astype(np.float32)
    square = delta * delta
    if settings.kind == "adagrad":
        v = state.v + square
    elif settings.kind == "adam":
        v = settings.beta2 * state.v + (1 - settings.beta2) * square
    else:  # yogi
        v = state.v - (1 - settings.beta2) * square * np.sign(state.v - square)
    v = v.astype(np.float32)
    step = settings.lr * m / (np.sqrt(v) + settings.tau)
    return (model + step).astype(np.float32), ServerOptimizerState(m, v)
