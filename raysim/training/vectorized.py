"""Many clients' local SGD at once: parameters stacked per layer, one batched step for all.

A host simulates hundreds of clients with small models; trained one at a time (`LocalTrainer`), most of
the time goes to per-call Python and torch overhead rather than arithmetic. Here the clients of a group
run one lockstep loop instead. Every parameter tensor is stacked [clients, *shape]; one `vmap` of the
model's `functional_call` computes every client's mini-batch in a few batched kernels, and autograd
differentiates the sum of the clients' losses (each client's parameters get only its own gradient).
Perceptrons (Flatten/Linear/ReLU stacks: mlr, mlp, linear) are written out as batched matrix products
with their backward pass by hand, which lets a weight's gradient product land straight in the velocity
or the parameters; a model that cannot be vmapped falls back to LocalTrainer.

The results are `LocalTrainer.sgd`'s, client by client, up to floating-point rounding:
- each client's batches come from its own generator in LocalTrainer's order (an epoch's permutation, then
  every batch's augmentation, noise and labels as it is used), so every client sees the same samples;
- batches are padded to the batch size with samples of weight zero, so a loss is the mean over real samples;
- a client's steps run over its epochs back to back and the clients of a chunk are sorted by step count,
  so the clients still training are a prefix and a finished client's parameters and velocity stay as they are.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch
from torch.func import functional_call, vmap

from raysim.algorithms.base import LocalSGD, SGDResult
from raysim.algorithms.prox import soft_threshold
from raysim.models.flat import FlatModel, perceptron_layers
from raysim.training.local import ClientData, LocalTrainer

SGDJob = tuple[LocalSGD, ClientData, np.random.Generator]
"""One client's request, its data and the generator LocalTrainer.sgd would draw its batches from."""

Layers = dict[str, torch.Tensor]
"""One tensor per model parameter, stacked over clients: name -> [clients, *shape]."""

Gradient = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A stacked gradient, or for a perceptron's weight matrix its factors (delta [clients, out, batch], input
[clients, in, batch]): the gradient is delta @ input^T, left as a product so an update can fuse it."""

logger = logging.getLogger(__name__)


def group_key(request: LocalSGD) -> tuple:
    """Requests that can share one lockstep loop: the same hyperparameters and the same objective terms."""
    return (
        request.epochs,
        request.lr,
        request.batch_size,
        request.momentum,
        request.weight_decay,
        request.prox_weight,
        request.linear is not None,
        request.mask is not None,
        request.offset is not None,
        request.l1 is not None,
        request.max_steps,
    )


class VectorizedTrainer:
    """Executes many clients' LocalSGD requests together on `device`, `chunk` clients at a time at most."""

    def __init__(self, model: FlatModel, chunk: int = 16, device: torch.device | None = None):
        if chunk < 1:
            raise ValueError(f"VectorizedTrainer: chunk must be at least 1, got {chunk}")
        self.model = model
        self.chunk = chunk
        self.device = torch.device("cpu") if device is None else device
        self.module = copy.deepcopy(model.module).to(self.device)
        self._layers = perceptron_layers(self.module, model.input_shape)
        self._batched = vmap(self._forward)
        self._sequential = LocalTrainer(model)
        self._sources: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        self.unavailable = self._probe()
        """Why this model cannot be trained vectorized (every request then runs on LocalTrainer), or None."""
        self.mode: Literal["perceptron", "vmap", "sequential"] = (
            "sequential" if self.unavailable is not None else "vmap" if self._layers is None else "perceptron"
        )
        """How requests run: batched matrix products (Flatten/Linear/ReLU stacks), vmap, or one at a time."""
        if self.unavailable is not None:
            logger.warning("vectorized client training falls back to one client at a time: %s", self.unavailable)
        elif self.mode == "vmap" and self.device.type == "cpu":
            logger.warning(
                "vectorized client training of a %s on the CPU runs through vmap, usually slower than one client at "
                "a time (cnn: 0.27-0.6x, benchmarks/vectorized_training.py); give hosts GPUs (runtime.host_gpus) "
                "or use runtime.client_training: sequential",
                model.name,
            )

    def sgd(self, jobs: Sequence[SGDJob]) -> list[SGDResult]:
        """LocalTrainer.sgd of every job, in the order given."""
        results: list[SGDResult | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for position, (request, _data, _generator) in enumerate(jobs):
            groups[group_key(request)].append(position)
        for key, members in groups.items():
            if self.unavailable is not None or key[-1] is not None:  # a few capped steps: no lockstep loop needed
                for position in members:
                    results[position] = self._sequential.sgd(*jobs[position])
                continue
            # Longest first: within a chunk the clients still training are then always a prefix.
            members.sort(key=lambda position: -_steps(jobs[position]))
            for start in range(0, len(members), self.chunk):
                part = members[start : start + self.chunk]
                for position, result in zip(part, self._train([jobs[p] for p in part]), strict=True):
                    results[position] = result
        return results  # type: ignore[return-value]

    def _forward(self, params: Layers, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, params, (x,))

    def _probe(self) -> str | None:
        """Run one vectorized step for two clients with two samples each; the reason it fails, if it does."""
        shapes = dict(zip(self.model.spec.names, self.model.spec.shapes, strict=True))
        params = {name: torch.zeros((2, *shape), device=self.device) for name, shape in shapes.items()}
        x = torch.zeros((2, 2, *self.model.input_shape), device=self.device)
        y = torch.zeros((2, 2), dtype=torch.float32 if self.model.task == "regression" else torch.int64)
        try:
            self._gradients(params, None, x, y.to(self.device), torch.ones((2, 2), device=self.device))
        except Exception as error:  # whatever fails here (typically vmap on some layer) fails every step
            reason = " ".join(str(error).split())
            return f"model {self.model.name!r} cannot be trained vectorized ({type(error).__name__}: {reason})"
        return None

    def _gradients(
        self, params: Layers, offset: Layers | None, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Gradient]]:
        """Each client's weighted mean loss [clients] and the gradient of every layer, at `params` (+ `offset`)."""
        if self._layers is not None:
            point = params if offset is None else {name: params[name] + offset[name] for name in params}
            return self._perceptron(self._layers, point, x, y, weight)
        leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
        point = leaves if offset is None else {name: leaves[name] + offset[name] for name in leaves}
        with torch.enable_grad():
            outputs = self._batched(point, x).transpose(1, 2)
            losses = (self.model.sample_losses(outputs, y) * weight).sum(dim=1)
            grads = torch.autograd.grad(losses.sum(), tuple(leaves.values()))
        return losses.detach(), dict(zip(leaves, grads, strict=True))

    def _perceptron(
        self,
        layers: list[tuple[str | None, str | None]],
        point: Layers,
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Gradient]]:
        """`_gradients` of a Flatten/Linear/ReLU stack (`layers`), forward and backward written out.

        Activations are kept as [clients, features, batch], so that each layer is one batched product W h and
        its weight gradient delta h^T: the layouts MKL runs fastest (vmap gives nn.Linear h W^T, whose
        gradient h^T delta is up to three times slower on a CPU)."""
        hidden = x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 2)
        inputs = []
        for weight_name, bias_name in layers:
            inputs.append(hidden)
            if weight_name is None:
                hidden = torch.relu(hidden)
            elif bias_name is None:
                hidden = torch.bmm(point[weight_name], hidden)
            else:
                hidden = torch.baddbmm(point[bias_name].unsqueeze(2), point[weight_name], hidden)
        losses = (self.model.sample_losses(hidden, y) * weight).sum(dim=1)
        # d losses / d outputs, per sample weighted: softmax - one-hot (cross-entropy) or the residual (squares).
        if self.model.task == "regression":
            delta = (hidden - y.unsqueeze(1)) * weight.unsqueeze(1)
        else:
            delta = torch.softmax(hidden, dim=1)
            delta.scatter_add_(1, y.unsqueeze(1), torch.full_like(delta[:, :1], -1.0))
            delta.mul_(weight.unsqueeze(1))
        gradients: dict[str, Gradient] = {}
        first = next(i for i, (weight_name, _bias) in enumerate(layers) if weight_name is not None)
        for index in range(len(layers) - 1, first - 1, -1):
            weight_name, bias_name = layers[index]
            if weight_name is None:  # ReLU: the gradient passes where its input was positive (autograd's op)
                delta = torch.ops.aten.threshold_backward(delta, inputs[index], 0.0)
                continue
            gradients[weight_name] = (delta, inputs[index])
            if bias_name is not None:
                gradients[bias_name] = delta.sum(dim=2)
            if index > first:
                delta = torch.bmm(point[weight_name].transpose(1, 2), delta)
        return losses, gradients

    def _source(self, array: np.ndarray) -> torch.Tensor:
        """A dataset array as a tensor on the device (on the CPU a view, on a GPU a copy made once)."""
        cached = self._sources.get(id(array))
        if cached is None or cached[0] is not array:
            with warnings.catch_warnings():  # read-only object-store arrays: only ever read here
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(array).to(self.device)
            cached = self._sources[id(array)] = (array, tensor)
        return cached[1]

    def _stack(self, vectors: Sequence[np.ndarray], dtype: torch.dtype) -> Layers:
        """Flat per-client vectors as contiguous per-layer stacks on the device."""
        flat = torch.from_numpy(np.stack([np.asarray(v) for v in vectors])).to(self.device, dtype)
        return {name: p.contiguous() for name, p in self.model.spec.unflatten(flat).items()}

    def _train(self, jobs: list[SGDJob]) -> list[SGDResult]:
        """One chunk of a group (same key, sorted by step count, longest first) in one lockstep loop."""
        requests = [request for request, _data, _generator in jobs]
        params = self._stack([r.start for r in requests], torch.float32)
        offset = self._stack([r.offset for r in requests], torch.float32) if requests[0].offset is not None else None
        update = _Update(requests, params, self._stack)
        batches = _Batches(jobs, self._source, self.device)
        losses = torch.zeros((len(jobs), len(batches.active)), dtype=torch.float32, device=self.device)
        for step, active in enumerate(batches.active):
            x, y, weight = batches.step(step, active)
            now = {name: p[:active] for name, p in params.items()}
            shift = None if offset is None else {name: o[:active] for name, o in offset.items()}
            losses[:active, step], gradients = self._gradients(now, shift, x, y, weight)
            for name, p in now.items():
                update(name, p, gradients[name])
        flat = np.empty((len(jobs), self.model.size), np.float32)
        for name, p in params.items():
            torch.from_numpy(flat)[:, self.model.spec.slice(name)] = p.reshape(len(jobs), -1)
        seen = losses.cpu().numpy().astype(np.float64)
        return [
            SGDResult(
                params=flat[i].copy(),  # its own array, as LocalTrainer's: a state must not keep the chunk alive
                mean_loss=float(np.mean(seen[i, :steps])) if steps else float("nan"),
                steps=steps,
            )
            for i, steps in enumerate(batches.totals)
        ]


class _Update:
    """LocalTrainer.sgd's parameter update for one chunk's stacked layers (its velocity lives here).

    The gradient terms LocalTrainer adds one by one are folded (the same values up to rounding):
    weight_decay x + prox_weight (x - center) + linear = decay x - constant, with constant =
    prox_weight center - linear made once. A weight gradient given as a product (a perceptron's) is
    computed straight into the velocity (momentum) or, for plain SGD, into the parameters."""

    def __init__(self, requests: list[LocalSGD], params: Layers, stack: Callable[[list, torch.dtype], Layers]):
        """`stack` makes per-layer stacks of flat per-client vectors (VectorizedTrainer._stack)."""
        first = requests[0]
        size = sum(p[0].numel() for p in params.values())
        self.lr, self.momentum = first.lr, first.momentum
        self.decay = first.weight_decay + first.prox_weight
        self.constant = None
        if first.prox_weight or first.linear is not None:
            self.constant = stack([_constant_term(r, size) for r in requests], torch.float32)
        self.frozen = None
        if first.mask is not None:
            self.frozen = {name: ~m for name, m in stack([r.mask for r in requests], torch.bool).items()}
        self.threshold = None
        if first.l1 is not None:
            l1 = stack([np.broadcast_to(np.asarray(r.l1, np.float32), (size,)) for r in requests], torch.float32)
            self.threshold = {name: first.lr * value for name, value in l1.items()}
        self.velocity = {name: torch.zeros_like(p) for name, p in params.items()} if first.momentum else None

    def __call__(self, name: str, p: torch.Tensor, gradient: Gradient) -> None:
        """One SGD step of layer `name` for the active clients (the first len(p) of the chunk)."""
        active = len(p)
        frozen = None if self.frozen is None else self.frozen[name][:active]
        moving = None if self.velocity is None else self.velocity[name][:active]
        fused = False
        if isinstance(gradient, tuple):
            product = (gradient[0], gradient[1].transpose(1, 2))
            if moving is not None:  # v = momentum v + delta input^T; the other terms are added to v below
                gradient, fused = moving.baddbmm_(*product, beta=self.momentum), True
            elif self.decay or self.constant is not None or frozen is not None:
                gradient = torch.bmm(*product)
            else:  # plain SGD: x -= lr delta input^T, in the product itself
                p.baddbmm_(*product, alpha=-self.lr)
                self._shrink(name, p, frozen)
                return
        if self.decay:
            gradient.add_(p, alpha=self.decay)
        if self.constant is not None:
            gradient.sub_(self.constant[name][:active])
        if frozen is not None:  # a frozen coordinate's gradient, hence also its velocity, stays 0
            gradient.masked_fill_(frozen, 0.0)
        if moving is not None and not fused:
            gradient = torch.add(gradient, moving, alpha=self.momentum, out=moving)
        p.sub_(gradient, alpha=self.lr)
        self._shrink(name, p, frozen)

    def _shrink(self, name: str, p: torch.Tensor, frozen: torch.Tensor | None) -> None:
        """The l1 proximal step after the gradient step (soft-thresholding, only where not frozen)."""
        if self.threshold is None:
            return
        shrunk = soft_threshold(p, self.threshold[name][: len(p)])
        p.copy_(shrunk if frozen is None else torch.where(frozen, p, shrunk))


def _constant_term(request: LocalSGD, size: int) -> np.ndarray:
    """prox_weight center - linear: the part of the objective's extra gradient terms that does not move."""
    value = np.zeros(size, np.float32)
    if request.prox_weight:
        value = np.float32(request.prox_weight) * np.asarray(request.prox_center, np.float32)
    if request.linear is not None:
        value = value - np.asarray(request.linear, np.float32)
    return value


def _steps(job: SGDJob) -> int:
    """How many SGD steps LocalTrainer.sgd takes for a job."""
    request, data, _generator = job
    return request.epochs * -(-len(data.train) // request.batch_size)


class _Batches:
    """The mini-batches of one chunk's clients, drawn as LocalTrainer.sgd draws them, one lockstep step at a time.

    A client without per-access randomness (no feature noise, no random labels) draws only its epochs'
    permutations and, with augmented inputs, each batch's crops and flips right after its epoch's permutation,
    so its whole plan is made up front (the features of clients with plain inputs gathered in one call); a
    client with it draws each batch's augmentation, noise and labels from its generator when the batch is
    used, after that epoch's permutation and before the next, exactly as the sequential loop does. Stored
    rows that need normalization or augmentation become model input through the clients' `Inputs.rows`, the
    function the sequential trainer uses, so both see the same bits.
    """

    def __init__(self, jobs: list[SGDJob], source: Callable[[np.ndarray], torch.Tensor], device: torch.device):
        request = jobs[0][0]
        self.jobs = jobs
        self.batch_size = width = request.batch_size
        self.sizes = [len(data.train) for _request, data, _generator in jobs]
        self.per_epoch = [-(-n // width) for n in self.sizes]
        self.totals = [request.epochs * p for p in self.per_epoch]
        length = max(self.totals, default=0)
        self.active = [sum(total > step for total in self.totals) for step in range(length)]
        """How many clients (a prefix: jobs come longest first) still train at each step."""
        self.sources = [source(data.x) if data.inputs.plain else None for _request, data, _generator in jobs]
        """Each client's features on the device, if they are model input as stored (else read through Inputs)."""
        self.shared = all(array is not None and array is self.sources[0] for array in self.sources)
        """Whether every client's features are one plain array (then one gather serves them all)."""
        first = jobs[0][1]
        self.read_together = not self.shared and all(
            data.x is first.x and data.inputs == first.inputs and data.inputs.augment == "none"
            for _request, data, _generator in jobs
        )
        """Whether every client reads one stored array through the same normalization (then one read serves all)."""
        self.fresh = [i for i, (_r, data, _g) in enumerate(jobs) if data.noise_std or data.random_labels]
        self.orders: dict[int, np.ndarray] = {}
        self.draws: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """An augmenting client's crop corners [steps, batch, 2] and flips [steps, batch] (padding: no-ops)."""
        index = np.zeros((length, len(jobs), width), np.int64)
        weight = np.zeros((length, len(jobs), width), np.float32)
        labels = np.zeros((length, len(jobs), width), jobs[0][1].y.dtype)
        fresh = set(self.fresh)
        for i, (_request, data, generator) in enumerate(jobs):
            n, per_epoch, total = self.sizes[i], self.per_epoch[i], self.totals[i]
            if not total:
                continue
            last = n - (per_epoch - 1) * width
            weight[:total, i] = 1.0 / width
            weight[per_epoch - 1 : total : per_epoch, i] = 0.0
            weight[per_epoch - 1 : total : per_epoch, i, :last] = 1.0 / last
            if i in fresh:
                continue
            augments = data.inputs.augment != "none"
            if augments:
                corners = np.full((total, width, 2), data.inputs.padding, np.int64)
                flips = np.zeros((total, width), bool)
                self.draws[i] = (corners, flips)
            plan = np.empty((request.epochs, per_epoch * width), np.int64)
            for epoch in range(request.epochs):
                plan[epoch, :n] = data.train[generator.permutation(n)]
                for batch in range(per_epoch if augments else 0):
                    count, at = min(width, n - batch * width), epoch * per_epoch + batch
                    corners[at, :count], flips[at, :count] = data.inputs.draw(count, generator)  # type: ignore[misc]
            plan[:, n:] = plan[:, :1]  # padding: a real sample, weighted zero
            index[:total, i] = plan.reshape(total, width)
            labels[:total, i] = data.y[index[:total, i]]
        self.plan = index
        self.index = torch.from_numpy(index).to(device)
        self.counts = (weight > 0).sum(axis=2)
        """The real (weighted) samples of each client's batch at each step [steps, clients]: a prefix of the batch."""
        self.buffer = torch.zeros((len(jobs) * width, *jobs[0][1].x.shape[1:]), device=device)
        """The gathered features of a step, one buffer for all steps. Rows read through Inputs are read for real
        samples only: a padding row keeps an earlier step's finite values, which its zero weight cancels exactly."""
        self.weight = torch.from_numpy(weight).to(device)
        self.labels = torch.from_numpy(labels).to(device)

    def step(self, step: int, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features [active, batch, *input], targets [active, batch] and sample weights of the active clients."""
        width = self.batch_size
        rows = self.buffer[: active * width]
        features = rows.view(active, width, *rows.shape[1:])
        if self.shared:
            torch.index_select(self.sources[0], 0, self.index[step, :active].reshape(-1), out=rows)  # type: ignore[arg-type]
        elif self.read_together:
            data = self.jobs[0][1]
            real = np.flatnonzero(np.arange(width) < self.counts[step, :active, None])
            inputs = data.inputs.rows(data.x, self.plan[step, :active].reshape(-1)[real])
            rows[torch.from_numpy(real).to(rows.device)] = torch.from_numpy(inputs).to(rows.device)
        else:
            for i in range(active):
                source, data = self.sources[i], self.jobs[i][1]
                if source is not None:
                    torch.index_select(source, 0, self.index[step, i], out=features[i])
                elif not (data.noise_std or data.random_labels):  # a fresh client's batch is made below
                    count, draws = self.counts[step, i], self.draws.get(i)
                    cropping = None if draws is None else tuple(d[:count] for d in _at(draws, step))
                    plan = data.inputs.rows(data.x, self.plan[step, i, :count], cropping)  # type: ignore[arg-type]
                    features[i, :count].copy_(torch.from_numpy(plan))
        for i in self.fresh:
            if i >= active:
                break
            _request, data, generator = self.jobs[i]
            epoch_step = step % self.per_epoch[i]
            if epoch_step == 0:
                self.orders[i] = generator.permutation(self.sizes[i])
            batch = data.train[self.orders[i][epoch_step * width : (epoch_step + 1) * width]]
            xb, yb = data.batch(batch, generator, training=True)
            features[i, : len(batch)] = torch.from_numpy(xb)
            if self.sources[i] is None:  # padding of a client read through Inputs: finite, weighted zero
                features[i, len(batch) :] = 0.0
            self.labels[step, i, : len(batch)] = torch.from_numpy(yb)
        return features, self.labels[step, :active], self.weight[step, :active]


def _at(draws: tuple[np.ndarray, np.ndarray], step: int) -> tuple[np.ndarray, np.ndarray]:
    """One step's augmentation draws of a client."""
    return draws[0][step], draws[1][step]
