"""`raysim bench` end to end: the three ways compute the same global model, and the table and JSON report it."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from raysim.studies.bench import GpuSampler, Measurement, gpu_usage, read_gpus, report


def test_gpu_usage_is_the_mean_utilisation_and_peak_memory_inside_the_measured_window():
    """nvidia-smi's CSV (one line per GPU) read into samples: readings it could not take ([N/A]) and samples
    outside the window do not count."""
    assert read_gpus("40, 1200\n80, 2400\n[N/A], 2400\n\n") == [(40.0, 1200.0), (80.0, 2400.0)]
    samples = [
        (99.9, 99.0, 9000.0),  # start-up, before the window
        *((100.1, u, m) for u, m in read_gpus("40, 1200\n80, 2400")),  # two GPUs at one time
        (100.7, 90.0, 1800.0),
        (101.1, 0.0, 9500.0),  # the evaluating last round, after it
    ]
    assert gpu_usage(samples, 100.0, 101.0) == pytest.approx((70.0, 2400.0))
    assert gpu_usage(samples, 102.0, 103.0) is None


def test_no_gpu_sampling_unless_asked_and_possible():
    with GpuSampler(False) as sampler:
        pass
    assert sampler.samples == [] and sampler.usage(0.0, 2e9) == (None, None)


def test_report_adds_the_gpu_columns_when_a_way_used_a_gpu(tmp_path):
    common = {"clients": 1000, "model": "cnn", "rounds": 5, "startup_seconds": 20.0, "peak_rss_mib": 9000.0}
    results = [
        Measurement(
            "reference",
            hosts=1,
            seconds_per_round=10.0,
            updates_per_second=100.0,
            ratio_vs_reference=1.0,
            max_abs_diff_vs_reference=0.0,
            **common,
        ),
        Measurement(
            "vectorized",
            hosts=4,
            seconds_per_round=0.5,
            updates_per_second=2000.0,
            ratio_vs_reference=0.05,
            max_abs_diff_vs_reference=1e-6,
            host_gpus=0.25,
            device="cuda",
            gpu_utilisation_percent=63.4,
            gpu_memory_mib=5120.0,
            chunk=250,
            **common,
        ),
    ]
    console = Console(width=250, record=True)
    report(results, tmp_path / "bench.json", console)
    text = console.export_text()
    assert "GPU util %" in text and "GPU/host" in text and "flame round on fashion_mnist" in text
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert "0.25" in rows[1] and "cuda" in rows[1] and "63" in rows[1] and "5120" in rows[1] and "250" in rows[1]
    assert rows[0].rstrip("│ ").endswith("-")  # the reference sampled no GPU
    written = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert written[1]["gpu_utilisation_percent"] == 63.4 and written[1]["host_gpus"] == 0.25
    assert written[0]["chunk"] is None and written[1]["chunk"] == 250
