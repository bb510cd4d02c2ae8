"""Runs a client's local work on its own data, one client at a time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raysim.algorithms.base import FullGradient, GradientResult, LocalSGD, SGDResult
from raysim.algorithms.prox import soft_threshold
from raysim.models.flat import FlatModel


@dataclass(frozen=True)
class ClientData:
    """A view of the shared dataset arrays restricted to one client's indices (no copies made)."""

    x: np.ndarray
    y: np.ndarray
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray
    noise_std: float = 0.0
    """Gaussian feature noise redrawn at every access (the quality-skew partition, raysim.data.partitions)."""
    random_labels: int = 0
    """If > 0, labels are redrawn uniformly from this many classes at every access (label poisoning)."""

    def batch(self, indices: np.ndarray, generator: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The samples `indices` as this client sees them: with its noise and poisoned labels, freshly drawn."""
        x, y = self.x[indices], self.y[indices]
        if not (self.noise_std or self.random_labels):
            return x, y
        if generator is None:
            raise ValueError("ClientData.batch: a client with noisy features or poisoned labels needs a generator")
        if self.noise_std:
            x = x + generator.normal(0.0, self.noise_std, size=x.shape).astype(x.dtype)
        if self.random_labels:
            y = generator.integers(0, self.random_labels, size=len(y)).astype(y.dtype)
        return x, y

    def arrays(self, split: str, generator: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.batch(getattr(self, split), generator)


def _tensor(array: np.ndarray | None, dtype: type) -> torch.Tensor | None:
    return None if array is None else torch.from_numpy(np.array(array, dtype=dtype))


class LocalTrainer:
    """Executes LocalSGD requests for the clients of one process with one torch model instance."""

    def __init__(self, model: FlatModel):
        self.model = model

    def sgd(self, request: LocalSGD, data: ClientData, generator: np.random.Generator) -> SGDResult:
        """Mini-batch SGD (with optional momentum) on the request's objective; see LocalSGD."""
        x = torch.from_numpy(np.array(request.start, dtype=np.float32))
        # Copies: the arrays may be read-only views of Ray's object store, which torch must not alias.
        center = _tensor(request.prox_center, np.float32)
        linear = _tensor(request.linear, np.float32)
        mask = _tensor(request.mask, bool)
        offset = _tensor(request.offset, np.float32)
        l1 = None if request.l1 is None else request.lr * _tensor(request.l1, np.float32)
        velocity = torch.zeros_like(x) if request.momentum else None
        losses: list[float] = []
        indices = data.train
        for _epoch in range(request.epochs):
            order = generator.permutation(len(indices))
            for start in range(0, len(order), request.batch_size):
                batch = indices[order[start : start + request.batch_size]]
                xb, yb = (torch.from_numpy(a) for a in data.batch(batch, generator))
                loss, grad = self.model.loss_and_grad(x if offset is None else offset + x, xb, yb)
                losses.append(loss)
                if request.weight_decay:
                    grad.add_(x, alpha=request.weight_decay)
                if request.prox_weight:
                    grad.add_(x - center, alpha=request.prox_weight)  # type: ignore[operator]
                if linear is not None:
                    grad.add_(linear)
                if mask is not None:
                    grad.masked_fill_(~mask, 0.0)
                if velocity is not None:
                    velocity.mul_(request.momentum).add_(grad)
                    grad = velocity
                x.sub_(grad, alpha=request.lr)
                if l1 is not None:
                    x = soft_threshold(x, l1) if mask is None else torch.where(mask, soft_threshold(x, l1), x)
        return SGDResult(
            params=x.numpy(), mean_loss=float(np.mean(losses)) if losses else float("nan"), steps=len(losses)
        )

    def full_gradient(self, request: FullGradient, data: ClientData, generator: np.random.Generator) -> GradientResult:
        """The mean loss over the request's split and its gradient, in one batch."""
        if request.split not in ("train", "val", "test"):
            raise ValueError(f"FullGradient.split: {request.split!r}; allowed: train, val, test")
        if not len(getattr(data, request.split)):
            raise ValueError(
                f"FullGradient: this client's {request.split!r} split is empty (check the algorithm's split settings "
                "and partition.test_fraction / val_fraction)"
            )
        xb, yb = (torch.from_numpy(a) for a in data.arrays(request.split, generator))
        point = torch.from_numpy(np.array(request.point, dtype=np.float32))
        loss, grad = self.model.loss_and_grad(point, xb, yb)
        return GradientResult(grad.numpy(), float(loss))
