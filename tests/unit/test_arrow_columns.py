"""The Arrow columns hosts build from their buffers (raysim.evaluation.columns.arrow_column) are the arrays pa.array
makes of the same values, nulls included, without pyarrow's pandas check (and so without pandas in the host)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from raysim.evaluation.columns import arrow_column, evaluation_batch
from raysim.evaluation.records import ClientEvaluation, ModelScores

SIZES = st.integers(0, 40)
DTYPES = st.sampled_from([np.float64, np.float32, np.int64, np.int32, np.bool_])


@given(data=st.data(), size=SIZES, dtype=DTYPES, with_nulls=st.booleans())
def test_a_column_from_buffers_is_pa_arrays_column(data, size, dtype, with_nulls):
    values = data.draw(hnp.arrays(dtype, size))
    valid = data.draw(hnp.arrays(np.bool_, size)) if with_nulls else None
    made = arrow_column(values, valid)
    expected = pa.array(values, mask=None if valid is None else ~valid)
    assert made.type == expected.type and made.null_count == expected.null_count
    assert made.equals(expected) or _same_with_nan(made, expected)
    made.validate(full=True)


def _same_with_nan(a: pa.Array, b: pa.Array) -> bool:
    """Equal but for NaN, which Arrow's equality, as IEEE's, finds unequal to itself."""
    return all(
        x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
        for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True)
    )


def test_an_evaluation_batch_has_null_for_a_score_not_taken_and_nan_for_a_nan_score():
    scored = ModelScores(0.5, 1.0, float("nan"))
    other = ClientEvaluation(3, scored, scored, {"local": ModelScores(0.25, 2.0, 0.5)})
    batch = evaluation_batch([other, ClientEvaluation(1, scored, scored, {})])
    assert batch.column("client_id").to_pylist() == [1, 3]
    assert batch.column("local_test_acc").to_pylist() == [None, 0.25]
    assert batch.column("pm_test_acc").to_pylist() == [0.5, 0.5]
    assert all(math.isnan(value) for value in batch.column("gm_train_loss").to_pylist())
    assert batch.column("gm_val_acc").null_count == 0
