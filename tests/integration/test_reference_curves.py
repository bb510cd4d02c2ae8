"""Issue 47 section 2: raysim's FedAvgM, MOON, FedPer, FedBABU, FedBN and FedFomo against FL-bench's own
implementations (benchmarks/reference/: README.md, curves.json, curves.png).

FL-bench (commit 06e658b, run beside raysim in its own venv by benchmarks/reference/flbench_run.py) and raysim ran
each method on the same setting: Fashion-MNIST, 20 clients dealt 6,000 samples by Dirichlet(0.1) (the committed
benchmarks/reference/partition.parquet, the same per-client train/test indices both sides read), FL-bench's 2NN
(LeNet5 with BatchNorm for FedBN) as a raysim plugin model with FL-bench's initial weights (`model.init: authors`,
seed 42), full participation, 1 local epoch of SGD at lr 0.01 with batch 32, 20 rounds. curves.json holds FL-bench's
per-round mean client test accuracy; each test runs raysim in process on that setting and checks its curve stays
within a tolerance of the recorded one.

What still differs is the order of the mini-batches (each side draws its own shuffles) and, for FedFomo, the
validation split (FL-bench redraws its 20% every round, raysim's is fixed), so the curves cannot coincide; the
observed gaps (mean |diff| over the recorded points / largest |diff|, in accuracy points) were: FedPer 0.37 / 0.75,
FedBN 0.37 / 1.05, MOON 0.56 / 1.62, FedFomo 0.83 / 1.88 (raysim about 1 point lower from round 4: it never trains on
its fixed validation 20%), FedBABU 1.25 / 3.41 (its fine-tuned PM; GM 0.76 / 2.91), FedAvgM 2.24 / 6.76 against
FL-bench with its server optimizer's Nesterov flag off (`test_against`: raysim's FedAvgM is Hsu et al.'s heavy-ball
momentum; FL-bench's as published is Nesterov, 5.65 / 15.32 away, see the README). Each tolerance is about twice the
observed gap, at least 1 point on the mean and 2.5 on the largest: batch order alone moves these curves by that much,
while a wrong method moves them further (the README's table of perturbed settings: MOON at mu 1 instead of 5 is
2.35 / 6.76 away, FedBN averaging uniformly 8.6 / 17.1, FedBABU fine-tuning 2 epochs 3.1 / 5.8, FedPer as FedAvg
39 / 46). FedAvgM's momentum amplifies batch-order differences after round 10, so it is held tighter on its first
11 points (0..10 rounds: observed 1.17 / 2.90) and looser on all 20. Round 0 (the initial model on the same test
sets) must agree exactly.

Cost: the six runs take about 40 s of CPU together (20 or 21 rounds each, in process, one thread).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "reference"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"reference_{name}", REFERENCE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _module("run")
CURVES = reference.load_reference()


@dataclass(frozen=True)
class Tolerance:
    mean: float
    """Largest mean |raysim - FL-bench| over the recorded points, accuracy points."""
    max: float
    """Largest |raysim - FL-bench| at any recorded point."""


TOLERANCES = {
    "fedper": Tolerance(1.0, 2.5),
    "fedbn": Tolerance(1.0, 2.5),
    "moon": Tolerance(1.25, 3.5),
    "fedfomo": Tolerance(1.75, 4.0),
    "fedbabu": Tolerance(2.5, 7.0),
    "fedavgm": Tolerance(4.5, 13.5),
}
FEDBABU_GM = Tolerance(1.5, 6.0)
FEDAVGM_FIRST = (11, Tolerance(2.5, 6.0))
"""FedAvgM's first 11 points (0..10 rounds), before its momentum amplifies the batch-order differences."""


def _fashion_mnist_installed() -> bool:
    from raysim.data.fashion_mnist import _read_dir, candidate_dirs

    return any(d.is_dir() and _read_dir(d) is not None for d in candidate_dirs(None))


pytestmark = pytest.mark.skipif(not _fashion_mnist_installed(), reason="needs the full Fashion-MNIST (make setup)")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    from tests.support.stores import fresh_store

    return fresh_store(tmp_path_factory.mktemp("reference-mlflow") / "mlflow.db")


def _table(pairs, library, ours) -> str:
    return "\n".join(
        f"  round {p['step']:>2}: FL-bench {a:6.2f}  raysim {b:6.2f}"
        for p, a, b in zip(pairs, library, ours, strict=True)
    )


def _check(name: str, pairs, library, ours, tolerance: Tolerance) -> None:
    mean, worst = reference.gaps(library, ours)
    assert mean <= tolerance.mean and worst <= tolerance.max, (
        f"{name}: raysim is {mean:.2f} points from FL-bench on average (tolerance {tolerance.mean}), "
        f"{worst:.2f} at most (tolerance {tolerance.max}):\n{_table(pairs, library, ours)}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(TOLERANCES))
def test_raysim_curve_stays_within_tolerance_of_flbench(method, store):
    from raysim.algorithms.interface import ALGORITHMS

    if method not in ALGORITHMS.names():
        pytest.skip(f"raysim has no algorithm {method!r} in this checkout")
    entry = CURVES["methods"][method]
    pairs = entry["pairs"]
    library = entry[entry.get("test_against", "curve")]
    history = reference.raysim_history(method, max(p["step"] for p in pairs), store)
    ours = reference.raysim_points(history, pairs)
    if pairs[0]["step"] == 0:  # the same initial model on the same test sets
        assert ours[0] == pytest.approx(library[0], abs=1e-6)
    _check(method, pairs, library, ours, TOLERANCES[method])
    if method == "fedbabu":
        gm_pairs = entry["gm_pairs"]
        gm = reference.raysim_points(history, gm_pairs)
        _check("fedbabu GM", gm_pairs, entry["gm_curve"], gm, FEDBABU_GM)
    if method == "fedavgm":
        first, tolerance = FEDAVGM_FIRST
        _check(f"fedavgm, first {first} points", pairs[:first], library[:first], ours[:first], tolerance)


@pytest.mark.parametrize("model, method", [("flbench_2nn", "fedper"), ("flbench_lenet5", "fedbn")])
def test_the_plugin_models_start_from_flbench_initial_weights(model, method):
    """raysim's `model.init: authors` draw of the plugin model at seed 42 is FL-bench's initial model, bit for bit."""
    from raysim import plugins
    from raysim.models.flat import ModelSpec

    plugins.load(str(REFERENCE / "flbench_models.py"))
    init = ModelSpec(model, (1, 28, 28), 10, "classification").build().initial_parameters(42)
    digest = hashlib.sha256(np.asarray(init, np.float32).tobytes()).hexdigest()
    assert digest == CURVES["methods"][method]["initial_model_sha256"]


def test_the_committed_partitions_are_what_partition_py_writes(tmp_path):
    import pyarrow.parquet as pq

    partition = _module("partition")
    parts = partition.dirichlet_partition(partition.fashion_mnist_labels(), **partition.SETTING)
    for name, with_val in (("partition.parquet", False), ("partition_val.parquet", True)):
        partition.write_parquet(parts, tmp_path / name, with_val=with_val)
        assert pq.read_table(tmp_path / name).equals(pq.read_table(REFERENCE / name)), name
