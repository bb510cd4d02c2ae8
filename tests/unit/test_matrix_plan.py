"""The configuration matrix's plan (tests/support/matrix.py): its cover of every pair of values, the pairwise
generator on its own, and the sample of cells that also runs on Ray."""

from __future__ import annotations

from itertools import product

import pytest

from tests.support.matrix import AXES, RAY_SAMPLE, RUNS, check_cover
from tests.support.pairwise import pairs_of, pairwise


def test_every_pair_of_values_meets_in_a_run_or_a_refusal():
    """Every two values of two axes meet in a cell that runs, or, when no allowed combination holds them, in a
    refused cell; no run is a combination refused on purpose."""
    check_cover()


@pytest.mark.parametrize("sizes", [(2, 2, 2), (3, 3, 3, 3), (5, 4, 3, 2, 2), (12, 11, 5, 2, 2)])
def test_the_pairwise_cover_meets_every_pair_in_few_rows(sizes):
    axes = {f"axis{i}": list(range(size)) for i, size in enumerate(sizes)}
    rows = pairwise(axes)
    rows_of_product = (dict(zip(axes, values, strict=True)) for values in product(*axes.values()))
    every = {pair for row in rows_of_product for pair in pairs_of(row, list(axes))}
    assert set().union(*(pairs_of(row, list(axes)) for row in rows)) == every
    assert sizes[0] * sizes[1] <= len(rows) <= sizes[0] * sizes[1] + sizes[0]


def test_the_ray_sample_runs_every_algorithm_executor_and_scheme_among_the_runs():
    assert set(RAY_SAMPLE) <= set(RUNS)
    for axis in ("algorithm", "executor", "scheme"):
        assert {getattr(cell, axis) for cell in RAY_SAMPLE} == set(AXES[axis]), axis
    assert len(RAY_SAMPLE) <= len(AXES["algorithm"]) + len(AXES["scheme"])
