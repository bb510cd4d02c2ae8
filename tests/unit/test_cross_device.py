"""The cross-device pieces of issue 49 outside the state store: clients that draw their own samples
(partition.samples_per_client), the bench's cross-device settings, and its reference loop over sampled clients
(the server's running sum of every client's latest message, eq. (14), against the plain sum of a full round)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.data.partitions import shared_iid
from raysim.errors import ConfigError
from raysim.runtime.problem import prepare
from raysim.studies.bench import reference_loop, scale_overrides, workload


def test_each_client_draws_its_own_distinct_samples_reproducibly():
    parts = shared_iid(50, 200, 7, np.random.default_rng(3))
    assert len(parts) == 200 and all(len(set(p.tolist())) == 7 and p.max() < 50 for p in parts)
    again = shared_iid(50, 200, 7, np.random.default_rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert len({tuple(sorted(p.tolist())) for p in parts}) > 150, "independent draws, not one share repeated"


def test_more_clients_than_samples_partition_with_samples_per_client():
    config = validate_config(
        {
            "algorithm": {"name": "flame"},
            "dataset": {"name": "synthetic_classification"},
            "partition": {"scheme": "iid", "samples_per_client": 10},
            "model": {"name": "mlr"},
            "clients": {"count": 3000},
        }
    )
    problem = prepare(config)
    assert len(problem.clients) == 3000 and len(problem.x) == 2000
    assert all(len(split.train) + len(split.test) == 10 for _, split in problem.clients)


def test_samples_per_client_is_refused_with_the_authors_draw():
    with pytest.raises(ConfigError, match="partition.samples_per_client=5: partition.draw=authors"):
        validate_config(
            {"algorithm": {"name": "flame"}, "partition": {"scheme": "iid", "samples_per_client": 5, "draw": "authors"}}
        )


def test_the_bench_scale_settings():
    assert scale_overrides(1000, 1.0, "hosts", None) == ["runtime.state_store=hosts"]
    assert scale_overrides(100_000, 0.01, "disk", None) == [
        "runtime.state_store=disk",
        "clients.fraction=0.01",
        "partition.samples_per_client=10",
        "tracking.eval_sample=1000",
    ]
    assert scale_overrides(500, 1.0, "memory", 4) == ["runtime.state_store=memory", "partition.samples_per_client=4"]


def test_the_reference_over_state_files_equals_the_plain_loop_at_full_participation(tmp_path):
    """Eq. (14): the running sum of the clients' latest messages plus each round's changes is the sum of the round's
    messages when every client takes part (equal up to float64 rounding of the sums)."""
    plain = workload(12, 2, "mlr", None, Path(tmp_path), vectorized=False)
    files = workload(12, 2, "mlr", None, Path(tmp_path), vectorized=False, overrides=["runtime.state_store=disk"])
    problem = prepare(plain)
    _, w_plain = reference_loop(plain, problem)
    disk: list[int] = []
    _, w_files = reference_loop(files, problem, disk=disk)
    np.testing.assert_allclose(w_files, w_plain, rtol=0, atol=1e-6)
    assert disk and disk[0] > 0
    assert not any(tmp_path.glob("reference-states-*")), "the state files are removed"
