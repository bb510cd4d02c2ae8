"""Exact, order-independent summation of uploads (raysim.runtime.exact_sum)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.algorithms.interface import Upload
from raysim.runtime.exact_sum import UploadRangeError, add_rows, encode, rejection


@dataclass
class Message(Upload):
    vector: np.ndarray
    weight: float


vectors = st.lists(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=6, max_size=6), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(vectors, st.randoms(use_true_random=False))
def test_any_grouping_and_order_gives_the_identical_total(rows, random):
    """Hosts sum disjoint groups in any order; the decoded total must not depend on either."""
    terms = [encode(Message(np.array(r, np.float32), float(i)), 100, i) for i, r in enumerate(rows)]
    reference = reduce(lambda a, b: a + b, terms).decode()
    shuffled = terms[:]
    random.shuffle(shuffled)
    cut = random.randint(0, len(shuffled))
    groups = [g for g in (shuffled[:cut], shuffled[cut:]) if g]
    total = reduce(lambda a, b: a + b, [reduce(lambda a, b: a + b, g) for g in groups]).decode()
    np.testing.assert_array_equal(total.vector, reference.vector)
    assert total.weight == reference.weight
    np.testing.assert_allclose(reference.vector, np.sum(np.array(rows, np.float64), axis=0), atol=len(rows) * 2**-32)


def test_non_finite_or_out_of_range_uploads_raise():
    with pytest.raises(UploadRangeError, match="client 3.*NaN"):
        encode(Message(np.array([0.0, np.nan]), 1.0), 10, 3)
    with pytest.raises(UploadRangeError, match="diverged"):
        encode(Message(np.array([1e9]), 1.0), 10, 0)


@settings(max_examples=60, deadline=None)
@given(vectors, st.randoms(use_true_random=False), st.integers(1, 4))
def test_a_chunk_of_rows_adds_up_exactly_as_its_uploads_one_by_one(rows, random, chunk):
    """`add_rows` (a host's chunk of uploads in one pass) gives the integer total of encoding every upload alone
    and adding them, whatever the chunks, and counts every client."""
    uploads = np.array(rows, np.float32)
    weights = np.arange(len(rows), dtype=np.float64)
    terms = [encode(Message(u, w), 100, i) for i, (u, w) in enumerate(zip(uploads, weights, strict=True))]
    alone = reduce(lambda a, b: a + b, terms)
    total, start = None, 0
    while start < len(rows):
        size = random.randint(1, chunk)
        ids = list(range(start, min(start + size, len(rows))))
        total, rejected = add_rows(total, Message(uploads[ids], weights[ids]), ids, 100)
        assert rejected == []
        start += size
    assert total.count == alone.count == len(rows)
    assert all(np.array_equal(total.fields[name], alone.fields[name]) for name in alone.fields)


def test_rows_that_cannot_be_summed_are_left_out_and_named():
    """A NaN, an inf or a too large entry in any field leaves that client out of the sum (and only it); the
    others are added as if it had not been there."""
    uploads = np.ones((4, 3), np.float32)
    uploads[1, 2] = np.nan
    uploads[3, 0] = 1e9
    weights = np.array([1.0, 1.0, np.inf, 1.0])
    total, rejected = add_rows(None, Message(uploads, weights), [10, 11, 12, 13], 10)
    assert rejected == [11, 12, 13] and total.count == 1
    assert total.decode().vector.tolist() == [1.0, 1.0, 1.0] and total.decode().weight == 1.0
    assert add_rows(None, Message(uploads[1:2], weights[1:2]), [11], 10) == (None, [11])
    assert rejection(Message(uploads[1], 1.0), 10, 11) == "client 11: upload field 'vector' has NaN or inf values"
    assert "diverged" in rejection(Message(uploads[3], 1.0), 10, 13)
