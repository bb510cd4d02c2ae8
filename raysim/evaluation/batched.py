"""Batched scorers: the loss, accuracy and outputs of a FlatModel on many samples, many groups of samples and
many parameter vectors at once, each group's scores the same as if it were scored alone (MIN_ROWS)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raysim.models.flat import FlatModel


@dataclass(frozen=True)
class SampleScores:
    """What passes give for each of their samples: its mean loss (float64), its correct outputs (0 for regression),
    and the network's outputs when kept."""

    losses: np.ndarray
    correct: np.ndarray
    outputs: np.ndarray | None

    @classmethod
    def empty(cls, count: int, classes: int | None) -> SampleScores:
        outputs = None if classes is None else np.empty((count, classes), np.float32)
        return cls(np.empty(count, np.float64), np.empty(count, np.int64), outputs)

    def fill(self, at: int, losses: np.ndarray, correct: np.ndarray, outputs: Any = None) -> None:
        """Write a pass's samples from position `at` (outputs: an array or tensor, kept only if this keeps them)."""
        part = slice(at, at + len(losses))
        self.losses[part], self.correct[part] = losses, correct
        if self.outputs is not None and outputs is not None:
            self.outputs[part] = np.asarray(outputs)


@dataclass(frozen=True)
class Scores:
    """What one forward pass over some samples gives an evaluation."""

    loss: float
    accuracy: float
    """NaN for regression."""
    loss_sum: float
    """The FLAME authors' fairness unit: the sum over consecutive batches of `sum_batch` samples of each batch's
    mean loss (NaN without `sum_batch`)."""
    outputs: np.ndarray | None
    """The network's outputs (logits) when asked for (`keep_outputs`): the same as FlatModel.predict gives."""


class Scorer:
    """Scores of a model's parameter vectors on groups of samples, in as few passes as give the same results as one
    group at a time."""

    def __init__(self, model: FlatModel):
        self.model = model

    def evaluate(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray, chunk: int = 2048) -> tuple[float, float]:
        """(mean loss, accuracy) over the samples; accuracy is NaN for regression."""
        scores = self.scores(flat, x, y, chunk=chunk)
        return scores.loss, scores.accuracy

    def scores(
        self,
        flat: np.ndarray,
        x: np.ndarray,
        y: np.ndarray,
        sum_batch: int | None = None,
        keep_outputs: bool = False,
        chunk: int = 2048,
    ) -> Scores:
        """Everything an evaluation reads off one forward pass over the samples (see Scores)."""
        return self.scores_many(flat, [(x, y)], sum_batch, keep_outputs, chunk)[0]

    def scores_many(
        self,
        flat: np.ndarray,
        groups: Sequence[tuple[np.ndarray, np.ndarray]],
        sum_batch: int | None = None,
        keep_outputs: bool = False,
        chunk: int = 2048,
    ) -> list[Scores]:
        """`scores` of one parameter vector on each group of samples (e.g. the global model on every client's
        test split), with the groups' samples going through the network together (`sample_scores_many`)."""
        samples = self.sample_scores_many(flat, groups, keep_outputs, chunk)
        return self.group_scores(samples, [len(y) for _, y in groups], sum_batch, keep_outputs)

    def scores_each(
        self,
        params: Sequence[np.ndarray],
        groups: Sequence[tuple[np.ndarray, np.ndarray]],
        sum_batch: int | None = None,
        keep_outputs: bool = False,
        rows: int = 8192,
    ) -> list[Scores]:
        """`scores` of each group at its own parameter vector (every client's PM on its own split), the groups in
        batched products (`sample_scores_each`)."""
        samples = self.sample_scores_each(params, groups, keep_outputs, rows)
        return self.group_scores(samples, [len(y) for _, y in groups], sum_batch, keep_outputs)

    @torch.no_grad()
    def sample_scores_many(
        self,
        flat: np.ndarray,
        groups: Sequence[tuple[np.ndarray, np.ndarray]],
        keep_outputs: bool = False,
        chunk: int = 2048,
    ) -> SampleScores:
        """Each sample's scores at one parameter vector, the samples of all groups in order, `chunk` rows a pass.

        A sample's output does not depend on which others share its pass: every pass has at least MIN_ROWS rows
        (a short one is padded with copies of its first row), as MKL takes a different, differently rounded path
        for up to 3 rows (measured with this machine's AVX-512 MKL; tests/unit/test_models.py checks it). So the scores
        of a group are the same whatever groups it is scored with."""
        samples = SampleScores.empty(sum(len(y) for _, y in groups), self._outputs_kept(keep_outputs))
        params = torch.tensor(flat, dtype=torch.float32)
        filled = 0
        for xs, ys in _blocks(groups, chunk):
            logits = self._padded_forward(params, torch.from_numpy(xs))
            samples.fill(filled, *self._sample_scores(logits, torch.from_numpy(ys)), logits if keep_outputs else None)
            filled += len(ys)
        return samples

    @torch.no_grad()
    def sample_scores_each(
        self,
        params: Sequence[np.ndarray],
        groups: Sequence[tuple[np.ndarray, np.ndarray]],
        keep_outputs: bool = False,
        rows: int = 8192,
    ) -> SampleScores:
        """Each sample's scores at its group's own parameter vector, the samples of all groups in order.

        A Flatten/Linear/ReLU stack scores many groups in one batched product per layer: the groups, shortest
        first, are packed `rows` padded rows at a time, each padded with zeros to the pack's longest (at least
        MIN_ROWS rows). A group's scores are exactly those of `scores` on it alone (tests/unit/test_models.py), so
        they do not depend on which clients share a host. Other models score one group at a time."""
        if len(params) != len(groups):
            raise ValueError(f"scores_each: {len(params)} parameter vectors for {len(groups)} groups")
        sizes = [len(y) for _, y in groups]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        samples = SampleScores.empty(int(starts[-1]), self._outputs_kept(keep_outputs))
        if self.model.layers is None:  # one group at a time, as `scores` scores it alone
            for g, (group, own) in enumerate(zip(groups, params, strict=True)):
                alone = self.sample_scores_many(own, [group], keep_outputs)
                samples.fill(int(starts[g]), alone.losses, alone.correct, alone.outputs)
            return samples
        for pack in _packs(sizes, rows):
            logits = self._stacked_forward([params[g] for g in pack], [groups[g][0] for g in pack])
            targets = torch.from_numpy(np.concatenate([groups[g][1] for g in pack]))
            losses, correct = self._sample_scores(logits, targets)
            kept = logits.numpy() if keep_outputs else None
            at = 0
            for g in pack:  # back to the groups' own order
                part = slice(at, at + sizes[g])
                samples.fill(int(starts[g]), losses[part], correct[part], None if kept is None else kept[part])
                at += sizes[g]
        return samples

    def _outputs_kept(self, keep_outputs: bool) -> int | None:
        return self.model.head.out_features if keep_outputs else None

    def _sample_scores(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's mean loss (float64) and its correct outputs (0 for regression), from a pass's outputs."""
        count = len(targets)
        losses = self.model.sample_losses(logits, targets).reshape(count, -1).mean(dim=1).double().numpy()
        if self.model.task != "classification":
            return losses, np.zeros(count, np.int64)
        return losses, (logits.argmax(dim=1) == targets).reshape(count, -1).sum(dim=1).numpy()

    def _stacked_forward(self, params: Sequence[np.ndarray], xs: Sequence[np.ndarray]) -> torch.Tensor:
        """A perceptron's outputs on each group's samples at the group's own parameters, as the rows of every
        group in order: nn.Linear's h W^T + b for all groups in one baddbmm per layer (MKL gives each group the
        same rounding as its own F.linear on at least MIN_ROWS rows)."""
        longest = max(MIN_ROWS, *(len(x) for x in xs))
        features = int(np.prod(self.model.input_shape))
        padded = np.zeros((len(xs), longest, features), np.float32)
        for row, x in enumerate(xs):
            padded[row, : len(x)] = x.reshape(len(x), -1)
        stacked = self.model.spec.unflatten(torch.from_numpy(np.stack(params)))
        hidden = torch.from_numpy(padded)
        layers = self.model.layers
        assert layers is not None  # only a perceptron's groups are scored stacked (sample_scores_*)
        for weight, bias in layers:
            if weight is None:
                hidden = torch.relu(hidden)
            elif bias is None:
                hidden = torch.bmm(hidden, stacked[weight].transpose(1, 2))
            else:
                hidden = torch.baddbmm(stacked[bias].unsqueeze(1), hidden, stacked[weight].transpose(1, 2))
        return torch.cat([hidden[row, : len(x)] for row, x in enumerate(xs)])

    def group_scores(
        self,
        samples: SampleScores,
        sizes: Sequence[int] | np.ndarray,
        sum_batch: int | None = None,
        keep_outputs: bool = False,
    ) -> list[Scores]:
        """Scores of consecutive groups of `sizes` samples from their samples' losses, hits and outputs (each group's
        sums in a few array operations over all groups, none depending on another group)."""
        losses, correct, kept = samples.losses, samples.correct, samples.outputs
        sizes = np.asarray(sizes, np.int64)
        starts = np.cumsum(sizes) - sizes
        counts = np.maximum(sizes, 1)
        mean_loss = _segment_sums(losses, starts, sizes) / counts
        if self.model.task == "classification":
            accuracy = _segment_sums(correct, starts, sizes) / counts
        else:
            accuracy = np.full(len(sizes), np.nan)
        loss_sum = np.full(len(sizes), np.nan)
        if sum_batch is not None:  # per group: the sum over its consecutive batches of `sum_batch` of the batch means
            batches = -(-sizes // sum_batch)
            offsets = np.arange(int(batches.sum())) - np.repeat(np.cumsum(batches) - batches, batches)
            batch_starts = np.repeat(starts, batches) + offsets * sum_batch
            batch_sizes = np.minimum(sum_batch, np.repeat(sizes, batches) - offsets * sum_batch)
            means = _segment_sums(losses, batch_starts, batch_sizes) / np.maximum(batch_sizes, 1)
            group_starts = np.cumsum(batches) - batches
            loss_sum = np.where(batches > 0, _segment_sums(means, group_starts, batches), 0.0)
        empty = np.zeros((0, self.model.head.out_features), np.float32)
        return [
            Scores(
                float(mean_loss[g]),
                float(accuracy[g]),
                float(loss_sum[g]),
                (kept[starts[g] : starts[g] + sizes[g]] if kept is not None else empty) if keep_outputs else None,
            )
            for g in range(len(sizes))
        ]

    def _padded_forward(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The network's outputs on `x`, computed on at least MIN_ROWS rows (see scores_many)."""
        if len(x) >= MIN_ROWS:
            return self.model.forward(params, x)
        padding = x[:1].expand(MIN_ROWS - len(x), *x.shape[1:])
        return self.model.forward(params, torch.cat([x, padding]))[: len(x)]


MIN_ROWS = 16
"""The fewest rows an evaluation pass has (Scorer.scores_many)."""


def _segment_sums(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The sum of each of the consecutive segments values[start : start + size] (0 for an empty one), each reduced
    on its own (np.add.reduceat over the non-empty segments, which tile the values)."""
    sums = np.zeros(len(starts), np.float64 if values.dtype.kind == "f" else np.int64)
    filled = sizes > 0
    if filled.any():
        sums[filled] = np.add.reduceat(values, starts[filled])
    return sums


def _packs(sizes: Sequence[int], rows: int) -> Iterator[list[int]]:
    """The indices of the non-empty groups, shortest first, in packs whose count times their longest (at least
    MIN_ROWS) stays within `rows` (a longer group alone)."""
    pack: list[int] = []
    for g in sorted((g for g in range(len(sizes)) if sizes[g]), key=lambda g: sizes[g]):
        if pack and (len(pack) + 1) * max(MIN_ROWS, sizes[g]) > rows:
            yield pack
            pack = []
        pack.append(g)
    if pack:
        yield pack


def _blocks(groups: Sequence[tuple[np.ndarray, np.ndarray]], chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The groups' samples in order, as (x, y) blocks of `chunk` rows (the last may be shorter)."""
    pending: list[tuple[np.ndarray, np.ndarray]] = []
    rows = 0
    for x, y in groups:
        begin = 0
        while begin < len(y):
            take = min(chunk - rows, len(y) - begin)
            pending.append((x[begin : begin + take], y[begin : begin + take]))
            rows += take
            begin += take
            if rows == chunk:
                yield np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending])
                pending, rows = [], 0
    if rows:
        yield np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending])
