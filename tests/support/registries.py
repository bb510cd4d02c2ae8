"""raysim's registries, and taking a plugin's entries out of them again (tests/conftest.py `no_plugin_left`)."""

from __future__ import annotations

import sys

from raysim import plugins
from raysim.algorithms import ALGORITHMS
from raysim.data import DATASETS, PARTITIONS
from raysim.executors import EXECUTORS
from raysim.models import MODELS
from raysim.registry import Registry, defined_by
from raysim.threats import ATTACKS, ROBUST_RULES

REGISTRIES: tuple[Registry, ...] = (ALGORITHMS, DATASETS, PARTITIONS, MODELS, ATTACKS, ROBUST_RULES, EXECUTORS)


def forget_plugin(spec: str) -> None:
    """Take the entries the plugin `spec` (as raysim.plugins.load took it) registered out of every registry, and
    forget its module, as if it had never been loaded in this process."""
    module = plugins._loaded.pop(spec)  # noqa: SLF001 - the tests' isolation reaches into the loader's bookkeeping
    name = module.__name__
    sys.modules.pop(name, None)
    for registry in REGISTRIES:
        for key, entry in list(registry.items()):
            origin = getattr(defined_by(entry), "__module__", "") or ""
            if origin == name or origin.startswith(f"{name}."):
                registry._entries.pop(key)  # noqa: SLF001 - likewise
