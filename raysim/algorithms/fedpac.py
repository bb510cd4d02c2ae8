"""FedPAC: a shared body aligned to global class prototypes, and personal heads combined across clients (Xu, Tong and
Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration", ICLR 2023,
arXiv:2306.11867, Algorithm 1).

The model is split at its head (ParamSpec.head, the last linear layer): a body f, averaged by the server, and a head
g_i per client. A selected client i receives the global body theta, the global class prototypes c and its combined
head g^_i (the initial head before its first selection), and

1. computes, at the received body, the statistics of its classifier combination (Sec. 4.2): its class shares
   p_i(k) = n_ik / n_i, its class means mu_ik of the features z = f(x), the prior-weighted prototypes
   h_i = [p_i(k) mu_ik]_k (classes x d) and the feature variance V_i = E||z y^T - h_i||_F^2 = E||z||^2 - ||h_i||_F^2
   (y one-hot; the authors' `statistics_extraction`, as the paper's Algorithm 1 takes them before training);
2. trains its head alone for `head_epochs` epochs from g^_i, the body frozen (CE, at rate `head_lr`);
3. trains its body for `epochs` epochs, the new head frozen, on eq. 6,

       CE(g_i(f(x)), y) + lambda * (1/B) sum_b ||f(x_b) - c_{y_b}||^2 / d         (`alignment: mse`)

   per batch of B samples with features of dimension d, towards the global prototype of each sample's class (none
   in round 0: plain CE). The paper writes eq. 6 without the 1/d, but its lambda = 1 is the authors' code's weight
   of torch's mse_loss, which divides by d ("1.0 for mse_loss"; PFLlib and FL-bench alike), as raysim's FedProto
   takes its eq. 8; `alignment: squared_norm` is eq. 6 as written (lambda d times stronger: on the quickstart
   Fashion-MNIST run it pulls the features so hard that the PM falls from 0.72 to 0.58 in two rounds, against
   0.95 with mse). A class without a global prototype is pulled to the client's own class mean at the received
   body (the authors' code and FL-bench, `missing_prototypes: local`; the paper is silent) or adds 0 (PFLlib,
   `skip`);
4. uploads its body (times n_i) and n_i, its head, its local prototypes at the trained body (eq. 7) with their class
   counts, and h_i and V_i / n_i.

The server averages the bodies weighted by n_i, and the local prototypes per class weighted by the clients' counts
of the class (eq. 8, `aggregation: samples`; `clients`: the unweighted mean of PFLlib), from this round's uploads.
For each selected client i it then solves eq. 10-11, the estimated test loss of the combination over the simplex,

    alpha_i = argmin_{alpha >= 0, sum_j alpha_j = 1}  sum_j alpha_j^2 V_j / n_j + ||sum_j alpha_j (h_i - h_j)||_F^2,

a quadratic alpha^T P alpha with P_jk = [j = k] V_j / n_j + <h_i - h_j, h_i - h_k>, over the round's selected
clients j, solved exactly (`simplex_qp`), and keeps g^_i = sum_j alpha_ij g_j for client i's next selection. The
solution is used as it is: the libraries' cvxpy solve zeroes weights below 1e-3 (the authors' code and FL-bench then
renormalize) and replaces P by its eigenvalues above 0.01 when it is not positive semidefinite (it always is, up to
rounding: here a ridge of 1e-12 of its scale where it is singular). `collaboration: false` keeps alpha_i = e_i
(each client its own head: the paper's ablation without classifier collaboration); with lambda = 0 as well it is
FedRep with one head epoch and n_i-weighted bodies (tests check they coincide).

The server reads each client's head, h_i and V_i / n_i by client (`reads_messages`); the bodies and prototypes it
takes from the sum. Uplink: body, n_i, head, the prototype and count of each class held, and (with collaboration)
h_i's rows of those classes and V_i / n_i; downlink: the body, the client's own combined head and the global
prototypes that exist. GM = the global body with the initial head. PM = the global body with the head the client
trained at its last step (its state); `combined` (extra model, `combined/acc`, ...) = the global body with the
combined head g^_i the server holds for it, the paper's personalized model (a client step cannot see it before its
next selection, so it reaches evaluation through `evaluation_context`).

ClassMeans answers class means but no second moment: E||z||^2 is measured by a LocalSGD request that moves nothing
(mask all False) on one batch of the whole training split, whose loss term (`FeatureEnergy`) is that mean with a
zero gradient: exact, with the split's training augmentation if the dataset has one. The local losses are this
module's terms; one client at a time (`stacks = False`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.interface import (
    ALGORITHMS,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import ClassMeans, LocalSGD, Vector, class_means, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

FEATURE_CHUNK = 2048
"""Samples whose features FeatureEnergy computes at once."""


@dataclass(frozen=True, eq=False)
class FeatureAlignment(Term):
    """eq. 6's local loss in place of f_i: CE(logits, y) + weight * (1/B) sum_b ||z_b - targets[y_b]||^2 over a
    batch of B samples with features z = f(x) (the head's input), a sample whose class has no target adding 0."""

    targets: np.ndarray
    """[classes, d]: the global prototypes (or a client's own class means where a class has none)."""
    has_target: np.ndarray
    """[classes] bool."""
    weight: float
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch
        from torch import nn

        if model.task != "classification":
            raise ValueError(f"FedPAC's loss needs a classifier; model {model.name!r} is trained for {model.task}")
        with model.dropout(seed):
            features, logits = model.features(point, x)
        total = nn.functional.cross_entropy(logits, y)
        if self.weight:
            # Copies: the arrays may be read-only views of Ray's object store, which torch must not alias.
            targets = torch.tensor(np.asarray(self.targets, np.float32), device=features.device)[y]
            kept = torch.tensor(np.asarray(self.has_target, bool), device=features.device)[y]
            gap = torch.where(kept[:, None], features - targets, torch.zeros_like(features))
            total = total + self.weight * gap.pow(2).sum(dim=1).mean()
        return total


@dataclass(frozen=True, eq=False)
class FeatureEnergy(Term):
    """Not a loss to descend: the batch's mean squared feature norm (1/B) sum_b ||f(x_b)||^2 (float64, dropout off),
    with a zero gradient, so that a LocalSGD request that moves nothing reports it as its mean loss."""

    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss_and_grad(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> tuple[float, torch.Tensor]:
        import torch

        total = 0.0
        with torch.no_grad():
            for start in range(0, len(x), FEATURE_CHUNK):
                features, _ = model.features(point, x[start : start + FEATURE_CHUNK])
                total += float(features.double().pow(2).sum())
        return total / max(len(x), 1), torch.zeros_like(point)


def simplex_qp(p: np.ndarray, tolerance: float = 1e-12) -> np.ndarray:
    """argmin alpha^T P alpha over the simplex {alpha >= 0, sum alpha = 1} for a symmetric positive definite P: the
    KKT conditions (P alpha = lambda 1 + mu, mu >= 0 and 0 on the support, lambda = alpha^T P alpha) make
    beta = alpha / lambda the solution of min_{beta >= 0} beta^T P beta / 2 - 1^T beta, found by the active-set method
    of Lawson and Hanson in its Gram form (Bro and de Jong's FNNLS), exact in finitely many steps; alpha = beta /
    sum beta. P is first scaled to a unit mean diagonal (alpha does not change)."""
    p = np.asarray(p, np.float64)
    p = p / max(float(np.trace(p)) / len(p), np.finfo(np.float64).tiny)
    k = len(p)
    ones = np.ones(k)
    beta = np.zeros(k)
    passive = np.zeros(k, dtype=bool)

    def solve(support: np.ndarray) -> np.ndarray:
        s = np.zeros(k)
        s[support] = np.linalg.solve(p[np.ix_(support, support)], ones[support])
        return s

    for _ in range(10 * k + 10):
        gradient = ones - p @ beta  # minus the gradient: positive where raising beta_j lowers the objective
        free = ~passive & (gradient > tolerance)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        s = solve(passive)
        while (s[passive] <= tolerance).any():  # step back to the last feasible point on the way to s
            blocked = passive & (s <= tolerance)
            gap = beta[blocked] - s[blocked]
            step = float(np.min(np.where(gap > 0, beta[blocked] / np.where(gap > 0, gap, 1.0), 0.0)))
            beta = beta + step * (s - beta)
            passive &= beta > tolerance
            beta[~passive] = 0.0
            s = solve(passive)
        beta = s
    return beta / beta.sum()


def combination_weights(stats: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """[k, k]: row i the weights alpha_i of eq. 10-11 for client i over the k clients whose prior-weighted
    prototypes h_j are the rows of `stats` ([k, classes * d]) and whose V_j / n_j are `variances`. P_i is built from
    the Gram matrix K = h h^T, <h_i - h_j, h_i - h_l> = K_ii - K_ij - K_il + K_jl."""
    h = np.asarray(stats, np.float64)
    gram = h @ h.T
    weights = np.empty_like(gram)
    for i in range(len(h)):
        p = gram[i, i] - gram[i][:, None] - gram[i][None, :] + gram + np.diag(np.maximum(variances, 0.0))
        p = (p + p.T) / 2
        try:
            np.linalg.cholesky(p)
        except np.linalg.LinAlgError:  # singular: no variance and coinciding statistics
            p = p + 1e-12 * max(float(np.trace(p)) / len(p), 1e-30) * np.eye(len(p))
        weights[i] = simplex_qp(p)
    return weights


class FedPacSettings(SGDSettings):
    name: Literal["fedpac"] = "fedpac"
    lam: float = Field(
        1.0,
        ge=0,
        alias="lambda",
        description="lambda: weight of the feature alignment to the global prototypes (eq. 6)",
    )
    epochs: int = Field(1, ge=1, description="E: epochs on the body, the head frozen")
    head_epochs: int = Field(1, ge=0, description="epochs on the head, the body frozen, before the body's (1)")
    head_lr: float | None = Field(
        None, gt=0, description="rate of the head's epochs; None: lr (the authors' code: 0.1, FL-bench classifier_lr)"
    )
    alignment: Literal["mse", "squared_norm"] = Field(
        "mse",
        description="distance of the alignment: ||z - c_y||^2 / d, torch's mse_loss, for which the authors' code sets "
        "lambda = 1 (PFLlib, FL-bench alike), or ||z - c_y||^2 as eq. 6 writes it",
    )
    missing_prototypes: Literal["local", "skip"] = Field(
        "local",
        description="a class without a global prototype: aligned to the client's own class mean at the received "
        "body (the authors' code, FL-bench) or not aligned (PFLlib)",
    )
    aggregation: Literal["samples", "clients"] = Field(
        "samples",
        description="global prototype of a class: the local ones weighted by their class counts (eq. 8) or their "
        "unweighted mean (PFLlib)",
    )
    collaboration: bool = Field(
        True,
        description="combine the heads by the weights of eq. 10-11; false: each client keeps its own head (the "
        "paper's ablation without classifier collaboration)",
    )
    decayed_rates: ClassVar[tuple[str, ...]] = ("lr", "head_lr")


@dataclass
class FedPacClientState:
    client: int
    """The client's id: its row of the server's combined heads (`combined`)."""
    head: Vector
    """The head the client trained at its last step (the initial head before)."""


@dataclass
class FedPacBroadcast:
    body: Vector
    """The global body theta."""
    heads: np.ndarray
    """[m, head size]: each client's combined head g^_i (a client reads its own row)."""
    prototypes: np.ndarray
    """[classes, d] float32: the global prototypes c (zero for a class without one)."""
    present: np.ndarray
    """[classes] bool: the classes that have a global prototype."""


@dataclass
class FedPacServerState:
    body: Vector
    template: Vector
    """The initial full model: the GM's head."""
    heads: np.ndarray
    prototypes: np.ndarray
    present: np.ndarray


@dataclass
class FedPacUpload(Upload):
    """What the runtime sums (the body times n_i and n_i; the prototypes times their weights and the weights) and
    what the server reads by client (`message`: the head, h_i, V_i / n_i and n_i). It names no message field:
    Byzantine attacks and robust rules are refused."""

    weighted: Vector
    """n_i theta_i (float64)."""
    weight: float
    """n_i."""
    prototypes: np.ndarray
    """[classes * d] float64: each local prototype times its weight (count, or 1 for a class held), flattened (the
    runtime gives a per-client upload's fields of more than one axis back with an extra leading axis)."""
    prototype_weight: np.ndarray
    """[classes] float64."""
    head: Vector
    """g_i after local training."""
    stats: np.ndarray
    """[classes * d + 1]: h_i flattened, then V_i / n_i (zeros without collaboration)."""


@ALGORITHMS.register()
class FedPac(
    ServerReadsEachMessage[FedPacSettings, FedPacClientState, FedPacServerState, FedPacBroadcast, FedPacUpload]
):
    """A body averaged and aligned to global prototypes; heads combined per client by a quadratic program."""

    name = "fedpac"
    Settings = FedPacSettings
    Upload = FedPacUpload

    def __init__(self, settings: FedPacSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.head = params.head_mask()
        self.body = ~self.head
        self.classes, self.feature_dim = params.head_outputs, params.feature_dim

    def assemble(self, head: Vector, body: Vector) -> Vector:
        full = np.empty(self.params.size, np.float32)
        full[self.head] = head
        full[self.body] = body
        return full

    def init_server(self, init_params: Vector, num_clients: int) -> FedPacServerState:
        heads = np.tile(init_params[self.head], (num_clients, 1)).astype(np.float32)
        prototypes = np.zeros((self.classes, self.feature_dim), np.float32)
        return FedPacServerState(
            init_params[self.body].copy(), init_params.copy(), heads, prototypes, np.zeros(self.classes, dtype=bool)
        )

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedPacClientState:
        return FedPacClientState(client.id, init_params[self.head].copy())

    def broadcast(self, server: FedPacServerState) -> FedPacBroadcast:
        return FedPacBroadcast(server.body, server.heads, server.prototypes, server.present)

    def client_step(self, client: ClientInfo, state: FedPacClientState, received: FedPacBroadcast) -> ClientStep:
        s = self.settings
        start = self.assemble(received.heads[client.id], received.body)
        n = float(client.num_train)
        stats = np.zeros(self.classes * self.feature_dim + 1)
        metrics: dict[str, float] = {}
        targets, has_target = received.prototypes, received.present
        align = s.lam > 0 and bool(received.present.any())
        fallback = align and s.missing_prototypes == "local" and not received.present.all()
        if n and (s.collaboration or fallback):  # step 1, at the received body
            at_start = yield from class_means(ClassMeans(start))
            means = np.zeros((self.classes, self.feature_dim)) if at_start.means is None else at_start.means
            if fallback:
                targets = np.where(received.present[:, None], received.prototypes, means).astype(np.float32)
                has_target = received.present | (at_start.counts > 0)
            if s.collaboration:
                energy = yield from train(self.feature_energy(start, client.num_train))
                h = (at_start.counts / n)[:, None] * np.asarray(means, np.float64)
                variance = max(float(energy.mean_loss) - float((h**2).sum()), 0.0)  # V_i
                stats = np.append(h.ravel(), variance / n)
                metrics["feature_variance"] = variance
        params = start
        if s.head_epochs:  # step 2
            head_sgd = s.local_sgd(start, s.head_epochs, mask=self.head)
            head = yield from train(dataclasses.replace(head_sgd, lr=s.head_lr or s.lr))
            params, metrics["head_train_loss"] = np.asarray(head.params, np.float32), float(head.mean_loss)
        weight = s.lam if s.alignment == "squared_norm" else s.lam / self.feature_dim
        terms = (FeatureAlignment(targets, has_target, weight),) if align else ()
        body = yield from train(s.local_sgd(params, terms=terms, mask=self.body))  # step 3, eq. 6
        theta = np.asarray(body.params, np.float32)
        prototypes = np.zeros((self.classes, self.feature_dim))
        counts = np.zeros(self.classes)
        if n:  # eq. 7: the local prototypes at the trained body
            local = yield from class_means(ClassMeans(theta))
            counts = local.counts
            prototypes = prototypes if local.means is None else local.means.astype(np.float64)
        held = counts > 0
        proto_weight = counts if s.aggregation == "samples" else held.astype(np.float64)
        upload = FedPacUpload(
            n * theta[self.body].astype(np.float64),
            n,
            (proto_weight[:, None] * prototypes).ravel(),
            proto_weight,
            theta[self.head].copy(),
            stats,
        )
        metrics = {"train_loss": float(body.mean_loss), "classes_held": float(held.sum()), **metrics}
        return ClientUpdate(FedPacClientState(state.client, theta[self.head].copy()), upload, metrics)

    @staticmethod
    def feature_energy(start: Vector, num_train: int) -> LocalSGD:
        """A request that moves nothing and reports (1/n_i) sum ||f(x)||^2 over the training split as its loss."""
        return LocalSGD(
            start,
            epochs=1,
            lr=1.0,
            batch_size=max(num_train, 1),
            terms=(FeatureEnergy(),),
            mask=np.zeros_like(start, bool),
        )

    def message(self, update: ClientUpdate) -> Vector:
        """The head, h_i, V_i / n_i and n_i, which the server reads by client."""
        upload = update.upload
        return np.concatenate([upload.head, upload.stats, [upload.weight]])

    def server_step_by_client(
        self, server: FedPacServerState, total: FedPacUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[FedPacServerState, dict[str, float]]:
        """The n_i-weighted body, the prototypes of eq. 8, and each selected client's combined head (eq. 10-11)."""
        body = (total.weighted / total.weight).astype(np.float32) if total.weight > 0 else server.body
        present = total.prototype_weight > 0
        prototypes = np.zeros_like(server.prototypes)
        weighted = total.prototypes.reshape(self.classes, self.feature_dim)
        prototypes[present] = (weighted[present] / total.prototype_weight[present, None]).astype(np.float32)
        ids = sorted(messages)
        rows = np.stack([np.asarray(messages[c], np.float64) for c in ids])
        size = int(self.head.sum())
        own, stats, variances, sizes = rows[:, :size], rows[:, size:-2], rows[:, -2], rows[:, -1]
        weights = np.eye(len(ids))
        usable = sizes > 0  # a client without data has no statistics: it keeps its own head
        if self.settings.collaboration and usable.any():
            weights[np.ix_(usable, usable)] = combination_weights(stats[usable], variances[usable])
        heads = server.heads.copy()
        heads[ids] = (weights @ own).astype(np.float32)
        metrics = {
            **server_metrics(body, server.body),
            "prototype_classes": float(present.sum()),
            "self_weight": float(np.mean(np.diag(weights))),
            "partners": float(np.mean((weights > 1e-3).sum(axis=1))),
        }
        return FedPacServerState(body, server.template, heads, prototypes, present), metrics

    def global_model(self, server: FedPacServerState) -> Vector:
        return self.assemble(server.template[self.head], server.body)

    def evaluated_model(self, state: FedPacClientState, global_params: Vector) -> Vector:
        """The current global body with the head the client trained at its last step."""
        return self.assemble(state.head, global_params[self.body])

    def evaluation_context(self, server: FedPacServerState) -> np.ndarray:
        """The combined heads g^_i (`extra_models`)."""
        return server.heads

    def extra_models(
        self, state: FedPacClientState, global_params: Vector, context: np.ndarray | None = None
    ) -> dict[str, Vector]:
        """`combined`: the current global body with the combined head the server holds for the client."""
        if context is None or state.client >= len(context):
            return {}
        return {"combined": self.assemble(context[state.client], global_params[self.body])}

    def uplink_bytes(self, upload: FedPacUpload) -> int:
        """Body, n_i, head, a prototype and a count per class held, and with collaboration h_i's rows of those
        classes and V_i / n_i, as float32."""
        held = int((upload.prototype_weight > 0).sum())
        stats = held * self.feature_dim + 1 if self.settings.collaboration else 0
        return 4 * (upload.weighted.size + 1 + upload.head.size + held * (self.feature_dim + 1) + stats)

    def downlink_bytes(self, broadcast: FedPacBroadcast) -> int:
        """The body, the client's own combined head and the global prototypes that exist, as float32."""
        return 4 * (broadcast.body.size + broadcast.heads.shape[1] + int(broadcast.present.sum()) * self.feature_dim)
