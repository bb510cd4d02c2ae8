"""What the catalog tests of several tiers share."""

from __future__ import annotations

from raysim.data import DATASETS

BUILT_IN = {name: source for name, source in DATASETS.items() if source.__module__.startswith("raysim.")}
"""The package's own sources (a plugin's, registered in this process by another test, is in neither the README nor
a fresh `raysim datasets`)."""
