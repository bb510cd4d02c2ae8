"""Refresh tests/system_durations.json (the system lane's order, tests/conftest.py) from a measured run.

    make test PYTEST_ADDOPTS=--junitxml=/tmp/run.xml
    .venv/bin/python -m tests.support.durations /tmp/run.xml

A test's seconds are its JUnit time (setup, call and teardown: pytest's default `junit_duration_report`), one
decimal; a parametrized test's id keeps its parameters, an `@group` suffix (xdist's loadgroup) is dropped, as the
ordering looks tests up without it.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import SYSTEM_SECONDS


def system_seconds(junit: Path) -> dict[str, float]:
    """Each system test's seconds in the run `junit` records, by node id."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "")
        if not module.startswith("tests.system."):
            continue
        node = f"{module.replace('.', '/')}.py::{case.get('name', '').split('@')[0]}"
        seconds[node] = round(seconds.get(node, 0.0) + float(case.get("time", 0.0)), 1)
    return dict(sorted(seconds.items()))


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        raise SystemExit("usage: python -m tests.support.durations JUNIT_XML (a junit file of a `make test` run)")
    seconds = system_seconds(Path(argv[0]))
    if not seconds:
        raise SystemExit(f"{argv[0]}: no system test in it (run the whole suite or tests/system with --junitxml)")
    SYSTEM_SECONDS.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"{SYSTEM_SECONDS}: {len(seconds)} system tests, {sum(seconds.values()):,.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
