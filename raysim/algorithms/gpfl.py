"""GPFL: global and personalized feature information learned together through a Conditional Valve (Zhang, Hua, Wang,
Song, Xue, Ma, Cao, Guan: "GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized
Federated Learning", ICCV 2023, arXiv:2308.10279).

The network is split at its head (ParamSpec.head, the last linear layer): a feature extractor f (the body) whose
features z = f(x) have size d, and the client's personalized head h_i. Two modules are shared beside it: the Global
Category Embedding layer (GCE, one embedding e_c in R^d per class c) and the Conditional Valve (CoV), two small
networks of a conditional input v, each Linear(d, d), ReLU, LayerNorm(d):

    gamma(v) = LN_gamma(ReLU(A_gamma v + a_gamma)),   beta(v) = LN_beta(ReLU(A_beta v + a_beta))
    CoV(z, v) = ReLU(z * (1 + gamma(v)) + beta(v))                        (coordinate by coordinate)

fed with the global conditional input g = (1/C) sum_c e_c or the client's personalized one p_i = sum_c alpha_ic e_c
(alpha_ic: the share of class c in the client's training split), both taken from the received GCE and fixed for the
round. The global route z_g = CoV(z, g) is guided towards the GCE, the personalized route z_p = CoV(z, p_i) feeds the
personalized head. A selected client trains body, head, CoV and GCE together by local SGD on

    CE(h_i(z_p), y)
      + angle_weight * CE(cos(z_g, e_1..e_C), y)                          (angle-level guidance: a cosine softmax)
      + lambda * ||Z_g - E_y||                                            (magnitude-level guidance)
      + (mu / 2) (||theta_CoV||^2 + ||E||^2)                              (the regularizer on CoV and GCE)

where E_y stacks the received (frozen) embeddings of the batch's labels, and uploads body, CoV and GCE; the server
averages the three weighted by training samples (`aggregation`) and the head never leaves the client.

The paper's text was not at hand here: the forms above are those of the authors' code (TsingZ0/GPFL clientgp.py /
servergp.py, the same in TsingZ0/PFLlib clientgpfl.py / servergpfl.py), so no equation numbers are cited; the
defaults lambda = 0.01 and mu = 0.1 are the authors' run_me.sh for the 4-layer CNN and the 3-layer MLP (0.0001 and
0 for ResNet-18 and fastText). In that code the magnitude-level term is the norm of the batch's whole difference
matrix (`magnitude: batch`); `magnitude: sample` takes the mean of the samples' distances instead, and mu is the
SGD weight decay of the CoV's and GCE's optimizers, i.e. (mu / 2) ||.||^2 in the loss, as here. Departures, all for
raysim's protocol:
- g and p_i come from the GCE the client receives this round; the code computes them at the end of the previous
  round from the GCE the client held before the new one was copied in (a round's lag, and for a client selected in
  that round its own trained GCE);
- alpha_i is counted at each selected round (ClassMeans without a point); a client never selected has the uniform
  share, p_i = g;
- a selected client starts from the current global CoV and GCE (the code sends them to every client after each
  round: the same).

Evaluation: PM = the network with the current body and the client's head, its features passed through the valve of
its personalized conditional input: logits = h_i(ReLU(z * (1 + gamma(p_i)) + beta(p_i))), a FeatureValve vector
(raysim.models.composed; `composed_model`, with the server's body, CoV and GCE as `evaluation_context`); GM = the
body with the initial head (as FedPer's). A held-out client deploys the GM. Uplink: body, CoV (2 d^2 + 6 d) and GCE
(C d) and the weight; downlink the same without the weight. The upload names no message, so Byzantine attacks and
robust rules, which act on a message of the model's coordinates, are refused for it. Ablations: `angle_weight: 0` and
`lambda: 0` drop the two guidance terms, `valve: false` drops the CoV (z_p = z_g = z, the CoV frozen and the PM the
plain network); all three with mu = 0 is FedPer (the tests check it).

The loss is this module's term (`GPFLLoss`): its features come through FlatModel.features, one client at a time (not
stacked, `stacks = False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import upload_weight
from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import ClassMeans, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.models.composed import FeatureValve
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

LAYER_NORM_EPS = 1e-5
"""torch's LayerNorm epsilon (the CoV's)."""


def valve_size(d: int) -> int:
    """Parameters of the CoV on features of size d: per branch (gamma, beta) Linear(d, d) and LayerNorm(d)."""
    return 2 * (d * d + 3 * d)


def conditional_valve(cov: torch.Tensor, context: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gamma(v), beta(v)) of the CoV vector `cov` (per branch: A [d, d], a, LayerNorm weight, LayerNorm bias) at
    the conditional input v = `context` [d]."""
    import torch
    from torch import nn

    outputs = []
    for branch in range(2):
        offset = branch * (d * d + 3 * d)
        weight = cov[offset : offset + d * d].reshape(d, d)
        bias, norm_weight, norm_bias = cov[offset + d * d : offset + d * d + 3 * d].reshape(3, d)
        hidden = torch.relu(nn.functional.linear(context, weight, bias))
        outputs.append(nn.functional.layer_norm(hidden, (d,), norm_weight, norm_bias, LAYER_NORM_EPS))
    return outputs[0], outputs[1]


def angle_guidance(features: torch.Tensor, embeddings: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The angle-level guidance: the mean over the batch of -log softmax_c(cos(z_g, e_c))[y], the cosines unscaled
    (the authors' GCE.forward)."""
    from torch import nn

    cosines = nn.functional.normalize(features, dim=1) @ nn.functional.normalize(embeddings, dim=1).T
    return nn.functional.cross_entropy(cosines, y)


def magnitude_guidance(features: torch.Tensor, anchors: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """The magnitude-level guidance: ||Z_g - E_y|| over the batch's whole matrix (the authors' torch.norm), or with
    `per_sample` the mean over the samples of ||z_g - e_y||_2."""
    import torch

    if per_sample:
        return torch.linalg.vector_norm(features - anchors, dim=1).mean()
    return torch.linalg.vector_norm(features - anchors)


@dataclass(frozen=True, eq=False)
class GPFLLoss(Term):
    """The local loss in place of f_i, on the vector (network, CoV, GCE) (the network's size, valve_size(d), C d):

        CE(h(z_p), y) + angle_weight * angle_guidance(z_g, E, y) + lam * magnitude_guidance(z_g, anchors[y])
          + (mu / 2) (||CoV||^2 + ||E||^2)

    with z = f(x) the network's features on the batch, z_p = CoV(z, personal), z_g = CoV(z, generic) (both z itself
    without the valve, and no CoV in the regularizer), h the network's head and E the trained GCE."""

    generic: np.ndarray
    """[d]: the global conditional input g."""
    personal: np.ndarray
    """[d]: the client's personalized conditional input p_i."""
    anchors: np.ndarray
    """[C, d]: the received GCE, frozen, that the magnitude-level guidance pulls z_g towards."""
    angle_weight: float = 1.0
    lam: float = 0.0
    mu: float = 0.0
    per_sample: bool = False
    valve: bool = True
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        if model.task != "classification":
            raise ValueError(f"GPFL's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        classes, d = self.anchors.shape
        size, cov_size = model.size, valve_size(d)
        network, cov = point[:size], point[size : size + cov_size]
        embeddings = point[size + cov_size :].reshape(classes, d)
        with model.dropout(seed):
            features, _logits = model.features(network, x)
        if self.valve:
            gamma, beta = conditional_valve(cov, self.tensor("personal"), d)
            personal = torch.relu(features * (1 + gamma) + beta)
            gamma, beta = conditional_valve(cov, self.tensor("generic"), d)
            generic = torch.relu(features * (1 + gamma) + beta)
        else:
            personal = generic = features
        spec = model.spec
        weight = network[spec.slice(spec.head[0])].reshape(model.head.weight.shape)
        bias = network[spec.slice(spec.head[1])] if len(spec.head) > 1 else None
        total = nn.functional.cross_entropy(nn.functional.linear(personal, weight, bias), y)
        if self.angle_weight:
            total = total + self.angle_weight * angle_guidance(generic, embeddings, y)
        if self.lam:
            anchors = self.tensor("anchors")[y]
            total = total + self.lam * magnitude_guidance(generic, anchors, self.per_sample)
        if self.mu:
            squares = embeddings.square().sum() + (cov.square().sum() if self.valve else 0.0)
            total = total + 0.5 * self.mu * squares
        return total


class GPFLSettings(SGDSettings):
    name: Literal["gpfl"] = "gpfl"
    lam: float = Field(
        0.01,
        ge=0,
        alias="lambda",
        description="lambda: weight of the magnitude-level guidance ||Z_g - E_y|| (0.01 in the authors' run_me.sh for "
        "the 4-layer CNN and 3-layer MLP, `-lam 0.01`; 0.0001 for ResNet-18; 0: none)",
    )
    mu: float = Field(
        0.1,
        ge=0,
        description="mu: weight decay of the CoV and the GCE, (mu/2)(||theta_CoV||^2 + ||E||^2) (0.1 in the authors' "
        "run_me.sh for the CNN and MLP, `-mu 0.1`; 0 for ResNet-18)",
    )
    angle_weight: float = Field(
        1.0,
        ge=0,
        description="weight of the angle-level guidance, the cosine softmax of z_g over the GCE (1 in the paper and "
        "code; 0: none, an ablation)",
    )
    magnitude: Literal["batch", "sample"] = Field(
        "batch",
        description="the magnitude-level guidance: the norm of the batch's difference matrix (the authors' "
        "torch.norm) or the mean of the samples' distances",
    )
    valve: bool = Field(
        True,
        description="the Conditional Valve between the features and the two routes (false: z_p = z_g = z, the CoV "
        "frozen, an ablation; with angle_weight 0, lambda 0 and mu 0 that is FedPer)",
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weights of the server's averages: training-set sizes (the authors' code) or equal"
    )
    init_seed: int = Field(0, ge=0, description="seed of the CoV's and GCE's initial draw (the same on every host)")


@dataclass
class GPFLClientState:
    head: Vector
    """The personalized head laid out as the network's head (ParamSpec.head: weight, then bias); never sent."""
    class_share: Vector
    """[C] float32: alpha_i, the share of each class in the training split (uniform before the first round)."""


@dataclass
class GPFLServerState:
    shared: Vector
    """The body, the CoV and the GCE (the composite vector without the head's coordinates)."""
    template_head: Vector
    """The initial head: the GM's."""


@dataclass
class GPFLUpload(Upload):
    """A client's weight times its body, CoV and GCE (the shared layout), and its weight. It names no message (see
    the module docstring)."""

    weighted: Vector
    weight: float


@ALGORITHMS.register()
class GPFL(Algorithm[GPFLSettings, GPFLClientState, GPFLServerState, Vector, GPFLUpload]):
    name = "gpfl"
    Settings = GPFLSettings
    Upload = GPFLUpload

    def __init__(self, settings: GPFLSettings, params: ParamSpec):
        super().__init__(settings, params)
        try:
            self.network_head = params.head_mask()
        except ValueError as error:
            raise ConfigError(f"algorithm.name=gpfl splits the model at its head: {error}") from error
        self.dim, self.classes, size = params.feature_dim, params.head_outputs, params.size
        self.network = slice(0, size)
        self.valve = slice(size, size + valve_size(self.dim))
        self.embeddings = slice(self.valve.stop, self.valve.stop + self.classes * self.dim)
        self.personal = np.zeros(self.embeddings.stop, bool)
        self.personal[self.network] = self.network_head
        self.shared = ~self.personal

    def init_server(self, init_params: Vector, num_clients: int) -> GPFLServerState:
        """The CoV as torch initializes it (Linear: U(-1/sqrt(d), 1/sqrt(d)); LayerNorm: weight 1, bias 0) and the
        GCE as nn.Embedding does (N(0, 1)), drawn from `init_seed`; the body the initial network's."""
        d, draws = self.dim, np.random.default_rng(self.settings.init_seed)
        bound = 1.0 / np.sqrt(d)
        branches = [
            np.concatenate([draws.uniform(-bound, bound, d * d + d), np.ones(d), np.zeros(d)]) for _ in range(2)
        ]
        embeddings = draws.standard_normal(self.classes * d)
        composite = np.concatenate([init_params, *branches, embeddings]).astype(np.float32)
        return GPFLServerState(composite[self.shared], init_params[self.network_head].copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> GPFLClientState:
        uniform = np.full(self.classes, 1.0 / self.classes, np.float32)
        return GPFLClientState(np.array(init_params[self.network_head], np.float32), uniform)

    def broadcast(self, server: GPFLServerState) -> Vector:
        return server.shared

    def assemble(self, head: Vector, shared: Vector) -> Vector:
        """The composite vector (network, CoV, GCE) of a personalized head and the shared body, CoV and GCE."""
        composite = np.empty(self.personal.size, np.float32)
        composite[self.personal] = head
        composite[self.shared] = shared
        return composite

    def conditional_inputs(self, composite: Vector, class_share: Vector) -> tuple[np.ndarray, np.ndarray]:
        """(g, p_i): the mean of the GCE's embeddings and their mix by the client's class shares."""
        embeddings = composite[self.embeddings].reshape(self.classes, self.dim).astype(np.float64)
        generic = embeddings.mean(axis=0)
        return generic.astype(np.float32), (class_share.astype(np.float64) @ embeddings).astype(np.float32)

    def client_step(self, client: ClientInfo, state: GPFLClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        counts = (yield from class_means(ClassMeans(None))).counts
        share = (counts / counts.sum()).astype(np.float32) if counts.sum() > 0 else state.class_share
        start = self.assemble(state.head, broadcast)
        generic, personal = self.conditional_inputs(start, share)
        anchors = start[self.embeddings].reshape(self.classes, self.dim).copy()
        loss = GPFLLoss(generic, personal, anchors, s.angle_weight, s.lam, s.mu, s.magnitude == "sample", s.valve)
        mask = None
        if not s.valve:
            mask = np.ones(self.personal.size, bool)
            mask[self.valve] = False
        result = yield from train(s.local_sgd(start, terms=(loss,), mask=mask))
        trained = np.asarray(result.params, np.float32)
        head = trained[self.personal].copy()
        weight = float(upload_weight(client.num_train, s.aggregation))
        metrics = {
            "train_loss": result.mean_loss,
            "head_change": float(np.linalg.norm(head - state.head)),
            "valve_change": float(np.linalg.norm(trained[self.valve] - start[self.valve])),
            "embedding_change": float(np.linalg.norm(trained[self.embeddings] - start[self.embeddings])),
        }
        upload = GPFLUpload(weight * trained[self.shared].astype(np.float64), weight)
        return ClientUpdate(GPFLClientState(head, share), upload, metrics)

    def server_step(self, server: GPFLServerState, total: GPFLUpload, num_selected: int):
        """Body, CoV and GCE: sum_i a_i x_i / sum_i a_i over the selected clients (unchanged when no weight came)."""
        if total.weight <= 0:
            return server, server_metrics(server.shared, server.shared)
        shared = (np.asarray(total.weighted) / total.weight).astype(np.float32)
        return GPFLServerState(shared, server.template_head), server_metrics(shared, server.shared)

    def global_model(self, server: GPFLServerState) -> Vector:
        """The body with the initial head, as the network."""
        return self.assemble(server.template_head, server.shared)[self.network].copy()

    def evaluation_context(self, server: GPFLServerState) -> Vector:
        """The current body, CoV and GCE, which every client's PM is built with (`composed_model`)."""
        return server.shared

    def personalized_network(self) -> FeatureValve | None:
        """The network with a valve before its head; none without the CoV (the PM is then the network itself)."""
        return FeatureValve() if self.settings.valve else None

    def evaluated_model(self, state: GPFLClientState, global_params: Vector) -> Vector | None:
        """Without the CoV: the current body with the client's head (only asked then)."""
        model = global_params.copy()
        model[self.network_head] = state.head
        return model

    def composed_model(self, state: GPFLClientState, global_params: Vector, context: Any = None) -> Vector:
        """PM: the current body with the client's head and the valve (1 + gamma(p_i), beta(p_i)) of the current CoV
        (FeatureValve's layout: the network, then a, then c)."""
        if context is None:
            raise ValueError("GPFL's personalized model needs the server's CoV and GCE (its evaluation context)")
        composite = self.assemble(state.head, context)
        _generic, personal = self.conditional_inputs(composite, state.class_share)
        gamma, beta = valve_numpy(composite[self.valve], personal, self.dim)
        return np.concatenate([composite[self.network], 1.0 + gamma, beta]).astype(np.float32)


def valve_numpy(cov: np.ndarray, context: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """`conditional_valve` in float64 numpy, for the PM's vector."""
    outputs = []
    for branch in range(2):
        offset = branch * (d * d + 3 * d)
        weight = cov[offset : offset + d * d].reshape(d, d).astype(np.float64)
        bias, norm_weight, norm_bias = cov[offset + d * d : offset + d * d + 3 * d].reshape(3, d).astype(np.float64)
        hidden = np.maximum(weight @ context.astype(np.float64) + bias, 0.0)
        normalized = (hidden - hidden.mean()) / np.sqrt(hidden.var() + LAYER_NORM_EPS)
        outputs.append(normalized * norm_weight + norm_bias)
    return outputs[0], outputs[1]
