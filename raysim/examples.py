"""Examples of the registered choices. Every algorithm and partition scheme says, through its classmethod
`example(context)`, the config sections under which it runs in a small experiment: its own section, and another
section only where it cannot run without it (AugFL: the meta partition; the natural scheme: a dataset with
natural ids; the file scheme: a partition file). So two choices whose examples set one section differently
cannot run together, and raysim must refuse that config with one line naming the section.

Whoever needs a working experiment for any registered choice (the test matrix, tests/integration/test_matrix.py) builds
it from these: a new entry comes with its example and needs no table kept elsewhere. Examples are plain settings,
computed before any data is read; they write nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Fragment = dict[str, Any]
"""Config sections by name (`algorithm`, `partition`, `dataset`, ...), each a raw settings tree that replaces the
experiment's whole section."""


@dataclass(frozen=True)
class ExampleContext:
    """What an example may build on."""

    base: Mapping[str, Any]
    """The valid experiment (a raw config tree) whose sections the example's replace."""
    partition_file: Path
    """A Parquet file of the base experiment's partition, as `raysim partition` writes it (for an example that
    replays one)."""


def model_example(entry: Any, context: ExampleContext) -> Fragment:
    """The config sections a registered model needs besides `model` (a raysim.models.spec.ModelEntry): its entry's
    `example(context)` when it has one (a multimodal model names a dataset with its modalities), else none: the
    model runs on any dataset."""
    example = entry.example
    return {} if example is None else example(context)
