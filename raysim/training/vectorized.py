"""Many clients' local SGD at once: parameters stacked per layer, one batched step for all.

A host simulates hundreds of clients with small models; trained one at a time (`LocalTrainer`), most of
the time goes to per-call Python and torch overhead rather than arithmetic. Here the clients of a group
run one lockstep loop instead. Every parameter tensor is stacked [clients, *shape]; one `vmap` of the
model's `functional_call` computes every client's mini-batch in a few batched kernels, and autograd
differentiates the sum of the clients' losses (each client's parameters get only its own gradient).
Perceptrons (Flatten/Linear/ReLU stacks: mlr, mlp, linear) are written out as batched matrix products
with their backward pass by hand, which lets a weight's gradient product land straight in the velocity
or the parameters; a model that cannot be vmapped, or that has dropout (whose masks each client draws from its
own stream, FedAPM's multimodal models: stacked they measured slower, docs/performance.md), falls back to
LocalTrainer.

The unit of work is a chunk's rows (`sgd_rows`): a request whose vectors are [clients, n] (or one [n] vector
shared by all, such as a received global model) trains in one buffer [clients, n] whose per-layer views are
the stacked parameters, so nothing is stacked or unstacked per layer and the result is that buffer.

The results are `LocalTrainer.sgd`'s, client by client, up to floating-point rounding:
- each client's batches come from its own generator in LocalTrainer's order (an epoch's permutation, then
  every batch's augmentation, noise and labels as it is used), so every client sees the same samples;
- batches are padded to the batch size with samples of weight zero, so a loss is the mean over real samples;
- a client's steps run over its epochs back to back and the clients of a chunk are sorted by step count,
  so the clients still training are a prefix and a finished client's parameters and velocity stay as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import numpy as np
import torch
from torch.func import functional_call, vmap

from raysim.algorithms.requests import BatchGradients, BatchGradientsResult, LocalSGD, SGDResult
from raysim.algorithms.terms import RowsContext, StackedTerm
from raysim.execution.stacking import unstack
from raysim.models.flat import FlatModel, perceptron_layers
from raysim.training.local import ClientData, Draws, LocalTrainer, drawn_epochs

SGDJob = tuple[LocalSGD, ClientData, Draws]
"""One client's request, its data and the generator LocalTrainer.sgd would draw its batches from."""

Layers = dict[str, torch.Tensor]
"""One tensor per model parameter, stacked over clients: name -> [clients, *shape]."""

Gradient = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A stacked gradient, or for a perceptron's weight matrix its factors (delta [clients, out, batch], input
[clients, in, batch]): the gradient is delta @ input^T, left as a product so an update can fuse it."""

logger = logging.getLogger(__name__)


def group_key(request: LocalSGD) -> tuple:
    """Requests that can share one lockstep loop: the same hyperparameters and the same kinds of terms with the
    same numbers (Term.key)."""
    return (
        request.epochs,
        request.lr,
        request.batch_size,
        request.momentum,
        request.weight_decay,
        request.mask is not None,
        request.random_batches,
        tuple(term.key() for term in request.terms),
    )


class VectorizedTrainer:
    """Executes many clients' LocalSGD requests together on `device`, `chunk` clients at a time at most."""

    def __init__(
        self,
        model: FlatModel,
        chunk: int = 16,
        device: torch.device | None = None,
        train_sizes: Sequence[int] | None = None,
    ):
        """`train_sizes`: the training-split sizes of the run's clients (the same on every host), when known: each
        lockstep step then pads its batches only to the widest batch a client of the run has at that step
        (`step_widths`), not to the batch size (1,000 Fashion-MNIST clients hold 56 samples each: batches of 100
        would be 44 % padding; 500 hold 112, whose second batch of 12 would be 88 % padding)."""
        if chunk < 1:
            raise ValueError(f"VectorizedTrainer: chunk must be at least 1, got {chunk}")
        self.model = model
        self.chunk = chunk
        self.train_sizes = None if train_sizes is None else np.unique(np.asarray(train_sizes, np.int64))
        self.device = torch.device("cpu") if device is None else device
        self.module = copy.deepcopy(model.module).to(self.device)
        self._layers = perceptron_layers(self.module, model.input_shape)
        self._batched = vmap(self._forward)
        self._sequential = LocalTrainer(model)
        self._sources: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        self._buffer: torch.Tensor | None = None
        self.unavailable = (
            f"model {model.name!r} has dropout, whose masks each client draws from its own stream (FedAPM's "
            "multimodal models, which have it, also ran slower stacked: docs/performance.md)"
            if model.stochastic
            else f"model {model.name!r} has running statistics (BatchNorm), which each client's own batches update"
            if model.has_statistics
            else self._probe()
        )
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
        """LocalTrainer.sgd of every job, in the order given (each result its own array)."""
        results: dict[int, SGDResult] = {}
        groups: dict[tuple, list[int]] = defaultdict(list)
        jobs = [(drawn_epochs(request, generator), data, generator) for request, data, generator in jobs]
        for position, (request, data, generator) in enumerate(jobs):
            if not request.batched:  # a term without a stacked form: one at a time (see sgd_rows)
                results[position] = self._sequential.sgd(request, data, generator)
            else:
                groups[group_key(request)].append(position)
        for members in groups.values():
            # Longest first: within a chunk the clients still training are then always a prefix.
            members.sort(key=lambda position: -_steps(jobs[position][0], jobs[position][1]))
            for start in range(0, len(members), self.chunk):
                part = members[start : start + self.chunk]
                stacked = self.sgd_rows(
                    stack_requests([jobs[p][0] for p in part]), [jobs[p][1] for p in part], [jobs[p][2] for p in part]
                )
                losses, steps = np.asarray(stacked.mean_loss), np.asarray(stacked.steps)
                for row, position in enumerate(part):  # its own array, as LocalTrainer's: a state must not keep
                    results[position] = SGDResult(  # the chunk's buffer alive
                        stacked.params[row].copy(), float(losses[row]), int(steps[row])
                    )
        return [results[position] for position in range(len(jobs))]

    def sgd_rows(self, request: LocalSGD, data: Sequence[ClientData], generators: Sequence[Draws]) -> SGDResult:
        """LocalTrainer.sgd of each row of a stacked request: its vectors are [k, n] (row i is client i's, whose
        data and generator are `data[i]` and `generators[i]`) or one [n] vector shared by every row; its numbers
        are shared. Returns params [k, n] (one new array), mean_loss [k] and steps [k]."""
        count = len(data)
        if request.random_epochs:  # each row's own draw of passes: rows of the same count train together
            return self._stacked(self.sgd(list(zip(unstack(request, count), data, generators, strict=True))))
        # A few random batches, or a term without a stacked form (a per-step SVD of every client's layers, a loss
        # term through FlatModel.features' forward hook, which vmap and the perceptron's backward pass do not take):
        # one client at a time.
        if self.unavailable is not None or not request.batched:
            jobs = zip(unstack(request, count), data, generators, strict=True)
            return self._stacked([self._sequential.sgd(row, d, g) for row, d, g in jobs])
        steps = np.array([_steps(request, d) for d in data], np.int64)
        order = np.argsort(-steps, kind="stable")  # longest first: the clients still training are a prefix
        ordered = not np.any(order != np.arange(count))
        if not ordered:
            request = _rows_of(request, order, count)
            data, generators = [data[i] for i in order], [generators[i] for i in order]
        result = self._train(request, data, generators)
        if ordered:
            return result
        back = np.argsort(order)
        return SGDResult(result.params[back], np.asarray(result.mean_loss)[back], np.asarray(result.steps)[back])

    def _stacked(self, rows: list[SGDResult]) -> SGDResult:
        """Clients' results trained one at a time as one result of rows (params [k, n], mean_loss [k], steps [k])."""
        return SGDResult(
            np.stack([r.params for r in rows]) if rows else np.empty((0, self.model.size), np.float32),
            np.array([r.mean_loss for r in rows]),
            np.array([r.steps for r in rows]),
        )

    def batch_gradients_rows(
        self, request: BatchGradients, data: Sequence[ClientData], generators: Sequence[Draws]
    ) -> BatchGradientsResult:
        """LocalTrainer.batch_gradients of each row of a stacked request (points [k, p, n], row i client i's, drawing
        from `data[i]` with `generators[i]`): each row's batch drawn as there, padded with samples of weight zero
        to the widest, and each of the p points one batched gradient for all rows. Returns grads [k, p, n] and
        losses [k, p]."""
        points = np.asarray(request.points, np.float32)
        count, size = len(data), self.model.size
        if points.ndim != 3 or points.shape[0] != count:
            raise ValueError(f"batch_gradients_rows: points must be [{count}, p, n], got {points.shape}")
        if self.unavailable is not None:
            rows = [
                self._sequential.batch_gradients(BatchGradients(points[i], request.batch_size), data[i], generators[i])
                for i in range(count)
            ]
            return BatchGradientsResult(np.stack([r.grads for r in rows]), np.stack([r.losses for r in rows]))
        batches: list[tuple[np.ndarray, np.ndarray] | None] = []
        for client, generator in zip(data, generators, strict=True):
            if not len(client.train):
                batches.append(None)
                continue
            batch = client.train[generator.permutation(len(client.train))[: request.batch_size]]
            batches.append(client.batch(batch, generator, training=True))
        width = max([len(b[1]) for b in batches if b is not None], default=1)
        first = next((b for b in batches if b is not None), None)
        grads = np.zeros_like(points)
        losses = np.full(points.shape[:2], np.nan)
        if first is None:
            return BatchGradientsResult(grads, losses)
        x = torch.zeros((count, width, *first[0].shape[1:]), dtype=torch.float32)
        y = torch.zeros((count, width), dtype=torch.from_numpy(first[1]).dtype)
        weight = torch.zeros((count, width), dtype=torch.float32)
        for i, b in enumerate(batches):
            if b is not None:
                n = len(b[1])
                x[i, :n], y[i, :n], weight[i, :n] = torch.from_numpy(b[0]), torch.from_numpy(b[1]), 1.0 / n
                x[i, n:] = x[i, :1]  # padding: a real sample, weighted zero
        x, y, weight = x.to(self.device), y.to(self.device), weight.to(self.device)
        out = torch.empty((count, size), dtype=torch.float32, device=self.device)
        views = self.model.spec.unflatten(out)
        for index in range(points.shape[1]):
            params = self.model.spec.unflatten(self._rows(np.ascontiguousarray(points[:, index]), count))
            loss, gradients = self._gradients(params, None, x, y, weight)
            for name, gradient in gradients.items():
                if isinstance(gradient, tuple):  # a perceptron's weight: its factors' product
                    gradient = torch.bmm(gradient[0], gradient[1].transpose(1, 2))
                views[name].copy_(gradient)
            grads[:, index] = out.cpu().numpy()
            losses[:, index] = loss.cpu().numpy()
        empty = np.array([b is None for b in batches])
        grads[empty], losses[empty] = 0.0, np.nan
        return BatchGradientsResult(grads, losses)

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

    @overload
    def _rows(self, vectors: np.ndarray, count: int, dtype: torch.dtype = ...) -> torch.Tensor: ...

    @overload
    def _rows(self, vectors: np.ndarray | None, count: int, dtype: torch.dtype = ...) -> torch.Tensor | None: ...

    def _rows(self, vectors: np.ndarray | None, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """A request's [k, n] rows (or one [n] vector for every row, expanded without a copy) as a tensor on the
        device: on the CPU a view of the array (only ever read), on a GPU a copy."""
        if vectors is None:
            return None
        array = np.asarray(vectors)
        with warnings.catch_warnings():  # read-only arrays (object store, shared initial states): only read here
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array).to(self.device, dtype)
        return tensor.expand(count, -1) if tensor.ndim == 1 else tensor

    def _train(self, request: LocalSGD, data: Sequence[ClientData], generators: Sequence[Draws]) -> SGDResult:
        """One chunk of rows, sorted by step count (longest first), in one lockstep loop."""
        count = len(data)
        start = np.asarray(request.start)
        if request.in_place and self._trainable_in_place(start):
            flat = torch.from_numpy(start)  # the rows themselves (LocalSGD.in_place): no copy
        else:
            flat = torch.empty((count, self.model.size), dtype=torch.float32, device=self.device)
            flat.copy_(self._rows(start, count))
        params = self.model.spec.unflatten(flat)  # per-layer views [k, *shape] of the one buffer
        layers = lambda vectors, dtype=torch.float32: self._layers_of(vectors, count, dtype)  # noqa: E731
        rows = RowsContext(count, self.model.size, request.lr, layers, self.model.spec.unflatten, self.device)
        terms = [term.stacked(rows) for term in request.terms]
        shifts = [shift for term in terms if (shift := term.shift()) is not None]
        update = _Update(request, params, terms, layers)
        widths = None if self.train_sizes is None else step_widths(self.train_sizes, request.batch_size, request.epochs)
        batches = _Batches(request, widths, data, generators, self._source, self._features)
        losses = torch.zeros((count, len(batches.active)), dtype=torch.float32, device=self.device)
        for step, active in enumerate(batches.active):
            x, y, weight = batches.step(step, active)
            now = {name: p[:active] for name, p in params.items()}
            moved = _shifted(shifts, active)
            losses[:active, step], gradients = self._gradients(now, moved, x, y, weight)
            for term in terms:
                term.before_step(flat[:active])
            for name, p in now.items():
                update(name, p, gradients[name])
        seen = losses.cpu().numpy().astype(np.float64)
        totals = np.asarray(batches.totals)
        mean_loss = np.array([np.mean(seen[i, :steps]) if steps else np.nan for i, steps in enumerate(totals)])
        return SGDResult(start if flat.data_ptr() == start.ctypes.data else flat.cpu().numpy(), mean_loss, totals)

    def _trainable_in_place(self, start: np.ndarray) -> bool:
        """Whether a request's rows can be trained where they are: writable float32 rows [k, n] in one block of
        memory, on a CPU device."""
        return (
            self.device.type == "cpu"
            and start.ndim == 2
            and start.dtype == np.float32
            and start.flags.c_contiguous
            and start.flags.writeable
        )

    def _features(self, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A buffer of `rows` samples of `shape` for a chunk's batches, kept from chunk to chunk (made of zeros
        once, grown when needed): its rows always hold finite values (see _Batches.buffer)."""
        size = rows * int(np.prod(shape))
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.zeros(size, device=self.device)
        return self._buffer[:size].view(rows, *shape)

    def _layers_of(self, vectors: np.ndarray | None, count: int, dtype: torch.dtype) -> Layers | None:
        """A request's rows (or shared vector) as per-layer views [k, *shape] on the device."""
        rows = self._rows(vectors, count, dtype)
        return None if rows is None else self.model.spec.unflatten(rows)


def _shifted(shifts: list[Layers], active: int) -> Layers | None:
    """Per layer, what the first `active` rows' point of f_i is shifted by (the terms' shifts summed), or None."""
    if not shifts:
        return None
    total = {name: value[:active] for name, value in shifts[0].items()}
    for shift in shifts[1:]:
        total = {name: value + shift[name][:active] for name, value in total.items()}
    return total


class _Update:
    """LocalTrainer.sgd's parameter update for one chunk's stacked layers (its velocity lives here), with the
    request's terms in their stacked form (StackedTerm).

    The gradient of weight_decay x and the terms is decay x + the terms' constants (decay = weight_decay + the terms'
    decays, the constants added in the terms' order), read from the request's rows (views, no copies). A weight
    gradient given as a product (a perceptron's) is computed straight into the velocity (momentum) or, without
    momentum or mask, into the parameters: x <- (1 - lr decay) x - lr delta input^T in one product, then the
    constants times -lr (the same values as LocalTrainer's up to rounding). After the step each term's map."""

    def __init__(
        self, request: LocalSGD, params: Layers, terms: list[StackedTerm], layers: Callable[..., Layers | None]
    ):
        """`layers(vectors, dtype)` views a request's rows (or shared vector) per layer (VectorizedTrainer)."""
        self.lr, self.momentum = request.lr, request.momentum
        self.terms = terms
        self.decay = request.weight_decay + sum(term.decay for term in terms)
        mask = layers(request.mask, torch.bool)
        self.frozen = None if mask is None else {name: ~m for name, m in mask.items()}
        self.velocity = {name: torch.zeros_like(p) for name, p in params.items()} if request.momentum else None

    def __call__(self, name: str, p: torch.Tensor, gradient: Gradient) -> None:
        """One SGD step of layer `name` for the active clients (the first len(p) of the chunk)."""
        active = len(p)
        frozen = None if self.frozen is None else self.frozen[name][:active]
        moving = None if self.velocity is None else self.velocity[name][:active]
        if isinstance(gradient, tuple) and moving is None and frozen is None:
            p.baddbmm_(gradient[0], gradient[1].transpose(1, 2), beta=1.0 - self.lr * self.decay, alpha=-self.lr)
            self._add_constants(name, p, -self.lr)
            self._after_step(name, p, frozen)
            return
        if isinstance(gradient, tuple):  # with momentum: v = momentum v + delta input^T, the other terms below
            product = (gradient[0], gradient[1].transpose(1, 2))
            gradient = moving.baddbmm_(*product, beta=self.momentum) if moving is not None else torch.bmm(*product)
            moving = None  # already folded in
        elif moving is not None:
            gradient = torch.add(gradient, moving, alpha=self.momentum, out=moving)
        if self.decay:
            gradient.add_(p, alpha=self.decay)
        self._add_constants(name, gradient, 1.0)
        if frozen is not None:  # a frozen coordinate's gradient, hence also its velocity, stays 0
            gradient.masked_fill_(frozen, 0.0)
        p.sub_(gradient, alpha=self.lr)
        self._after_step(name, p, frozen)

    def _add_constants(self, name: str, target: torch.Tensor, scale: float) -> None:
        for term in self.terms:
            term.add_constant(name, target, scale)

    def _after_step(self, name: str, p: torch.Tensor, frozen: torch.Tensor | None) -> None:
        for term in self.terms:
            term.after_step(name, p, frozen)


def stack_requests(requests: Sequence[LocalSGD]) -> LocalSGD:
    """Requests of the same group (`group_key`) as one request over their rows: start and mask [k, n], each term
    stacked (Term.stack), numbers shared."""
    first = requests[0]
    width = _size(first)
    stacked: dict[str, Any] = {"start": np.stack([np.broadcast_to(np.asarray(r.start), (width,)) for r in requests])}
    if first.mask is not None:
        stacked["mask"] = np.stack([np.broadcast_to(np.asarray(r.mask), (width,)) for r in requests])
    terms = [type(term).stack([r.terms[i] for r in requests], width) for i, term in enumerate(first.terms)]
    return dataclasses.replace(first, **stacked, terms=tuple(terms))


def _size(request: LocalSGD) -> int:
    return int(np.asarray(request.start).shape[-1])


def _rows_of(request: LocalSGD, order: np.ndarray, count: int) -> LocalSGD:
    """The request with its [k, n] rows (start, mask, the terms' vectors) permuted by `order`."""
    permuted: dict[str, Any] = {"terms": tuple(term.rows_of(order) for term in request.terms)}
    for name in ("start", "mask"):
        value = getattr(request, name)
        if value is not None and np.ndim(value) == 2:
            permuted[name] = np.asarray(value)[order]
    return dataclasses.replace(request, **permuted)


def _steps(request: LocalSGD, data: ClientData) -> int:
    """How many SGD steps LocalTrainer.sgd takes for a request on a client's data."""
    if request.random_batches is not None:
        return request.random_batches if len(data.train) else 0
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

    def __init__(
        self,
        request: LocalSGD,
        widths: np.ndarray | None,
        data: Sequence[ClientData],
        generators: Sequence[Draws],
        source: Callable[[np.ndarray], torch.Tensor],
        features: Callable[[int, tuple[int, ...]], torch.Tensor],
    ):
        """The batches of the rows of `request` (longest first), row i drawn from `data[i]` with `generators[i]`,
        the batches of step t padded to `widths[t]` samples (`step_widths` of the run; None: the batch size at
        every step); `features(rows, shape)` gives the buffer of a step's samples (VectorizedTrainer._features).
        A step's width must not depend on which clients share the chunk: products over a batch round differently
        at another width."""
        self.data, self.generators = data, generators
        self.batch_size = request.batch_size
        self.sizes = [len(d.train) for d in data]
        self.per_epoch = [-(-n // request.batch_size) for n in self.sizes]
        self.totals = [request.epochs * p for p in self.per_epoch]
        length = max(self.totals, default=0)
        if widths is None:
            widths = np.full(length, request.batch_size, np.int64)
        if len(widths) < length:
            raise ValueError(f"_Batches: a client trains {length} steps, the run's widths cover {len(widths)}")
        self.widths = widths[:length]
        """Samples of each step's batches, padding included (the run's, so the same whatever the chunk)."""
        width = max(1, int(self.widths.max(initial=0)))
        """The stored batches' width: the widest step's (the batch size when a client of the run has more)."""
        if any(min(n, request.batch_size) > width for n in self.sizes):
            raise ValueError(
                f"_Batches: a client's batches are wider than the run's {width} samples "
                "(VectorizedTrainer.train_sizes lacks its training split's size)"
            )
        self.active = [sum(total > step for total in self.totals) for step in range(length)]
        """How many clients (a prefix: rows come longest first) still train at each step."""
        self.sources = [source(d.x) if d.inputs.plain else None for d in data]
        """Each client's features on the device, if they are model input as stored (else read through Inputs)."""
        self.shared = all(array is not None and array is self.sources[0] for array in self.sources)
        """Whether every client's features are one plain array (then one gather serves them all)."""
        first = data[0]
        self.read_together = not self.shared and all(
            d.x is first.x and d.inputs == first.inputs and d.inputs.augment == "none" for d in data
        )
        """Whether every client reads one stored array through the same normalization (then one read serves all)."""
        self.fresh = [i for i, d in enumerate(data) if d.noise_std or d.random_labels]
        self.orders: dict[int, np.ndarray] = {}
        self.draws: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """An augmenting client's crop corners [steps, batch, 2] and flips [steps, batch] (padding: no-ops)."""
        index = np.zeros((length, len(data), width), np.int64)
        weight = np.zeros((length, len(data), width), np.float32)
        labels = np.zeros((length, len(data), width), first.y.dtype)
        fresh = set(self.fresh)
        for i, (client, generator) in enumerate(zip(data, generators, strict=True)):
            n, per_epoch, total = self.sizes[i], self.per_epoch[i], self.totals[i]
            if not total:
                continue
            last = n - (per_epoch - 1) * request.batch_size
            weight[:total, i] = 1.0 / request.batch_size
            weight[per_epoch - 1 : total : per_epoch, i] = 0.0
            weight[per_epoch - 1 : total : per_epoch, i, :last] = 1.0 / last
            if i in fresh:
                continue
            augments = client.inputs.augment != "none"
            if augments:
                corners = np.full((total, width, 2), client.inputs.padding, np.int64)
                flips = np.zeros((total, width), bool)
                self.draws[i] = (corners, flips)
            plan = np.empty((request.epochs, per_epoch * width), np.int64)
            for epoch in range(request.epochs):
                plan[epoch, :n] = client.train[generator.permutation(n)]
                for batch in range(per_epoch if augments else 0):
                    count, at = min(request.batch_size, n - batch * request.batch_size), epoch * per_epoch + batch
                    drawn = client.inputs.draw(count, generator)
                    assert drawn is not None  # augments: Inputs.draw draws
                    corners[at, :count], flips[at, :count] = drawn
            plan[:, n:] = plan[:, :1]  # padding: a real sample, weighted zero
            index[:total, i] = plan.reshape(total, width)
            labels[:total, i] = client.y[index[:total, i]]
        self.plan = index
        self.counts = (weight > 0).sum(axis=2)
        """The real (weighted) samples of each client's batch at each step [steps, clients]: a prefix of the batch."""
        if length and np.any(self.counts.max(axis=1) > self.widths):
            step = int(np.argmax(self.counts.max(axis=1) > self.widths))
            raise ValueError(
                f"_Batches: a client has {self.counts[step].max()} samples at step {step}, wider than the run's "
                f"{self.widths[step]} (VectorizedTrainer.train_sizes lacks its training split's size)"
            )
        self.buffer = features(len(data) * width, tuple(first.x.shape[1:]))
        """The gathered features of a step, one buffer for all steps (and chunks). Rows read through Inputs are read
        for real samples only: a padding row keeps an earlier step's finite values, which its zero weight cancels
        exactly."""
        device = self.buffer.device
        self.index = torch.from_numpy(index).to(device)
        self.weight = torch.from_numpy(weight).to(device)
        self.labels = torch.from_numpy(labels).to(device)

    def step(self, step: int, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features [active, batch, *input], targets [active, batch] and sample weights of the active clients."""
        width = int(self.widths[step])
        rows = self.buffer[: active * width]
        features = rows.view(active, width, *rows.shape[1:])
        shared = self.sources[0] if self.shared else None  # every client reads the one source
        if shared is not None:
            torch.index_select(shared, 0, self.index[step, :active, :width].reshape(-1), out=rows)
        elif self.read_together:
            data = self.data[0]
            real = np.flatnonzero(np.arange(width) < self.counts[step, :active, None])
            indices = self.plan[step, :active, :width].reshape(-1)[real]
            if rows.device.type == "cpu":  # straight into the buffer
                data.inputs.rows_into(data.x, indices, rows.numpy().reshape(len(rows), -1), real)
            else:
                rows[torch.from_numpy(real).to(rows.device)] = torch.from_numpy(data.inputs.rows(data.x, indices))
        else:
            for i in range(active):
                source, data = self.sources[i], self.data[i]
                if source is not None:
                    torch.index_select(source, 0, self.index[step, i, :width], out=features[i])
                elif not (data.noise_std or data.random_labels):  # a fresh client's batch is made below
                    count, draws = self.counts[step, i], self.draws.get(i)
                    cropping = None if draws is None else _at(draws, step, count)
                    plan = data.inputs.rows(data.x, self.plan[step, i, :count], cropping)
                    features[i, :count].copy_(torch.from_numpy(plan))
        for i in self.fresh:
            if i >= active:
                break
            data, generator = self.data[i], self.generators[i]
            epoch_step = step % self.per_epoch[i]
            if epoch_step == 0:
                self.orders[i] = generator.permutation(self.sizes[i])
            size = self.batch_size
            batch = data.train[self.orders[i][epoch_step * size : (epoch_step + 1) * size]]
            xb, yb = data.batch(batch, generator, training=True)
            features[i, : len(batch)] = torch.from_numpy(xb)
            if self.sources[i] is None:  # padding of a client read through Inputs: finite, weighted zero
                features[i, len(batch) :] = 0.0
            self.labels[step, i, : len(batch)] = torch.from_numpy(yb)
        return features, self.labels[step, :active, :width], self.weight[step, :active, :width]


def step_widths(sizes: np.ndarray, batch_size: int, epochs: int) -> np.ndarray:
    """The widest batch at each lockstep step of `epochs` epochs over clients of the training-split `sizes` (each
    epoch a client's full batches of `batch_size`, then its rest): a step pads to it, so no step is wider than a
    client of the run needs, and the widths depend on the run alone, never on a chunk's clients."""
    sizes = np.asarray(sizes, np.int64)
    sizes = sizes[sizes > 0]
    per_epoch = -(-sizes // batch_size)
    widths = np.zeros(int(epochs * per_epoch.max(initial=0)), np.int64)
    for steps in np.unique(per_epoch):
        rest = int((sizes[per_epoch == steps] - (steps - 1) * batch_size).max())
        at = np.arange(epochs * steps)
        here = np.where(at % steps == steps - 1, rest, batch_size)
        np.maximum(widths[: len(here)], here, out=widths[: len(here)])
    return widths


def _at(draws: tuple[np.ndarray, np.ndarray], step: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A client's augmentation draws at one step, of its batch's first `count` samples."""
    return draws[0][step, :count], draws[1][step, :count]
