"""Algorithms, one module each, registered by name (the config's `algorithm.name`)."""

from __future__ import annotations

from raysim.algorithms.base import Algorithm, AlgorithmSettings, ClientInfo, run_client_step
from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.flame import Flame
from raysim.models.flat import ParamSpec

REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Flame, FedAvg)}


def build_algorithm(settings: AlgorithmSettings, params: ParamSpec) -> Algorithm:
    return REGISTRY[settings.name](settings, params)


__all__ = ["REGISTRY", "Algorithm", "AlgorithmSettings", "ClientInfo", "build_algorithm", "run_client_step"]
