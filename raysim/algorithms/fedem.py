"""FedEM: federated EM over a mixture of M shared component models (Marfoq, Neglia, Bellet, Kameni and Vidal,
"Federated Multi-Task Learning under a Mixture of Distributions", NeurIPS 2021, arXiv:2108.10252; the authors' code
is github:omarfoq/FedEM).

Every client's distribution is taken to be a mixture of M underlying ones, D_i = sum_m pi_im D~_m, the m-th
component modelled by a network theta_m that all clients share. The server holds Theta = (theta_1, ..., theta_M)
and sends all M models to the selected clients; client i keeps only its mixture weights pi_i (uniform at first).
A selected client, from the received Theta, runs one EM step on its training samples s = (x, y):

    (E)   E-step:  q_s(m) = pi_im exp(-l(theta_m; s)) / sum_k pi_ik exp(-l(theta_k; s))
    (M1)  M-step:  pi_im <- (1/n_i) sum_s q_s(m)
    (M2)  M-step:  theta_m <- local SGD from the received theta_m on (1/n_i) sum_s q_s(m) l(theta_m; s)

(the authors' `MixtureClient`: q from the received components and the old pi, for the whole round) and uploads
its M models; the server averages each component over the selected clients weighted by n_i (FedAvg per component,
`aggregation: uniform` for equal weights). (E), (M1) and (M2) are this module's labels: the paper's text was not at
hand for its equation numbers. The client's personalized model (PM) is the mixture of the components' predictions,
p_i(y|x) = sum_m pi_im p(y|x; theta_m), the paper's predictor: not one network's parameters, so its vector is
[pi_i, theta_1, ..., theta_M] of the personalized network raysim.models.composed.ComponentMixture (its outputs the
log of the mixture's class probabilities: a classifier's), with the current components (`evaluation_context`). The
GM is the component that the last round's clients weight most (sum_i n_i pi_im, M numbers riding with the upload,
not counted as sent). A held-out client deploys the GM (the paper's unseen clients fit their pi by EM on the
components, which `adapt`, given the GM alone, cannot reach).

How the steps run on raysim's requests, which give no per-sample losses: the E-step's q is computed batch by batch
inside loss terms from the received components and the old pi (`Responsibilities`, `WeightedComponents`), which is
the authors' per-sample q, since q_s depends only on s; the new pi is the result of one pass of SGD of rate 1 from 0
on the linear objective -<v, sum_s q_s> / n_i (`Responsibilities`), which lands exactly on (1/n_i) sum_s q_s; and the
M components train together as one vector Theta on sum_m (1/B) sum_{s in batch} q_s(m) l(theta_m; s), separable
over m, so that each theta_m takes the SGD steps of its own weighted loss (the authors' `loss_vec @ weights / B`) on
the same batches (theirs shuffle anew for each component). With M = 1 every q is 1, no E-step runs, and FedEM is
FedAvg.

Initialization: theta_1 is the run's initial model; theta_m (m > 1) permutes the entries of each of its tensors at
random (`init_seed`), a fresh draw of an i.i.d. initialization (the authors seed each learner with seed + m); equal
components would get equal q and never separate. Defaults M = 3, lr 0.03, batch 128, one epoch: the authors'
CIFAR-10 and FEMNIST runs (EMNIST 0.05, CIFAR-100 0.01); their multi-step decay (0.1 at T/2 and 3T/4) has no
counterpart here (`lr_decay` is geometric). Departures, for raysim's protocol: the server averages over the selected
clients (the authors' `CentralizedAggregator` averages over all clients, an unselected one holding the previous
global components: the same with full participation, their experiments' setting); q is computed on the batches as
training draws them (augmented, where the data set augments), the authors' on the stored samples. Models with
running statistics (BatchNorm) are refused: the mixture weights and the M components are vectors of other sizes
than the network's, whose statistics the trainer writes. Uplink and downlink: M models; the upload names no message
(it holds M of them), so Byzantine attacks and robust rules are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import upload_weight
from raysim.algorithms.interface import (
    ALGORITHMS,
    NOT_SENT,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    Upload,
    server_metrics,
)
from raysim.algorithms.requests import LocalSGD, Vector, train
from raysim.algorithms.settings import SGDSettings
from raysim.algorithms.terms import Term
from raysim.errors import ConfigError
from raysim.models.composed import ComponentMixture
from raysim.models.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import FlatModel

SMALLEST_WEIGHT = 1e-30
"""The floor of pi_im under its logarithm: a component whose weight underflowed to 0 keeps q_s(m) = 0."""


def component_losses(model: FlatModel, components: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """l(theta_m; s) [M, B]: each component's loss on each sample of the batch (a sample of several outputs: their
    mean), dropout off."""
    import torch

    with torch.no_grad():
        return torch.stack([sample_losses(model, theta, x, y) for theta in components])


def sample_losses(model: FlatModel, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The network's loss at `theta` on each sample of the batch, [B] (the task's loss, as FlatModel.sample_losses)."""
    return model.sample_losses(model.forward(theta, x), y).reshape(len(x), -1).mean(dim=1)


def responsibilities(log_weights: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """q_s(m) = pi_m exp(-l_m(s)) / sum_k pi_k exp(-l_k(s)) [M, B] (E), from log pi [M] and the losses [M, B]."""
    import torch

    return torch.softmax(log_weights[:, None] - losses, dim=0)


@dataclass(frozen=True, eq=False)
class Responsibilities(Term):
    """The E-step and pi's M-step as a loss term in place of f_i, on a vector v of the M mixture weights:

        -<v, sum_{s in batch} q_s> / n_i,   q_s from the received `components` and the old pi (E)

    Its gradient does not depend on v, so one pass of SGD of rate 1 (no momentum, no weight decay) from v = 0 ends
    at (1/n_i) sum_s q_s, the new pi (M1), whatever the batches."""

    components: np.ndarray
    """[M, n]: the received components, rows of the network's layout."""
    log_weights: np.ndarray
    """[M]: log pi_i before this round's M-step."""
    samples: int
    """n_i: the client's training samples (one pass covers each once)."""
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss_and_grad(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> tuple[float, torch.Tensor]:
        q = responsibilities(self.tensor("log_weights"), component_losses(model, self.tensor("components"), x, y))
        grad = -q.sum(dim=1) / self.samples
        return float(point.detach() @ grad), grad


@dataclass(frozen=True, eq=False)
class WeightedComponents(Term):
    """The components' M-step (M2) as a loss term in place of f_i, on the vector Theta = (theta_1, ..., theta_M):

        sum_m (1/B) sum_{s in batch} q_s(m) l(theta_m; s),   q_s from the received `components` and the old pi

    (q fixed for the request, (E): the authors' per-sample weights); separable over m."""

    components: np.ndarray
    """[M, n]: the received components, from which q is computed (the point trained starts there too)."""
    log_weights: np.ndarray
    """[M]: log pi_i before this round's M-step."""
    replaces_loss: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def loss(
        self, model: FlatModel, point: torch.Tensor, x: torch.Tensor, y: torch.Tensor, seed: int | None
    ) -> torch.Tensor:
        import torch

        received = self.tensor("components")
        q = responsibilities(self.tensor("log_weights"), component_losses(model, received, x, y))
        thetas = point.reshape(received.shape)
        with model.dropout(seed):
            losses = torch.stack([sample_losses(model, theta, x, y) for theta in thetas])
        return (q * losses).sum(dim=0).mean()


class FedEMSettings(SGDSettings):
    name: Literal["fedem"] = "fedem"
    components: int = Field(3, ge=1, description="M: the shared component models (3 in the paper's experiments)")
    lr: float = Field(0.03, gt=0, description="eta: local learning rate (the authors' CIFAR-10 and FEMNIST runs)")
    batch_size: int = Field(128, ge=1, description="local batch size (128 in the authors' runs)")
    aggregation: Literal["samples", "uniform"] = Field(
        "samples", description="weights of each component's average: training-set sizes n_i (the paper) or equal"
    )
    init_seed: int = Field(
        0, ge=0, description="seed of the permutations that make components 2..M's initial models from the run's"
    )


@dataclass
class FedEMClientState:
    weights: Vector
    """pi_i [M] (float64): the client's mixture weights after its last M-step (uniform before it first trains)."""


@dataclass
class FedEMServerState:
    components: Vector
    """[M, n] float32: Theta, one row per component in the network's layout."""
    mass: Vector
    """[M] float64: sum_i n_i pi_im over the last round's clients (which component the GM is)."""


@dataclass
class FedEMUpload(Upload):
    """A client's weight times its M trained components, its weight, and its weight times its new pi (not sent: it
    only picks the GM). It names no message field."""

    weighted: Vector
    weight: float
    mass: Vector = field(metadata=NOT_SENT)


def initial_components(init_params: Vector, params: ParamSpec, count: int, seed: int) -> np.ndarray:
    """[count, n]: the initial model, then count - 1 models each of whose tensors is a random permutation of the
    initial model's (a constant tensor, e.g. a norm's scale, stays as it is)."""
    generator = np.random.default_rng(seed)
    rows = [np.asarray(init_params, np.float32)]
    for _ in range(count - 1):
        row = rows[0].copy()
        for name in params.names:
            part = params.slice(name)
            row[part] = generator.permutation(rows[0][part])
        rows.append(row)
    return np.stack(rows)


@ALGORITHMS.register()
class FedEM(Algorithm[FedEMSettings, FedEMClientState, FedEMServerState, Vector, FedEMUpload]):
    """Federated EM over M shared components; each client's PM is its mixture of their predictions."""

    name = "fedem"
    Settings = FedEMSettings
    Upload = FedEMUpload

    def __init__(self, settings: FedEMSettings, params: ParamSpec):
        super().__init__(settings, params)
        if params.statistics:
            raise ConfigError(
                f"model.name: {params.model!r} has running statistics (BatchNorm), which FedEM cannot train "
                "(it trains its M components and mixture weights as vectors of other sizes than the network's); choose"
                " a model without BatchNorm"
            )
        self.mixture = ComponentMixture(settings.components)

    def init_server(self, init_params: Vector, num_clients: int) -> FedEMServerState:
        s = self.settings
        components = initial_components(init_params, self.params, s.components, s.init_seed)
        return FedEMServerState(components, np.ones(s.components))

    def init_client(self, client: ClientInfo, init_params: Vector) -> FedEMClientState:
        return FedEMClientState(np.full(self.settings.components, 1.0 / self.settings.components))

    def broadcast(self, server: FedEMServerState) -> Vector:
        return server.components

    def client_step(self, client: ClientInfo, state: FedEMClientState, received: Vector) -> ClientStep:
        """One EM step from the received components: the new pi (E, M1), then the components' weighted local SGD
        (M2), q from the old pi in both."""
        s = self.settings
        count = s.components
        components = np.asarray(received, np.float32)
        log_weights = np.log(np.maximum(state.weights, SMALLEST_WEIGHT)).astype(np.float32)
        weights = state.weights
        if count > 1 and client.num_train > 0:
            e_step = Responsibilities(components, log_weights, client.num_train)
            shares = yield from train(LocalSGD(np.zeros(count, np.float32), 1, 1.0, s.batch_size, terms=(e_step,)))
            means = np.maximum(np.asarray(shares.params, np.float64), 0.0)
            weights = means / means.sum()
        loss = WeightedComponents(components, log_weights)
        result = yield from train(s.local_sgd(components.reshape(-1), terms=(loss,)))
        trained = np.asarray(result.params, np.float32).reshape(components.shape)
        weight = float(upload_weight(client.num_train, s.aggregation))
        metrics = {
            "train_loss": result.mean_loss,
            "weight_max": float(weights.max()),
            "weight_entropy": float(-(weights * np.log(np.maximum(weights, SMALLEST_WEIGHT))).sum()),
        }
        upload = FedEMUpload(weight * trained.astype(np.float64).reshape(-1), weight, weight * weights)
        return ClientUpdate(FedEMClientState(weights), upload, metrics)

    def server_step(self, server: FedEMServerState, total: FedEMUpload, num_selected: int):
        """Each component: sum_i a_i theta_im / sum_i a_i over the selected clients (FedAvg per component)."""
        if not total.weight:
            return server, server_metrics(self.global_model(server), self.global_model(server))
        components = (total.weighted / total.weight).astype(np.float32).reshape(server.components.shape)
        updated = FedEMServerState(components, np.asarray(total.mass, np.float64))
        metrics = {
            **server_metrics(components.reshape(-1), server.components.reshape(-1)),
            "dominant_share": float(updated.mass.max() / max(updated.mass.sum(), SMALLEST_WEIGHT)),
        }
        return updated, metrics

    def global_model(self, server: FedEMServerState) -> Vector:
        """The component that the last round's clients weight most (sum_i n_i pi_im)."""
        return server.components[int(np.argmax(server.mass))]

    def evaluation_context(self, server: FedEMServerState) -> Vector:
        """The components, which every client's PM mixes."""
        return server.components

    def personalized_network(self) -> ComponentMixture:
        return self.mixture

    def composed_model(self, state: FedEMClientState, global_params: Vector, context: Any = None) -> Vector:
        """PM: [pi_i, theta_1, ..., theta_M] (ComponentMixture's layout) with the current components."""
        if context is None:
            raise ValueError("FedEM's personalized model needs the server's components (its evaluation context)")
        return np.concatenate([np.asarray(state.weights, np.float32), np.asarray(context, np.float32).reshape(-1)])
