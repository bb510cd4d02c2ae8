"""The system lane's order (tests/conftest.py) and the file it reads, refreshed from a run's JUnit file."""

from __future__ import annotations

from pathlib import Path

from tests.support.durations import system_seconds

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.system.test_cluster" name="test_recipe@system-cluster" time="45.36" />
<testcase classname="tests.system.test_docs" name="test_page[README.md]@system-docs" time="41.52" />
<testcase classname="tests.system.test_docs" name="test_page[usage.md]@system-docs" time="2.04" />
<testcase classname="tests.unit.test_flame" name="test_invariant" time="0.30" />
<testcase classname="tests.integration.test_runtime" name="test_hosts" time="14.4" />
</testsuite></testsuites>
"""


def test_a_runs_junit_gives_each_system_tests_seconds_under_the_id_the_ordering_looks_up(tmp_path: Path):
    (tmp_path / "run.xml").write_text(JUNIT)
    assert system_seconds(tmp_path / "run.xml") == {
        "tests/system/test_cluster.py::test_recipe": 45.4,
        "tests/system/test_docs.py::test_page[README.md]": 41.5,
        "tests/system/test_docs.py::test_page[usage.md]": 2.0,
    }


def test_the_shipped_file_names_only_system_tests_that_exist():
    """A renamed or removed test left in the file orders nothing; one missing counts as the median (2 s)."""
    import json

    from tests.conftest import SYSTEM_SECONDS

    root = SYSTEM_SECONDS.parent.parent
    for node in json.loads(SYSTEM_SECONDS.read_text()):
        path, name = node.split("::")
        assert f"def {name.split('[')[0]}(" in (root / path).read_text(), node


def test_the_cpu_census_sums_by_tier_and_module_and_lists_the_costliest_first():
    from tests.support.cpu_census import summary

    lines = [
        {"test": "tests/system/test_sweep.py::test_twenty", "cpu_s": 60.0, "wall_s": 40.0, "worker": "gw0"},
        {"test": "tests/system/test_sweep.py::test_refused", "cpu_s": 4.0, "wall_s": 5.0, "worker": "gw1"},
        {"test": "tests/unit/test_flame.py::test_invariant", "cpu_s": 0.5, "wall_s": 0.6, "worker": "gw1"},
    ]
    text = summary(lines, top=2)
    assert text.splitlines()[0] == "3 tests, 64 CPU seconds (two cores: at least 0.5 minutes)"
    assert "     64       45  system" in text and "      0        1  unit" in text
    assert "     64       45  tests/system/test_sweep.py" in text
    costliest = text.split("test (the 2 costliest)\n")[1].splitlines()
    assert [line.split()[-1] for line in costliest] == [
        "tests/system/test_sweep.py::test_twenty",
        "tests/system/test_sweep.py::test_refused",
    ]
