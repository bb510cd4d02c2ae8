"""The test tiers' order, and the shared fixtures: one real local Ray instance per test session (per xdist worker),
a local multi-node cluster per module that asks for one, a tenth of Fashion-MNIST, and a fresh sqlite MLflow store
per test.

A test's tier is its folder (docs/development.md): tests/unit (no Ray, no subprocess, no network server),
tests/integration (whole experiments in process; a local Ray where the test is about actors), tests/system (real
processes and signals, servers, a cluster, the browser, the docs' commands, the shipped configs).

`make test` hands its workers (three on two cores: docs/development.md, Scheduling) one test at a time as they free
up (`--dist loadgroup`; a module whose tests share an expensive module fixture, a cluster or a finished suite, goes as
one group: `pytestmark = pytest.mark.xdist_group(...)`), in the order `pytest_collection_modifyitems` makes: a system
test starts a process tree (a Ray, a server) that takes both cores, so two of them side by side each ran 40 % slower;
the order interleaves the system tier with the other two, so that while one worker runs a system test the others run
lighter ones, the system modules with the most slow tests first.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TIERS = ("system", "integration", "unit")
"""The folders under tests/."""
TYPICAL_SECONDS = {"system": 15.0, "integration": 1.5, "unit": 0.05}
"""A test's typical duration in each tier, which the order below weighs tests by."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Two lanes merged by their typical durations: the system tier's tests in file order, and the integration and
    unit tiers' in file order; the next test comes from the lane that has used less time so far."""
    system = heaviest_modules_first([item for item in items if tier_of(item) == "system"])
    lighter = [item for item in items if tier_of(item) != "system"]
    order, used = [], {"system": 0.0, "lighter": 0.0}
    while system or lighter:
        lane = "system" if system and (not lighter or used["system"] <= used["lighter"]) else "lighter"
        item = (system if lane == "system" else lighter).pop(0)
        used[lane] += TYPICAL_SECONDS[tier_of(item)]
        order.append(item)
    items[:] = order


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A grouped test fails at once when `--dist loadgroup` did not group it: xdist sends a group to one worker by
    the `@group` its ids end with, and a pytest that drops it (9.2 with xdist 3.8, pytest-xdist #1386) spreads the
    group's tests over both workers without a word, each building the module's cluster or suite again."""
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
    if grouped and "@" not in item.nodeid:
        pytest.fail(
            "--dist loadgroup does not group this test (no @group in its id: pytest-xdist #1386); use the pytest "
            "that constraints.txt pins (make setup)",
            pytrace=False,
        )


_census = None


def pytest_configure(config: pytest.Config) -> None:
    """With RAYSIM_CPU_CENSUS naming a file, each test's CPU seconds go to it (tests/support/cpu_census.py), from
    the process that runs the test (a worker; not xdist's controller, which only relays reports)."""
    global _census
    controller = not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
    if os.environ.get("RAYSIM_CPU_CENSUS") and not controller:
        from tests.support.cpu_census import Census

        _census = Census(Path(os.environ["RAYSIM_CPU_CENSUS"]), os.environ.get("PYTEST_XDIST_WORKER", "main"))


def pytest_runtest_logstart(nodeid: str) -> None:
    if _census is not None:
        _census.start(nodeid)


def pytest_runtest_logfinish(nodeid: str) -> None:
    if _census is not None:
        _census.finish(nodeid)


def pytest_sessionfinish() -> None:
    if _census is not None:
        _census.close()


SYSTEM_SECONDS = Path(__file__).with_name("system_durations.json")
"""Each system test's seconds in a `make test` run (call + setup + teardown, tests under 1 s left out), measured
with `pytest tests/system -n 2 --dist loadgroup --durations=0`; only the order of the system lane reads it, so a
stale or missing entry costs time, never a result."""

UNMEASURED_SECONDS = 2.0
"""A system test without an entry (a new one): as the median one."""


def heaviest_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The system tier's tests longest first (the longest-processing-time rule: the run does not end with one
    worker in a long test while the other has nothing left), a module whose tests share one worker
    (`xdist_group`) placed as a whole by its total; file order among equals."""
    import json

    seconds = json.loads(SYSTEM_SECONDS.read_text()) if SYSTEM_SECONDS.exists() else {}
    own = {item: seconds.get(item.nodeid.split("@")[0], UNMEASURED_SECONDS) for item in items}
    grouped: dict[Path, float] = {}
    for item in items:
        if item.get_closest_marker("xdist_group"):
            grouped[item.path] = grouped.get(item.path, 0.0) + own[item]
    position = {item: index for index, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(item.path, position[item])

    def key(item: pytest.Item) -> tuple[float, int, int]:
        if item.path in grouped:
            return (-grouped[item.path], first[item.path], position[item])
        return (-own[item], position[item], 0)

    return sorted(items, key=key)


def tier_of(item: pytest.Item) -> str:
    """The tier folder a test lives in."""
    parts = Path(str(item.path)).parts
    tier = parts[parts.index("tests") + 1] if "tests" in parts else ""
    if tier not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit, tests/integration or tests/system")
    return tier


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance (2 CPUs, small object store) shared by the tests that need Ray, started lean as
    raysim starts its own (raysim.runtime.session.lean_head) and without a log monitor: it lives for the whole
    session, and a log monitor scans its logs folder ten times a second (1.4 CPU s a minute, a tenth of a core
    over three workers). The tests read what they check from Ray's answers, not from the workers' output."""
    import ray

    from raysim.runtime.session import lean_head

    with lean_head(log_monitor=False):
        ray.init(
            address="local",
            num_cpus=2,
            object_store_memory=512 * 2**20,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_crew_left():
    """The actors a module's runs kept (runtime.reuse_actors: tiny_config's default) hold CPUs of the session's Ray
    that the next module's runs need (nothing to do, nor to import, where no run kept any)."""
    yield
    crews = sys.modules.get("raysim.runtime.crews")
    if crews is not None:
        crews.dismiss_parked()


@pytest.fixture(autouse=True)
def no_plugin_left():
    """A test that loads a plugin in this process (`main(["submit", ..., "--plugin", FILE])`, a config's `plugins:`)
    registers its entries for the rest of the process: they are taken out after it, and its module forgotten, so
    that every test sees the registries raysim ships (and a later test that loads the plugin imports it again)."""
    plugins = sys.modules.get("raysim.plugins")
    before = set(plugins.loaded()) if plugins is not None else set()
    yield
    plugins = sys.modules.get("raysim.plugins")
    if plugins is None or set(plugins.loaded()) == before:
        return
    from tests.support.registries import forget_plugin

    for spec in set(plugins.loaded()) - before:
        forget_plugin(spec)


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes started with `ray start` on 127.0.0.1 (tests.support.cluster.LocalCluster), for
    the tests of one module; afterwards none of its processes is left."""
    from tests.support.cluster import LocalCluster

    started = LocalCluster()
    try:
        yield started.start()
    finally:
        started.stop()
        assert not started.own_pids()


@pytest.fixture(scope="session")
def fmnist_tenth(tmp_path_factory) -> Path:
    """A tenth of the installed Fashion-MNIST as a `dataset.root` in its standard layout (the four IDX files):
    the first 6,000 training and 1,000 test images, real ones, read by the real loader and normalized as uint8
    images like the whole set, at a tenth of the cost of every pass over the data."""
    from raysim.data.fashion_mnist import FILES, load_fashion_mnist
    from tests.support.data_files import write_idx

    x, y = load_fashion_mnist(download=False)
    root = tmp_path_factory.mktemp("fashion-mnist-tenth")
    for part, rows in (("train", slice(0, 6000)), ("test", slice(60000, 61000))):
        write_idx(root / FILES[f"{part}_images"], x[rows])
        write_idx(root / FILES[f"{part}_labels"], y[rows].astype("uint8"))
    return root


@pytest.fixture
def mlflow_uri(tmp_path) -> str:
    """A fresh sqlite tracking store for one test (tests/support/stores.py)."""
    from tests.support.stores import fresh_store

    return fresh_store(tmp_path / "mlflow.db")
