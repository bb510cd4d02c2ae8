"""A model seen as one flat float32 vector.

Everything outside this module (client state, messages, server sums) handles parameters as flat numpy
vectors: cheap to add, zero-copy through Ray's object store, and sliceable per layer through
`ParamSpec`. Only here do vectors become torch parameters, via `torch.func.functional_call`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from raysim.data.sources import Task
from raysim.models.zoo import build_module, initial_parameters


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and offset of every parameter tensor inside the flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, module: nn.Module) -> ParamSpec:
        names, shapes, offsets, offset = [], [], [], 0
        for name, param in module.named_parameters():
            names.append(name)
            shapes.append(tuple(param.shape))
            offsets.append(offset)
            offset += param.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets))

    @property
    def size(self) -> int:
        last = self.shapes[-1] if self.shapes else ()
        return (self.offsets[-1] + int(np.prod(last))) if self.offsets else 0

    def slice(self, name: str) -> slice:
        index = self.names.index(name)
        return slice(self.offsets[index], self.offsets[index] + int(np.prod(self.shapes[index])))

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `flat` shaped like the module's parameters (gradients flow back into `flat`)."""
        return {
            name: flat[offset : offset + int(np.prod(shape))].view(shape)
            for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True)
        }


@dataclass(frozen=True)
class Scores:
    """What one forward pass over some samples gives an evaluation."""

    loss: float
    accuracy: float
    """NaN for regression."""
    loss_sum: float
    """The FLAME authors' fairness unit: the sum over consecutive batches of `sum_batch` samples of each batch's
    mean loss (NaN without `sum_batch`)."""
    outputs: np.ndarray | None
    """The network's outputs (logits) when asked for (`keep_outputs`): the same as `predict` gives."""


class FlatModel:
    """Loss, gradient and evaluation of a network at a flat parameter vector."""

    def __init__(self, name: str, input_shape: tuple[int, ...], outputs: int, task: Task = "classification"):
        self.name = name
        self.task = task
        self.input_shape = tuple(input_shape)
        self.module = build_module(name, input_shape, outputs)
        self.spec = ParamSpec.of(self.module)
        self._head = [layer for layer in self.module.modules() if isinstance(layer, nn.Linear)][-1]

    @property
    def size(self) -> int:
        return self.spec.size

    def initial_parameters(self, seed: int) -> np.ndarray:
        return initial_parameters(self.module, seed).numpy()

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return 0.5 * ((outputs.squeeze(-1) - targets) ** 2).mean()  # f_i = 1/(2N) ||X theta - y||^2
        return nn.functional.cross_entropy(outputs, targets)

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each sample (its mean is `_loss`), for batches padded with samples weighted zero.

        `outputs` has the classes (or the one regression output) on dimension 1: [N, K] or [N, K, *more],
        `targets` the remaining shape ([N] or [N, *more])."""
        if self.task == "regression":
            return 0.5 * (outputs.squeeze(1) - targets) ** 2
        return nn.functional.cross_entropy(outputs, targets, reduction="none")

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, self.spec.unflatten(flat), (x,))

    def features(self, flat: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits): the features are the input of the network's last linear layer
        (what knowledge distillation compares, augfl.md 2.1)."""
        captured: list[torch.Tensor] = []
        handle = self._head.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0]))
        try:
            logits = self.forward(flat, x)
        finally:
            handle.remove()
        return captured[0], logits

    def loss_and_grad(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Mean minibatch loss at `flat` and its gradient (a new flat tensor)."""
        point = flat.detach().requires_grad_(True)
        loss = self._loss(self.forward(point, x), y)
        (grad,) = torch.autograd.grad(loss, point)
        return loss.item(), grad

    @torch.no_grad()
    def predict(self, flat: np.ndarray, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
        """The network's outputs (logits) on the samples, as float32."""
        params = torch.tensor(flat, dtype=torch.float32)
        parts = [self.forward(params, torch.from_numpy(x[start : start + chunk])) for start in range(0, len(x), chunk)]
        return torch.cat(parts).numpy() if parts else np.zeros((0, 0), np.float32)

    def evaluate(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray, chunk: int = 2048) -> tuple[float, float]:
        """(mean loss, accuracy) over the samples; accuracy is NaN for regression."""
        scores = self.scores(flat, x, y, chunk=chunk)
        return scores.loss, scores.accuracy

    @torch.no_grad()
    def scores(
        self,
        flat: np.ndarray,
        x: np.ndarray,
        y: np.ndarray,
        sum_batch: int | None = None,
        keep_outputs: bool = False,
        chunk: int = 2048,
    ) -> Scores:
        """Everything an evaluation reads off one forward pass over the samples (see Scores)."""
        params = torch.tensor(flat, dtype=torch.float32)
        total_loss, correct = 0.0, 0
        per_sample, kept = [], []
        for start in range(0, len(y), chunk):
            xb = torch.from_numpy(x[start : start + chunk])
            yb = torch.from_numpy(y[start : start + chunk])
            outputs = self.forward(params, xb)
            total_loss += float(self._loss(outputs, yb)) * len(yb)
            if sum_batch is not None:
                per_sample.append(self.sample_losses(outputs, yb).to(torch.float64))
            if keep_outputs:
                kept.append(outputs)
            if self.task == "classification":
                correct += int((outputs.argmax(dim=1) == yb).sum())
        n = max(len(y), 1)
        accuracy = correct / n if self.task == "classification" else float("nan")
        loss_sum = float("nan")
        if sum_batch is not None:
            losses = torch.cat(per_sample) if per_sample else torch.zeros(0, dtype=torch.float64)
            loss_sum = float(sum(part.mean() for part in torch.split(losses, sum_batch)))
        outputs = (torch.cat(kept).numpy() if kept else np.zeros((0, 0), np.float32)) if keep_outputs else None
        return Scores(total_loss / n, accuracy, loss_sum, outputs)
