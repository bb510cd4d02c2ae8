"""AugFL's knowledge transfer (augfl.md 2): the CRD loss, the gradient the paper's server step uses, the
authors'-code variant (replayed against their CRD `train_distill` loop written again in plain torch), its switches
(how the student copy moves, the momentum across rounds, where negatives are drawn), and the state that persists
between rounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raysim.algorithms.augfl.crd import ContrastiveTransfer, CrdState, nce_loss
from raysim.algorithms.augfl.settings import TransferSettings
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.runtime import checkpoint

FEATURES, CLASSES, SAMPLES = 12, 3, 64


def _transfer(**settings) -> tuple[ContrastiveTransfer, np.ndarray]:
    generator = np.random.default_rng(0)
    x = generator.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    y = generator.integers(0, CLASSES, SAMPLES)
    student = FlatModel("mlp", (FEATURES,), CLASSES)
    teacher = FlatModel("mlp", (FEATURES,), CLASSES)
    options = {"feat_dim": 8, "negatives": 16, "batch_size": SAMPLES, **settings}
    pm = teacher.initial_parameters(5)
    transfer = ContrastiveTransfer(TransferSettings(**options), student, teacher, pm, x, y, 3)
    return transfer, student.initial_parameters(1)


def test_nce_loss_is_crds_contrast_loss():
    """-[log P+/(P+ + K Pn) + sum_neg log K Pn/(P- + K Pn)] / batch, with Pn = 1/|D_s| (augfl.md 2.2)."""
    scores = np.random.default_rng(1).uniform(0.01, 3.0, size=(5, 8))
    n, k = 100, 7
    expected = -(np.log(scores[:, 0] / (scores[:, 0] + k / n)).sum() + np.log((k / n) / (scores[:, 1:] + k / n)).sum())
    assert float(nce_loss(torch.from_numpy(scores), n)) == pytest.approx(expected / 5, rel=1e-6)


def test_paper_gradient_is_the_derivative_of_the_bound_at_theta():
    """One batch: the returned grad R_h is d/dtheta of the CRD loss at theta^t itself (heads, memories, Z and
    negatives fixed), checked by central differences of the loss along random directions."""
    transfer, theta = _transfer()
    _, state, _ = transfer.gradient(theta, transfer.init_state())  # sets Z; the next call reuses it
    gradient, _, _ = transfer.gradient(theta, state)
    generator = np.random.default_rng(2)
    for tilt in (0.0, 1.0, 2.0):  # the gradient's own direction and two random tilts of it (float32: keep g.v big)
        noise = generator.normal(size=theta.size)
        direction = gradient / np.linalg.norm(gradient) + tilt * noise / np.linalg.norm(noise)
        eps = 0.005 / np.linalg.norm(direction)
        plus = transfer.gradient(theta + eps * direction, state)[2]["transfer_loss"]
        minus = transfer.gradient(theta - eps * direction, state)[2]["transfer_loss"]
        assert (plus - minus) / (2 * eps) == pytest.approx(gradient @ direction, rel=0.01, abs=1e-3)


def test_paper_mode_trains_the_critic_while_theta_stays_put():
    """The heads take the critic's min over h (the loss falls round after round at a fixed theta)."""
    transfer, theta = _transfer(lr=0.5, momentum=0.0, batch_size=16)
    state = transfer.init_state()
    losses = []
    for _ in range(30):
        _, state, metrics = transfer.gradient(theta, state)
        losses.append(metrics["transfer_loss"])
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05
    assert not state.student_velocity.any()  # paper mode never moves the student copy


def test_code_mode_without_crd_is_the_epoch_average_of_the_cross_entropy_gradient():
    """augfl.md 2.2: with crd_weight 0 and a student copy that stays at theta^t, the epoch-averaged gradient over
    equal batches is the full-batch cross-entropy gradient on D_s; the authors' copy, moved by weight decay alone,
    stays within the decay's reach of it; one moved along its gradient (raysim before issue 48) does not."""
    code = {"mode": "code", "crd_weight": 0.0, "ce_weight": 1.0, "lr": 0.5, "momentum": 0.0, "batch_size": 16}
    transfer, theta = _transfer(**code, student_step="none")
    gradient, _, _ = transfer.gradient(theta, transfer.init_state())
    _, full = transfer.student.loss_and_grad(torch.from_numpy(theta), transfer.x, transfer.y)
    np.testing.assert_allclose(gradient, full.numpy(), atol=1e-6)
    decayed, _ = _transfer(**code)  # student_step: weight_decay, the code mode's default
    near, state, _ = decayed.gradient(theta, decayed.init_state())
    assert 0 < np.linalg.norm(near - full.numpy()) < 1e-2 * np.linalg.norm(full.numpy())
    # momentum 0, four batches: the velocity is the last step, weight decay at theta (1 - lr wd)^3, no gradient in it
    np.testing.assert_allclose(state.student_velocity, 5e-4 * theta * (1 - 0.5 * 5e-4) ** 3, rtol=1e-5)
    moving, _ = _transfer(**code, student_step="gradient")
    along_path, state, _ = moving.gradient(theta, moving.init_state())
    assert np.linalg.norm(along_path - full.numpy()) > 0.1 * np.linalg.norm(full.numpy())
    assert state.student_velocity.any()


def test_memory_banks_stay_unit_norm_and_the_state_round_trips_a_checkpoint(tmp_path):
    transfer, theta = _transfer(batch_size=16)
    _, state, _ = transfer.gradient(theta, transfer.init_state())
    np.testing.assert_allclose(np.linalg.norm(state.memory_student, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(state.memory_teacher, axis=1), 1.0, rtol=1e-5)
    assert np.isfinite(state.normalizers).all() and state.rounds == 1
    checkpoint.save_tree(tmp_path / "s.npz", state)
    back: CrdState = checkpoint.load_tree(tmp_path / "s.npz")
    first, after_first, _ = transfer.gradient(theta, state)
    second, after_second, _ = transfer.gradient(theta, back)
    assert first.tobytes() == second.tobytes()  # same seed and state: the same negatives, the same result
    for field in dataclasses.fields(CrdState):
        assert np.array_equal(getattr(after_first, field.name), getattr(after_second, field.name))


# --- the authors' code (github.com/zerui981105/AugFL, src/CRD), written again in plain torch as read there ---


class _Mlp(torch.nn.Module):
    """raysim's `mlp` (inputs-128-64-classes, ReLU) with the CRD repository's `is_feat` interface."""

    def __init__(self, inputs: int, classes: int):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (
            torch.nn.Linear(inputs, 128),
            torch.nn.Linear(128, 64),
            torch.nn.Linear(64, classes),
        )

    def load_flat(self, flat: np.ndarray) -> _Mlp:
        offset = 0
        with torch.no_grad():
            for p in self.parameters():  # weight then bias, layer by layer: the order of a flat vector
                p.copy_(torch.from_numpy(flat[offset : offset + p.numel()].reshape(p.shape)))
                offset += p.numel()
        assert offset == flat.size
        return self

    def forward(self, x, is_feat=False):
        feature = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        logits = self.fc3(feature)
        return ([feature], logits) if is_feat else logits


class _Embed(torch.nn.Module):
    """criterion.py's Embed: Linear then x / ||x||_2."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)

    def forward(self, x):
        x = self.linear(x.view(x.shape[0], -1))
        return x.div(x.pow(2).sum(1, keepdim=True).pow(0.5))


class _AuthorsCrd:
    """criterion.py's CRDLoss with memory.py's ContrastMemory (given contrast indices, mode exact) and ContrastLoss,
    the memory banks and Z living across rounds as in their `CRD` object."""

    def __init__(self, state: CrdState, dims: tuple[int, int], n_data: int, k: int):
        heads, offset = torch.from_numpy(state.heads.copy()), 0
        parts = []
        for shape in ((8, dims[0]), (8,), (8, dims[1]), (8,)):
            size = int(np.prod(shape))
            parts.append(heads[offset : offset + size].view(shape))
            offset += size
        self.embed_s, self.embed_t = _Embed(parts[0], parts[1]), _Embed(parts[2], parts[3])
        self.memory_v1 = torch.from_numpy(state.memory_student.copy())  # the student side's bank (v1 = f_s)
        self.memory_v2 = torch.from_numpy(state.memory_teacher.copy())
        self.z = [-1.0, -1.0]
        self.n_data, self.k, self.t, self.momentum = n_data, k, 0.07, 0.5

    def _contrast_loss(self, x):
        bsz, m = x.shape[0], x.size(1) - 1
        pn = 1 / float(self.n_data)
        p_pos = x.select(1, 0)
        log_d1 = torch.div(p_pos, p_pos.add(m * pn + 1e-7)).log_()
        p_neg = x.narrow(1, 1, m)
        log_d0 = torch.div(p_neg.clone().fill_(m * pn), p_neg.add(m * pn + 1e-7)).log_()
        return -(log_d1.sum(0) + log_d0.view(-1, 1).sum(0)) / bsz

    def __call__(self, f_s, f_t, y, idx):
        v1, v2 = self.embed_s(f_s), self.embed_t(f_t)
        batch, dim = v1.shape
        weight_v1 = torch.index_select(self.memory_v1, 0, idx.view(-1)).detach().view(batch, self.k + 1, dim)
        out_v2 = torch.exp(torch.div(torch.bmm(weight_v1, v2.view(batch, dim, 1)), self.t))
        weight_v2 = torch.index_select(self.memory_v2, 0, idx.view(-1)).detach().view(batch, self.k + 1, dim)
        out_v1 = torch.exp(torch.div(torch.bmm(weight_v2, v1.view(batch, dim, 1)), self.t))
        if self.z[0] < 0:
            self.z[0] = (out_v1.mean() * self.n_data).item()
        if self.z[1] < 0:
            self.z[1] = (out_v2.mean() * self.n_data).item()
        out_v1, out_v2 = torch.div(out_v1, self.z[0]), torch.div(out_v2, self.z[1])
        with torch.no_grad():
            for memory, v in ((self.memory_v1, v1), (self.memory_v2, v2)):
                pos = (
                    torch.index_select(memory, 0, y.view(-1)).mul_(self.momentum).add_(torch.mul(v, 1 - self.momentum))
                )
                memory.index_copy_(0, y, pos.div(pos.pow(2).sum(1, keepdim=True).pow(0.5)))
        return self._contrast_loss(out_v1) + self._contrast_loss(out_v2)


def _authors_train(student, teacher, crd, optimizer, batches, x, y, zero_student_grad=True):
    """loops.py's train_distill (gamma 1, alpha 0, beta 0.8): the per-batch student gradients, summed then averaged;
    the student's gradient zeroed before optimizer.step() (`zero_student_grad`: their loop; False: the copy steps
    along it)."""
    student.train()
    teacher.eval()
    grad = [torch.zeros(p.size()) for p in student.parameters()]
    count = 0
    for index, contrast_idx in batches:
        feat_s, logit_s = student(x[index], is_feat=True)
        with torch.no_grad():
            feat_t, _ = teacher(x[index], is_feat=True)
            feat_t = [f.detach() for f in feat_t]
        loss = 1.0 * torch.nn.functional.cross_entropy(logit_s, y[index]) + 0.8 * crd(
            feat_s[-1], feat_t[-1], index, contrast_idx
        )
        optimizer.zero_grad()
        loss.backward()
        count += 1
        for p, b in zip(student.parameters(), grad, strict=True):
            b += p.grad.clone()
        if zero_student_grad:
            for p in student.parameters():
                p.grad.detach_()
                p.grad.zero_()
        optimizer.step()
    return torch.cat([(g / count).reshape(-1) for g in grad]).numpy()


@pytest.mark.parametrize(
    ("negatives", "student_step", "momentum_buffers"),
    [
        (12, "weight_decay", "reset"),  # the code mode's defaults, K below a class's others: drawn without replacement
        (40, "weight_decay", "reset"),  # K above them: with replacement
        (12, "gradient", "kept"),  # raysim's old code mode (issue 48): the copy moves along its gradient, momentum kept
    ],
)
def test_code_mode_computes_what_the_authors_crd_train_computes(negatives, student_step, momentum_buffers):
    """Three rounds of `CRD.train` as their code runs it (a new SGD optimizer over the student and both heads every
    call, lr 0.002, momentum 0.9, weight decay 5e-4; the student copy loaded with theta^t; heads, banks and Z kept),
    given raysim's batches and negatives: the same averaged gradient, heads, memory banks and Z to float32
    tolerance."""
    generator = np.random.default_rng(4)
    x = generator.normal(size=(48, FEATURES)).astype(np.float32)
    y = generator.integers(0, CLASSES, 48)
    student_model, teacher_model = FlatModel("mlp", (FEATURES,), CLASSES), FlatModel("mlp", (FEATURES,), CLASSES)
    pm = teacher_model.initial_parameters(5)
    settings = TransferSettings(
        mode="code", feat_dim=8, negatives=negatives, batch_size=16, student_step=student_step,
        momentum_buffers=momentum_buffers,
    )  # fmt: skip
    transfer = ContrastiveTransfer(settings, student_model, teacher_model, pm, x, y, 3)
    state = transfer.init_state()
    teacher = _Mlp(FEATURES, CLASSES).load_flat(pm)
    student = _Mlp(FEATURES, CLASSES)
    crd = _AuthorsCrd(state, (64, 64), 48, negatives)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    optimizer = None
    for round_index in range(3):
        theta = student_model.initial_parameters(10 + round_index)  # a new theta^t every round
        gradient, state, _ = transfer.gradient(theta, state)
        student.load_flat(theta)  # the aggregation overwrites the global model's parameters
        if optimizer is None or momentum_buffers == "reset":  # their CRD.train builds the optimizer each call
            trainable = [*student.parameters(), *crd.embed_s.parameters(), *crd.embed_t.parameters()]
            optimizer = torch.optim.SGD(trainable, lr=0.002, momentum=0.9, weight_decay=5e-4)
        batches = list(transfer.draws(round_index))
        expected = _authors_train(student, teacher, crd, optimizer, batches, xs, ys, student_step == "weight_decay")
        assert np.linalg.norm(gradient - expected) <= 2e-6 * np.linalg.norm(expected)
        heads = torch.cat([p.detach().reshape(-1) for m in (crd.embed_s, crd.embed_t) for p in m.parameters()])
        np.testing.assert_allclose(state.heads, heads.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(state.memory_student, crd.memory_v1.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.memory_teacher, crd.memory_v2.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.normalizers, crd.z, rtol=1e-6)


def test_switches_that_must_coincide_do_bit_for_bit():
    """Code mode with CE off, CRD weight 1, the student copy at theta^t, momentum kept and uniform negatives is paper
    mode; a copy moved by weight decay 0 never moves; restarting momentum changes nothing in a first round (it starts
    from zero) nor with momentum 0, and changes the second round otherwise."""
    theta = FlatModel("mlp", (FEATURES,), CLASSES).initial_parameters(1)

    def rounds(count: int = 2, **settings) -> list[tuple[np.ndarray, CrdState]]:
        transfer, _ = _transfer(batch_size=16, **settings)
        state, out = transfer.init_state(), []
        for _ in range(count):
            gradient, state, _ = transfer.gradient(theta, state)
            out.append((gradient, state))
        return out

    def same(a: list, b: list) -> bool:
        return all(
            ga.tobytes() == gb.tobytes()
            and all(np.array_equal(getattr(sa, f.name), getattr(sb, f.name)) for f in dataclasses.fields(CrdState))
            for (ga, sa), (gb, sb) in zip(a, b, strict=True)
        )

    as_paper = {"mode": "code", "ce_weight": 0.0, "crd_weight": 1.0, "student_step": "none"}
    assert same(rounds(), rounds(**as_paper, momentum_buffers="kept", negatives_from="others"))
    assert same(rounds(mode="code", weight_decay=0.0), rounds(mode="code", weight_decay=0.0, student_step="none"))
    reset, kept = rounds(mode="code"), rounds(mode="code", momentum_buffers="kept")
    assert same(reset[:1], kept[:1]) and not same(reset[1:], kept[1:])
    assert same(rounds(mode="code", momentum=0.0), rounds(mode="code", momentum=0.0, momentum_buffers="kept"))


@pytest.mark.parametrize("negatives", [10, 30, 100])
def test_other_class_negatives_are_drawn_from_the_other_classes_only(negatives):
    """The authors' sampler (negatives_from other_classes): column 0 is the sample itself, the K others are samples
    of other classes, distinct when K is at most their number (without replacement) and uniform over them;
    `others` draws from every other sample, the positive's class included."""
    transfer, _ = _transfer(mode="code", negatives=negatives, batch_size=16)
    labels = transfer.y.numpy()
    seen = np.zeros(SAMPLES, np.int64)
    for index, contrast in transfer.draws(0):
        assert contrast.shape == (len(index), 1 + negatives) and torch.equal(contrast[:, 0], index)
        for positive, row in zip(index.numpy(), contrast[:, 1:].numpy(), strict=True):
            others = np.flatnonzero(labels != labels[positive])
            assert np.isin(row, others).all()
            if negatives <= len(others):
                assert len(np.unique(row)) == negatives
            seen += np.bincount(row, minlength=SAMPLES)
    for c in range(CLASSES):  # each sample is drawn as often as the others of its class: uniform over the candidates
        share = seen[labels == c]
        assert share.min() > 0 and share.std() < 0.5 * share.mean()
    uniform, _ = _transfer(mode="code", negatives=negatives, batch_size=16, negatives_from="others")
    rows = [(index.numpy(), contrast[:, 1:].numpy()) for index, contrast in uniform.draws(0)]
    assert all((row != positive[:, None]).all() for positive, row in rows)
    assert any((labels[row] == labels[positive][:, None]).any() for positive, row in rows)


def test_transfer_settings_resolve_by_mode_and_refuse_what_cannot_hold():
    paper, code = TransferSettings(), TransferSettings(mode="code")
    assert (paper.student_path, paper.reset_momentum, paper.negative_pool) == ("none", False, "others")
    assert (code.student_path, code.reset_momentum, code.negative_pool) == ("weight_decay", True, "other_classes")
    with pytest.raises(ValueError, match="algorithm.transfer.student_step=gradient: paper mode"):
        TransferSettings(student_step="gradient")
    with pytest.raises(ConfigError, match="^algorithm.transfer.negatives_from=other_classes: .* one class"):
        student = FlatModel("mlp", (FEATURES,), CLASSES)
        x = np.zeros((8, FEATURES), np.float32)
        ContrastiveTransfer(
            TransferSettings(mode="code"), student, student, student.initial_parameters(0), x, np.ones(8, np.int64), 0
        )
