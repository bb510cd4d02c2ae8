"""Exact, order-independent summation of uploads (raysim.runtime.exact_sum)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysim.algorithms.base import Upload
from raysim.runtime.exact_sum import UploadRangeError, encode


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
