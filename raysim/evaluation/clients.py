"""Per-client evaluation on a host: the samples its clients are scored on at one evaluation (EvaluationData), and
the scores on them of a model shared by all the clients or of each client's own (ClientScorer), every split of every
client in batched passes (raysim.evaluation.batched)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from raysim.evaluation.batched import SampleScores, Scorer
from raysim.evaluation.classification import SingleLabelAuc, classification_scores_many
from raysim.evaluation.records import ModelScores
from raysim.models.flat import FlatModel
from raysim.seeding import Stream, rng

if TYPE_CHECKING:
    from raysim.training.local import ClientData

TrainLossUnit = Literal["mean", "batch_sum"]
"""The scored training loss: the mean over the split, or the sum over its batches of loss_sum_batch samples of the
batch-mean loss (the FedAPM authors' `inference`; tracking.train_loss_unit)."""

SPLITS = ("train", "test", "val")
"""A client's splits, in the order whose position keys a split's access-time draws at an evaluation."""


@dataclass(frozen=True)
class EvaluationData:
    """The samples some clients are scored on at one evaluation, each client's in one block (x, y): its test split,
    its train split when training losses are scored, its val split; `parts` [clients, 3] their sizes."""

    x: list[np.ndarray]
    y: list[np.ndarray]
    parts: np.ndarray
    with_train: bool

    def subset(self, keep: list[int]) -> EvaluationData:
        """The data of the clients at positions `keep`."""
        return EvaluationData([self.x[i] for i in keep], [self.y[i] for i in keep], self.parts[keep], self.with_train)


def evaluation_data(
    clients: Mapping[int, ClientData], client_ids: list[int], with_train: bool, seed: int, evaluation: int
) -> EvaluationData:
    """The clients' splits (`clients`: each one's data by id) as they see them at evaluation number `evaluation`:
    the samples of every client without per-access randomness read (and normalized) in one call; a client with it
    draws its noise and labels afresh, keyed by the evaluation count and split, so that every model it scores sees
    the same draw."""
    names = ("test", "train", "val") if with_train else ("test", "val")
    parts = np.zeros((len(client_ids), 3), np.int64)
    xs: list[np.ndarray] = [np.zeros(0)] * len(client_ids)
    ys: list[np.ndarray] = [np.zeros(0)] * len(client_ids)
    plain: dict[int, np.ndarray] = {}
    for position, client_id in enumerate(client_ids):
        data = clients[client_id]
        parts[position] = [len(data.test), len(data.train) if with_train else 0, len(data.val)]
        if not data.redrawn:  # nothing to draw: no generator to make (10,000 clients make 30,000 of them)
            plain[position] = np.concatenate([getattr(data, name) for name in names])
            ys[position] = data.y[plain[position]]
            continue
        drawn = [
            data.arrays(name, rng(seed, Stream.DATA_NOISE, client_id, evaluation, SPLITS.index(name))) for name in names
        ]
        xs[position] = np.concatenate([x for x, _ in drawn])
        ys[position] = np.concatenate([y for _, y in drawn])
    if plain:  # one read of the stored rows for all of them (one dataset, one normalization on a host)
        data = clients[client_ids[next(iter(plain))]]
        rows = data.inputs.rows(data.x, np.concatenate(list(plain.values())))
        blocks = np.split(rows, np.cumsum([len(indices) for indices in plain.values()])[:-1])
        for position, block in zip(plain, blocks, strict=True):
            xs[position] = block
    return EvaluationData(xs, ys, parts, with_train)


@dataclass(frozen=True)
class ClientScorer:
    """The scores (ModelScores) of models on clients' splits at one evaluation (ClientHost.evaluate)."""

    model: FlatModel
    loss_sum_batch: int
    """Batch size of the summed test loss (tracking.loss_sum_batch)."""
    auc_single_label: SingleLabelAuc
    """The AUC of a one-label test split (raysim.evaluation.classification.classification_scores)."""
    train_loss_unit: TrainLossUnit = "mean"
    """The unit of the training loss (tracking.train_loss_unit)."""

    def scores(self, params: np.ndarray | list[np.ndarray], data: EvaluationData) -> list[ModelScores]:
        """The scores on each client's splits of one model shared by all (a vector: Scorer.sample_scores_many) or
        of each client's own (a list, one per client: Scorer.sample_scores_each): every sample of every split in
        one pass per model; the training loss only where the train split is scored (else NaN)."""
        scorer, classifier = Scorer(self.model), self.model.task == "classification"
        groups = list(zip(data.x, data.y, strict=True))
        if isinstance(params, list):
            samples = scorer.sample_scores_each(params, groups, keep_outputs=classifier)
        else:
            samples = scorer.sample_scores_many(params, groups, keep_outputs=classifier)
        return self._summaries(scorer, samples, data)

    def output_scores(self, outputs: list[np.ndarray], data: EvaluationData) -> list[ModelScores]:
        """The scores on each client's splits of outputs computed elsewhere (Algorithm.feature_outputs: one
        [samples, C] array per client, its block's samples in order), as `scores` scores a network's outputs."""
        scorer = Scorer(self.model)
        logits = torch.from_numpy(np.concatenate(outputs).astype(np.float32))
        targets = torch.from_numpy(np.concatenate(data.y))
        samples = SampleScores.empty(len(targets), self.model.head.out_features)
        losses = self.model.sample_losses(logits, targets).double().numpy()
        samples.fill(0, losses, (logits.argmax(dim=1) == targets).long().numpy(), logits.numpy())
        return self._summaries(scorer, samples, data)

    def _summaries(self, scorer: Scorer, samples: SampleScores, data: EvaluationData) -> list[ModelScores]:
        """Each client's ModelScores from its samples' scores (in the clients' blocks' order)."""
        classifier, groups = self.model.task == "classification", data.y
        scores = scorer.group_scores(samples, data.parts.reshape(-1), self.loss_sum_batch, classifier)
        tests, trains, vals = scores[0::3], scores[1::3], scores[2::3]
        f1_auc = [(float("nan"), float("nan"))] * len(groups)
        if classifier and groups:
            f1_auc = classification_scores_many(
                np.concatenate([test.outputs for test in tests]),
                np.concatenate([y[:size] for y, size in zip(data.y, data.parts[:, 0], strict=True)]),
                data.parts[:, 0].tolist(),
                self.auc_single_label,
            )
        return [
            ModelScores(
                test.accuracy,
                test.loss,
                (train.loss if self.train_loss_unit == "mean" else train.loss_sum) if data.with_train else float("nan"),
                val.accuracy if size else float("nan"),
                f1,
                auc,
                test.loss_sum,
            )
            for test, train, val, size, (f1, auc) in zip(tests, trains, vals, data.parts[:, 2], f1_auc, strict=True)
        ]

    def own_scores(
        self, models: dict[int, np.ndarray | None], chunk: list[int], splits: EvaluationData
    ) -> dict[int, ModelScores]:
        """The scores of the clients' own models (None: the client has none) on their own splits."""
        owned = {i: model for i, c in enumerate(chunk) if (model := models[c]) is not None}
        having = list(owned)
        scores = self.scores(list(owned.values()), splits.subset(having))
        return {chunk[i]: score for i, score in zip(having, scores, strict=True)}
