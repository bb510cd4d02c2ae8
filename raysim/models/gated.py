"""The torch side of GatedHeads (raysim.models.composed): FedCP's personalized model, the network with a global head
and a conditional policy network that splits each sample's features between the two heads, as a torch module whose
parameters are GatedHeads' vector (raysim.models.flat.GatedHeadsModel scores such vectors, FedCP's GatedHeadsLoss
trains them); FeatureValve's, GPFL's (raysim.algorithms.gpfl); and ComponentMixture's, FedEM's
(raysim.algorithms.fedem)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from raysim.models.composed import ComponentMixture, FeatureValve, GatedHeads


class GatedHeadsNetwork(nn.Module):
    """`network` with a policy network and a global head on the features its head `head_name` (its last linear layer,
    raysim.models.flat.composed_module finds it) takes: its forward gives GatedHeads' logits; its parameters, in
    named_parameters order, are GatedHeads' vector (policy, then network, then global_head)."""

    def __init__(self, network: nn.Module, head_name: str, heads: GatedHeads):
        super().__init__()
        self.head_name = head_name
        head = network.get_submodule(head_name)
        assert isinstance(head, nn.Linear)
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
        assert isinstance(head, nn.Linear)  # __init__ checked it
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


class Valve(nn.Module):
    """The valve (a, c) of FeatureValve: identity-initialized (a = 1, c = 0)."""

    def __init__(self, d: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.shift = nn.Parameter(torch.zeros(d))


class FeatureValveNetwork(nn.Module):
    """`network` with a valve on the features its head `head_name` takes (raysim.models.flat.composed_module finds
    it): its forward gives FeatureValve's logits W ReLU(a * h + c) + b; its parameters, in named_parameters order, are
    FeatureValve's vector (network, then valve.scale a, then valve.shift c)."""

    def __init__(self, network: nn.Module, head_name: str, valve: FeatureValve):
        super().__init__()
        self.head_name = head_name
        head = network.get_submodule(head_name)
        assert isinstance(head, nn.Linear)
        self.network = network
        self.valve = Valve(head.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's forward with its head's input h replaced by ReLU(a * h + c) (a pre-hook on the head, so the
        head's own forward hooks see the valve's output)."""
        head = self.network.get_submodule(self.head_name)
        valve = self.valve
        handle = head.register_forward_pre_hook(
            lambda _module, inputs: (torch.relu(inputs[0] * valve.scale + valve.shift),)
        )
        try:
            return self.network(x)
        finally:
            handle.remove()


class MixtureNetwork(nn.Module):
    """`mixture.components` copies of `network` and their mixture weights pi (a parameter, uniform at first): its
    forward gives ComponentMixture's outputs log sum_m pi_m softmax(f(x; theta_m)); its parameters, in
    named_parameters order, are ComponentMixture's vector (weights, then each of components.0, components.1, ...)."""

    def __init__(self, network: nn.Module, mixture: ComponentMixture):
        super().__init__()
        self.weights = nn.Parameter(torch.full((mixture.components,), 1.0 / mixture.components))
        self.components = nn.ModuleList(copy.deepcopy(network) for _ in range(mixture.components))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The log of the mixture's class probabilities, from each copy's log-softmax (a weight of 0: a term of 0)."""
        outputs = torch.stack([component(x) for component in self.components])
        log_weights = self.weights.clamp_min(0).log().reshape(-1, *[1] * (outputs.dim() - 1))
        return torch.logsumexp(torch.log_softmax(outputs, dim=2) + log_weights, dim=0)
