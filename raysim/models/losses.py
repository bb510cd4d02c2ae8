"""Local losses beyond a model's plain task loss, described without torch (raysim.models.flat computes them): what
a LocalSGD request (raysim.algorithms.base) trains on when a method acts on the model's features and head."""

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
