"""The torch side of GatedHeads (raysim.models.losses): FedCP's personalized model, the network with a global head
and a conditional policy network that splits each sample's features between the two heads, as a torch module whose
parameters are GatedHeads' vector, and the model that trains (GatedHeadsLoss) and scores such vectors."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from raysim.models.flat import FlatModel, last_linear, param_spec
from raysim.models.losses import MMD_BANDWIDTHS, GatedHeads, GatedHeadsLoss


class GatedHeadsNetwork(nn.Module):
    """`network` with a policy network and a global head: its forward gives GatedHeads' logits; its parameters, in
    named_parameters order, are GatedHeads' vector (policy, then network, then global_head)."""

    def __init__(self, network: nn.Module, heads: GatedHeads):
        super().__init__()
        self.head_name, head = last_linear(network)
        d = head.in_features
        self.policy = nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.ReLU())
        self.network = network
        self.global_head = nn.Linear(d, head.out_features, bias=head.bias is not None)
        self.tau = heads.tau

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        details: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logits W_p (h * s) + b_p + W_g (h * r) + b_g (GatedHeads); `context` the conditional input (default:
        the personalized head's summed rows), `generator` draws Gumbel noise into the policy (default: none). With
        `details`: (logits, the features h [B, d], the policy [B, 2, d] whose rows are s and r)."""
        head = self.network.get_submodule(self.head_name)
        captured: list[torch.Tensor] = []
        handle = head.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0]))
        try:
            self.network(x)
        finally:
            handle.remove()
        features = captured[0]
        condition = nn.functional.normalize(head.weight.sum(dim=0) if context is None else context, dim=0).detach()
        scores = self.policy(features * condition).view(len(features), 2, -1)
        if generator is not None:  # torch's gumbel_softmax noise, -log(Exp(1)), from the given generator
            scores = scores - torch.empty_like(scores).exponential_(generator=generator).log()
        shares = torch.softmax(scores / self.tau, dim=1)
        personal, shared = shares[:, 0], shares[:, 1]
        logits = nn.functional.linear(features * personal, head.weight, head.bias) + self.global_head(features * shared)
        return (logits, features, shares) if details else logits


class GatedHeadsModel(FlatModel):
    """GatedHeads vectors around the network of `network` as a FlatModel: `forward` (what evaluation scores) the
    noiseless policy's logits, `gated_loss_and_grad` a GatedHeadsLoss step; `spec` is the vector's layout (its head
    the global head)."""

    def __init__(self, network: FlatModel, heads: GatedHeads):
        super().__init__(network.name, network.input_shape, network.head.out_features, network.task)
        if self.task != "classification":
            raise ValueError(f"gated heads need a classifier; model {self.name!r} is trained for {self.task}")
        self.network = network
        self.heads = heads
        self.module = GatedHeadsNetwork(self.module, heads)
        self.module.eval()
        self.spec = param_spec(self.module, network.name)
        self.head = self.module.global_head
        self.layers = None

    @torch.no_grad()
    def shares(self, flat: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The noiseless policy of each sample, [samples, 2, d] (rows s and r), at the vector `flat`."""
        params = self.spec.unflatten(torch.tensor(flat, dtype=torch.float32))
        return functional_call(self.module, params, (torch.from_numpy(x),), {"details": True})[2].numpy()

    def gated_loss_and_grad(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, loss: GatedHeadsLoss, seed: int | None
    ) -> tuple[float, torch.Tensor]:
        """GatedHeadsLoss `loss` on the batch at the vector `flat` and its gradient; `seed` (drawn from the client's
        stream) seeds the Gumbel noise and the network's dropout."""
        if loss.gumbel and seed is None:
            raise ValueError("GatedHeadsLoss: Gumbel noise needs the step's seed")
        point = flat.detach().requires_grad_(True)
        generator = torch.Generator().manual_seed(seed) if loss.gumbel and seed is not None else None
        context = torch.tensor(np.asarray(loss.context, np.float32))
        with self._dropout(seed):
            logits, features, _shares = functional_call(
                self.module, self.spec.unflatten(point), (x,), {"context": context, "generator": generator,
                                                                 "details": True},
            )  # fmt: skip
        total = nn.functional.cross_entropy(logits, y)
        if loss.mmd_weight and loss.reference is not None:
            with torch.no_grad():
                reference, _ = self.network.features(torch.tensor(np.asarray(loss.reference, np.float32)), x)
            total = total + loss.mmd_weight * mmd(features, reference)
        (grad,) = torch.autograd.grad(total, point)
        return total.item(), grad


def mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The biased MMD^2 estimate between the rows of x and y with the sum of Gaussian kernels exp(-||a - b||^2 /
    (2 sigma)) over sigma in MMD_BANDWIDTHS (GatedHeadsLoss): mean K_xx + mean K_yy - 2 mean K_xy, the squared
    distances from inner products as the authors' code takes them (smooth where a distance is 0)."""
    xx, yy, xy = x @ x.T, y @ y.T, x @ y.T
    x_norms, y_norms = xx.diagonal(), yy.diagonal()
    distances = (
        x_norms[:, None] + x_norms[None, :] - 2 * xx,
        y_norms[:, None] + y_norms[None, :] - 2 * yy,
        x_norms[:, None] + y_norms[None, :] - 2 * xy,
    )
    kernels = [sum(torch.exp(-0.5 * d / sigma) for sigma in MMD_BANDWIDTHS) for d in distances]
    return (kernels[0] + kernels[1] - 2 * kernels[2]).mean()
