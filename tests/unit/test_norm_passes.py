"""The one-pass norms of issue 49's regression fix, against numpy's float64 norms they replace: ||pi_i|| (FLAME's
dual_norm, raysim.jit.norms), the deviation over the shared tensors (sum of per-tensor Frobenius norms and their L2,
fedapm.md 1.5; raysim.jit.segment_distances) read in place from whole-model rows, and the clients' saved models
written a block at a time into the archive np.savez writes."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from raysim.algorithms.families.consensus import row_norms
from raysim.algorithms.families.split import change_and_deviation, deviation, shared_segments
from raysim.jit import distances, norms, rows, segment_distances
from raysim.models.spec import ParamSpec
from raysim.tracking.models import save_client_models

SPEC = ParamSpec(("0.weight", "0.bias", "2.weight", "2.bias"), ((6, 5), (6,), (3, 6), (3,)), (0, 30, 36, 54))
"""A two-layer perceptron's layout: 57 parameters in four tensors."""


def _rows(order: str = "C", dtype: type = np.float32, k: int = 5, n: int = 57) -> np.ndarray:
    values = np.random.default_rng(3).normal(size=(k, n)) * np.logspace(-3, 3, n)  # entries of many magnitudes
    return np.asarray(values, dtype=dtype, order=order)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_norms_are_numpys_float64_norms(order, dtype):
    a = _rows(order, dtype)
    expected = np.linalg.norm(a.astype(np.float64), axis=-1)
    np.testing.assert_allclose(norms(a), expected, rtol=1e-13)
    np.testing.assert_allclose(row_norms(a), expected, rtol=1e-13)
    assert isinstance(norms(a[2]), float) and norms(a[2]) == pytest.approx(expected[2], rel=1e-13)
    assert norms(np.zeros((0, 4))).shape == (0,)


def test_zero_width_rows_are_rows_and_their_norms_zero():
    """`rows` names the row count: numpy cannot infer -1 in reshape(-1, 0), so a model (or a segment) of no
    parameters failed before any pass; a vector [0] is one row [1, 0], rows [k, 0] stay k rows, both views."""
    one, many = np.zeros(0, np.float32), np.zeros((3, 0), np.float32)
    assert rows(one).shape == (1, 0) and rows(many).shape == (3, 0) and rows(np.zeros((0, 0))).shape == (0, 0)
    assert rows(one).base is one and rows(many).base is many
    vector = _rows()[0]
    assert rows(vector).shape == (1, 57) and np.shares_memory(rows(vector), vector)
    assert norms(one) == 0.0 and norms(many).tolist() == [0.0] * 3
    assert distances(one, one) == 0.0 and distances(many, one).tolist() == [0.0] * 3


@pytest.mark.parametrize("order", ["C", "F"])
def test_segment_distances_are_the_segments_norms_and_their_l2(order):
    a, b = _rows(order), _rows()[0]
    starts, stops = np.array([0, 36, 54]), np.array([30, 54, 57])  # the weights and the last bias; 0.bias left out
    parts = [np.linalg.norm(a[:, s:e].astype(np.float64) - b[s:e], axis=-1) for s, e in zip(starts, stops, strict=True)]
    sums, l2 = segment_distances(a, b, starts, stops)
    np.testing.assert_allclose(sums, np.sum(parts, axis=0), rtol=1e-13)
    np.testing.assert_allclose(l2, np.sqrt(np.sum(np.square(parts), axis=0)), rtol=1e-13)
    one = segment_distances(a[1], b, starts, stops)
    assert one == pytest.approx((sums[1], l2[1]), rel=1e-13) and all(isinstance(x, float) for x in one)
    assert segment_distances(a, b, np.zeros(0, np.int64), np.zeros(0, np.int64))[0].tolist() == [0.0] * len(a)


def test_the_deviation_read_from_whole_rows_is_the_one_of_the_shared_parts():
    """`whole`: rows of the whole model give what their shared-part copies give, over the fully shared tensors only
    (a tensor the split cuts through counts in neither), as the definition's per-tensor Frobenius norms."""
    shared = np.ones(SPEC.size, bool)
    shared[SPEC.slice("2.weight")] = False  # the head's weight personal
    shared[SPEC.slice("0.bias")][:2] = False  # a tensor partly personal: not a shared tensor
    local, reference = _rows(), _rows(k=1)[0] * 0.5
    copies = deviation(SPEC, shared, local[:, shared], reference[shared])
    whole = deviation(SPEC, shared, local, reference, whole=True)
    tensors = [name for name in SPEC.names if shared[SPEC.slice(name)].all()]
    assert tensors == ["0.weight", "2.bias"]
    norm = [
        np.linalg.norm(local[:, SPEC.slice(t)].astype(np.float64) - reference[SPEC.slice(t)], axis=-1) for t in tensors
    ]
    for found in (copies, whole):
        np.testing.assert_allclose(found[0], norm[0] + norm[1], rtol=1e-13)
        np.testing.assert_allclose(found[1], np.hypot(norm[0], norm[1]), rtol=1e-13)
    assert deviation(SPEC, shared, local[0], reference, whole=True) == pytest.approx((whole[0][0], whole[1][0]))


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("reference_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [57, 1001])
def test_change_and_deviation_in_one_call_are_the_bits_of_the_two_passes(order, reference_dtype, n):
    """FedAvg's update_norm and deviation from one compiled call (issue 49.0): the very bits of raysim.jit.distances
    and of `deviation` (same sums in the same order, not merely close), for rows and for one vector, over entries of
    many magnitudes, widths that are not a multiple of a vector register, and a split whose head is personal."""
    spec = SPEC if n == 57 else ParamSpec(("w", "b", "head"), ((900,), (51,), (50,)), (0, 900, 951))
    shared = np.ones(spec.size, bool)
    shared[spec.slice(spec.names[-1])] = False
    segments = shared_segments(spec, shared, whole=True)
    assert segments[0].dtype == segments[1].dtype == np.int64
    for seed in range(5):
        generator = np.random.default_rng(seed)
        scale = np.logspace(-4, 4, n)
        local = np.asarray(generator.normal(size=(7, n)) * scale, np.float32, order=order)
        reference = np.asarray(generator.normal(size=n) * scale, reference_dtype)
        change, sums, l2 = change_and_deviation(local, reference, segments)
        assert change.tolist() == distances(local, reference).tolist()
        expected = deviation(spec, shared, local, reference, whole=True)
        assert sums.tolist() == expected[0].tolist() and l2.tolist() == expected[1].tolist()
        one = change_and_deviation(local[3], reference, segments)
        assert one == (distances(local[3], reference), *deviation(spec, shared, local[3], reference, whole=True))
        assert all(isinstance(x, float) for x in one)
    empty = change_and_deviation(np.zeros((0, n), np.float32), np.zeros(n, np.float32), segments)
    assert [x.shape for x in empty] == [(0,)] * 3


def test_an_averaging_step_logs_the_two_passes_norms():
    """The averaging family's client step (FedAvg) takes update_norm and deviation from the one call where it starts
    from the broadcast: its metrics are those of `distances` and `deviation` of the rows it uploads."""
    from raysim.algorithms import ClientInfo, build_algorithm
    from raysim.algorithms.fedavg import FedAvgSettings
    from raysim.algorithms.requests import LocalSGD, SGDResult

    algorithm = build_algorithm(FedAvgSettings(personal=["2.*"]), SPEC)
    client = ClientInfo(0, 10, 1.0, 5)
    broadcast = _rows(k=1)[0]
    trained = broadcast * 0.9 + 1.0
    step = algorithm.client_step(client, algorithm.init_client(client, broadcast), broadcast)
    assert isinstance(next(step), LocalSGD)
    with pytest.raises(StopIteration) as stopped:
        step.send(SGDResult(trained, 0.5, 1))
    update = stopped.value.value
    shared = np.ones(SPEC.size, bool)
    shared[SPEC.slice("2.weight")] = shared[SPEC.slice("2.bias")] = False
    per_tensor, l2 = deviation(SPEC, shared, trained, broadcast, whole=True)
    assert update.metrics["update_norm"] == distances(trained, broadcast)
    assert (update.metrics["deviation"], update.metrics["deviation_l2"]) == (per_tensor, l2)


def test_client_models_written_in_blocks_are_the_archive_np_savez_writes(tmp_path):
    params = _rows(k=7)
    ids = np.array([0, 2, 3, 5, 8, 9, 11])
    blocks = [(ids[:3], params[:3]), (ids[3:4], params[3:4]), (ids[4:], np.asfortranarray(params[4:]))]
    save_client_models(iter(blocks), tmp_path / "blocks.npz")
    np.savez(tmp_path / "whole.npz", client_id=ids.astype(np.int64), params=params)
    with zipfile.ZipFile(tmp_path / "blocks.npz") as ours, zipfile.ZipFile(tmp_path / "whole.npz") as numpys:
        assert ours.namelist() == numpys.namelist() == ["client_id.npy", "params.npy"]
        assert all(ours.read(name) == numpys.read(name) for name in ours.namelist())  # byte for byte
    with np.load(tmp_path / "blocks.npz") as saved:
        assert saved["client_id"].dtype == np.int64 and np.array_equal(saved["params"], params)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["blocks.npz", "whole.npz"]  # no scratch file left

    save_client_models(iter([]), tmp_path / "none.npz")
    with np.load(tmp_path / "none.npz") as saved:
        assert saved["client_id"].shape == (0,) and saved["params"].shape == (0, 0)
