"""Algorithms, one module each, registered by name (the config's `algorithm.name`)."""

from __future__ import annotations

from raysim.algorithms.augfl import AugFl
from raysim.algorithms.base import Algorithm, AlgorithmSettings, ClientInfo, run_client_step
from raysim.algorithms.ditto import Ditto
from raysim.algorithms.fedadmm import FedAdmm
from raysim.algorithms.fedalt import FedAlt
from raysim.algorithms.fedapm import FedApm
from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.fedprox import FedProx
from raysim.algorithms.fedsim import FedSim
from raysim.algorithms.fedslr import FedSlr
from raysim.algorithms.flame import Flame
from raysim.algorithms.local import Local
from raysim.algorithms.pfedme import PFedMe
from raysim.models.spec import ParamSpec

REGISTRY: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (Flame, FedAvg, FedAdmm, FedProx, PFedMe, Ditto, FedApm, FedAlt, FedSim, Local, FedSlr, AugFl)
}


def build_algorithm(settings: AlgorithmSettings, params: ParamSpec) -> Algorithm:
    return REGISTRY[settings.name](settings, params)


__all__ = ["REGISTRY", "Algorithm", "AlgorithmSettings", "ClientInfo", "build_algorithm", "run_client_step"]
