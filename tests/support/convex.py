"""Convex problems with closed-form answers: FLAME's orthogonal linear regression (flame.md App. B-A) and
quadratic client objectives solved exactly (FedSLR's Lemma 3)."""

from __future__ import annotations

import numpy as np

from raysim.algorithms import ClientInfo
from raysim.algorithms.prox import soft_threshold
from raysim.algorithms.requests import LocalSGD, SGDResult
from raysim.algorithms.terms import L1, Linear, Offset, Prox
from raysim.config import validate_config
from raysim.data.partitions import ClientSplit
from raysim.models.flat import ModelSpec
from raysim.models.spec import ParamSpec
from raysim.runtime.problem import Problem
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess


def orthogonal_regression(b: list[float], n: int, d: int, seed: int) -> tuple[Problem, np.ndarray]:
    """Clients with X_i^T X_i = N b_i I (flame.md App. B-A); returns the problem and each theta_hat_i."""
    generator = np.random.default_rng(seed)
    xs, ys, clients, theta_hat, offset = [], [], [], [], 0
    for i, b_i in enumerate(b):
        q, _ = np.linalg.qr(generator.normal(size=(n, d)))
        x = np.sqrt(n * b_i) * q
        y = x @ generator.normal(size=d) + 0.3 * generator.normal(size=n)
        theta_hat.append(x.T @ y / (n * b_i))
        x_test = generator.normal(size=(2, d))
        xs += [x, x_test]
        ys += [y, x_test @ theta_hat[-1]]
        train = np.arange(offset, offset + n)
        test = np.arange(offset + n, offset + n + 2)
        offset += n + 2
        split = ClientSplit(i, train, test, np.array([], dtype=np.int64))
        clients.append((ClientInfo(i, n, 1.0 / len(b), len(b)), split))
    problem = Problem(
        x=np.concatenate(xs).astype(np.float32),
        y=np.concatenate(ys).astype(np.float32),
        model_spec=ModelSpec("linear", (d,), 1, "regression"),
        clients=clients,
        init_params=np.zeros(d, np.float32),
    )
    return problem, np.array(theta_hat)


SPEC = ParamSpec(names=("conv", "fc", "bias"), shapes=((3, 2, 2, 2), (4, 5), (4,)), offsets=(0, 24, 44))
"""A conv kernel (matrix 6 x 4), a linear weight (4 x 5) and a bias: 48 parameters."""


class Quadratic:
    """Client objectives f_i(x) = h_i/2 ||x - a_i||^2, with every LocalSGD request solved exactly."""

    def __init__(self, m: int, size: int, seed: int):
        generator = np.random.default_rng(seed)
        self.h = generator.uniform(0.5, 2.0, size=m)
        self.a = generator.normal(size=(m, size))

    def grad(self, i: int, x: np.ndarray) -> np.ndarray:
        return self.h[i] * (x - self.a[i])

    def executor(self, i: int):
        def execute(r: LocalSGD) -> SGDResult:
            offset, prox, linear, l1 = r.term(Offset), r.term(Prox), r.term(Linear), r.term(L1)
            shift = 0.0 if offset is None else offset.offset
            weight, center = (0.0, 0.0) if prox is None else (prox.weight, prox.center)
            curvature = self.h[i] + weight + r.weight_decay
            x = self.h[i] * (self.a[i] - shift) + weight * center - (0.0 if linear is None else linear.vector)
            x = x / curvature
            if l1 is not None:
                x = soft_threshold(x, np.asarray(l1.weight) / curvature)
            return SGDResult(x.astype(np.float32), 0.0, 1)

        return execute


B, N, D = [1.0, 2.0, 3.0], 40, 4


b = np.array(B)[:, None]


def run_orthogonal(algorithm: dict, rounds: int):
    problem, theta_hat = orthogonal_regression(B, N, D, seed=5)
    config = validate_config(tiny_config(algorithm=algorithm, clients={"count": 3}, model={"name": "linear"}))
    sim = InProcess(config, problem)
    for round_index in range(rounds):
        sim.round(round_index)
    return sim, theta_hat
