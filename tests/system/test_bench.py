"""`raysim bench` end to end: the three ways compute the same global model, and the table and JSON report it."""

from __future__ import annotations

import json

import pytest

from raysim.cli import main
from tests.support.cli import raysim


def refused(capsys, *args: str) -> str:
    """`raysim bench ARGS` in this process (the command line's own code, without a Python start of its own), which
    must refuse in one `error:` line (exit 2) and measure nothing: that line."""
    assert main(["bench", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    return err.strip()


@pytest.mark.slow
def test_bench_runs_three_ways_that_agree_with_the_reference(tmp_path, fmnist_tenth):
    """On a tenth of Fashion-MNIST (`--set dataset.root`): every way passes over the same real images, a tenth as
    many steps to compare."""
    out = tmp_path / "bench.json"
    done = raysim(
        "bench",
        "--clients",
        "6",
        "--rounds",
        "3",
        "--model",
        "mlr",
        "--hosts",
        "2",
        "--chunk",
        "2",
        "--set",
        f"dataset.root={fmnist_tenth}",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ratio vs reference" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["way"] for r in results] == ["reference", "sequential", "vectorized"]
    assert [r["chunk"] for r in results] == [None, None, 2]  # 3 clients a host: chunks of 2 and 1
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
    assert all(r["gpu_utilisation_percent"] is None and r["device"] == "cpu" for r in results)
    assert "GPU util %" not in done.stdout  # no GPU asked for: no GPU columns


def test_bench_rejects_too_few_rounds_and_an_empty_chunk_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refused(capsys, "--clients", "2", "--rounds", "2") == (
        "error: --rounds 2: at least 3 are needed (the first warms up, the last evaluates)"
    )
    assert refused(capsys, "--clients", "2", "--chunk", "0") == (
        "error: --chunk 0: at least 1 client must train at a time"
    )
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.slow
def test_bench_eval_times_the_evaluation_apart_without_the_reference(tmp_path, fmnist_tenth, capsys, monkeypatch):
    """`--eval` evaluates after every round and reports its time beside the training round's; without the
    reference way there are no ratios; `--set` reaches the workload (spilled client state and a tenth of
    Fashion-MNIST here). The command runs in this process: the first test runs it as a process of its own."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--clients",
            "8",
            "--rounds",
            "3",
            "--model",
            "mlr",
            "--hosts",
            "2",
            "--ways",
            "sequential",
            "--eval",
            "--set",
            "runtime.state_memory_mb=0.05",
            "--set",
            "runtime.actors=in_process",  # the evaluation's timing is the subject; the first test times Ray's hosts
            "--set",
            f"dataset.root={fmnist_tenth}",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "eval / round" in printed.out
    (result,) = json.loads(out.read_text())["results"]
    assert result["way"] == "sequential" and result["ratio_vs_reference"] is None
    assert result["max_abs_diff_vs_reference"] is None
    assert result["evaluation_seconds"] > 0 and result["seconds_per_round"] > 0
    assert result["evaluation_vs_round"] == pytest.approx(result["evaluation_seconds"] / result["seconds_per_round"])


def test_bench_refuses_a_bad_set_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, "--clients", "2", "--set", "runtime.client_training=fast")
    assert "runtime.client_training" in line and "vectorized" in line
    assert not (tmp_path / "bench.json").exists()


def test_bench_refuses_the_flame_reference_for_another_algorithm(tmp_path, capsys, monkeypatch):
    """The reference loop is FLAME's: a ratio against it for FedAvg would compare two different algorithms."""
    monkeypatch.chdir(tmp_path)
    assert refused(capsys, "--clients", "2", "--set", "algorithm.name=fedavg") == (
        "error: --set algorithm.name=fedavg: the reference loop is FLAME's; "
        "run the other ways alone (--ways sequential vectorized)"
    )


def test_bench_refuses_the_reference_for_a_model_with_dropout(tmp_path, capsys, monkeypatch):
    """The reference loop trains without dropout: its w would differ from a multimodal model's for that alone
    (found in the reference way's own process, once the model is built)."""
    monkeypatch.chdir(tmp_path)
    line = refused(
        capsys,
        "--clients",
        "2",
        "--set",
        "model.name=image_text_classifier",
        "--set",
        "dataset.name=crisismmd_synthetic",
        "--set",
        "dataset.samples=40",
    )
    assert line == (
        "error: --set model.name=image_text_classifier: the reference loop trains without dropout, which this model "
        "has; run the other ways alone (--ways sequential vectorized)"
    )
    assert not (tmp_path / "bench.json").exists()
