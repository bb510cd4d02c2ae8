"""FedCP: each sample's features split between a global and a personalized head by a conditional policy network
(Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedCP: Separating Feature Information for Personalized Federated Learning
via Conditional Policy", KDD 2023, arXiv:2307.01217), a baseline of AugFL's Table II (AugFL, Sec. VI; Table II) and
FedAPM's Table 4 (FedAPM, App. B.5.3, Table 4).

The network is split at its head (ParamSpec.head, the last linear layer): a feature extractor f (the body), and on
its features h = f(x) (size d) two heads, the global head g (W_g, b_g) and the client's personalized head p_i
(W_p, b_p), with the Conditional Policy Network (CPN) between them (raysim.models.composed.GatedHeads):

    v      = c_i / ||c_i||, c_i = sum over the classes of the rows of W_p        (the client-specific input)
    u      = ReLU(LayerNorm(A (h * v) + a)) = (u_p, u_g)                          (the CPN on the conditional input)
    (s, r) = softmax((u_p + G_p) / tau, (u_g + G_g) / tau) entry by entry        (the policy: s + r = 1, in [0, 1])
    out    = p_i(h * s) + g(h * r)                                               (the personalized model's output)

G is Gumbel noise while training (the CPN's Gumbel-Softmax, tau = 1). A selected client starts from the received
body, global head and CPN with its own personalized head, freezes the global head, and trains body, CPN and
personalized head by local SGD on

    CE(out, y) + lambda * MMD^2(f(x), f_global(x))

where f_global is the received (frozen) extractor: the MMD term (Gaussian kernels, `mmd`) keeps the
local features close to the global ones. It uploads its body, its CPN and, for the global head,
(1 - head_mix) W_g + head_mix W_p (the authors' `generate_upload_head`, 0.5/0.5); the server averages the three
weighted by training samples and the personalized head never leaves the client.

Settings follow the authors' code (TsingZ0/PFLlib clientcp.py / servercp.py; TsingZ0/FedCP run_me.sh: lambda = 5,
batch 10, lr 0.005, one local epoch): the paper's text was not at hand here, so no equation numbers are cited, and the
forms above are those of the authors' code. Departures, all for raysim's protocol:
- the conditional input v is computed from the personalized head the client holds (as the code's `set_head_g` does
  after each participation), also before its first round, where the code draws it uniformly at random;
- a selected client starts from the current global CPN and global head (the code hands them to the clients of the
  last round only: the same with full participation, its experiments' setting);
- the PM is scored with the noiseless policy softmax(u / tau) (the code samples Gumbel noise at test too).

Evaluation: PM = the GatedHeads model of the current body, global head and CPN (`evaluation_context`) with the
client's personalized head (`composed_model`; `personalized_network` tells the hosts how to score it); GM = the
body with the global head (the network's own layout). A held-out client deploys the GM. Uplink and downlink: body,
global head and CPN (the CPN has 2 d^2 + 6 d parameters); the upload names no message, so Byzantine attacks and
robust rules, which act on a message of the model's coordinates, are refused for it.

The gated two-head loss with its MMD term is this module's term (`GatedHeadsLoss`): it runs through the composed
network's forward (FlatModel.composed) and a forward hook on the head, one client at a time (not stacked,
`stacks = False`), as FedRoD's and FedProto's losses.
"""

from __future__ import annotations

import functools
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
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.models.composed import GatedHeads
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)
"""sigma of GatedHeadsLoss's Gaussian kernels (the FedCP authors' `MMD(x, y, 'rbf')`)."""


@dataclass(frozen=True, eq=False)
class GatedHeadsLoss(Term):
    """The local loss in place of f_i, of a GatedHeads vector (its layout: GatedHeads) on a batch of B samples:

        CE(logits, y) + mmd_weight * MMD^2(h, h_ref)

    with the policy's conditional input `context` fixed for the whole request (not recomputed from the training
    personalized head), and MMD^2 the biased estimate between the batch's features h and those of the network at
    `reference` (a frozen copy, no gradient): `mmd`."""

    heads: GatedHeads
    context: np.ndarray
    """[d]: the conditional input v (unnormalized: the forward normalizes it)."""
    reference: np.ndarray | None = None
    """The network's parameters (its size) whose features the MMD term pulls the trained features towards."""
    mmd_weight: float = 0.0
    gumbel: bool = True
    """Gumbel noise in the policy's softmax at every step (drawn from the step's seed: the client's stream)."""
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.mmd_weight and self.reference is None:
            raise ValueError("GatedHeadsLoss: mmd_weight > 0 needs a reference network")

    @property
    def draws(self) -> bool:
        """Gumbel noise is drawn at every step."""
        return self.gumbel

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        """The loss at the GatedHeads vector `point`; `seed` (drawn from the client's stream) seeds the Gumbel noise
        and the network's dropout."""
        import torch
        from torch import nn
        from torch.func import functional_call

        if self.gumbel and seed is None:
            raise ValueError("GatedHeadsLoss: Gumbel noise needs the step's seed")
        composed = model.composed(self.heads)
        generator = torch.Generator().manual_seed(seed) if self.gumbel and seed is not None else None
        context = torch.tensor(np.asarray(self.context, np.float32))
        with composed.dropout(seed):
            logits, features, _shares = functional_call(
                composed.module,
                composed.spec.unflatten(point),
                (x,),
                {"context": context, "generator": generator, "details": True},
            )
        total = nn.functional.cross_entropy(logits, y)
        if self.mmd_weight and self.reference is not None:
            with torch.no_grad():
                reference, _ = model.features(torch.tensor(np.asarray(self.reference, np.float32)), x)
            total = total + self.mmd_weight * mmd(features, reference)
        return total


def mmd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The biased MMD^2 estimate between the rows of x and y with the sum of Gaussian kernels exp(-||a - b||^2 /
    (2 sigma)) over sigma in MMD_BANDWIDTHS: mean K_xx + mean K_yy - 2 mean K_xy, the squared distances from inner
    products as the authors' code takes them (smooth where a distance is 0)."""
    import torch

    xx, yy, xy = x @ x.T, y @ y.T, x @ y.T
    x_norms, y_norms = xx.diagonal(), yy.diagonal()
    distances = (
        x_norms[:, None] + x_norms[None, :] - 2 * xx,
        y_norms[:, None] + y_norms[None, :] - 2 * yy,
        x_norms[:, None] + y_norms[None, :] - 2 * xy,
    )
    kernels = [functools.reduce(torch.add, [torch.exp(-0.5 * d / s) for s in MMD_BANDWIDTHS]) for d in distances]
    return (kernels[0] + kernels[1] - 2 * kernels[2]).mean()


class FedCPSettings(SGDSettings):
    name: Literal["fedcp"] = "fedcp"
    lam: float = Field(
        5.0,
        ge=0,
        alias="lambda",
        description="lambda: weight of the MMD term between the local and the received global features (5 in the "
        "authors' run_me.sh, `-lam 5`)",
    )
    tau: float = Field(1.0, gt=0, description="temperature of the policy's softmax (1 in the authors' code)")
    gumbel: bool = Field(True, description="Gumbel noise in the policy while training (the authors' gumbel_softmax)")
    head_mix: float = Field(
        0.5,
        ge=0,
        le=1,
        description="share of the personalized head in the global head a client uploads, (1 - head_mix) W_g + "
        "head_mix W_p (0.5 in the authors' code; 1: the personalized heads alone)",
    )
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weights of the server's averages: training-set sizes (the authors' code) or equal"
    )
    policy_seed: int = Field(0, ge=0, description="seed of the CPN's initial draw (the same CPN on every host)")


@dataclass
class FedCPClientState:
    personal_head: Vector
    """W_p, b_p laid out as the network's head (ParamSpec.head: weight, then bias); never sent."""


@dataclass
class FedCPServerState:
    shared: Vector
    """The CPN, the body and the global head: a GatedHeads vector without the personalized head's coordinates."""


@dataclass
class FedCPUpload(Upload):
    """A client's weight times its CPN, body and uploaded global head (the shared layout), and its weight. It names
    no message (see the module docstring)."""

    weighted: Vector
    weight: float


@ALGORITHMS.register()
class FedCP(Algorithm[FedCPSettings, FedCPClientState, FedCPServerState, Vector, FedCPUpload]):
    name = "fedcp"
    Settings = FedCPSettings
    Upload = FedCPUpload

    def __init__(self, settings: FedCPSettings, params: ParamSpec):
        super().__init__(settings, params)
        if params.statistics:
            raise ConfigError(
                f"model.name: {params.model!r} has running statistics (BatchNorm), which FedCP cannot train "
                "(it trains its policy network and heads around the network as one composed vector); choose a model "
                "without BatchNorm"
            )
        self.heads = GatedHeads(tau=settings.tau)
        self.network_head = params.head_mask()
        d, policy, size = params.feature_dim, self.heads.policy_size(params.feature_dim), params.size
        self.weight_size = params.head_outputs * d
        self.policy = np.zeros(policy + size + params.head_size, bool)
        self.policy[:policy] = True
        self.network = slice(policy, policy + size)
        self.personal = np.zeros_like(self.policy)
        self.personal[self.network] = self.network_head
        self.global_head = np.zeros_like(self.policy)
        self.global_head[policy + size :] = True
        self.shared = ~self.personal

    def init_server(self, init_params: Vector, num_clients: int) -> FedCPServerState:
        """The CPN as torch initializes it (Linear: U(-1/sqrt(d), 1/sqrt(d)); LayerNorm: gamma 1, beta 0), drawn from
        `policy_seed`; body and global head the initial network's."""
        d = self.params.feature_dim
        bound = 1.0 / np.sqrt(d)
        draw = np.random.default_rng(self.settings.policy_seed).uniform(-bound, bound, 2 * d * d + 2 * d)
        policy = np.concatenate([draw, np.ones(2 * d), np.zeros(2 * d)]).astype(np.float32)
        composite = np.concatenate([policy, init_params, init_params[self.network_head]]).astype(np.float32)
        return FedCPServerState(composite[self.shared])

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedCPClientState:
        return FedCPClientState(np.array(init_params[self.network_head], np.float32))

    def broadcast(self, server: FedCPServerState) -> Vector:
        return server.shared

    def assemble(self, personal_head: Vector, shared: Vector) -> Vector:
        """The GatedHeads vector of a personalized head and the shared CPN, body and global head."""
        composite = np.empty(self.policy.size, np.float32)
        composite[self.personal] = personal_head
        composite[self.shared] = shared
        return composite

    def conditional_input(self, personal_head: Vector) -> np.ndarray:
        """c_i = sum over the classes of the rows of W_p (the forward normalizes it)."""
        d = self.params.feature_dim
        return personal_head[: self.weight_size].reshape(-1, d).sum(axis=0, dtype=np.float32)

    def client_step(self, client: ClientInfo, state: FedCPClientState, broadcast: Vector) -> ClientStep:
        s = self.settings
        start = self.assemble(state.personal_head, broadcast)
        loss = GatedHeadsLoss(
            self.heads, self.conditional_input(state.personal_head), start[self.network].copy(), s.lam, s.gumbel
        )
        result = yield from train(s.local_sgd(start, terms=(loss,), mask=~self.global_head))  # the global head frozen
        trained = np.asarray(result.params, np.float32)
        personal = trained[self.personal]
        sent = trained.copy()
        sent[self.global_head] = (1 - s.head_mix) * start[self.global_head] + s.head_mix * personal
        weight = float(upload_weight(client.num_train, s.aggregation))
        metrics = {
            "train_loss": result.mean_loss,
            "personal_head_change": float(np.linalg.norm(personal - state.personal_head)),
            "policy_change": float(np.linalg.norm(trained[self.policy] - start[self.policy])),
        }
        upload = FedCPUpload(weight * sent[self.shared].astype(np.float64), weight)
        return ClientUpdate(FedCPClientState(personal.copy()), upload, metrics)

    def server_step(self, server: FedCPServerState, total: FedCPUpload, num_selected: int):
        """The CPN, body and global head: sum_i a_i x_i / sum_i a_i over the selected clients."""
        shared = (total.weighted / total.weight).astype(np.float32)
        return FedCPServerState(shared), server_metrics(shared, server.shared)

    def global_model(self, server: FedCPServerState) -> Vector:
        """The body with the global head, as the network."""
        composite = self.assemble(np.zeros(int(self.network_head.sum()), np.float32), server.shared)
        network = composite[self.network].copy()
        network[self.network_head] = composite[self.global_head]
        return network

    def evaluation_context(self, server: FedCPServerState) -> Vector:
        """The current CPN, body and global head, which every client's PM is built with (`composed_model`)."""
        return server.shared

    def personalized_network(self) -> GatedHeads:
        return self.heads

    def composed_model(self, state: FedCPClientState, global_params: Vector, context: Any = None) -> Vector:
        """PM: the current CPN, body and global head with the client's personalized head (GatedHeads' layout)."""
        if context is None:
            raise ValueError("FedCP's personalized model needs the server's CPN (its evaluation context)")
        return self.assemble(state.personal_head, context)
