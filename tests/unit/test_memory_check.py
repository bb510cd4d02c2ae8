"""A run whose data, partition and client state will not fit in memory is refused before anything is loaded (issue
51, section 3): a multimodal substitute with `samples: 1000000000` took the process to 13.8 GB in 110 s. The
estimates (raysim.data.footprint, raysim.runtime.memory) are checked against what loading really takes and what
the hosts really hold; the refusals against the CLI's one-line rule."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from raysim.config import validate_config
from raysim.data.dataset import DATASETS, DatasetSettings
from raysim.data.footprint import Footprint, file_footprint, npz_members
from raysim.errors import ConfigError
from raysim.runtime.memory import MB, available_memory, check_data
from raysim.runtime.problem import prepare
from raysim.runtime.state_store import state_nbytes
from tests.support.data_files import image_of
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess

FACTOR = 1.5
"""How far an estimate may be from what loading takes (both ways): the estimates below are within 1.15 of it."""

BILLION = {"name": "crisismmd_synthetic", "samples": 1_000_000_000}


def _refuse_ray_and_mlflow(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)


def _cli(tmp_path: Path, tree: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`raysim run` of the config in this process: its exit code and the lines it wrote to stderr."""
    from raysim.cli import main

    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tree))
    code = main(["run", str(config), "--quiet"])
    out, err = capsys.readouterr()
    assert out == ""
    return code, err.strip().splitlines()


def test_a_billion_samples_are_refused_in_one_line_before_anything_is_loaded_or_started(tmp_path, monkeypatch, capsys):
    import raysim.cli
    import raysim.runtime.driver  # noqa: F401  (imported before the count: what the run allocates is the subject)

    _refuse_ray_and_mlflow(monkeypatch)
    store = tmp_path / "mlflow.db"
    tree = tiny_config(
        dataset=BILLION,
        model={"name": "image_text_classifier"},
        partition={"scheme": "iid"},
        runtime={"actors": "ray"},
        tracking={"experiment": "tests", "uri": f"sqlite:///{store}"},
    )
    tracemalloc.start()
    began = time.perf_counter()
    try:
        code, lines = _cli(tmp_path, tree, capsys)
        seconds = time.perf_counter() - began
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 2 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: dataset.samples=1000000000: loading dataset crisismmd_synthetic"), line
    assert "MB this machine has available" in line and line.endswith("; lower dataset.samples"), line
    needed = int(line.split("needs about ")[1].split(" MB")[0].replace(",", ""))
    assert needed > 10**8  # 67 KB a row, a billion rows: the 200 TB the load would have taken
    assert peak < 200 * MB and seconds < 30  # nothing of it was drawn (it filled 13.8 GB in 110 s)
    assert not store.exists() and not (tmp_path / "mlruns").exists()


def test_a_low_memory_limit_refuses_a_small_run_naming_it(tmp_path, monkeypatch, capsys):
    _refuse_ray_and_mlflow(monkeypatch)
    tree = tiny_config(
        runtime={"actors": "in_process", "memory_limit_mb": 0.1},
        tracking={"experiment": "tests", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )
    code, lines = _cli(tmp_path, tree, capsys)
    assert code == 2 and lines == [
        "error: loading dataset synthetic_classification (2,000 samples) needs about 0.7 MB, more than "
        "runtime.memory_limit_mb=0.1; raise runtime.memory_limit_mb"
    ]
    substitute = tiny_config(dataset={"name": "kuhar_synthetic", "samples": 1000}, runtime={"memory_limit_mb": 10})
    with pytest.raises(ConfigError, match=r"^dataset.samples=1000: .* more than runtime.memory_limit_mb=10; lower "):
        prepare(validate_config(substitute))


def _flame_mlp(clients: int, **runtime: Any) -> dict[str, Any]:
    return tiny_config(
        model={"name": "mlp"},
        partition={"scheme": "iid"},
        clients={"count": clients},
        runtime={"actors": "in_process", **runtime},
    )


def test_the_clients_states_are_refused_naming_clients_count_unless_they_spill():
    """FLAME keeps theta_i, w_i and pi_i: 3 x 11,177 float32 of the MLP on 20 features (131 KB) per client; 1,000
    clients' 128 MB do not fit 100 MB, and do with a host that keeps 10 MB of them in memory (the rest on disk)."""
    with pytest.raises(ConfigError) as refused:
        prepare(validate_config(_flame_mlp(1000, memory_limit_mb=100, state_store="hosts")))
    message = str(refused.value)
    assert message.startswith("clients.count=1000: the data and 1,000 clients' states (131 KB each for flame on model ")
    assert message.endswith(
        "more than runtime.memory_limit_mb=100; lower clients.count or raise runtime.memory_limit_mb (or set "
        "runtime.state_memory_mb: the states past it spill to disk)"
    )
    hosts = {"state_store": "hosts", "num_hosts": 2}
    problem = prepare(validate_config(_flame_mlp(1000, memory_limit_mb=100, state_memory_mb=10, **hosts)))
    assert len(problem.clients) == 1000
    with pytest.raises(ConfigError, match=r"lower runtime.state_memory_mb or clients.count or raise runtime.memory"):
        prepare(validate_config(_flame_mlp(1000, memory_limit_mb=100, state_memory_mb=60, **hosts)))
    # state_store=auto: past half the memory the run may take, or the hosts' budgets together (120 MB), the store's
    # columns go to disk, and the run fits
    assert len(prepare(validate_config(_flame_mlp(1000, memory_limit_mb=100))).clients) == 1000
    assert len(prepare(validate_config(_flame_mlp(1000, memory_limit_mb=100, state_memory_mb=60, num_hosts=2))).clients)


@pytest.mark.parametrize("algorithm", ["flame", "ditto", "scaffold", "fedavg"])
def test_the_state_estimate_is_what_the_host_holds_once_every_client_trained(algorithm):
    """One client's initial state times the clients is what a host holds after a round of all of them: the figure the
    check counts is the real one."""
    tree = _flame_mlp(6)
    tree["algorithm"] = {"name": algorithm}
    tree["clients"]["per_round"] = 6
    simulation = InProcess(validate_config(tree))
    info, _ = simulation.problem.clients[0]
    one = state_nbytes(simulation.host.algorithm.init_client(info, simulation.problem.init_params))
    simulation.round(0)
    held = sum(state_nbytes(state) for state in simulation.states.values())
    assert held == 6 * one and (algorithm == "fedavg") == (one == 0)


def _write_images(root: Path) -> dict[str, Any]:
    for label, name in enumerate(("a", "b", "c")):
        (root / name).mkdir(parents=True)
        for k in range(60):
            image_of(40 * label + k, (64, 64), "RGB").save(root / name / f"{k}.png")
    return {"root": str(root)}


def _write_medmnist(root: Path) -> dict[str, Any]:
    generator = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 4000), ("val", 500), ("test", 1000)):
        arrays[f"{split}_images"] = generator.integers(0, 256, size=(n, 28, 28, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 9).reshape(n, 1).astype(np.uint8)
    np.savez_compressed(root / "pathmnist.npz", **arrays)
    return {"root": str(root), "subset": "pathmnist", "download": False}


def _write_npz(root: Path) -> dict[str, Any]:
    generator = np.random.default_rng(0)
    x = generator.integers(0, 256, size=(10_000, 1, 28, 28), dtype=np.uint8)  # widened to float32 by the loader
    np.savez(root / "data.npz", x=x, y=generator.integers(0, 10, 10_000), groups=np.arange(10_000) % 7)
    return {"path": str(root / "data.npz")}


def _write_converted(root: Path) -> dict[str, Any]:
    """A converted CrisisMMD archive as `python -m raysim.data.fedmultimodal convert` writes it: one image feature
    per sample, tweets of 4-32 token features."""
    generator = np.random.default_rng(0)
    n = 600
    tokens = generator.integers(4, 33, n)
    np.savez(
        root / "crisismmd.npz",
        y=generator.integers(0, 8, n),
        groups=np.arange(n) % 20,
        part=np.zeros(n, np.int8),
        group_names=np.array([str(i) for i in range(20)]),
        image_steps=generator.standard_normal((n, 1280), dtype=np.float32),
        image_lengths=np.ones(n, np.int64),
        text_steps=generator.standard_normal((int(tokens.sum()), 512), dtype=np.float32),
        text_lengths=tokens,
    )
    return {"root": str(root)}


LOADS = {
    "crisismmd_synthetic": lambda root: {"samples": 400},
    "cremad_synthetic": lambda root: {"samples": 100},
    "kuhar_synthetic": lambda root: {"samples": 3000},
    "synthetic_writers": lambda root: {},
    "fashion_mnist": lambda root: {"download": False},
    "image_folder": _write_images,
    "medmnist": _write_medmnist,
    "npz": _write_npz,
    "crisismmd": _write_converted,
}
"""Sources whose estimate is checked against a real load: the substitutes at a few hundred samples, the installed
Fashion-MNIST and small files in each other layout (CIFAR-10 at its full 60,000:
tests/integration/test_memory_estimates.py)."""


@pytest.mark.parametrize("name", sorted(LOADS))
def test_the_estimate_is_what_loading_takes(name, tmp_path, monkeypatch):
    """`nbytes` against the loaded arrays' bytes, `peak` against tracemalloc's peak while loading (numpy reports its
    allocations to it), both within FACTOR; the estimate itself reads headers only (well under a second). The load
    is a first one, which decodes: an empty cache folder (raysim.data.decoded)."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path / "cache"))
    settings = DATASETS.get(name).model_validate({"name": name, **LOADS[name](tmp_path)})
    began = time.perf_counter()
    footprint = settings.footprint()
    assert footprint is not None and time.perf_counter() - began < 1
    tracemalloc.start()
    try:
        dataset = settings.load(0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    held = sum(a.nbytes for a in (dataset.x, dataset.y, dataset.groups) if a is not None)
    assert footprint.samples == len(dataset.y) or name == "synthetic_writers"  # 300 writers of U(20, 60): about
    assert 1 / FACTOR < footprint.nbytes / held < FACTOR, (footprint.nbytes, held)
    assert 1 / FACTOR < footprint.peak / peak < FACTOR, (footprint.peak, peak)


def test_a_substitutes_estimate_scales_with_its_samples_and_names_the_setting():
    small, large = (DATASETS.get("cremad_synthetic")(samples=n).footprint() for n in (1000, 2000))
    assert large.nbytes == 2 * small.nbytes and large.setting == "dataset.samples"
    assert small.nbytes == 1000 * (4 * (600 * 80 + 1 + 6 * 1280) + 16)  # packed float32 rows, int64 labels and groups


def test_npz_headers_give_shapes_without_reading_the_arrays(tmp_path):
    arrays = {"a": np.zeros((3, 4), np.float32), "b": np.arange(5, dtype=np.int16)}
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    assert npz_members(tmp_path / "c.npz") == {"a": ((3, 4), np.dtype(np.float32)), "b": ((5,), np.dtype(np.int16))}
    (tmp_path / "broken.npz").write_bytes(b"PK not an archive")
    assert npz_members(tmp_path / "broken.npz") == {}


class _PluginSettings(DatasetSettings):
    """A plugin's source that says nothing of its size (not registered: the registries are the matrix's axes)."""

    name: str = "plugin_data"
    path: str | None = None


def test_a_plugin_source_gets_the_generic_estimate_of_its_file(tmp_path):
    assert _PluginSettings().footprint() is None  # nothing named: unknown, only the clients' states are checked
    (tmp_path / "blob.bin").write_bytes(b"\0" * 5000)
    assert _PluginSettings(path=str(tmp_path / "blob.bin")).footprint() == Footprint(None, 5000, 5000)
    assert file_footprint(tmp_path / "missing.bin") is None


def test_the_machines_figure_is_memavailable_or_the_cgroups_limit_less_its_usage_when_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    1000000 kB\n")
    cgroups = tmp_path / "cgroup"
    cgroups.write_text("0::/jobs/run\n")
    folder = tmp_path / "fs" / "jobs" / "run"
    folder.mkdir(parents=True)
    (folder / "memory.max").write_text("max\n")
    (folder / "memory.current").write_text("100\n")
    assert available_memory(meminfo, cgroups, tmp_path / "fs") == (1_024_000_000, "MemAvailable")
    (folder / "memory.max").write_text("600000000\n")
    (folder / "memory.current").write_text("100000000\n")
    assert available_memory(meminfo, cgroups, tmp_path / "fs") == (
        500_000_000,
        "its cgroup's memory.max less its usage",
    )
    cgroups.write_text("4:memory:/jobs/run\n")  # cgroup v1 writes "no limit" as a huge number
    v1 = tmp_path / "fs" / "memory" / "jobs" / "run"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    assert available_memory(meminfo, cgroups, tmp_path / "fs") == (1_024_000_000, "MemAvailable")
    assert available_memory(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None
    assert available_memory() is not None  # this machine's /proc/meminfo


def test_without_a_figure_nothing_is_refused(monkeypatch):
    import raysim.runtime.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda: None)
    assert check_data(validate_config(tiny_config(dataset=BILLION))) is None
