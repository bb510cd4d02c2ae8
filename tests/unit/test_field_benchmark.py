"""The field benchmark suites (configs/paper/suites/field_benchmark_*.yaml, issue 47): what
benchmarks/field_benchmark.py writes from configs/compare.yaml, every method of the baselines suite on both splits,
100 clients at 10 % participation, 3 seeds."""

from __future__ import annotations

import importlib.util

import pytest

from raysim.studies.suite import load_suite
from tests.support.paths import ROOT

SPEC = importlib.util.spec_from_file_location("field_benchmark", ROOT / "benchmarks" / "field_benchmark.py")
assert SPEC is not None and SPEC.loader is not None
FIELD = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(FIELD)


@pytest.mark.parametrize("key", ["fmnist", "cifar10"])
def test_the_shipped_suite_is_what_the_generator_writes_from_the_baselines_suite(key):
    path = ROOT / "configs" / "paper" / "suites" / f"field_benchmark_{key}.yaml"
    assert path.read_text() == FIELD.text(key), f"run `python benchmarks/field_benchmark.py`: {path.name} is stale"


def test_every_method_of_the_baselines_suite_runs_on_both_splits_at_ten_percent_participation():
    compare = {config.algorithm.name for _, config in load_suite(ROOT / "configs" / "compare.yaml").experiments()}
    field = load_suite(ROOT / "configs" / "paper" / "suites" / "field_benchmark_fmnist.yaml").experiments()
    assert len(field) == 2 * 3 * len(compare)
    splits: dict[str, set[str]] = {}
    for _, config in field:
        assert (config.clients.count, config.clients.per_round, config.rounds) == (100, 10, 50)
        splits.setdefault(config.partition.scheme, set()).add(config.algorithm.name)
        if config.partition.scheme == "dirichlet":
            assert config.partition.beta == 0.1
        else:
            assert (config.partition.scheme, config.partition.q) == ("q_label", 2)
    assert splits == {"dirichlet": compare, "q_label": compare}
    assert {config.seed for _, config in field} == {1, 2, 3}
