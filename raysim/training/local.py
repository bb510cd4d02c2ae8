"""Runs a client's local work on its own data, one client at a time."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import torch

from raysim.algorithms.requests import (
    BatchGradients,
    BatchGradientsResult,
    ClassMeans,
    ClassMeansResult,
    FullGradient,
    GradientResult,
    LocalSGD,
    Request,
    Result,
    SGDResult,
    TrainModel,
    draws_randomness,
)
from raysim.data.augment import crop_flip
from raysim.jit import kernel
from raysim.models.flat import FlatModel
from raysim.training.authors_batches import ReplayedBatches

Augment = Literal["none", "crop_flip"]
"""Training-time augmentation (dataset.augment): crop_flip = with probability `crop_probability` a random crop of
the original size from the image zero-padded on each side, then a horizontal flip with probability 0.5
(torchvision's RandomCrop(padding) and RandomHorizontalFlip on the raw image, before Normalize)."""


def model_inputs(rows: np.ndarray, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> np.ndarray:
    """Dataset rows as model input: uint8 images (n, C, H, W) normalized per channel to float32,
    ((v / 255) - mean[c]) / std[c] with every operation in float32 (correctly rounded, so the same bits wherever it
    runs, and those of normalizing a whole float32 array up front); rows of a dataset without mean/std (stored
    ready, float32) are returned as they are."""
    if mean is None or std is None:
        return rows
    if rows.dtype != np.uint8 or rows.ndim != 4 or rows.shape[1] != len(mean):
        raise ValueError(
            f"model_inputs: per-channel normalization needs uint8 images (n, {len(mean)}, H, W), got {rows.dtype} "
            f"{rows.shape}"
        )
    normalized = rows.astype(np.float32)
    normalized /= np.float32(255.0)
    normalized -= np.asarray(mean, np.float32)[None, :, None, None]
    normalized /= np.asarray(std, np.float32)[None, :, None, None]
    return normalized


Draws = np.random.Generator | ReplayedBatches
"""Where a client's training randomness comes from: its seeded stream, or that stream with the mini-batches replayed
from the FLAME authors' code (clients.batches: authors)."""

CropDraws = tuple[np.ndarray, np.ndarray]
"""Per sample: the crop's top-left corner in the padded image (n x 2, each in 0..2 padding) and whether to flip (n)."""


@dataclass(frozen=True)
class Inputs:
    """How a dataset's stored rows become model input. Image datasets may be stored as uint8 so that CIFAR-100 or
    Tiny-ImageNet fit the object store; `mean`/`std` (per channel, pixel units in [0, 1]) then normalize rows as
    they are read. `augment` applies to training batches only (LocalSGD), never to evaluation or gradients."""

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: Augment = "none"
    padding: int = 4
    """crop_flip: zeros added on each side before cropping (4 on CIFAR, 8 on Tiny-ImageNet, FedSLR, App. B.1)."""
    crop_probability: float = 0.5
    """crop_flip: the share of samples that are cropped (0.5 in FedSLR's setting, FedSLR, App. B.1; 1: always, as
    torchvision's RandomCrop); the others keep the centred, uncropped image."""
    lengths: tuple[int, ...] = ()
    """Columns of packed multimodal rows that hold sequence lengths (raysim.data.modalities): feature noise
    leaves them as they are."""

    @property
    def plain(self) -> bool:
        """Rows are model input as stored: no normalization and no augmentation."""
        return self.mean is None and self.augment == "none"

    def draw(self, count: int, generator: Draws | None) -> CropDraws | None:
        """The augmentation of `count` training samples, drawn from the client's stream (corners, then flips)."""
        if self.augment == "none":
            return None
        if generator is None:
            raise ValueError("Inputs.draw: augmented training batches need the client's generator")
        corners = generator.integers(0, 2 * self.padding + 1, size=(count, 2))
        if self.crop_probability < 1:
            cropped = generator.random(count) < self.crop_probability
            corners = np.where(cropped[:, None], corners, self.padding)
        flips = generator.random(count) < 0.5
        return corners, flips

    def rows(self, x: np.ndarray, indices: np.ndarray, draws: CropDraws | None = None) -> np.ndarray:
        """The samples `indices` of the stored array `x` as model input, cropped and flipped as `draws` say."""
        if draws is None and self._normalizes(x):
            out = np.empty((len(indices), *x.shape[1:]), np.float32)
            self.rows_into(x, indices, out.reshape(len(indices), _width(x)), np.arange(len(indices)))
            return out
        rows = x[indices]
        if draws is not None:
            rows = crop_flip(rows, *draws, self.padding)
        return model_inputs(rows, self.mean, self.std)

    def rows_into(self, x: np.ndarray, indices: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        """Write the samples `indices` of `x`, not augmented, as model input into the rows `positions` of `out`
        ([rows, features] float32): normalized uint8 images in one pass (the bits of `model_inputs`), else copied."""
        if self._normalizes(x):
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            _normalize_rows(x.reshape(len(x), len(mean), -1), indices, mean, std, out, positions)
        else:
            out[positions] = model_inputs(x[indices], self.mean, self.std).reshape(len(indices), _width(x))

    def _normalizes(self, x: np.ndarray) -> bool:
        """Whether rows of `x` are uint8 images that this normalization turns into float32."""
        return self.mean is not None and x.dtype == np.uint8 and x.ndim == 4 and x.shape[1] == len(self.mean)


def _width(x: np.ndarray) -> int:
    """Features per row of `x`, spelled out: reshape(0, -1) is ambiguous, and an empty split (a client's
    validation part when partition.val_fraction is 0) is read as 0 rows."""
    return math.prod(x.shape[1:])


@kernel
def _normalize_rows(x, indices, mean, std, out, positions):
    """out[positions[r]] = ((x[indices[r]] / 255) - mean[c]) / std[c] per channel c, in float32 (model_inputs)."""
    channels, size = x.shape[1], x.shape[2]
    for r in range(len(indices)):
        source, target = indices[r], positions[r]
        for c in range(channels):
            for e in range(size):
                value = np.float32(x[source, c, e]) / np.float32(255.0)
                out[target, c * size + e] = (value - mean[c]) / std[c]


@dataclass(frozen=True)
class ClientData:
    """A view of the shared dataset arrays restricted to one client's indices (no copies made)."""

    x: np.ndarray
    y: np.ndarray
    train: np.ndarray
    test: np.ndarray
    val: np.ndarray
    noise_std: float = 0.0
    """Gaussian feature noise redrawn at every access (the quality-skew partition, raysim.data.partitions)."""
    random_labels: int = 0
    """If > 0, labels are redrawn uniformly from this many classes at every access (label poisoning)."""
    inputs: Inputs = Inputs()
    """How stored rows of `x` become model input (normalization of uint8 images, training augmentation)."""

    def batch(
        self, indices: np.ndarray, generator: Draws | None = None, training: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The samples `indices` as this client sees them: with its noise and poisoned labels, freshly drawn, and
        for a `training` batch its augmentation (drawn first, then the noise, then the labels)."""
        draws = self.inputs.draw(len(indices), generator) if training else None
        x, y = self.inputs.rows(self.x, indices, draws), self.y[indices]
        if not (self.noise_std or self.random_labels):
            return x, y
        if generator is None:
            raise ValueError("ClientData.batch: a client with noisy features or poisoned labels needs a generator")
        if self.noise_std:
            noise = generator.normal(0.0, self.noise_std, size=x.shape).astype(x.dtype)
            if self.inputs.lengths:  # drawn for every column, as for any dataset: the same stream either way
                noise[:, list(self.inputs.lengths)] = 0.0
            x = x + noise
        if self.random_labels:
            y = generator.integers(0, self.random_labels, size=len(y)).astype(y.dtype)
        return x, y

    @property
    def redrawn(self) -> bool:
        """Whether an access draws noise or labels: only then does an evaluation need the client's generator."""
        return bool(self.noise_std or self.random_labels)

    def arrays(self, split: str, generator: Draws | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.batch(getattr(self, split), generator)


@overload
def _tensor(array: None, dtype: type) -> None: ...


@overload
def _tensor(array: np.ndarray | float, dtype: type) -> torch.Tensor: ...


def _tensor(array: np.ndarray | float | None, dtype: type) -> torch.Tensor | None:
    return None if array is None else torch.from_numpy(np.array(array, dtype=dtype))


def drawn_epochs(request: LocalSGD, generator: Draws) -> LocalSGD:
    """`request` with its passes drawn when it asks for random ones (LocalSGD.random_epochs): uniform on 1..epochs,
    the request's first draw from its generator (so every executor draws them alike); else `request` itself."""
    if not request.random_epochs:
        return request
    return dataclasses.replace(request, epochs=int(generator.integers(1, request.epochs + 1)), random_epochs=False)


def training_batches(request: LocalSGD, indices: np.ndarray, generator: Draws) -> Iterator[np.ndarray]:
    """The samples of each step of a LocalSGD request: `epochs` passes over a fresh shuffle of `indices` in batches
    (the last one smaller), or `random_batches` steps each on one batch picked uniformly among a fresh shuffle's
    batches (the FLAME authors' `random.choice(list(trainloader))`). Lazily, so that whatever a batch draws from the
    generator (noise, labels, augmentation) is drawn before the next shuffle."""
    size = request.batch_size
    if request.random_batches is None:
        for _epoch in range(request.epochs):
            order = generator.permutation(len(indices))
            for start in range(0, len(order), size):
                yield indices[order[start : start + size]]
        return
    count = -(-len(indices) // size)
    for _step in range(request.random_batches if count else 0):
        order = generator.permutation(len(indices))
        pick = generator.pick(count) if isinstance(generator, ReplayedBatches) else int(generator.integers(count))
        yield indices[order[pick * size : (pick + 1) * size]]


class LocalTrainer:
    """Executes LocalSGD requests for the clients of one process with one torch model instance."""

    def __init__(self, model: FlatModel):
        self.model = model

    def sgd(self, request: LocalSGD, data: ClientData, generator: Draws) -> SGDResult:
        """Mini-batch SGD (with optional momentum) on the request's objective, its terms in order; see LocalSGD."""
        request = drawn_epochs(request, generator)
        x = torch.from_numpy(np.array(request.start, dtype=np.float32))
        # A copy: the arrays may be read-only views of Ray's object store, which torch must not alias.
        mask = None if request.mask is None else torch.from_numpy(np.array(request.mask, dtype=bool))
        terms = request.terms
        loss_term = next((term for term in terms if term.replaces_loss), None)
        noisy = self.model.stochastic or request.draws
        velocity = torch.zeros_like(x) if request.momentum else None
        window = slice(0, self.model.size) if loss_term is None else loss_term.model_window(self.model)
        statistics = self._statistics_written(mask, window, len(x))
        running = x.clone() if statistics is not None else None
        losses: list[float] = []
        for batch in training_batches(request, data.train, generator):
            xb, yb = (torch.from_numpy(a) for a in data.batch(batch, generator, training=True))
            seed = int(generator.integers(2**62)) if noisy else None  # after the batch's draws
            point = x
            for term in terms:
                point = term.evaluated_at(point)
            with self.model.batch_statistics(None if running is None else running[window]):
                if loss_term is None:
                    loss, grad = self.model.loss_and_grad(point, xb, yb, seed)
                else:
                    loss, grad = loss_term.loss_and_grad(self.model, point, xb, yb, seed)
            losses.append(loss)
            if request.weight_decay:
                grad.add_(x, alpha=request.weight_decay)
            for term in terms:
                term.add_gradient(grad, x)
            if mask is not None:
                grad.masked_fill_(~mask, 0.0)
            if velocity is not None:
                velocity.mul_(request.momentum).add_(grad)
                grad = velocity
            x.sub_(grad, alpha=request.lr)
            for term in terms:
                mapped = term.proximal(x, request.lr, self.model)
                if mapped is not x:  # a frozen coordinate stays where the step left it
                    x = mapped if mask is None else torch.where(mask, mapped, x)
            if statistics is not None and running is not None:
                x = torch.where(statistics, running, x)
        return SGDResult(
            params=x.numpy(), mean_loss=float(np.mean(losses)) if losses else float("nan"), steps=len(losses)
        )

    def _statistics_written(
        self, trained: torch.Tensor | None, window: slice | None = None, length: int | None = None
    ) -> torch.Tensor | None:
        """The coordinates a training step sets to its batch's running statistics rather than moves by a gradient
        (those of a layer that trains: a frozen layer's statistics stay as they are), or None when there are none;
        in a vector of `length` whose `window` holds the model (a loss term's vector: Term.model_window)."""
        if not self.model.has_statistics:
            return None
        statistics = torch.from_numpy(self.model.spec.statistics_mask())
        if window is not None and length is not None and length != len(statistics):
            placed = torch.zeros(length, dtype=torch.bool)
            placed[window] = statistics
            statistics = placed
        return statistics if trained is None else statistics & trained

    def train_model(
        self,
        request: TrainModel,
        data: ClientData,
        generator: Draws,
        on_step: Callable[[int, float], None] | None = None,
    ) -> SGDResult:
        """A TrainModel request on `data`'s training split: torch.optim.SGD's update (the gradient plus weight_decay
        times the parameters into the momentum buffer, then a step of the epoch's rate, `TrainModel.lr_at`) over
        `epochs` fresh shuffles; `on_step(epoch, loss)` after every step (a progress bar)."""
        x = torch.from_numpy(np.array(request.start, dtype=np.float32))
        velocity = torch.zeros_like(x)
        statistics = self._statistics_written(None)
        running = x.clone() if statistics is not None else None
        losses: list[float] = []
        one_pass = LocalSGD(request.start, 1, request.lr, request.batch_size)
        for epoch in range(request.epochs):
            lr = request.lr_at(epoch)
            for batch in training_batches(one_pass, data.train, generator):
                xb, yb = (torch.from_numpy(a) for a in data.batch(batch, generator, training=True))
                dropout_seed = int(generator.integers(2**62)) if self.model.stochastic else None
                with self.model.batch_statistics(running):
                    loss, grad = self.model.loss_and_grad(x, xb, yb, dropout_seed)
                grad.add_(x, alpha=request.weight_decay)
                velocity.mul_(request.momentum).add_(grad)
                x.sub_(velocity, alpha=lr)
                if statistics is not None and running is not None:
                    x = torch.where(statistics, running, x)
                losses.append(loss)
                if on_step is not None:
                    on_step(epoch, loss)
        return SGDResult(
            params=x.numpy(), mean_loss=float(np.mean(losses)) if losses else float("nan"), steps=len(losses)
        )

    def batch_gradients(self, request: BatchGradients, data: ClientData, generator: Draws) -> BatchGradientsResult:
        """The loss and gradient at each point of the request on one fresh mini-batch (see BatchGradients): its
        samples a uniform draw without replacement, then their augmentation, noise and labels, then one dropout
        seed shared by every point (a finite difference of gradients needs the same network at both points)."""
        points = np.asarray(request.points, np.float32)
        grads, losses = np.zeros_like(points), np.full(len(points), np.nan)
        if not len(data.train):
            return BatchGradientsResult(grads, losses)
        batch = data.train[generator.permutation(len(data.train))[: request.batch_size]]
        xb, yb = (torch.from_numpy(a) for a in data.batch(batch, generator, training=True))
        dropout_seed = int(generator.integers(2**62)) if self.model.stochastic else None
        for index, point in enumerate(points):
            loss, grad = self.model.loss_and_grad(torch.from_numpy(point.copy()), xb, yb, dropout_seed)
            grads[index], losses[index] = grad.numpy(), loss
        return BatchGradientsResult(grads, losses)

    def run(self, request: Request, data: ClientData, generator: Draws | None) -> Result:
        """Any request of a client step, by its kind; `generator` None only for one that draws nothing
        (raysim.algorithms.requests.draws_randomness)."""
        handler = self.handlers.get(type(request))
        if handler is None:
            raise TypeError(f"the trainer runs {', '.join(k.__name__ for k in self.handlers)}, not {request!r}")
        if generator is None and draws_randomness(request):
            raise ValueError(f"a {type(request).__name__} request needs the client's generator")
        return handler(request, data, generator)

    @property
    def handlers(self) -> dict[type, Callable[[Any, ClientData, Any], Result]]:
        """The one table of what runs each kind of request (raysim.algorithms.requests)."""
        return {
            LocalSGD: self.sgd,
            FullGradient: self.full_gradient,
            BatchGradients: self.batch_gradients,
            ClassMeans: self.class_means,
        }

    def full_gradient(self, request: FullGradient, data: ClientData, generator: Draws | None) -> GradientResult:
        """The mean loss over the request's split (its `indices`, or a random `fraction` of them) and its gradient,
        in one batch."""
        _check_split("FullGradient", request.split, data)
        split = getattr(data, request.split)
        positions = np.arange(len(split)) if request.indices is None else np.asarray(request.indices, np.int64)
        drawn = None
        if request.fraction < 1:
            if generator is None:
                raise ValueError("FullGradient: a random fraction of the split needs the client's generator")
            count = max(1, int(request.fraction * len(positions)))
            drawn = positions[generator.permutation(len(positions))[:count]]
            positions = drawn
        rows = split if request.indices is None and drawn is None else split[positions]
        xb, yb = (torch.from_numpy(a) for a in data.batch(rows, generator))
        point = torch.from_numpy(np.array(request.point, dtype=np.float32))
        loss, grad = self.model.loss_and_grad(point, xb, yb)
        return GradientResult(grad.numpy(), float(loss), drawn)

    def class_means(self, request: ClassMeans, data: ClientData, generator: Draws | None) -> ClassMeansResult:
        """The per-class sample counts of the request's split and, at its point, their mean features (the samples
        as the client sees them, with its noise and labels redrawn). The counts alone draw nothing: those of the
        stored labels, or for a client whose labels are redrawn uniformly from r classes their expectation, n / r
        for each of the r classes."""
        _check_split("ClassMeans", request.split, data)
        classes = self.model.head.out_features
        if not request.draws:
            labels = data.y[getattr(data, request.split)]
            if data.random_labels:
                counts = np.zeros(classes)
                counts[: data.random_labels] = len(labels) / data.random_labels
                return ClassMeansResult(counts, None)
            return ClassMeansResult(self.model.class_means(None, data.x[:0], labels, classes)[0], None)
        xb, yb = data.arrays(request.split, generator)
        counts, means = self.model.class_means(request.point, xb, yb, classes, embedding=request.embedding)
        return ClassMeansResult(counts, means)


def _check_split(kind: str, split: str, data: ClientData) -> None:
    """A ValueError unless `split` names a non-empty split of the client's data."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"{kind}.split: {split!r}; allowed: train, val, test")
    if not len(getattr(data, split)):
        raise ValueError(
            f"{kind}: this client's {split!r} split is empty (check the algorithm's split settings "
            "and partition.test_fraction / val_fraction)"
        )
