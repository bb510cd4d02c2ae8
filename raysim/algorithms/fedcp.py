"""FedCP: each sample's features split between a global and a personalized head by a conditional policy network
(Zhang, Hua, Wang, Song, Xue, Ma, Guan: "FedCP: Separating Feature Information for Personalized Federated Learning
via Conditional Policy", KDD 2023, arXiv:2307.01217), a baseline of AugFL's Table II (augfl.md 4.4, 5) and FedAPM's
Table 4 (fedapm.md 4.3, 5.2).

The network is split at its head (ParamSpec.head, the last linear layer): a feature extractor f (the body), and on
its features h = f(x) (size d) two heads, the global head g (W_g, b_g) and the client's personalized head p_i
(W_p, b_p), with the Conditional Policy Network (CPN) between them (raysim.models.losses.GatedHeads):

    v      = c_i / ||c_i||, c_i = sum over the classes of the rows of W_p        (the client-specific input)
    u      = ReLU(LayerNorm(A (h * v) + a)) = (u_p, u_g)                          (the CPN on the conditional input)
    (s, r) = softmax((u_p + G_p) / tau, (u_g + G_g) / tau) entry by entry        (the policy: s + r = 1, in [0, 1])
    out    = p_i(h * s) + g(h * r)                                               (the personalized model's output)

G is Gumbel noise while training (the CPN's Gumbel-Softmax, tau = 1). A selected client starts from the received
body, global head and CPN with its own personalized head, freezes the global head, and trains body, CPN and
personalized head by local SGD on

    CE(out, y) + lambda * MMD^2(f(x), f_global(x))

where f_global is the received (frozen) extractor: the MMD term (Gaussian kernels, raysim.models.losses) keeps the
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

Not stacked (`stacks = False`): the gated two-head loss with its MMD term runs through a forward hook on the head
(FlatModel.composed), one client at a time, as FedRoD's and FedProto's feature losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.servers import server_metrics, upload_weight
from raysim.algorithms.settings import SGDSettings
from raysim.models.losses import GatedHeads, GatedHeadsLoss
from raysim.models.spec import ParamSpec


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
        result = yield from train(s.local_sgd(start, loss=loss, mask=~self.global_head))  # the global head frozen
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
