"""Personalized models that are not the network itself but built around it, described without torch: FedCP's gated
heads, GPFL's feature valve, FedEM's mixture of components. Each description is a `ComposedNetwork`; raysim.models.flat
builds these three's torch modules (raysim.models.gated), and a method that needs another kind describes it in its own
file, its `module` building the torch module around the network; raysim.models.flat.FlatModel.composed scores any."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import nn


class ComposedNetwork:
    """A personalized model built around the network: hashable (a frozen dataclass), its vector the parameters of
    `module(network)` in named_parameters order."""

    classifier_only: ClassVar[bool] = False
    """Whether it needs a network trained for classification."""

    def module(self, network: nn.Module) -> nn.Module:
        """The torch module around `network` whose forward evaluation scores (torch imported inside, not at the top
        of a method's module): what a description defined outside raysim.models gives (the built-in three's modules
        are raysim.models.gated's)."""
        raise NotImplementedError(f"{type(self).__name__}.module: the torch module around the network")


@dataclass(frozen=True)
class GatedHeads(ComposedNetwork):
    """A classifier whose features are split, sample by sample, between two heads by a conditional policy network:
    FedCP's personalized model (Zhang et al., KDD 2023; raysim.algorithms.fedcp). With the network's features
    h = f(x) (the input of its head, ParamSpec.head, of size d), its head (W_p, b_p: the personalized head), a second
    head (W_g, b_g: the global head) and the policy network (A [2d, d], a [2d], then LayerNorm(2d) gamma, beta):

        v      = c / ||c||,  c = sum over the classes of the rows of W_p   (the client's conditional input, detached)
        u      = ReLU(LayerNorm(A (h * v) + a)),  u = (u_p, u_g), each of size d
        (s, r) = softmax((u_p + g_p) / tau, (u_g + g_g) / tau) entry by entry, so s + r = 1, each in [0, 1]
        logits = W_p (h * s) + b_p + W_g (h * r) + b_g

    (g: Gumbel noise while training, GatedHeadsLoss.gumbel; none at evaluation). Its vector: the policy network
    (A, a, gamma, beta), then the network's own parameters (body and personalized head, laid out as the network),
    then the global head laid out as the network's head (ParamSpec.head: weight, then bias)."""

    tau: float = 1.0
    """The softmax temperature of the policy (1 in the authors' code)."""

    classifier_only: ClassVar[bool] = True

    def policy_size(self, feature_dim: int) -> int:
        """Parameters of the policy network on features of size d: 2d x d + 2d (linear), 2d + 2d (LayerNorm)."""
        return 2 * feature_dim * feature_dim + 6 * feature_dim


@dataclass(frozen=True)
class FeatureValve(ComposedNetwork):
    """A classifier whose features pass, coordinate by coordinate, through an affine map and a ReLU before its head:
    GPFL's personalized model (Zhang et al., ICCV 2023; raysim.algorithms.gpfl). With the network's features h = f(x)
    (the input of its head, ParamSpec.head, of size d), its head (W, b) and the client's valve (a, c), each of size d:

        logits = W ReLU(a * h + c) + b

    Its vector: the network's own parameters (laid out as the network), then a, then c."""

    def valve_size(self, feature_dim: int) -> int:
        """Parameters of the valve on features of size d: a and c."""
        return 2 * feature_dim


@dataclass(frozen=True)
class ComponentMixture(ComposedNetwork):
    """A classifier that mixes the predictions of M copies of the network: FedEM's personalized model (Marfoq et al.,
    NeurIPS 2021; raysim.algorithms.fedem). With the copies' parameters theta_1, ..., theta_M and the client's mixture
    weights pi (M values, nonnegative, summing to 1):

        outputs = log sum_m pi_m softmax(f(x; theta_m))

    the log of the mixture's class probabilities, so that their cross-entropy is the mixture's negative
    log-likelihood and their argmax its prediction. Its vector: pi, then theta_1, ..., theta_M, each laid out as the
    network."""

    components: int
    """M: the copies of the network."""

    classifier_only: ClassVar[bool] = True
