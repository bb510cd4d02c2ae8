"""`raysim bench` end to end: the three ways compute the same global model, and the table and JSON report it."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import _raysim


@pytest.mark.slow
def test_bench_runs_three_ways_that_agree_with_the_reference(tmp_path):
    out = tmp_path / "bench.json"
    done = _raysim("bench", "--clients", "6", "--rounds", "3", "--model", "mlr", "--hosts", "2", "--json", str(out),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ratio vs reference" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["way"] for r in results] == ["reference", "raysim", "vectorized"]
    reference = results[0]
    assert reference["ratio_vs_reference"] == 1.0 and reference["max_abs_diff_vs_reference"] == 0.0
    for result in results:
        assert result["clients"] == 6 and result["seconds_per_round"] > 0 and result["peak_rss_mib"] > 100
        assert result["updates_per_second"] == pytest.approx(6 / result["seconds_per_round"])
    for result in results[1:]:
        # the plain torch loop, the default runtime and vectorized training compute one FLAME run
        assert result["max_abs_diff_vs_reference"] < 1e-5
        assert result["hosts"] == 2
        ratio = result["seconds_per_round"] / reference["seconds_per_round"]
        assert result["ratio_vs_reference"] == pytest.approx(ratio)
        assert result["peak_rss_mib"] > reference["peak_rss_mib"]  # Ray's processes are counted too


def test_bench_rejects_too_few_rounds(tmp_path):
    done = _raysim("bench", "--clients", "2", "--rounds", "2", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --rounds 2: at least 3 are needed (the first warms up, the last evaluates)"
    )
