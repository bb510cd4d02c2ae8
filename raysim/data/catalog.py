"""What each `dataset.name` reads, where it looks, and how to get it: `raysim datasets`, from each registered source's
settings class (DatasetSettings.summary, layout, get, markers), a plugin's included.

The check is cheap (a file or folder that marks the layout exists); loading reads and validates the files.
"""

from __future__ import annotations

from pathlib import Path

from raysim.data.dataset import DatasetSettings
from raysim.data.download import default_root

__all__ = ["default_root", "found_at"]


def found_at(source: type[DatasetSettings], roots: list[Path]) -> Path | None:
    """The first root under which the source's layout is present (None if it is in none; a source without
    markers is always available)."""
    if not source.markers:
        return Path("-")
    for root in roots:
        if any(next(root.glob(marker), None) is not None for marker in source.markers):
            return root
    return None
