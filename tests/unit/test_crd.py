"""AugFL's knowledge transfer (augfl.md 2): the CRD loss, the gradient the paper's server step uses, the
authors'-code variant, and the state that persists between rounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from raysim.algorithms.augfl.crd import ContrastiveTransfer, CrdState, nce_loss
from raysim.algorithms.augfl.settings import TransferSettings
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
    """augfl.md 2.2: with crd_weight 0 and a vanishing rate, the epoch-averaged gradient over equal batches is
    the full-batch cross-entropy gradient on D_s; with a real rate the student moves and the average differs."""
    transfer, theta = _transfer(mode="code", crd_weight=0.0, ce_weight=1.0, lr=1e-12, momentum=0.0, batch_size=16)
    gradient, _, _ = transfer.gradient(theta, transfer.init_state())
    _, full = transfer.student.loss_and_grad(torch.from_numpy(theta), transfer.x, transfer.y)
    np.testing.assert_allclose(gradient, full.numpy(), atol=1e-6)
    moving, _ = _transfer(mode="code", crd_weight=0.0, lr=0.5, momentum=0.0, batch_size=16)
    along_path, state, _ = moving.gradient(theta, moving.init_state())
    assert np.linalg.norm(along_path - full.numpy()) > 1e-3 and state.student_velocity.any()


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
