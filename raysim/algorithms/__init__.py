"""Algorithms, one module each (AugFL: a package), registered by name (the config's `algorithm.name`,
raysim.algorithms.interface.ALGORITHMS).

The built-in modules are imported here so that they register: the papers' methods and their baselines in the order
`raysim algorithms` lists them, then every other module of the package by name, so that a new method is its own
file and nothing else (`HOUSE` names the modules that are not methods). The names a plugin's algorithm needs are
exported here (docs/extending.md)."""

from __future__ import annotations

import importlib
import pkgutil

# isort: off
from raysim.algorithms import flame, fedapm, fedavg, fedadmm, fedprox, pfedme, ditto, fedalt, fedsim, local  # noqa: F401
from raysim.algorithms import feddyn, fedslr, augfl  # noqa: F401
from raysim.algorithms import scaffold, gpgd, lpgd  # noqa: F401
from raysim.algorithms import fedrep, lg_fedavg, fedspa  # noqa: F401
from raysim.algorithms import perfedavg, apfl, lp_proj  # noqa: F401
from raysim.algorithms import fedproto, fedrod  # noqa: F401
from raysim.algorithms import fedlp, fedala  # noqa: F401
from raysim.algorithms.augfl import kd_only  # noqa: F401
from raysim.algorithms import fedcp  # noqa: F401
from raysim.algorithms import fedpcl  # noqa: F401

# isort: on
from raysim.algorithms.interface import ALGORITHMS, Algorithm, ClientInfo, ClientUpdate, Upload, server_metrics
from raysim.algorithms.requests import LocalSGD, SGDResult, Vector
from raysim.algorithms.settings import AlgorithmSettings, SGDSettings
from raysim.models.spec import ParamSpec


def build_algorithm(settings: AlgorithmSettings, params: ParamSpec) -> Algorithm:
    return ALGORITHMS.get(settings.name)(settings, params)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmSettings",
    "ClientInfo",
    "ClientUpdate",
    "LocalSGD",
    "SGDResult",
    "SGDSettings",
    "Upload",
    "Vector",
    "build_algorithm",
    "server_metrics",
]

HOUSE = frozenset({"interface", "requests", "settings", "terms", "prox", "families"})
"""The modules of raysim.algorithms every method may import; every other module (a package: AugFL) is one method's
(tests/unit/test_architecture.py: a method imports the house and the families, never another method)."""

for _method in sorted(module.name for module in pkgutil.iter_modules(__path__)):
    if _method not in HOUSE:
        importlib.import_module(f"{__name__}.{_method}")
