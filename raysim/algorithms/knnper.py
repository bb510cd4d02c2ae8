"""kNN-Per: FedAvg's global model, personalized at inference by a kNN model over the client's own training samples in
the global model's feature space (Marfoq, Neglia, Kameni and Vidal, "Personalized Federated Learning through Local
Memorization", ICML 2022, arXiv:2111.09360).

Training is FedAvg (this class is raysim's Averaging, unchanged): the global model, a body phi (the network up to its
head, ParamSpec.head) and a head, is the weighted mean of the selected clients' locally trained models. Clients keep
nothing between rounds; uplink and downlink are FedAvg's (the model and its weight up, the model down).

Personalization happens when a client is scored: with the current global model it builds its datastore
S_i = {(phi(x_j), y_j)} over its training split (all of it, or `capacity` samples drawn at random, the authors'
`random` strategy), and for a sample x with features z = phi(x) and global logits g(x) it predicts

    p_kNN(y | x) = sum_{j in N_k(z)} w_j 1{y_j = y},   w_j = exp(-||z - z_j||^2 / (d sigma)) / sum_{l in N_k(z)} (same)
    p_i(y | x)   = lambda p_kNN(y | x) + (1 - lambda) softmax(g(x))_y

N_k(z) the k stored features nearest to z in Euclidean distance, d the feature dimension, sigma the kernel's scale
(`scale`). The PM's outputs are log p_i, so that softmax cross-entropy scores the mixture's negative log-likelihood
and argmax its prediction; a class of probability 0 (lambda = 1, a label no neighbour has) gets PROBABILITY_FLOOR.
lambda = 0 is the global model; lambda = 1 with k = 1 on a stored sample gives its label. A client with no training
sample has an empty datastore and deploys the global model (the authors' code's empty-datastore branch).

Paper and libraries: the kernel exp(-||.||^2 / (d sigma)) on squared L2 distances (faiss IndexFlatL2) is the authors'
code's (omarfoq/knn-per client.py, KNNPerClient.gather_knn_outputs) and FL-bench's (src/client/knnper.py), sigma = 1
in both; the weights are computed shifted by the nearest distance, which cancels in the normalization and keeps far
neighbours from all underflowing to 0. `mix: logits` mixes p_kNN with the global model's logits instead of its
probabilities, the authors' code's default (its `--interpolate_logits` defaults to the string "store_true", so
`apply_softmax` is off) and FL-bench's; the paper interpolates probabilities, the default. The paper tunes lambda per
client on a grid and sweeps k and the capacity; defaults here: k = 10 (the authors' base-model scripts; FL-bench 5),
lambda = 0.5 (FL-bench's), the whole training split (the authors' full capacity; FL-bench keeps 500). The paper's
text was not at hand here: no equation numbers are cited.

Evaluation hook: the mixture is not a vector of the network's parameters, so raysim's evaluation, which scores
parameter vectors (evaluated_model, extra_models, the composed networks), cannot score it yet. The host needs to
compute, for a client of an algorithm with `scores_from_features`, the global model's features of the client's
training split and its features and logits on the scored samples (FeatureData) and to score the outputs
`feature_outputs` returns in place of the PM's. Until it does, the PM scored is the global model
(Averaging.evaluated_model: None).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.families.averaging import Averaging, AveragingSettings, ClientState
from raysim.algorithms.interface import ALGORITHMS, ClientInfo, FeatureData

PROBABILITY_FLOOR = 1e-12
"""The probability the mixture's outputs give a class it gives none (lambda = 1 and no neighbour with its label):
a large, finite loss (-log 1e-12 = 27.6) in place of an infinite one."""

QUERY_ROWS = 1024
"""Queries whose distances to the datastore are computed in one block (memory: rows x datastore size)."""


class KnnPerSettings(AveragingSettings):
    name: Literal["knnper"] = "knnper"
    k: int = Field(10, ge=1, description="k: the neighbours of the kNN model (the authors' scripts: 10; FL-bench: 5)")
    lam: float = Field(
        0.5,
        ge=0,
        le=1,
        alias="lambda",
        description="lambda: weight of the kNN model in the mixture, lambda p_kNN + (1 - lambda) p_global "
        "(FL-bench's 0.5; the paper tunes it per client; 0: the global model)",
    )
    scale: float = Field(
        1.0,
        gt=0,
        description="sigma: the kernel exp(-||z - z_j||^2 / (d sigma)) of the neighbours' weights (the authors' "
        "`kernel_length_scale` and FL-bench's `scale`: 1)",
    )
    capacity: int | None = Field(
        None,
        ge=1,
        description="the datastore's size: a client with more training samples keeps this many drawn at random (the "
        "authors' `random` strategy; FL-bench: 500); none: all of them (the authors' full capacity)",
    )
    mix: Literal["probabilities", "logits"] = Field(
        "probabilities",
        description="what p_kNN is mixed with: the global model's probabilities (the paper) or its logits (the "
        "authors' code's default and FL-bench's)",
    )

    @model_validator(mode="after")
    def _no_shared_only(self) -> KnnPerSettings:
        if self.shared_only:
            raise ValueError("algorithm.shared_only is the FedAPM authors' FedAvg; knnper trains the whole model")
        return self


@ALGORITHMS.register()
class KnnPer(Averaging):
    name = "knnper"
    Settings = KnnPerSettings
    settings: KnnPerSettings
    scores_from_features: ClassVar[bool] = True
    """The PM is scored from `feature_outputs` (the proposed core hook), not from a parameter vector."""

    def feature_outputs(
        self, client: ClientInfo, state: ClientState, data: FeatureData, context: Any = None
    ) -> np.ndarray:
        """The PM's outputs [m, C] on the scored samples: log p_i, or with `mix: logits` the mixed logits."""
        s = self.settings
        keys, labels = datastore(data.memory_features, data.memory_labels, s.capacity, data.rng)
        return knnper_outputs(data.features, data.logits, keys, labels, s.k, s.lam, s.scale, s.mix)


def datastore(
    features: np.ndarray, labels: np.ndarray, capacity: int | None, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The stored (features, labels): all of them, or `capacity` of them drawn without replacement when there are
    more (the authors' `random` strategy)."""
    if capacity is None or len(labels) <= capacity:
        return features, labels
    if rng is None:
        raise ValueError(f"a datastore of {capacity} of {len(labels)} samples draws them: it needs a generator")
    keep = np.sort(rng.choice(len(labels), size=capacity, replace=False))
    return features[keep], labels[keep]


def squared_distances(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """||q - z||^2 of every query (rows) to every key (columns), float64, never below 0."""
    q, z = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
    distances = (q**2).sum(axis=1)[:, None] - 2.0 * q @ z.T + (z**2).sum(axis=1)[None, :]
    return np.maximum(distances, 0.0)


def neighbour_weights(distances: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """The normalized kernel weights of each row's neighbours from their squared distances [m, k]:
    exp(-D_j / (d sigma)) / sum_l exp(-D_l / (d sigma)), computed shifted by the row's least distance."""
    shifted = distances - distances.min(axis=1, keepdims=True)
    weights = np.exp(-shifted / (dim * scale))
    return weights / weights.sum(axis=1, keepdims=True)


def knn_probabilities(
    queries: np.ndarray, keys: np.ndarray, labels: np.ndarray, classes: int, k: int, scale: float
) -> np.ndarray:
    """p_kNN [m, classes]: each query's kernel-weighted vote of its min(k, n) nearest keys (keys tied at the k-th
    distance: numpy's argpartition picks, as faiss picks among them)."""
    count = min(k, len(labels))
    dim = queries.shape[1]
    votes = np.zeros((len(queries), classes), np.float64)
    for begin in range(0, len(queries), QUERY_ROWS):
        block = slice(begin, begin + QUERY_ROWS)
        distances = squared_distances(queries[block], keys)
        nearest = np.argpartition(distances, count - 1, axis=1)[:, :count]
        weights = neighbour_weights(np.take_along_axis(distances, nearest, axis=1), dim, scale)
        rows = np.repeat(np.arange(len(nearest)), count)
        np.add.at(votes[block], (rows, labels[nearest].ravel()), weights.ravel())
    return votes


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis (float64)."""
    shifted = np.asarray(logits, np.float64) - np.max(logits, axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def mixture(knn: np.ndarray, logits: np.ndarray, lam: float, mix: str = "probabilities") -> np.ndarray:
    """The PM's outputs from p_kNN and the global logits: log(lambda p_kNN + (1 - lambda) softmax(g)), computed in
    log space (a class with no probability gets log PROBABILITY_FLOOR), or with `mix: logits`
    lambda p_kNN + (1 - lambda) g (float32)."""
    if mix == "logits":
        return (lam * knn + (1.0 - lam) * np.asarray(logits, np.float64)).astype(np.float32)
    with np.errstate(divide="ignore"):
        outputs = np.logaddexp(np.log(lam) + np.log(knn), np.log1p(-lam) + log_softmax(logits))
    return np.where(np.isneginf(outputs), np.log(PROBABILITY_FLOOR), outputs).astype(np.float32)


def knnper_outputs(
    features: np.ndarray,
    logits: np.ndarray,
    keys: np.ndarray,
    labels: np.ndarray,
    k: int,
    lam: float,
    scale: float,
    mix: str = "probabilities",
) -> np.ndarray:
    """kNN-Per's outputs [m, C] on samples with global features `features` and logits `logits`, from the datastore
    (`keys`, `labels`); an empty datastore gives the global model's (lambda = 0)."""
    if len(labels) == 0:
        lam = 0.0
        knn = np.zeros(logits.shape, np.float64)
    else:
        knn = knn_probabilities(features, keys, np.asarray(labels, np.int64), logits.shape[1], k, scale)
    return mixture(knn, logits, lam, mix)
