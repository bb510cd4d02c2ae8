"""pFedHN: a server-side hypernetwork generates each client's model (Shamsian, Navon, Fetaya and Chechik,
"Personalized Federated Learning using Hypernetworks", ICML 2021, arXiv:2103.04628, Algorithm 1).

The server holds a hypernetwork h(v_i; phi): a learned embedding v_i per client (dimension `embedding_dim`) through
an MLP whose output is the client's whole model theta_i = h(v_i; phi), so that the objective is
min over phi, v_1..v_m of sum_i L_i(h(v_i; phi)). A selected client receives its theta_i, trains it locally to
theta~_i (`local_steps` = K SGD steps on random batches: K = 50 at lr 5e-3 in the authors' code) and sends
dtheta_i = theta~_i - theta_i. The server then steps phi and v_i along the chain rule with dtheta_i in place of the
loss gradient (eq. 4): the gradient of phi is the vector-Jacobian product (d theta_i / d phi)^T (theta_i - theta~_i),
of v_i the same through the MLP (a torch autograd VJP in the server step, as the authors' code
`torch.autograd.grad(theta_i, phi, grad_outputs=theta_i - theta~_i)`: the descent direction -dtheta_i).

The MLP is the authors' (AvivSham/pFedHN, CNNHyper; the paper's fully connected network with three hidden layers
and a linear head per weight tensor): Linear(e, hidden), then `hidden_layers` times ReLU and Linear(hidden, hidden),
then the output layer, no ReLU before it. The authors give every layer of the target network its own output head
Linear(hidden, size of the layer); here one Linear(hidden, n) produces the flat parameter vector,
which is those heads stacked row-wise: the same function, the same parameters and (PyTorch's default init depends
only on the fan-in, `hidden` for every head) the same initial distribution. The hypernetwork starts as the authors':
every layer U(-1/sqrt(fan_in), 1/sqrt(fan_in)), embeddings N(0, 1), drawn from a generator seeded by the model's
initial parameters (so by the experiment's seed); the network's own initial model theta_0 is not used by it.

Defaults where the paper is silent are the authors' code's (trainer.py): embedding_dim int(1 + m/4) (13 for 50
clients), hidden 100, 3 hidden layers; the server's optimizer SGD with lr 1e-2, momentum 0.9, weight decay 1e-3
(on the embeddings too, which have their own rate `embedding_lr`, default the same), the hypernetwork's gradient
clipped to norm 50 (torch's clip_grad_norm_); `server_optimizer: adam` is the authors' other choice (torch.optim.Adam
with `server_weight_decay` as its L2 term: set it to 0 for theirs). The inner SGD is the code's: batch 64,
momentum 0.9, weight decay 5e-5 (the code also clips the inner gradients to norm 50; raysim's local SGD does not).

Algorithm 1 visits one client per step; a raysim round trains several from the same phi. `server_update:
sequential` (default) takes one optimizer step per client message, in client-id order, each with the VJP at the
phi that generated that client's theta_i (the round's: the one the authors' code differentiates through): with one
client per round it is Algorithm 1, and as in the paper the hypernetwork makes one step per local training.
`server_update: mean` takes one step on the mean of the round's VJPs instead (plain SGD: the sequential steps with
lr / k). FL-bench's pFedHN trains the round's clients one after another, each from the phi its predecessor left,
which a round of parallel clients cannot do.

Models: each client receives its own theta_i (the broadcast holds the m generated models; counted as one model
down) and sends one model-sized dtheta_i (one model up); the server reads each client's message (`reads_messages`),
so Byzantine attacks and robust rules, which replace a mean of messages, are refused. The PM is the theta_i the
client was sent at its last round (the initial model theta_0 before its first), which the hosts can score from the
client's state; `score_current` also scores the model the current hypernetwork generates for it (extra model
`current`: the authors' evaluation, every client's h(v_i; phi) after the last step). The GM is the mean of the m
generated models, (1/m) sum_i h(v_i; phi), i.e. the output layer at the mean of the clients' features. A held-out
client deploys the GM (the paper's new clients learn an embedding with phi frozen; not implemented).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from raysim.algorithms.interface import (
    ALGORITHMS,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerReadsEachMessage,
    Upload,
    payload_bytes,
    server_metrics,
)
from raysim.algorithms.requests import Vector, train
from raysim.algorithms.settings import SGDSettings

ADAM_BETAS = (0.9, 0.999)
"""torch.optim.Adam's defaults, as the authors' code leaves them."""
ADAM_EPS = 1e-8
CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s: the gradient is scaled by max_norm / (norm + 1e-6) when that is below 1."""


class PfedhnSettings(SGDSettings):
    name: Literal["pfedhn"] = "pfedhn"
    lr: float = Field(5e-3, gt=0, description="eta: the clients' inner learning rate (the authors' code: 5e-3)")
    batch_size: int = Field(64, ge=1, description="inner mini-batch size (the authors' code: 64)")
    momentum: float = Field(0.9, ge=0, lt=1, description="inner SGD momentum (the authors' code: 0.9)")
    weight_decay: float = Field(5e-5, ge=0, description="inner weight decay (the authors' code: 5e-5)")
    local_steps: int | None = Field(
        50,
        ge=1,
        description="K: inner SGD steps per round, each on one random batch (the authors' code: 50); None: "
        "`epochs` passes",
    )
    embedding_dim: int | None = Field(
        None, ge=1, description="dimension of the client embeddings v_i; None: int(1 + m/4), the authors' code"
    )
    hidden_dim: int = Field(100, ge=1, description="width of the hypernetwork's hidden layers (the authors' code: 100)")
    hidden_layers: int = Field(
        3, ge=0, description="ReLU + Linear(hidden, hidden) blocks after the first layer (the authors' n_hidden: 3)"
    )
    server_optimizer: Literal["sgd", "adam"] = Field("sgd", description="the hypernetwork's optimizer")
    server_lr: float = Field(1e-2, ge=0, description="the hypernetwork's learning rate (the authors' 1e-2)")
    embedding_lr: float | None = Field(None, ge=0, description="the embeddings' learning rate; None: server_lr")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum of the hypernetwork (the code's 0.9)")
    server_weight_decay: float = Field(1e-3, ge=0, description="L2 term of the hypernetwork's steps (the code's 1e-3)")
    grad_clip: float | None = Field(
        50.0, gt=0, description="clip each hypernetwork gradient to this norm (the authors' code: 50); None: never"
    )
    server_update: Literal["sequential", "mean"] = Field(
        "sequential",
        description="sequential: one hypernetwork step per client message (Algorithm 1); mean: one step on the "
        "mean of the round's VJPs",
    )
    score_current: bool = Field(
        False,
        description="also score each client's model as the current hypernetwork generates it (extra model "
        "`current`, the authors' evaluation); the PM is the model it was sent at its last round",
    )

    @model_validator(mode="after")
    def _random_epochs_need_passes(self) -> PfedhnSettings:
        if self.random_epochs and self.local_steps is not None:
            raise ValueError("algorithm.random_epochs draws passes: set algorithm.local_steps to null to use it")
        return self


@dataclass(frozen=True)
class Hypernetwork:
    """The layout of the hypernetwork's flat parameter vector phi: the embeddings [m, e], then each Linear layer's
    weight [out, in] and bias [out] (torch's layout), first layer to output layer. Its functions take numpy arrays
    or torch tensors alike."""

    clients: int
    embedding_dim: int
    hidden_dim: int
    hidden_layers: int
    outputs: int

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(out, in) of each Linear layer."""
        widths = [self.embedding_dim] + [self.hidden_dim] * (self.hidden_layers + 1) + [self.outputs]
        return list(zip(widths[1:], widths[:-1], strict=True))

    @property
    def embedding_size(self) -> int:
        return self.clients * self.embedding_dim

    @property
    def size(self) -> int:
        return self.embedding_size + sum(out * fan_in + out for out, fan_in in self.shapes)

    def split(self, phi: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        """The embeddings [m, e] and each layer's (weight, bias), as views of phi."""
        embeddings = phi[: self.embedding_size].reshape(self.clients, self.embedding_dim)
        layers, offset = [], self.embedding_size
        for out, fan_in in self.shapes:
            weight = phi[offset : offset + out * fan_in].reshape(out, fan_in)
            offset += out * fan_in
            layers.append((weight, phi[offset : offset + out]))
            offset += out
        return embeddings, layers

    def features(self, phi: Any, clients: Sequence[int]) -> Any:
        """The MLP's output for the clients' embeddings [k, hidden]: the output layer's input."""
        embeddings, layers = self.split(phi)
        x = embeddings[list(clients)]
        for index, (weight, bias) in enumerate(layers[:-1]):
            if index > 0:
                x = x.clip(min=0)
            x = x @ weight.T + bias
        return x

    def generate(self, phi: Any, clients: Sequence[int]) -> Any:
        """theta_i = h(v_i; phi) for each of `clients` [k, n]."""
        weight, bias = self.split(phi)[1][-1]
        return self.features(phi, clients) @ weight.T + bias

    def initial(self, rng: np.random.Generator) -> Vector:
        """The authors' (PyTorch's default) initialization: embeddings N(0, 1) (nn.Embedding), every Linear layer's
        weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear)."""
        parts = [rng.standard_normal(self.embedding_size)]
        for out, fan_in in self.shapes:
            bound = 1.0 / np.sqrt(fan_in)
            parts += [rng.uniform(-bound, bound, out * fan_in), rng.uniform(-bound, bound, out)]
        return np.concatenate(parts).astype(np.float32)


@dataclass
class PfedhnBroadcast:
    models: Vector
    """[m, n]: theta_i = h(v_i; phi) of every client; client i receives row i."""


@dataclass
class PfedhnUpload(Upload):
    """dtheta_i = theta~_i - theta_i. It names no message field: the server reads it by client (`message`), and
    Byzantine attacks and robust rules, which replace the mean of messages, are refused."""

    update: Vector


@dataclass
class PfedhnClientState:
    personal: Vector
    """The model the hypernetwork generated for it at its last round (the initial model before)."""
    client: int
    """Its id: its row of the current generated models (`score_current`)."""


@dataclass
class PfedhnServerState:
    params: Vector
    """phi with the embeddings, flat (Hypernetwork's layout)."""
    first: Vector
    """SGD's momentum buffer (zeros before the first step, and without momentum), or Adam's first moment."""
    second: Vector
    """Adam's second moment (empty with SGD)."""
    num_clients: int
    steps: int = 0
    """Optimizer steps taken (Adam's bias correction)."""


@ALGORITHMS.register()
class Pfedhn(
    ServerReadsEachMessage[PfedhnSettings, PfedhnClientState, PfedhnServerState, PfedhnBroadcast, PfedhnUpload]
):
    """A hypernetwork on the server generates every client's model from its embedding; the clients' local updates
    train it through the chain rule."""

    name = "pfedhn"
    Settings = PfedhnSettings
    Upload = PfedhnUpload

    def network(self, num_clients: int) -> Hypernetwork:
        s = self.settings
        embedding_dim = s.embedding_dim if s.embedding_dim is not None else int(1 + num_clients / 4)
        return Hypernetwork(num_clients, embedding_dim, s.hidden_dim, s.hidden_layers, self.params.size)

    def init_server(self, init_params: Vector, num_clients: int) -> PfedhnServerState:
        network = self.network(num_clients)
        seed = zlib.crc32(np.ascontiguousarray(init_params).tobytes())
        params = network.initial(np.random.default_rng(seed))
        second = np.zeros(network.size if self.settings.server_optimizer == "adam" else 0, np.float32)
        return PfedhnServerState(params, np.zeros_like(params), second, num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> PfedhnClientState:
        return PfedhnClientState(init_params, client.id)  # shared and read-only until the first step replaces it

    def broadcast(self, server: PfedhnServerState) -> PfedhnBroadcast:
        network = self.network(server.num_clients)
        return PfedhnBroadcast(network.generate(server.params, range(server.num_clients)).astype(np.float32))

    def downlink_bytes(self, broadcast: PfedhnBroadcast) -> int:
        """One model: each client receives its own theta_i."""
        return payload_bytes(broadcast.models[0])

    def client_step(self, client: ClientInfo, state: PfedhnClientState, received: PfedhnBroadcast) -> ClientStep:
        """K inner SGD steps from theta_i (Algorithm 1's inner loop); the upload is dtheta_i = theta~_i - theta_i."""
        s = self.settings
        theta = received.models[client.id]
        request = s.local_sgd(theta) if s.local_steps is None else s.local_sgd(theta, random_batches=s.local_steps)
        result = yield from train(request)
        delta = np.asarray(result.params, np.float64) - theta
        metrics = {"train_loss": result.mean_loss, "update_norm": float(np.linalg.norm(delta))}
        return ClientUpdate(PfedhnClientState(np.array(theta, np.float32), client.id), PfedhnUpload(delta), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """The client's dtheta_i, which the server reads by client."""
        return update.upload.update

    def server_step_by_client(
        self, server: PfedhnServerState, total: PfedhnUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[PfedhnServerState, dict[str, float]]:
        """The hypernetwork's steps on the round's messages (eq. 4, Algorithm 1): each client's gradient is the VJP
        (d theta_i / d (phi, v))^T (theta_i - theta~_i) at the round's phi; one optimizer step per client in id
        order (`sequential`) or one on their mean (`mean`)."""
        clients = sorted(messages)
        if not clients:
            return server, {}
        network = self.network(server.num_clients)
        vjp = HypernetworkVjp(network, server.params)
        if self.settings.server_update == "sequential":
            gradients: Any = (vjp(client, -np.asarray(messages[client])) for client in clients)
        else:
            mean = np.zeros(network.size, np.float64)
            for client in clients:
                mean += vjp(client, -np.asarray(messages[client]))
            gradients = [(mean / len(clients)).astype(server.params.dtype)]
        state, norms = server, []
        for gradient in gradients:
            state, norm = self.optimizer_step(state, gradient, network.embedding_size)
            norms.append(norm)
        updates = [float(np.linalg.norm(messages[client])) for client in clients]
        metrics = {
            **server_metrics(self.global_model(state), self.global_model(server)),
            "hn_grad_norm": float(np.mean(norms)),
            "update_norm": float(np.mean(updates)),
        }
        return state, metrics

    def optimizer_step(
        self, server: PfedhnServerState, gradient: Vector, embedding_size: int
    ) -> tuple[PfedhnServerState, float]:
        """One step of the hypernetwork's optimizer as torch's (clip_grad_norm_, then SGD with momentum and weight
        decay, or Adam with its L2 term), the embeddings (the first `embedding_size` coordinates) at their own rate;
        returns the new state and the gradient's norm before clipping."""
        s = self.settings
        params = server.params
        norm = float(np.linalg.norm(gradient.astype(np.float64)))
        if s.grad_clip is not None and s.grad_clip / (norm + CLIP_EPS) < 1.0:
            gradient = gradient * params.dtype.type(s.grad_clip / (norm + CLIP_EPS))
        if s.server_weight_decay:
            gradient = gradient + params.dtype.type(s.server_weight_decay) * params
        steps, first, second = server.steps + 1, server.first, server.second
        if s.server_optimizer == "sgd":
            if s.server_momentum:
                first = params.dtype.type(s.server_momentum) * server.first + gradient
            direction = first if s.server_momentum else gradient
        else:
            beta1, beta2 = ADAM_BETAS
            first = beta1 * server.first + (1 - beta1) * gradient
            second = beta2 * server.second + (1 - beta2) * gradient * gradient
            scale = np.sqrt(second / (1 - beta2**steps)) + ADAM_EPS
            direction = first / (1 - beta1**steps) / scale
        embedding_lr = s.server_lr if s.embedding_lr is None else s.embedding_lr
        rates = ((slice(0, embedding_size), embedding_lr), (slice(embedding_size, None), s.server_lr))
        params = params.copy()
        for part, lr in rates:
            params[part] -= params.dtype.type(lr) * direction[part]
        moments = first.astype(params.dtype), second.astype(params.dtype)
        return PfedhnServerState(params, *moments, server.num_clients, steps), norm

    def global_model(self, server: PfedhnServerState) -> Vector:
        """(1/m) sum_i h(v_i; phi): the output layer at the mean of the m clients' features."""
        network = self.network(server.num_clients)
        features = network.features(server.params, range(server.num_clients)).mean(axis=0, keepdims=True)
        weight, bias = network.split(server.params)[1][-1]
        return (features @ weight.T + bias)[0].astype(np.float32)

    def personalized_model(self, state: PfedhnClientState) -> Vector:
        return state.personal

    def evaluation_context(self, server: PfedhnServerState) -> Vector | None:
        """With `score_current`: every client's model as the current hypernetwork generates it [m, n]."""
        return self.broadcast(server).models if self.settings.score_current else None

    def extra_models(
        self, state: PfedhnClientState, global_params: Vector, context: Vector | None = None
    ) -> dict[str, Vector]:
        """`current`: h(v_i; phi) at the current phi (`score_current`)."""
        if context is None or state.client >= len(context):
            return {}
        return {"current": context[state.client]}


class HypernetworkVjp:
    """(d theta_i / d phi)^T c for client i, at one fixed phi (torch autograd through `Hypernetwork.generate`,
    in phi's dtype); the gradient covers the whole flat phi, the embeddings' rows of other clients at 0."""

    def __init__(self, network: Hypernetwork, phi: Vector):
        import torch

        self.network = network
        self.phi = torch.tensor(np.asarray(phi), requires_grad=True)

    def __call__(self, client: int, cotangent: Vector) -> Vector:
        import torch

        theta = self.network.generate(self.phi, [client])[0]
        weights = torch.as_tensor(np.asarray(cotangent), dtype=self.phi.dtype)
        (gradient,) = torch.autograd.grad(theta, self.phi, grad_outputs=weights)
        return gradient.numpy()
