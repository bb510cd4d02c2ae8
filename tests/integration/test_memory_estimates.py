"""The memory check (raysim.runtime.memory) never refuses a shipped experiment on this machine: every shipped config,
paper config and the first setting of every suite and sweep, as shipped (the publishers' dataset sizes, the configs'
client counts and models), is estimated below what the machine has available; and the estimate of a fixed-size source
is what loading it at its full size takes (CIFAR-10's 60,000 images)."""

from __future__ import annotations

import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from raysim.algorithms import ClientInfo, build_algorithm
from raysim.config import ExperimentConfig, is_suite_file, is_sweep_file, load_config
from raysim.data.dataset import DATASETS
from raysim.data.footprint import image_rows
from raysim.data.idx import EMNIST_CLASSES
from raysim.models.flat import ModelSpec
from raysim.runtime.memory import (
    MB,
    check_client_state,
    check_data,
    data_in_memory,
    states_in_memory,
)
from raysim.runtime.state_store import state_nbytes
from raysim.studies.suite import load_suite
from raysim.studies.sweep import load_sweep
from tests.support.data_files import cifar_batch
from tests.support.paths import ROOT

SHIPPED = sorted({*(ROOT / "configs").glob("*.yaml"), *(ROOT / "configs" / "paper").rglob("*.yaml")})

SHAPES = {
    "fashion_mnist": ((1, 28, 28), 10),
    "mnist": ((1, 28, 28), 10),
    "femnist": ((1, 28, 28), 62),
    "cifar10": ((3, 32, 32), 10),
    "cifar100": ((3, 32, 32), 100),
    "tiny_imagenet": ((3, 64, 64), 200),
    "image_folder": ((3, 64, 64), 6),
}
"""A sample's shape and the classes of the real datasets the shipped configs name (what their loaders return):
image_folder is FLAME's Medical MNIST at `dataset.size: 64` read as RGB."""
MEDICAL_MNIST = image_rows(58_954, (3, 64, 64), peak_factor=1.1)
"""The image folder's estimate where its files are (here they are not): Kaggle's 58,954 Medical MNIST images."""


def first_setting(path: Path, tmp_path: Path) -> ExperimentConfig:
    """A shipped file's experiment: the file itself, a suite's first run, or a sweep's first trial."""
    if is_suite_file(path):
        return load_suite(path).experiments()[0][1]
    if is_sweep_file(path):
        return load_sweep(path).trials(f"sqlite:///{tmp_path / 'unused.db'}")[0].config
    return load_config(path)


def shape_of(config: ExperimentConfig) -> tuple[tuple[int, ...], int, str]:
    """(input shape, outputs, task) of the config's data: the real sets' from SHAPES, the generated ones' from a
    load of a few samples (a substitute's shape does not depend on its samples)."""
    name = config.dataset.name
    if name == "emnist":
        return (1, 28, 28), EMNIST_CLASSES[config.dataset.split], "classification"
    if name in SHAPES:
        shape, classes = SHAPES[name]
        return shape, classes, "classification"
    small = {"samples": 200} if "samples" in type(config.dataset).model_fields else {}
    dataset = config.dataset.model_copy(update=small).load(config.seed)
    return dataset.input_shape, dataset.output_dim, dataset.task


def total_memory() -> int:
    """This machine's memory (MemTotal), the figure the shipped experiments are held to: what is available at a
    moment depends on what else runs (the checks use that, at the start of each run)."""
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    return int(line.split()[1]) * 1024


def test_no_shipped_experiment_is_refused_on_this_machine(tmp_path, monkeypatch):
    """Each estimate below three quarters of the machine's memory (room for the processes' own memory: Python,
    torch and Ray's take about 0.5 GB each), and the checks, given that figure, refuse none."""
    import raysim.runtime.memory as memory

    room = int(0.75 * total_memory())
    monkeypatch.setattr(memory, "available_memory", lambda: (room, "three quarters of MemTotal"))
    figures = {}
    for path in SHIPPED:
        config = first_setting(path, tmp_path)
        budget = check_data(config)  # refuses (ConfigError) a run past the figure
        footprint = config.dataset.footprint() or (MEDICAL_MNIST if config.dataset.name == "image_folder" else None)
        assert footprint is not None, f"{path.name}: dataset {config.dataset.name} has no estimate"
        shape, outputs, task = shape_of(config)
        model = ModelSpec(config.model.name, shape, outputs, task).build()
        algorithm = build_algorithm(config.algorithm, model.spec)
        count = config.clients.count
        one = algorithm.init_client(ClientInfo(0, 100, 1 / count, count), model.initial_parameters(0))
        check_client_state(config, budget, footprint.nbytes, footprint.samples or 0, one, count)
        states = states_in_memory(config.runtime, state_nbytes(one), count)
        run = data_in_memory(config.runtime, footprint.nbytes, footprint.samples or 0) + states
        figures[path.relative_to(ROOT)] = max(footprint.peak, run)
    largest = max(figures, key=figures.__getitem__)
    print(f"largest estimate: {largest} {figures[largest] / MB:,.0f} MB of {room / MB:,.0f} MB")
    assert figures[largest] < room


@pytest.mark.slow
def test_cifar10_at_its_full_size_takes_what_its_fixed_estimate_says(tmp_path):
    """CIFAR-10's publisher's batches (random pixels, 6 x 10,000 rows): the source's fixed estimate is what the
    loaded arrays hold, and its peak (every batch read, then concatenated) what tracemalloc sees, within 1.5."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in (*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(10_000, b"labels", 10, rng), protocol=2))
    settings = DATASETS.get("cifar10").model_validate({"name": "cifar10", "root": str(tmp_path), "download": False})
    footprint = settings.footprint()
    tracemalloc.start()
    try:
        dataset = settings.load(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert footprint.samples == len(dataset.y) == 60_000
    assert footprint.nbytes == dataset.x.nbytes + dataset.y.nbytes
    assert 1 / 1.5 < footprint.peak / peak < 1.5, (footprint.peak, peak)
