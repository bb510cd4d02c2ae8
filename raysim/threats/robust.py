"""Robust aggregation of client messages: Multi-Krum, coordinate-wise median, trimmed mean, norm clipping.

An aggregator maps the n messages (rows of a matrix) to one vector that replaces their mean.

- Averaging servers (Upload with a weight, e.g. FedAvg): the messages are those of this round's selected
  clients; the aggregate replaces their weighted mean.
- Running-sum servers (Upload.delta, e.g. FLAME's w = (1/m) sum_i u_i over ALL m clients with stale
  entries): the coordinator stores every client's latest message (m x d float32: m = 100 clients of a
  100k-parameter model cost 40 MB; kept only when an aggregator other than `mean` is configured) and
  aggregates all m of them, so w becomes the robust aggregate of the latest messages. Clients not yet
  selected count with their initial message, the initial model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.requests import Vector
from raysim.registry import OneOf, Registry
from raysim.settings import Settings

Rule = Callable[["RobustSettings", np.ndarray, int, Vector], Vector]
"""A robust rule: (settings, messages as rows, the assumed number f of Byzantine messages, the current global model)
-> the vector that replaces the messages' mean."""

ROBUST_RULES: Registry[Rule] = Registry("aggregation rule", "aggregation.rule")
"""The robust rules by `aggregation.rule`, each registered with `@ROBUST_RULES.register(name)`."""


class RobustSettings(Settings):
    """The config's `aggregation` section."""

    rule: Annotated[str, OneOf(ROBUST_RULES)] = Field(
        "mean", description="how the server combines messages; `mean` is the algorithm's own step"
    )
    byzantine: int | None = Field(
        None, ge=0, description="f assumed by Multi-Krum; default floor(attack.fraction * n) (authors' code)"
    )
    krum_selected: int | None = Field(
        None,
        ge=1,
        description="Multi-Krum: how many lowest-score messages are averaged; default n - f (blanchard) or 5 (code: "
        "the FLAME authors' helper averages torch.topk(scores, 5)), at most n",
    )
    krum_variant: Literal["blanchard", "code"] = Field(
        "blanchard",
        description="score: squared distances to the n-f-2 nearest (Blanchard et al.) or the FLAME authors' helper "
        "(utils.average_weights, aggr 'mkrum'): the sum of the n-f-1 smallest plain distances counting the zero "
        "self-distance, the 5 lowest averaged (the authors' code)",
    )
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed mean: share cut at EACH end per coordinate")
    clip_norm: float | None = Field(
        None, gt=0.0, description="norm clipping of m_i - w around the current global model; default median norm"
    )

    @property
    def active(self) -> bool:
        return self.rule != "mean"


def multi_krum(
    messages: np.ndarray, byzantine: int, selected: int | None = None, variant: str = "blanchard"
) -> tuple[Vector, np.ndarray]:
    """Average of the `selected` messages with the lowest Krum scores; returns (aggregate, chosen rows).

    `blanchard` (Blanchard et al., 2017): score_i = sum of the squared distances to the n - f - 2 nearest others,
    n - f averaged by default. `code` (the FLAME authors' helper): score_i = sum of the n - f - 1
    smallest plain distances in row i, the zero self-distance among them (so the n - f - 2 nearest others,
    unsquared), 5 averaged by default. Ties go to the lower row.
    """
    n = len(messages)
    squared = np.maximum(_squared_distances(messages), 0.0)
    np.fill_diagonal(squared, 0.0)  # exactly zero, as the helper's norm(u_i - u_i)
    if variant == "blanchard":
        neighbours = max(1, n - byzantine - 2)
        others = np.sort(squared + np.diag(np.full(n, np.inf)), axis=1)[:, : min(neighbours, n - 1)]
        default = n - byzantine
    else:
        others = np.sort(np.sqrt(squared), axis=1)[:, : max(1, n - byzantine - 1)]
        default = 5
    scores = others.sum(axis=1)
    keep = max(1, min(n, default if selected is None else selected))
    chosen = np.sort(np.argsort(scores, kind="stable")[:keep])
    return messages[chosen].mean(axis=0), chosen


def _squared_distances(messages: np.ndarray) -> np.ndarray:
    m = messages.astype(np.float64)
    norms = np.einsum("ij,ij->i", m, m)
    return norms[:, None] + norms[None, :] - 2.0 * m @ m.T


def trimmed_mean(messages: np.ndarray, fraction: float) -> Vector:
    """Per coordinate, the mean after dropping the floor(fraction * n) smallest and largest values."""
    cut = int(fraction * len(messages))
    ordered = np.sort(messages, axis=0)
    return ordered[cut : len(messages) - cut].mean(axis=0)


def norm_clip(messages: np.ndarray, reference: Vector, threshold: float | None) -> Vector:
    """Mean of reference + (m_i - reference) * min(1, c / ||m_i - reference||); c defaults to the median norm."""
    changes = messages.astype(np.float64) - reference
    norms = np.linalg.norm(changes, axis=1)
    c = float(np.median(norms)) if threshold is None else threshold
    scale = np.minimum(1.0, c / np.maximum(norms, 1e-12))
    return reference + (changes * scale[:, None]).mean(axis=0)


@ROBUST_RULES.register("mean")
def _mean(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """The plain mean (the algorithm's own server step does it; no robust rule)."""
    return messages.mean(axis=0)


@ROBUST_RULES.register("multi_krum")
def _multi_krum(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """Multi-Krum (Blanchard et al.; the authors' code's variant with krum_variant: code)."""
    return multi_krum(messages, byzantine, settings.krum_selected, settings.krum_variant)[0]


@ROBUST_RULES.register("median")
def _median(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """The coordinate-wise median."""
    return np.median(messages, axis=0)


@ROBUST_RULES.register("trimmed_mean")
def _trimmed_mean(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """The coordinate-wise mean without the trim_fraction smallest and largest values."""
    return trimmed_mean(messages, settings.trim_fraction)


@ROBUST_RULES.register("norm_clip")
def _norm_clip(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """The mean of the changes from the global model, each clipped to clip_norm."""
    return norm_clip(messages, reference, settings.clip_norm)


def aggregate(settings: RobustSettings, messages: np.ndarray, byzantine: int, reference: Vector) -> Vector:
    """The robust replacement of the mean of `messages` (rows) by the rule `aggregation.rule` names; `byzantine`
    is the default f."""
    f = byzantine if settings.byzantine is None else settings.byzantine
    return ROBUST_RULES.get(settings.rule)(settings, messages, f, reference)
