"""Runs a client's local work on its own data, one client at a time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raysim.algorithms.base import LocalSGD, SGDResult
from raysim.models.flat import FlatModel


@dataclass(frozen=True)
class ClientData:
    """A view of the shared dataset arrays restricted to one client's indices (no copies made)."""

    x: np.ndarray
    y: np.ndarray
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        indices = getattr(self, split)
        return self.x[indices], self.y[indices]


class LocalTrainer:
    """Executes LocalSGD requests for the clients of one process with one torch model instance."""

    def __init__(self, model: FlatModel):
        self.model = model

    def sgd(self, request: LocalSGD, data: ClientData, generator: np.random.Generator) -> SGDResult:
        """Mini-batch SGD (with optional momentum) on the request's objective; see LocalSGD."""
        x = torch.from_numpy(np.array(request.start, dtype=np.float32))
        center = None if request.prox_center is None else torch.from_numpy(np.asarray(request.prox_center))
        linear = None if request.linear is None else torch.from_numpy(np.asarray(request.linear))
        velocity = torch.zeros_like(x) if request.momentum else None
        losses: list[float] = []
        indices = data.train
        for _epoch in range(request.epochs):
            order = generator.permutation(len(indices))
            for start in range(0, len(order), request.batch_size):
                batch = indices[order[start : start + request.batch_size]]
                xb, yb = torch.from_numpy(data.x[batch]), torch.from_numpy(data.y[batch])
                loss, grad = self.model.loss_and_grad(x, xb, yb)
                losses.append(loss)
                if request.weight_decay:
                    grad.add_(x, alpha=request.weight_decay)
                if request.prox_weight:
                    grad.add_(x - center, alpha=request.prox_weight)  # type: ignore[operator]
                if linear is not None:
                    grad.add_(linear)
                if velocity is not None:
                    velocity.mul_(request.momentum).add_(grad)
                    grad = velocity
                x.sub_(grad, alpha=request.lr)
        return SGDResult(
            params=x.numpy(), mean_loss=float(np.mean(losses)) if losses else float("nan"), steps=len(losses)
        )
