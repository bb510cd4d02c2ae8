"""Local losses beyond a model's plain task loss, described without torch (raysim.models.flat computes them): what
a LocalSGD request (raysim.algorithms.requests) trains on when a method acts on the model's features and head; and the
personalized models that are not the network itself but built around it (GatedHeads; raysim.models.flat computes
them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class FeatureLoss:
    """A local loss on a classifier's features z = f(x) (the input of its head, ParamSpec.head) and its logits, in
    place of LocalSGD's plain task loss f_i, for methods that act on a model's features and head:

        CE(logits + logit_shift, y)
          + target_weight * (1/(B d)) sum_b ||z_b - targets[y_b]||^2 over the samples whose class has_target
          + [second_head] CE(stopgrad(logits) + W2 stopgrad(z) + b2, y)

    over a batch of B samples. `logit_shift` adds a per-class constant to the logits (log class counts: the
    balanced softmax of Ren et al. 2020); the target term pulls each sample's features towards a per-class vector
    (a class prototype) and is divided by B d as torch's mse_loss divides it (a sample without a target adds 0 to
    the sum, as an MSE against itself). With `second_head` the trained vector is the model's parameters followed by
    a second head (W2, b2) laid out as the model's head, which only the last term trains: a head that corrects the
    model's detached logits on its detached features (its gradient reaches neither the body nor the first head)."""

    logit_shift: np.ndarray | None = None
    """[classes], added to the logits of the first term."""
    targets: np.ndarray | None = None
    """[classes, d]: the vector each class's features are pulled towards."""
    has_target: np.ndarray | None = None
    """[classes] bool: the classes that have a target (default: all, when `targets` is given)."""
    target_weight: float = 0.0
    second_head: bool = False

    def __post_init__(self) -> None:
        if self.target_weight and self.targets is None:
            raise ValueError("FeatureLoss: target_weight > 0 needs targets")

    @property
    def draws(self) -> bool:
        """Whether the loss draws noise of its own at every step: never (dropout aside, FlatModel.stochastic)."""
        return False


@dataclass(frozen=True)
class GatedHeads:
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

    def policy_size(self, feature_dim: int) -> int:
        """Parameters of the policy network on features of size d: 2d x d + 2d (linear), 2d + 2d (LayerNorm)."""
        return 2 * feature_dim * feature_dim + 6 * feature_dim


@dataclass(frozen=True, eq=False)
class GatedHeadsLoss:
    """The local loss of a GatedHeads vector (its layout: GatedHeads) on a batch of B samples:

        CE(logits, y) + mmd_weight * MMD^2(h, h_ref)

    with the policy's conditional input `context` fixed for the whole request (not recomputed from the training
    personalized head), and MMD^2 the biased estimate between the batch's features h and those of the network at
    `reference` (a frozen copy, no gradient), with the sum of the Gaussian kernels exp(-||a - b||^2 / (2 sigma))
    over sigma in MMD_BANDWIDTHS: mean(K_hh) + mean(K_rr) - 2 mean(K_hr) over the B x B pairs."""

    heads: GatedHeads
    context: np.ndarray
    """[d]: the conditional input v (unnormalized: the forward normalizes it)."""
    reference: np.ndarray | None = None
    """The network's parameters (its size) whose features the MMD term pulls the trained features towards."""
    mmd_weight: float = 0.0
    gumbel: bool = True
    """Gumbel noise in the policy's softmax at every step (drawn from the step's seed: the client's stream)."""

    def __post_init__(self) -> None:
        if self.mmd_weight and self.reference is None:
            raise ValueError("GatedHeadsLoss: mmd_weight > 0 needs a reference network")

    @property
    def draws(self) -> bool:
        """Gumbel noise is drawn at every step."""
        return self.gumbel


MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
"""sigma of GatedHeadsLoss's Gaussian kernels (the FedCP authors' `MMD(x, y, 'rbf')`)."""


@dataclass(frozen=True, eq=False)
class PrototypeContrast:
    """FedPCL's prototype-wise contrastive loss (Tan et al., NeurIPS 2022; raysim.algorithms.fedpcl) on a classifier
    whose head is a projection: the embedding of x is z = h / ||h|| with h the head's output, and for each set s of
    class prototypes P_s [classes, d]

        sum_s weights[s] * mean_b -log softmax_j(<z_b, P_s[j]> / temperature)[y_b]

    the softmax over the classes that have a prototype (`present`), the mean over the batch's samples whose class has
    one (a sample of another class adds nothing). Set 0 is the global prototypes, the others the clients' local ones;
    `weights` the terms' weights (1, then 1/m each)."""

    prototypes: np.ndarray
    """[sets, classes, d]."""
    present: np.ndarray
    """[classes] bool."""
    weights: np.ndarray
    """[sets]."""
    temperature: float

    @property
    def draws(self) -> bool:
        """No noise of its own at any step (as FeatureLoss)."""
        return False
