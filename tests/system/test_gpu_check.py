"""benchmarks/gpu_check.sh (issue 49): its dry mode runs every step of the GPU check with the CPU standing in for
the GPU and prints one table of passing checks; its comparison fails where the two sides' results differ."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.xdist_group("system-gpu_check")

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CHECKS = ["vmap-mlp", "vmap-cnn", "resnet8x4-round", "fedslr-dense", "fedslr-factorized"]
HOSTS = ["hosts-0.25", "hosts-0.5", "hosts-1"]
COLUMNS = [
    "check",
    "what",
    "size",
    "device",
    "device time",
    "CPU path time",
    "CPU / device",
    "GPU MiB",
    "max difference",
    "tolerance",
    "result",
]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["GPU_CHECK_PYTHON"] = sys.executable
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def check(*args: str) -> subprocess.CompletedProcess:
    return run(sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args)


def table(text: str) -> list[dict[str, str]]:
    """The Markdown table's rows as {column: cell}; its header must be COLUMNS."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split(" | ")] for line in lines)
    assert header == COLUMNS
    return [dict(zip(header, row, strict=True)) for row in rows]


@pytest.fixture(scope="module")
def dry(tmp_path_factory, fmnist_tenth) -> tuple[subprocess.CompletedProcess, Path]:
    """The dry mode once for the module, its hosts rows (raysim bench: four processes, each passing over its data
    three times) on a tenth of Fashion-MNIST through the script's `--set`."""
    out = tmp_path_factory.mktemp("gpu-check")
    return run("bash", str(SCRIPT), "--dry", "--out", str(out), "--set", f"dataset.root={fmnist_tenth}"), out


def relative_difference(device: Path, cpu: Path) -> float:
    """The comparison written out again: the largest |device - cpu| relative to the CPU side's change from the
    start, over the compared arrays."""
    with np.load(device) as a, np.load(cpu) as b:
        keys = set(b.files) - {"meta", "start", "steps", "rows"}
        assert keys, "no array compared"
        start = b["start"].astype(np.float64)
        return max(np.max(np.abs(a[key].astype(np.float64) - b[key])) / np.max(np.abs(b[key] - start)) for key in keys)


@pytest.mark.slow
def test_the_dry_mode_runs_every_check_and_prints_one_table_of_passing_checks(dry):
    done, out = dry
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = table(done.stdout)
    assert [row["check"] for row in rows] == CHECKS + HOSTS
    assert all(row["result"] == "pass" and row["device"] == "cpu (dry)" for row in rows), rows
    assert (out / "table.md").read_text().strip() == done.stdout[done.stdout.index("GPU check (") :].strip()
    for row in rows:
        assert float(row["max difference"]) <= float(row["tolerance"]) == 1e-4  # no TF32 on a CPU
    found = {row["check"]: row for row in rows}
    assert found["vmap-mlp"]["size"] == "8 clients x 12 samples, batch 4, chunk 4"
    for name in CHECKS:
        device, cpu = out / f"{name}.device.npz", out / f"{name}.cpu.npz"
        # the table's number is the comparison's, computed here again from the two result files
        assert float(found[name]["max difference"]) == pytest.approx(
            relative_difference(device, cpu), rel=0.05, abs=1e-12
        )
    # the CNN's device side ran vmap in chunks of 2, its CPU side one client at a time: float32 rounding apart
    assert 0 < float(found["vmap-cnn"]["max difference"]) < 1e-4
    results = json.loads((out / "hosts.json").read_text())["results"]
    assert [(r["way"], r["host_gpus"]) for r in results] == [
        ("reference", 0),
        *(("vectorized", s) for s in (0.25, 0.5, 1)),
    ]
    for name, result in zip(HOSTS, results[1:], strict=True):
        assert float(found[name]["max difference"]) == pytest.approx(result["max_abs_diff_vs_reference"], rel=0.05)


@pytest.mark.slow
def test_the_comparison_fails_when_the_two_sides_differ(dry, tmp_path):
    done, out = dry
    assert done.returncode == 0, done.stderr[-3000:]
    device, cpu = out / "vmap-cnn.device.npz", out / "vmap-cnn.cpu.npz"
    same = check("compare", str(device), str(cpu))
    assert same.returncode == 0 and same.stdout.strip().endswith("tolerance 1e-04: pass")

    def altered(change, source: Path = device) -> Path:
        with np.load(source) as stored:
            arrays = {key: stored[key].copy() for key in stored.files}
        change(arrays)
        path = tmp_path / "altered.npz"
        np.savez(path, **arrays)
        return path

    def off_by(arrays) -> None:  # one coordinate of one client's trained vector off by 1e-3 of the update
        update = np.max(np.abs(arrays["params"] - arrays["start"]))
        arrays["params"][1, 7] += 1e-3 * update

    differ = check("compare", str(altered(off_by)), str(cpu))
    assert differ.returncode == 1 and "FAIL" in differ.stdout
    assert float(differ.stdout.split("max difference ")[1].split(",")[0]) == pytest.approx(1e-3, rel=0.05)

    def on_tf32(change):
        def both(arrays) -> None:
            change(arrays)
            arrays["meta"] = np.array(json.dumps(json.loads(str(arrays["meta"])) | {"tf32": True}))

        return both

    # a device side that ran TF32 convolutions is held to 1e-2 on a conv model, which the same 1e-3 then passes
    tf32 = check("compare", str(altered(on_tf32(off_by))), str(cpu))
    assert tf32.returncode == 0 and tf32.stdout.strip().endswith("tolerance 1e-02: pass")
    mlp = out / "vmap-mlp.device.npz"  # the MLP's products are float32 whatever cuDNN's convolutions do
    perceptron = check("compare", str(altered(on_tf32(off_by), mlp)), str(out / "vmap-mlp.cpu.npz"))
    assert perceptron.returncode == 1 and "tolerance 1e-04: FAIL" in perceptron.stdout

    def a_step_less(arrays) -> None:
        arrays["steps"][0] -= 1

    steps = check("compare", str(altered(a_step_less)), str(cpu))
    assert steps.returncode == 1 and "the clients took different numbers of steps" in steps.stdout
    other = check("compare", str(out / "vmap-mlp.device.npz"), str(cpu))
    assert other.returncode == 1 and "vmap-cnn.cpu.npz holds check 'vmap-cnn', not 'vmap-mlp'" in other.stdout

    # raysim bench's JSON: a share whose global model is off the reference loop's fails
    bench = json.loads((out / "hosts.json").read_text())
    bench["results"][2]["max_abs_diff_vs_reference"] = 2e-4
    (tmp_path / "hosts.json").write_text(json.dumps(bench))
    hosts = check("compare", str(tmp_path / "hosts.json"))
    assert hosts.returncode == 1
    assert [line.rsplit(": ", 1)[1] for line in hosts.stdout.splitlines()] == ["pass", "FAIL", "pass"]

    # the table: a folder with the altered result and one missing fails, naming both
    folder = tmp_path / "results"
    shutil.copytree(out, folder)
    shutil.copy(altered(off_by), folder / "vmap-cnn.device.npz")
    (folder / "fedslr-dense.cpu.npz").unlink()
    failed = check("table", str(folder))
    assert failed.returncode == 1 and "gpu check failed: vmap-cnn, fedslr-dense" in failed.stderr
    verdicts = {row["check"]: row["result"] for row in table(failed.stdout)}
    assert verdicts["vmap-cnn"] == "FAIL" and verdicts["fedslr-dense"] == "missing" and verdicts["vmap-mlp"] == "pass"


def test_without_a_gpu_the_real_mode_stops_at_once_saying_so():
    done = run("bash", str(SCRIPT))
    assert done.returncode == 2
    assert "sees no CUDA device; without a GPU run gpu_check.sh --dry" in done.stderr
    wrong = run("bash", str(SCRIPT), "--gpu")
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        "gpu_check.sh: unknown argument --gpu (allowed: --dry, --fp32, --out DIR, --set KEY=VALUE)"
    )
