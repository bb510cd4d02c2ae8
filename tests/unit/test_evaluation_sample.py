"""tracking.eval_sample: an evaluation scores a seeded sample of the clients, the same whatever the hosts; None
(or a sample as large as the run) scores every client, as before (issue 49.3)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raysim.config import ExperimentConfig, validate_config
from raysim.evaluation.sampling import evaluation_sample
from raysim.runtime.problem import Problem, prepare
from tests.support.experiments import tiny_config
from tests.support.inprocess import make_host


def test_the_sample_is_drawn_from_the_seed_alone_without_repeats():
    first = evaluation_sample(1, 100_000, 1000)
    assert first is not None and len(first) == 1000 and len(np.unique(first)) == 1000
    assert np.all(np.diff(first) > 0) and first[0] >= 0 and first[-1] < 100_000
    np.testing.assert_array_equal(first, evaluation_sample(1, 100_000, 1000))
    assert not np.array_equal(first, evaluation_sample(2, 100_000, 1000))
    assert evaluation_sample(1, 100, None) is None
    assert evaluation_sample(1, 100, 100) is None and evaluation_sample(1, 100, 500) is None


def _table(batches: list[pa.RecordBatch]) -> pa.Table:
    return pa.Table.from_batches(batches).sort_by("client_id")


@pytest.fixture(scope="module")
def tiny() -> tuple[ExperimentConfig, Problem]:
    config = validate_config(tiny_config(clients={"count": 8}, rounds=1))
    return config, prepare(config)


def _same(a: pa.Table, b: pa.Table) -> bool:
    """The same columns and values bit for bit (NaN, an absent split's score, equal to NaN)."""
    if a.column_names != b.column_names or a.num_rows != b.num_rows:
        return False
    for name in a.column_names:
        np.testing.assert_array_equal(a.column(name).to_numpy(), b.column(name).to_numpy(), err_msg=name)
    return True


def _evaluations(tiny: tuple[ExperimentConfig, Problem], sample: int | None, hosts: int) -> pa.Table:
    """Round 0's evaluation of the run's clients over `hosts` in-process hosts (client i on host i mod hosts) with
    tracking.eval_sample = `sample`."""
    config, problem = tiny
    parts = [problem.clients[index::hosts] for index in range(hosts)]
    hosts_ = [make_host(config, problem, part, eval_sample=sample) for part in parts]
    return _table([host.evaluate(problem.init_params) for host in hosts_])


def test_every_host_count_scores_the_same_sample_and_the_same_scores(tiny):
    whole = _evaluations(tiny, None, 1)
    assert whole.column("client_id").to_pylist() == list(range(8))
    sample = evaluation_sample(7, 8, 3)
    assert sample is not None
    for hosts in (1, 2, 3):
        sampled = _evaluations(tiny, 3, hosts)
        assert sampled.column("client_id").to_pylist() == sample.tolist()
        # each sampled client's scores are those it gets when every client is scored
        assert _same(sampled, whole.filter(pa.array(np.isin(whole.column("client_id").to_numpy(), sample))))


def test_no_sample_or_one_as_large_as_the_run_scores_every_client_as_before(tiny):
    whole = _evaluations(tiny, None, 2)
    assert _same(_evaluations(tiny, 8, 2), whole) and _same(_evaluations(tiny, 50, 1), whole)
