"""`raysim datasets`: every `dataset.name` says what it is and where it reads, the README lists it, and the command
finds a dataset whose layout is under `--root`."""

from __future__ import annotations

from tests.support.data_files import BUILT_IN
from tests.support.paths import ROOT


def test_every_source_says_what_it_is_and_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name, source in BUILT_IN.items():
        assert source.summary() and source.layout and source.get, name
        assert f"`{name}`" in readme or (name.startswith("synthetic_") and "`synthetic_*`" in readme), name
