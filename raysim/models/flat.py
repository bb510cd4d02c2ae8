"""A model seen as one flat float32 vector.

Everything outside this module (client state, messages, server sums) handles parameters as flat numpy
vectors: cheap to add, zero-copy through Ray's object store, and sliceable per layer through
`ParamSpec` (raysim.models.spec). Only here do vectors become torch parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from raysim.data.dataset import Task
from raysim.models.composed import ComponentMixture, ComposedNetwork, FeatureValve, GatedHeads
from raysim.models.gated import FeatureValveNetwork, GatedHeadsNetwork, MixtureNetwork
from raysim.models.spec import ParamSpec
from raysim.models.zoo import as_shape, build_module, carried_buffers, initial_parameters


@dataclass(frozen=True)
class ModelSpec:
    """What a host needs to build the model: name, input shape, outputs, task."""

    name: str
    input_shape: tuple[int, ...]
    outputs: int
    task: Task

    def build(self) -> FlatModel:
        return FlatModel(self.name, self.input_shape, self.outputs, self.task)


class FlatModel:
    """Loss, gradient and outputs of a network at a flat parameter vector (raysim.evaluation.batched scores it)."""

    def __init__(self, name: str, input_shape: tuple[int, ...], outputs: int, task: Task = "classification"):
        self.name = name
        self.task = task
        self.input_shape = as_shape(input_shape)
        self.module = build_module(name, input_shape, outputs)
        self.spec = param_spec(self.module, name, self.input_shape)
        self.head = last_linear(self.module)[1]
        """The last linear layer: its input is the features (`features`), its outputs the logits (ParamSpec.head)."""
        self.layers = perceptron_layers(self.module, self.input_shape)
        """(weight, bias) names of a Flatten/Linear/ReLU stack, which `forward` runs without functional_call."""
        self.stochastic = any(isinstance(layer, nn.Dropout) and layer.p > 0 for layer in self.module.modules())
        """The network has dropout: off (eval mode) except in `loss_and_grad` given a `dropout_seed`."""
        self.normalizations = [
            layer
            for layer in self.module.modules()
            if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.track_running_stats
        ]
        """The layers with running statistics (BatchNorm): on their batches' statistics only while training."""
        self._recording: torch.Tensor | None = None
        self.module.eval()
        self._composed: dict[ComposedNetwork, FlatModel] = {}

    @property
    def size(self) -> int:
        return self.spec.size

    @property
    def perceptron(self) -> bool:
        """A stack of Flatten, Linear and ReLU layers (mlr, mlp, linear): batched matrix products train many clients
        at once faster than one at a time, even on a CPU."""
        return self.layers is not None

    @property
    def has_statistics(self) -> bool:
        """The vector carries running statistics (a network with BatchNorm)."""
        return bool(self.spec.statistics)

    def initial_parameters(self, seed: int) -> np.ndarray:
        return initial_parameters(self.module, seed).numpy()

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.task == "regression":
            return 0.5 * ((outputs.squeeze(-1) - targets) ** 2).mean()  # f_i = 1/(2N) ||X theta - y||^2
        return nn.functional.cross_entropy(outputs, targets)

    def sample_losses(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each sample (its mean is `_loss`), for batches padded with samples weighted zero.

        `outputs` has the classes (or the one regression output) on dimension 1: [N, K] or [N, K, *more],
        `targets` the remaining shape ([N] or [N, *more])."""
        if self.task == "regression":
            return 0.5 * (outputs.squeeze(1) - targets) ** 2
        return nn.functional.cross_entropy(outputs, targets, reduction="none")

    def forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The network's outputs at `flat`. A Flatten/Linear/ReLU stack runs as the same torch ops its modules call
        (same results), without functional_call's per-call cost of swapping the module's parameters."""
        if self.layers is None:
            return self._through_module(flat, x)
        params = self.spec.unflatten(flat)
        hidden = x.reshape(len(x), -1)
        for weight, bias in self.layers:
            if weight is None:
                hidden = torch.relu(hidden)
            else:
                hidden = nn.functional.linear(hidden, params[weight], None if bias is None else params[bias])
        return hidden

    def _through_module(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The module's own forward with its parameters (and running statistics) taken from `flat` (hooks on its
        layers fire). Within `batch_statistics`, the pass that is differentiated records the running statistics its
        batch updates."""
        tensors = self.spec.unflatten(flat)
        if not self.spec.statistics:
            return functional_call(self.module, tensors, (x,))
        # No gradient flows into running statistics; while training they are copies, which the layers update.
        into = self._recording if len(x) > 1 else None  # one sample has no batch statistics: it is scored as is
        running = {name: tensors[name].detach() for name in self.spec.statistics}
        if into is not None:
            running = {name: value.clone() for name, value in running.items()}
        with self._normalizing(by_batch=into is not None):
            outputs = functional_call(self.module, {**tensors, **running}, (x,))
        if into is not None and flat.requires_grad:
            for name, value in running.items():
                into[self.spec.slice(name)] = value.reshape(-1)
        return outputs

    @contextmanager
    def batch_statistics(self, into: torch.Tensor | None) -> Iterator[None]:
        """Training mode for the normalization layers within the block: each normalizes by its batch's statistics,
        and the running statistics that the differentiated pass updates (momentum 0.1, as torch's BatchNorm) are
        written into `into`'s statistics coordinates (raysim.models.spec.ParamSpec.statistics). A batch of one
        sample, which has no batch statistics (torch refuses it), is normalized by the running ones and leaves them
        as they are. Without the block, or for a model without running statistics, the network is the function
        evaluation scores."""
        if into is None or not self.spec.statistics:
            yield
            return
        self._recording = into
        try:
            yield
        finally:
            self._recording = None

    @contextmanager
    def _normalizing(self, by_batch: bool) -> Iterator[None]:
        """The normalization layers in training mode (batch statistics) for the block when `by_batch`."""
        if not by_batch:
            yield
            return
        for layer in self.normalizations:
            layer.train()
        try:
            yield
        finally:
            for layer in self.normalizations:
                layer.eval()

    def features(self, flat: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits): the features are the input of the network's last linear layer
        (what knowledge distillation compares, AugFL, Sec. V)."""
        captured: list[torch.Tensor] = []
        handle = self.head.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0]))
        try:  # through the module itself (not forward's direct path), so that the hook sees the head's input
            logits = self._through_module(flat, x)
        finally:
            handle.remove()
        return captured[0], logits

    def loss_and_grad(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, dropout_seed: int | None = None
    ) -> tuple[float, torch.Tensor]:
        """Mean minibatch loss at `flat` and its gradient (a new flat tensor). With `dropout_seed` a network with
        dropout trains with it on, its masks drawn from a torch generator seeded so (the caller draws the seed from
        the client's stream: the same masks wherever the client runs); else dropout is off."""
        point = flat.detach().requires_grad_(True)
        with self.dropout(dropout_seed):
            loss = self._loss(self.forward(point, x), y)
        (grad,) = torch.autograd.grad(loss, point)
        return loss.item(), grad

    @overload
    def composed(self, network: GatedHeads) -> GatedHeadsModel: ...

    @overload
    def composed(self, network: ComposedNetwork) -> FlatModel: ...

    def composed(self, network: ComposedNetwork) -> FlatModel:
        """The model of the vectors of `network`, a personalized model built around this network (its forward what
        evaluation scores; `composed_module`), made once."""
        if network not in self._composed:
            if isinstance(network, GatedHeads):
                self._composed[network] = GatedHeadsModel(self, network)
            else:
                self._composed[network] = ComposedModel(self, network)
        return self._composed[network]

    def spec_head(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A head's (weight, bias) from a vector laid out as the model's head (`spec.head`: weight, then bias)."""
        weight = self.head.weight
        size = weight.numel()
        if flat.numel() != self.spec.head_size:
            raise ValueError(
                f"a second head of model {self.name!r} has {self.spec.head_size} values, got {flat.numel()}"
            )
        bias = flat[size:] if self.head.bias is not None else None
        return flat[:size].reshape(weight.shape), bias

    @torch.no_grad()
    def class_means(
        self,
        flat: np.ndarray | None,
        x: np.ndarray,
        y: np.ndarray,
        classes: int,
        chunk: int = 2048,
        embedding: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Per class: the samples' count [classes] (float64) and, at `flat`, their mean features [classes, d]
        (float32, summed in float64; zero for a class without samples), or with `embedding` their mean normalized
        outputs h / ||h||. Dropout off."""
        counts = np.bincount(np.asarray(y, np.int64), minlength=classes).astype(np.float64)[:classes]
        if flat is None:
            return counts, None
        params = torch.tensor(flat, dtype=torch.float32)
        width = self.head.out_features if embedding else self.head.in_features
        sums = torch.zeros((classes, width), dtype=torch.float64)
        for start in range(0, len(x), chunk):
            features, outputs = self.features(params, torch.from_numpy(x[start : start + chunk]))
            if embedding:
                features = nn.functional.normalize(outputs, dim=1)
            sums.index_add_(0, torch.from_numpy(np.asarray(y[start : start + chunk], np.int64)), features.double())
        means = sums / torch.from_numpy(np.maximum(counts, 1.0))[:, None]
        return counts, means.to(torch.float32).numpy()

    @contextmanager
    def dropout(self, seed: int | None) -> Iterator[None]:
        """Dropout on, from torch's generator seeded with `seed` (restored afterwards), within the block."""
        if seed is None or not self.stochastic:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.module.train()
            try:
                yield
            finally:
                self.module.eval()

    @torch.no_grad()
    def predict(self, flat: np.ndarray, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
        """The network's outputs (logits) on the samples, as float32."""
        params = torch.tensor(flat, dtype=torch.float32)
        parts = [self.forward(params, torch.from_numpy(x[start : start + chunk])) for start in range(0, len(x), chunk)]
        return torch.cat(parts).numpy() if parts else np.zeros((0, 0), np.float32)


class ComposedModel(FlatModel):
    """The vectors of a ComposedNetwork around the network of `network` as a FlatModel: `forward` what evaluation
    scores; `spec` the vector's layout (its head the module's last linear layer)."""

    def __init__(self, network: FlatModel, composed: ComposedNetwork):
        super().__init__(network.name, network.input_shape, network.head.out_features, network.task)
        if composed.classifier_only and self.task != "classification":
            name = type(composed).__name__
            raise ValueError(f"{name} needs a classifier; model {self.name!r} is trained for {self.task}")
        self.network = network
        self.composition = composed
        self.module = composed_module(self.module, composed)
        self.module.eval()
        self.spec = param_spec(self.module, network.name)
        self.head = last_linear(self.module)[1]
        self.layers = None


class GatedHeadsModel(ComposedModel):
    """GatedHeads vectors as a ComposedModel whose `spec` head is the global head, with `shares` (the policy's
    split of each sample's features) beside what FedCP's GatedHeadsLoss trains."""

    def __init__(self, network: FlatModel, heads: GatedHeads):
        super().__init__(network, heads)
        self.heads = heads
        assert isinstance(self.module, GatedHeadsNetwork)
        self.head = self.module.global_head

    @torch.no_grad()
    def shares(self, flat: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The noiseless policy of each sample, [samples, 2, d] (rows s and r), at the vector `flat`."""
        params = self.spec.unflatten(torch.tensor(flat, dtype=torch.float32))
        return functional_call(self.module, params, (torch.from_numpy(x),), {"details": True})[2].numpy()


def composed_module(network: nn.Module, composed: ComposedNetwork) -> nn.Module:
    """`network` inside the torch module of a personalized model built around it: raysim.models.gated's for the
    built-in descriptions, the description's own `module` for any other."""
    head = last_linear(network)[0]
    if isinstance(composed, GatedHeads):
        return GatedHeadsNetwork(network, head, composed)
    if isinstance(composed, FeatureValve):
        return FeatureValveNetwork(network, head, composed)
    if isinstance(composed, ComponentMixture):
        return MixtureNetwork(network, composed)
    return composed.module(network)


def param_spec(module: nn.Module, model: str = "", input_shape: tuple[int, ...] = ()) -> ParamSpec:
    """The layout of a module's parameters in the flat vector, in `named_parameters` order, then its running
    statistics (raysim.models.zoo.carried_buffers); `model`: its registered name (personalization presets look up the
    model's table by it, raysim.models.spec.personalization); `input_shape`: the sample shape it was built for."""
    names, shapes, offsets, offset = [], [], [], 0
    statistics = carried_buffers(module)
    for name, tensor in [*module.named_parameters(), *statistics]:
        names.append(name)
        shapes.append(tuple(tensor.shape))
        offsets.append(offset)
        offset += tensor.numel()
    prefix, head = last_linear(module)
    head_names = tuple(f"{prefix}.{part}" for part in ("weight", "bias") if getattr(head, part) is not None)
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    normalization = tuple(name for name, layer in module.named_modules() if isinstance(layer, norms))
    return ParamSpec(
        tuple(names),
        tuple(shapes),
        tuple(offsets),
        model,
        head_names,
        tuple(name for name, _ in statistics),
        normalization,
        input_shape,
    )


def last_linear(module: nn.Module) -> tuple[str, nn.Linear]:
    """The network's head, its last linear layer in module order, and its name: every model of the zoo ends in one
    (the classifier of a multimodal model, a ResNet's fc), and its input is the network's features."""
    linears = [(name, layer) for name, layer in module.named_modules() if isinstance(layer, nn.Linear)]
    if not linears:
        raise ValueError(f"model {type(module).__name__} has no linear layer to serve as its head")
    return linears[-1]


def perceptron_layers(module: nn.Module, input_shape: tuple[int, ...]) -> list[tuple[str | None, str | None]] | None:
    """(weight, bias) parameter names of each Linear of an nn.Sequential of Flatten, Linear and ReLU layers
    ((None, None) for a ReLU), or None for any other model."""
    if not isinstance(module, nn.Sequential):
        return None
    layers: list[tuple[str | None, str | None]] = []
    flat = len(input_shape) == 1
    for name, layer in module.named_children():
        if isinstance(layer, nn.Flatten) and layer.start_dim == 1 and layer.end_dim == -1:
            flat = True
        elif isinstance(layer, nn.Linear) and flat:
            layers.append((f"{name}.weight", None if layer.bias is None else f"{name}.bias"))
        elif isinstance(layer, nn.ReLU):
            layers.append((None, None))
        else:
            return None
    return layers
