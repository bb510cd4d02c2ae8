"""Knowledge transfer from a pretrained model (the teacher) to AugFL's meta-model on the server (AugFL, Sec. V).

Contrastive representation distillation (CRD, Tian et al.): the meta-model's penultimate features s =
g^theta(x) and the teacher's c = g^{theta_p}(x) on the server's transfer set D_s are mapped by heads f^s, f^c
(Linear to `feat_dim`, then L2-normalized) into one space. Each side is contrasted against a memory bank
of the other side's embeddings (|D_s| x feat_dim, updated with momentum 0.5): the positive is the same
sample, K = `negatives` others are drawn (`negatives_from`: uniform over all the other samples, or over the
samples of the other classes as the authors' CRD sampler does). With P = exp(f^s(s)^T m / tau) / Z and
Pn = 1/|D_s|,

    loss = -[log P_pos / (P_pos + K Pn) + sum_neg log K Pn / (P_neg + K Pn)] / batch     (per side, summed)

is R_h (AugFL, Sec. V; Z is fixed from the first batch, as in the CRD code). Two ways to get the
lambda * grad R_h that AugFL's server step (eq. 13) needs, `mode`:

- `paper`: grad_theta R_h at theta^t itself: one pass over D_s in mini-batches with theta fixed, the heads
  taking SGD steps (the critic's min over h); the theta-gradients are averaged.
- `code` (the authors' `CRD.train` and `train_distill`): one SGD epoch (lr 0.002, momentum 0.9,
  weight decay 5e-4) over D_s on ce_weight * CE + crd_weight * CRD; the average of the per-batch gradients of a
  student copy started at theta^t. Their loop zeroes the student's gradient before `optimizer.step()`, so the copy
  moves by weight decay and momentum alone (`student_step: weight_decay`; `gradient` steps it along its gradient,
  raysim's reading before issue 48), and it builds a new optimizer every round, so momentum restarts
  (`momentum_buffers: reset`).

The teacher's features on D_s are computed once (it is frozen and the server data are not augmented).
Heads, memory banks, Z and the momentum buffers persist across rounds in `CrdState`, part of AugFL's server state
(the buffers are used again only with `momentum_buffers: kept`). This module imports torch: only the coordinator
of an AugFL run with the CRD regularizer imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from raysim.algorithms.augfl.settings import TransferSettings
from raysim.algorithms.requests import Vector
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.seeding import Stream, rng, torch_seed


@dataclass
class CrdState:
    """What persists between rounds on the server (all float32 arrays, checkpointable)."""

    heads: Vector
    """Flat parameters of f^s then f^c."""
    head_velocity: Vector
    student_velocity: Vector
    """Momentum of the student copy (code mode; zeros otherwise)."""
    memory_student: np.ndarray
    memory_teacher: np.ndarray
    normalizers: Vector
    """(Z_student_side, Z_teacher_side); NaN until the first batch sets them."""
    rounds: int


class _Heads(nn.Module):
    def __init__(self, student_dim: int, teacher_dim: int, feat_dim: int):
        super().__init__()
        self.student = nn.Linear(student_dim, feat_dim)
        self.teacher = nn.Linear(teacher_dim, feat_dim)


def nce_loss(scores: torch.Tensor, num_data: int) -> torch.Tensor:
    """CRD's contrast loss of normalized scores [batch, 1 + K] (column 0: the positive)."""
    negatives = scores.shape[1] - 1
    noise = negatives / num_data
    eps = 1e-7
    positive = torch.log(scores[:, 0] / (scores[:, 0] + noise + eps))
    negative = torch.log(noise / (scores[:, 1:] + noise + eps))
    return -(positive.sum() + negative.sum()) / scores.shape[0]


class ContrastiveTransfer:
    """CRD between a student FlatModel (the meta-model) and a frozen teacher on a server dataset."""

    def __init__(
        self,
        settings: TransferSettings,
        student: FlatModel,
        teacher: FlatModel,
        teacher_params: Vector,
        x: np.ndarray,
        y: np.ndarray,
        seed: int,
    ):
        self.settings = settings
        self.student = student
        self.x = torch.tensor(x, dtype=torch.float32)  # copies: Ray's object store hands out read-only arrays
        self.y = torch.tensor(y, dtype=torch.int64)
        self.seed = seed
        pm = torch.tensor(teacher_params, dtype=torch.float32)
        with torch.no_grad():
            self.teacher_features = torch.cat([teacher.features(pm, chunk)[0] for chunk in self.x.split(1024)])
            student_dim = student.features(torch.zeros(student.size), self.x[:1])[0].shape[1]
        self.heads = _Heads(student_dim, self.teacher_features.shape[1], settings.feat_dim)
        self.head_spec = [(name, p.shape) for name, p in self.heads.named_parameters()]
        self._other_classes = self._other_class_table(y) if settings.negative_pool == "other_classes" else None

    @staticmethod
    def _other_class_table(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each class c, the indices of D_s whose label is not c (ascending, padded: row c of the table holds
        them in its first count[c] entries), the candidates of CRD's sampler for a positive of class c."""
        labels = np.asarray(y)
        classes = np.unique(labels)
        table = np.zeros((int(classes.max()) + 1, len(labels)), np.int64)
        counts = np.zeros(len(table), np.int64)
        for c in classes:
            others = np.flatnonzero(labels != c)
            if not len(others):
                raise ConfigError(
                    "algorithm.transfer.negatives_from=other_classes: the transfer set D_s holds one class only; "
                    "use negatives_from: others"
                )
            table[c, : len(others)] = others
            counts[c] = len(others)
        return table, counts

    @property
    def num_data(self) -> int:
        return len(self.y)

    def init_state(self) -> CrdState:
        """Heads from torch's default init and memory banks uniform in +-1/sqrt(feat_dim/3), as in CRD."""
        with torch.random.fork_rng():
            torch.manual_seed(torch_seed(self.seed, Stream.SERVER, 0))
            for layer in self.heads.modules():
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
        heads = torch.cat([p.detach().reshape(-1) for p in self.heads.parameters()]).numpy()
        bound = 1.0 / np.sqrt(self.settings.feat_dim / 3)
        generator = rng(self.seed, Stream.SERVER, 0)
        shape = (self.num_data, self.settings.feat_dim)
        memories = [generator.uniform(-bound, bound, shape).astype(np.float32) for _ in range(2)]
        return CrdState(
            heads.astype(np.float32),
            np.zeros_like(heads, dtype=np.float32),
            np.zeros(self.student.size, np.float32),
            memories[0],
            memories[1],
            np.full(2, np.nan, np.float32),
            0,
        )

    def _head_params(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        params, offset = {}, 0
        for name, shape in self.head_spec:
            size = int(np.prod(shape))
            params[name] = flat[offset : offset + size].view(shape)
            offset += size
        return params

    def _crd(self, student_features, heads, indices, contrast, memories, normalizers):
        """The symmetric CRD loss of one batch; updates `normalizers` in place on the first batch."""
        student_head = nn.functional.linear(student_features, heads["student.weight"], heads["student.bias"])
        teacher_head = nn.functional.linear(
            self.teacher_features[indices], heads["teacher.weight"], heads["teacher.bias"]
        )
        embed_s = nn.functional.normalize(student_head, dim=1)
        embed_t = nn.functional.normalize(teacher_head, dim=1)
        memory_s, memory_t = memories
        tau = self.settings.temperature
        # student embedding against the teacher-side memory, and the teacher embedding against the student's;
        # one matmul against the whole bank then a gather is far cheaper than gathering [batch, 1 + K, dim] rows
        scores_s = torch.exp((embed_s @ memory_t.T).gather(1, contrast) / tau)
        scores_t = torch.exp((embed_t @ memory_s.T).gather(1, contrast) / tau)
        if torch.isnan(normalizers).any():
            normalizers[0] = scores_s.mean().detach() * self.num_data
            normalizers[1] = scores_t.mean().detach() * self.num_data
        loss = nce_loss(scores_s / normalizers[0], self.num_data) + nce_loss(scores_t / normalizers[1], self.num_data)
        return loss, embed_s.detach(), embed_t.detach()

    def _update_memory(self, memory: torch.Tensor, indices: torch.Tensor, embedding: torch.Tensor) -> None:
        momentum = self.settings.memory_momentum
        memory[indices] = nn.functional.normalize(memory[indices] * momentum + embedding * (1 - momentum), dim=1)

    def draws(self, rounds: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of the epoch after `rounds` rounds, drawn as they are taken (a shuffled pass, as CRD's data
        loader): each batch's indices into D_s and its contrast indices [batch, 1 + K] (column 0 the positive, the
        same sample: CRD's mode `exact`), from the server's stream."""
        generator = rng(self.seed, Stream.SERVER, rounds + 1)
        order = torch.from_numpy(generator.permutation(self.num_data))
        for start in range(0, self.num_data, self.settings.batch_size):
            indices = order[start : start + self.settings.batch_size]
            negatives = torch.from_numpy(self._negatives(generator, indices.numpy()))
            yield indices, torch.cat([indices[:, None], negatives], dim=1)

    def _negatives(self, generator: np.random.Generator, indices: np.ndarray) -> np.ndarray:
        """K negatives per positive (see `TransferSettings.negatives_from`)."""
        if self._other_classes is None:  # uniform over the others, with replacement: skip the positive
            k = min(self.settings.negatives, self.num_data - 1)
            drawn = generator.integers(0, self.num_data - 1, size=(len(indices), k))
            return drawn + (drawn >= indices[:, None])
        table, counts = self._other_classes
        k = self.settings.negatives
        labels = self.y.numpy()[indices]
        drawn = np.empty((len(indices), k), np.int64)
        # CRD's sampler: np.random.choice(cls_negative[target], k, replace=k > len(cls_negative[target]))
        replace = k > counts[labels]
        rows = np.flatnonzero(replace)  # with replacement: uniform positions in each row's candidates, all at once
        positions = generator.integers(0, counts[labels[rows]][:, None], size=(len(rows), k))
        drawn[rows] = table[labels[rows][:, None], positions]
        for row in np.flatnonzero(~replace):
            drawn[row] = generator.choice(table[labels[row], : counts[labels[row]]], k, replace=False)
        return drawn

    def gradient(self, theta: Vector, state: CrdState) -> tuple[np.ndarray, CrdState, dict[str, float]]:
        """grad R_h at theta (see the module docstring for the two modes), the new state and metrics."""
        s = self.settings
        path = s.student_path
        student = torch.from_numpy(np.array(theta, dtype=np.float32))
        heads = torch.from_numpy(state.heads.copy())
        if s.reset_momentum:  # a new optimizer every round
            head_velocity, student_velocity = torch.zeros_like(heads), torch.zeros_like(student)
        else:
            head_velocity = torch.from_numpy(state.head_velocity.copy())
            student_velocity = torch.from_numpy(state.student_velocity.copy())
        memories = (torch.from_numpy(state.memory_student.copy()), torch.from_numpy(state.memory_teacher.copy()))
        normalizers = torch.from_numpy(state.normalizers.copy())
        gradient_sum = torch.zeros_like(student)
        losses, batches = [], 0
        for indices, contrast in self.draws(state.rounds):
            point = student.detach().requires_grad_(True)
            head_point = heads.detach().requires_grad_(True)
            features, logits = self.student.features(point, self.x[indices])
            loss, embed_s, embed_t = self._crd(
                features, self._head_params(head_point), indices, contrast, memories, normalizers
            )
            if s.code:
                loss = s.crd_weight * loss + s.ce_weight * nn.functional.cross_entropy(logits, self.y[indices])
            # a model without hidden layers (mlr) has the input as its features: then only CE reaches theta
            student_grad, head_grad = torch.autograd.grad(loss, [point, head_point], materialize_grads=True)
            gradient_sum += student_grad
            losses.append(float(loss.detach()))
            batches += 1
            with torch.no_grad():
                heads = _sgd(heads, head_grad, head_velocity, s.lr, s.momentum, s.weight_decay)
                if path == "gradient":  # the student copy moves along its gradient
                    student = _sgd(student, student_grad, student_velocity, s.lr, s.momentum, s.weight_decay)
                elif path == "weight_decay":  # its gradient zeroed before the step: weight decay and momentum only
                    student = _sgd(
                        student, torch.zeros_like(student), student_velocity, s.lr, s.momentum, s.weight_decay
                    )
                self._update_memory(memories[0], indices, embed_s)
                self._update_memory(memories[1], indices, embed_t)
        new = replace(
            state,
            heads=heads.numpy(),
            head_velocity=head_velocity.numpy(),
            student_velocity=student_velocity.numpy(),
            memory_student=memories[0].numpy(),
            memory_teacher=memories[1].numpy(),
            normalizers=normalizers.numpy(),
            rounds=state.rounds + 1,
        )
        return (gradient_sum / batches).numpy().astype(np.float64), new, {"transfer_loss": float(np.mean(losses))}


def _sgd(x: torch.Tensor, grad: torch.Tensor, velocity: torch.Tensor, lr: float, momentum: float, decay: float):
    """torch.optim.SGD's update (weight decay added to the gradient, then momentum); `velocity` in place."""
    step = grad + decay * x
    velocity.mul_(momentum).add_(step)
    return x - lr * velocity
