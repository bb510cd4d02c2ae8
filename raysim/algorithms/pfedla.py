"""pFedLA: layer-wise personalized aggregation learned by per-client hypernetworks (Ma, Zhang, Guo and Xu,
"Layer-wised Model Aggregation for Personalized Federated Learning", CVPR 2022, arXiv:2205.03993, Fig. 2).

The server keeps every client's latest model theta_j (`reads_messages`) and, for each client i, a hypernetwork
HN_i(v_i; phi_i) (phi_i: the paper's psi_i) of its own: a learned embedding v_i through an MLP whose heads output,
for each layer l of the network, aggregation weights alpha_i^l over the m clients (non-negative, summing to 1).
Client i's personalized model is aggregated layer by layer, theta-bar_i^l = sum_j alpha_ij^l theta_j^l (Fig. 2,
step 4); a selected client receives its theta-bar_i (one model down), trains it by local SGD and sends its update
dtheta_i = theta_i - theta-bar_i (one model up). The server stores theta_i = theta-bar_i + dtheta_i and steps phi_i
and v_i by the chain rule through the aggregation, with -dtheta_i in place of the loss gradient (step 3, as pFedHN):
the gradient is (d theta-bar_i / d (phi_i, v_i))^T (-dtheta_i) = (d alpha_i / d (phi_i, v_i))^T G_i with
G_i[l, j] = <theta_j^l, -dtheta_i^l>, so the m models enter through L x m inner products and only the small
hypernetwork is differentiated (torch autograd in the server step). Each client's hypernetwork moves only with its
own message, so a round of parallel clients is the paper's sequential visits: the VJP is taken at the phi_i and the
models that made the theta-bar_i it was sent (the round's start). The paper's text was not at hand: its steps are
cited by Fig. 2's numbering, and the details it leaves open follow FL-bench.

A layer (`layers: module`) is a module's tensors together, its weight and bias (FL-bench's first version, which
grouped the parameters of each Conv2d, Linear and BatchNorm2d); `layers: tensor` gives every parameter tensor its
own weights (FL-bench today). Running statistics (ParamSpec.statistics) are aggregated with their module's
weights (`tensor`: with its weight tensor's) and are no part of the gradient: no loss gradient moves them.

The hypernetwork is FL-bench's (src/server/pfedla.py): embedding v_i (N(0, 1), `embedding_dim` 100), `hidden_layers`
(3) times Linear and ReLU of width `hidden_dim` (100), then one Linear(hidden, m) head per layer (stacked here
into one Linear(hidden, L m): the same function and parameters). Every client's MLP and heads start as one copy
(FL-bench deep-copies one hypernetwork); their own SGD (lr `hn_lr` 5e-3, momentum `hn_momentum` 0: FL-bench's
defaults) steps the embedding and the MLP at the same rate. `weights: softmax` (default) normalizes each head's
output by a softmax over the m clients, the heads at PyTorch's default init (near-uniform weights: the early rounds
aggregate close to FedAvg with equal weights); `weights: relu` is FL-bench's: ReLU, then division by the sum (the
client's own model when every weight of a layer is 0), the heads' weights U(0, 1) and biases 0.

Where FL-bench differs and this module does not follow it: its hypernetwork's gradient takes
grad_outputs = trained - sent (dtheta_i, not -dtheta_i), so its SGD step moves theta-bar_i away from the
client's update; and its current client loads the client's stored model over the aggregated one
(all_model_params_personalized), so it trains from theta_i, not theta-bar_i. HeurpFedLA (FL-bench's k > 0: the k
layers of largest self weight kept local) is not implemented.

Memory: the server holds m models and m hypernetworks of e + e h + h + (hidden_layers - 1)(h^2 + h) + L (h m + m)
floats each (MLP of 784-128-64-10, L = 3, m = 100 at the defaults: 60,700, about a half of the model), plus as
many momentum buffers with `hn_momentum` > 0; the broadcast computes m aggregated models (m^2 n multiply-adds).
The uploads name no message field: Byzantine attacks and robust rules, which replace a mean of messages, are
refused. PM: the theta-bar_i the client was last sent (the initial model before); `score_current` also scores the
theta-bar_i the current hypernetwork and models give (extra model `current`). GM: the mean of the clients' latest
models; a held-out client deploys it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

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
from raysim.models.spec import ParamSpec


class PfedlaSettings(SGDSettings):
    name: Literal["pfedla"] = "pfedla"
    embedding_dim: int = Field(100, ge=1, description="dimension of each client's embedding v_i (FL-bench: 100)")
    hidden_dim: int = Field(100, ge=1, description="width of the hypernetworks' hidden layers (FL-bench: 100)")
    hidden_layers: int = Field(3, ge=1, description="Linear + ReLU layers before the heads (FL-bench: 3)")
    hn_lr: float = Field(5e-3, ge=0, description="the hypernetworks' SGD learning rate (FL-bench: 5e-3)")
    hn_momentum: float = Field(0.0, ge=0, lt=1, description="the hypernetworks' SGD momentum (FL-bench: 0)")
    weights: Literal["softmax", "relu"] = Field(
        "softmax",
        description="softmax: alpha_i^l = softmax over the m clients of the head's output; relu: FL-bench's "
        "ReLU divided by the sum (heads initialized U(0, 1), biases 0)",
    )
    layers: Literal["module", "tensor"] = Field(
        "module",
        description="what one aggregation weight covers: a module's tensors together (its weight and bias) or "
        "each parameter tensor (FL-bench today)",
    )
    score_current: bool = Field(
        False,
        description="also score theta-bar_i as the current hypernetwork and models give it (extra model "
        "`current`); the PM is the theta-bar_i the client was last sent",
    )


def layer_slices(params: ParamSpec, by: Literal["module", "tensor"]) -> tuple[tuple[slice, ...], ...]:
    """Each layer's coordinates in the flat vector, layers in the order their first tensor appears: the tensors of
    one module (`module`: the name before its last dot) or each tensor alone (`tensor`); a running statistic joins
    its module's weight in `tensor`. Adjacent tensors of a layer are merged into one slice."""
    groups: dict[str, list[slice]] = {}
    for name in params.names:
        prefix = name.rpartition(".")[0]
        if by == "module":
            key = prefix or name
        elif name in params.statistics and f"{prefix}.weight" in params.names:
            key = f"{prefix}.weight"
        else:
            key = name
        part = params.slice(name)
        slices = groups.setdefault(key, [])
        if slices and slices[-1].stop == part.start:
            slices[-1] = slice(slices[-1].start, part.stop)
        else:
            slices.append(part)
    return tuple(tuple(slices) for slices in groups.values())


@dataclass(frozen=True)
class LayerHypernetwork:
    """The layout of one client's flat hypernetwork vector: its embedding v_i [e], then each Linear layer's weight
    [out, in] and bias [out] (torch's layout), the last the L heads stacked [L m, hidden]. `weights` takes numpy
    arrays or torch tensors alike."""

    clients: int
    layers: int
    embedding_dim: int
    hidden_dim: int
    hidden_layers: int
    normalization: Literal["softmax", "relu"]

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(out, in) of each Linear layer, the stacked heads last."""
        widths = [self.embedding_dim] + [self.hidden_dim] * self.hidden_layers
        return [*zip(widths[1:], widths[:-1], strict=True), (self.layers * self.clients, self.hidden_dim)]

    @property
    def size(self) -> int:
        return self.embedding_dim + sum(out * fan_in + out for out, fan_in in self.shapes)

    def split(self, phi: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        """The embedding [e] and each layer's (weight, bias), as views of phi."""
        layers, offset = [], self.embedding_dim
        for out, fan_in in self.shapes:
            weight = phi[offset : offset + out * fan_in].reshape(out, fan_in)
            offset += out * fan_in
            layers.append((weight, phi[offset : offset + out]))
            offset += out
        return phi[: self.embedding_dim], layers

    def weights(self, phi: Any, client: int) -> Any:
        """alpha_i [L, m] of client `client` from its hypernetwork phi: each row non-negative, summing to 1."""
        x, layers = self.split(phi)
        for weight, bias in layers[:-1]:
            x = (x @ weight.T + bias).clip(min=0)
        weight, bias = layers[-1]
        logits = (x @ weight.T + bias).reshape(self.layers, self.clients)
        if isinstance(logits, np.ndarray):
            if self.normalization == "softmax":
                shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
                return shifted / shifted.sum(axis=1, keepdims=True)
            positive = logits.clip(min=0)
            total = positive.sum(axis=1, keepdims=True)
            own = np.eye(self.clients, dtype=logits.dtype)[client]
            return np.where(total > 0, positive / np.where(total > 0, total, 1), own)
        import torch

        if self.normalization == "softmax":
            return torch.softmax(logits, dim=1)
        positive = logits.clip(min=0)
        total = positive.sum(dim=1, keepdim=True)
        own = torch.zeros(self.clients, dtype=logits.dtype)
        own[client] = 1
        return torch.where(total > 0, positive / torch.where(total > 0, total, torch.ones_like(total)), own)

    def initial(self, rng: np.random.Generator) -> Vector:
        """Every client's hypernetwork [m, size]: embeddings N(0, 1) (nn.Embedding), one MLP and heads shared by
        all at PyTorch's default init U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear); with `relu` the heads'
        weights U(0, 1) and biases 0 (FL-bench's uniform_init_linear)."""
        embeddings = rng.standard_normal((self.clients, self.embedding_dim))
        parts = []
        for index, (out, fan_in) in enumerate(self.shapes):
            if self.normalization == "relu" and index == len(self.shapes) - 1:
                parts += [rng.uniform(0.0, 1.0, out * fan_in), np.zeros(out)]
            else:
                bound = 1.0 / np.sqrt(fan_in)
                parts += [rng.uniform(-bound, bound, out * fan_in), rng.uniform(-bound, bound, out)]
        shared = np.tile(np.concatenate(parts), (self.clients, 1))
        return np.concatenate([embeddings, shared], axis=1).astype(np.float32)


@dataclass
class PfedlaBroadcast:
    models: Vector
    """[m, n]: every client's theta-bar_i; client i receives row i."""


@dataclass
class PfedlaUpload(Upload):
    """dtheta_i = theta_i - theta-bar_i. It names no message field: the server reads it by client (`message`), and
    Byzantine attacks and robust rules, which replace the mean of messages, are refused."""

    update: Vector


@dataclass
class PfedlaClientState:
    personal: Vector
    """The theta-bar_i it was sent at its last round (the initial model before)."""
    client: int
    """Its id: its row of the current aggregated models (`score_current`)."""


@dataclass
class PfedlaServerState:
    models: Vector
    """[m, n]: every client's latest model theta_j (the initial model until it first trains)."""
    hypernetworks: Vector
    """[m, size]: each client's v_i and phi_i, flat (LayerHypernetwork's layout)."""
    momentum: Vector
    """[m, size]: SGD's momentum buffers (empty without momentum)."""


@ALGORITHMS.register()
class Pfedla(
    ServerReadsEachMessage[PfedlaSettings, PfedlaClientState, PfedlaServerState, PfedlaBroadcast, PfedlaUpload]
):
    """Per-client hypernetworks on the server learn layer-wise weights with which every client's model is
    aggregated from all clients' latest models."""

    name = "pfedla"
    Settings = PfedlaSettings
    Upload = PfedlaUpload

    def __init__(self, settings: PfedlaSettings, params: ParamSpec):
        super().__init__(settings, params)
        self.slices = layer_slices(params, settings.layers)
        self.trained = ~params.statistics_mask()
        """The coordinates the gradient reaches (all but the running statistics)."""

    def network(self, num_clients: int) -> LayerHypernetwork:
        s = self.settings
        layers = len(self.slices)
        return LayerHypernetwork(num_clients, layers, s.embedding_dim, s.hidden_dim, s.hidden_layers, s.weights)

    def init_server(self, init_params: Vector, num_clients: int) -> PfedlaServerState:
        network = self.network(num_clients)
        seed = zlib.crc32(np.ascontiguousarray(init_params).tobytes())
        hypernetworks = network.initial(np.random.default_rng(seed))
        momentum = np.zeros_like(hypernetworks) if self.settings.hn_momentum else np.zeros((num_clients, 0), np.float32)
        models = np.tile(np.asarray(init_params, np.float32), (num_clients, 1))
        return PfedlaServerState(models, hypernetworks, momentum)

    def init_client(self, client: ClientInfo, init_params: Vector) -> PfedlaClientState:
        return PfedlaClientState(init_params, client.id)  # shared and read-only until the first step replaces it

    def aggregate(self, alpha: Vector, models: Vector) -> Vector:
        """theta-bar_i^l = sum_j alpha_ij^l theta_j^l for every layer l (alpha [L, m], models [m, n]), in the
        models' dtype."""
        out = np.empty(models.shape[1], models.dtype)
        for weights, slices in zip(np.asarray(alpha, models.dtype), self.slices, strict=True):
            for part in slices:
                out[part] = weights @ models[:, part]
        return out

    def products(self, models: Vector, cotangent: Vector) -> Vector:
        """G [L, m]: G[l, j] = <theta_j^l, c^l>, the gradient of <theta-bar_i, c> in alpha_i."""
        return np.stack([sum(models[:, part] @ cotangent[part] for part in slices) for slices in self.slices])

    def broadcast(self, server: PfedlaServerState) -> PfedlaBroadcast:
        network = self.network(len(server.models))
        models = [self.aggregate(network.weights(phi, i), server.models) for i, phi in enumerate(server.hypernetworks)]
        return PfedlaBroadcast(np.stack(models).astype(np.float32, copy=False))

    def downlink_bytes(self, broadcast: PfedlaBroadcast) -> int:
        """One model: each client receives its own theta-bar_i."""
        return payload_bytes(broadcast.models[0])

    def client_step(self, client: ClientInfo, state: PfedlaClientState, received: PfedlaBroadcast) -> ClientStep:
        """Local SGD from theta-bar_i (Fig. 2, step 1); the upload is dtheta_i = theta_i - theta-bar_i (step 2)."""
        start = received.models[client.id]
        result = yield from train(self.settings.local_sgd(start))
        delta = np.asarray(result.params, np.float64) - start
        metrics = {"train_loss": result.mean_loss, "update_norm": float(np.linalg.norm(delta))}
        return ClientUpdate(PfedlaClientState(np.array(start, np.float32), client.id), PfedlaUpload(delta), metrics)

    def message(self, update: ClientUpdate) -> Vector:
        """The client's dtheta_i, which the server reads by client."""
        return update.upload.update

    def server_step_by_client(
        self, server: PfedlaServerState, total: PfedlaUpload, num_selected: int, messages: Mapping[int, Vector]
    ) -> tuple[PfedlaServerState, dict[str, float]]:
        """For each client that sent dtheta_i: theta_i = theta-bar_i + dtheta_i, and one SGD step of its v_i and
        phi_i along (d alpha_i / d (phi_i, v_i))^T G_i, G_i[l, j] = <theta_j^l, -dtheta_i^l> (Fig. 2, step 3), both
        at the round's models and hypernetwork (those that made the theta-bar_i it trained)."""
        clients = sorted(messages)
        if not clients:
            return server, {}
        network = self.network(len(server.models))
        models = server.models.copy()
        hypernetworks = server.hypernetworks.copy()
        momentum = server.momentum.copy()
        norms, self_weights = [], []
        for client in clients:
            delta = np.asarray(messages[client])
            phi = server.hypernetworks[client]
            models[client] = self.aggregate(network.weights(phi, client), server.models) + delta
            cotangent = np.where(self.trained, -delta, 0.0).astype(server.models.dtype)
            gradient = weights_vjp(network, phi, client, self.products(server.models, cotangent))
            norms.append(float(np.linalg.norm(gradient.astype(np.float64))))
            step = gradient
            if self.settings.hn_momentum:
                momentum[client] = phi.dtype.type(self.settings.hn_momentum) * momentum[client] + gradient
                step = momentum[client]
            hypernetworks[client] = phi - phi.dtype.type(self.settings.hn_lr) * step
            self_weights.append(float(network.weights(hypernetworks[client], client)[:, client].mean()))
        state = PfedlaServerState(models, hypernetworks, momentum)
        metrics = {
            **server_metrics(self.global_model(state), self.global_model(server)),
            "hn_grad_norm": float(np.mean(norms)),
            "update_norm": float(np.mean([np.linalg.norm(messages[client]) for client in clients])),
            "self_weight": float(np.mean(self_weights)),
        }
        return state, metrics

    def global_model(self, server: PfedlaServerState) -> Vector:
        """The mean of the clients' latest models."""
        return np.asarray(server.models, np.float64).mean(axis=0).astype(np.float32)

    def personalized_model(self, state: PfedlaClientState) -> Vector:
        return state.personal

    def evaluation_context(self, server: PfedlaServerState) -> Vector | None:
        """With `score_current`: every client's theta-bar_i from the current state [m, n]."""
        return self.broadcast(server).models if self.settings.score_current else None

    def extra_models(
        self, state: PfedlaClientState, global_params: Vector, context: Vector | None = None
    ) -> dict[str, Vector]:
        """`current`: theta-bar_i from the current hypernetwork and models (`score_current`)."""
        if context is None or state.client >= len(context):
            return {}
        return {"current": context[state.client]}


def weights_vjp(network: LayerHypernetwork, phi: Vector, client: int, products: Vector) -> Vector:
    """(d alpha_i / d phi)^T G for client `client`'s flat hypernetwork phi (embedding included), by torch autograd
    in phi's dtype: the gradient of sum_{l, j} alpha_ij^l G[l, j]."""
    import torch

    params = torch.tensor(np.asarray(phi), requires_grad=True)
    surrogate = (network.weights(params, client) * torch.as_tensor(np.asarray(products), dtype=params.dtype)).sum()
    (gradient,) = torch.autograd.grad(surrogate, params)
    return gradient.numpy()
