"""Partitions as data: `raysim partition CONFIG --out FILE` and `partition: {scheme: file, path: FILE}`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raysim.data.partition_file import read_metadata
from tests.support.data_files import write_partition_table
from tests.support.experiments import run_through_cli
from tests.support.paths import ROOT
from tests.support.stores import fresh_store

REPO = ROOT


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "raysim.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_raysim_partition_of_the_quickstart_replays_to_the_same_run(tmp_path):
    """The user's path: `raysim partition configs/quickstart.yaml --out F`, then the quickstart with
    `partition: {scheme: file, path: F}` gives the same numbers as the quickstart itself (a round, no figures or
    saved models: what they are is not in question here)."""
    out = tmp_path / "quickstart.parquet"
    done = _cli("partition", str(REPO / "configs/quickstart.yaml"), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: 10 clients" in done.stdout and "disjoint" in done.stdout
    metadata = read_metadata(out)
    assert metadata["dataset"] == "fashion_mnist" and metadata["num_samples"] == 70000 and metadata["seed"] == 1

    base = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    runs = []
    for name, partition in (("original", base["partition"]), ("replayed", {"scheme": "file", "path": str(out)})):
        folder = tmp_path / name
        folder.mkdir()
        uri = fresh_store(folder / "mlflow.db")
        run = run_through_cli(
            {**base, "partition": partition},
            uri,
            "rounds=1",
            f"tracking.uri={uri}",
            "tracking.figures=[]",
            "tracking.save_models=none",
            "runtime.actors=in_process",  # the partition is the subject: hosts in process
        )
        runs.append(run.data.metrics)
    keys = [k for k in runs[0] if k.startswith(("pm/", "gm/", "hm/")) and not k.startswith("time")]
    assert keys and {k: runs[0][k] for k in keys} == {k: runs[1][k] for k in keys}


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ([[0, None, 2], [3, 4]], "row 0, column 'train': a missing (null) index inside the list (position 1)"),
        ([[0, 2, 0], [3, 4]], "client 0: train lists sample 0 2 times"),
    ],
    ids=["null-index", "index-twice"],
)
def test_raysim_run_refuses_a_bad_partition_file_in_one_line_before_ray(tmp_path, train, expected):
    """A null inside an index list was a traceback; an index listed twice ran, the sample weighing double."""
    path = write_partition_table(tmp_path / "p.parquet", {"train": train, "test": [[5], [6]]})
    config = {
        "algorithm": {"name": "fedavg"},
        "dataset": {"name": "synthetic_classification"},
        "model": {"name": "mlr"},
        "partition": {"scheme": "file", "path": str(path)},
        "clients": {"count": 2},
        "rounds": 1,
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = _cli("run", str(tmp_path / "run.yaml"), "--quiet", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: partition.path={path}: {expected}"), line
    assert "Traceback" not in done.stderr and not (tmp_path / "mlflow.db").exists()


def test_raysim_partition_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("algorithm: {name: flame}\npartition: {scheme: q_label, q: 11}\n")
    done = _cli("partition", str(config), "--out", str(tmp_path / "p.parquet"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "partition.q=11" in done.stderr
    assert not (tmp_path / "p.parquet").exists()
