"""Helpers shared by several test modules (moved from test_algorithms.py)."""

from __future__ import annotations

SPLIT = ("fedapm", "fedalt", "fedsim", "fedrep", "lg_fedavg", "fedproto", "fedrod", "fedcp")
"""Algorithms that need a model of several layers (a personal and a shared part, a body and a head)."""


ALGORITHMS = {
    "fedadmm": {"rho": 0.25},
    "fedprox": {"mu": 0.1},
    "pfedme": {"lambda": 1.0},
    "ditto": {"lambda": 1.0},
    "fedapm": {"rho": 0.25},
    "fedalt": {},
    "fedsim": {},
    "local": {},
    "scaffold": {},
    "feddyn": {"alpha": 0.1},
    "gpgd": {"lambda": 0.01},
    "lpgd": {"lambda": 0.01},
    "fedrep": {"head_epochs": 2},
    "lg_fedavg": {},
    "fedspa": {"density": 0.5},
    "perfedavg": {"alpha": 0.05},
    "apfl": {"adaptive_alpha": True},
    "lp_proj": {"lambda": 1.0, "rho": 0.25, "d_sub": 3},
    "fedproto": {"lambda": 1.0},
    "fedrod": {},
    "fedlp": {"teacher_epochs": 1},
    "fedala": {},
    "fedcp": {},
    "kd_only": {"teacher_epochs": 1, "transfer": {"negatives": 32}},
    "fedpcl": {"teacher_epochs": 1},
}


META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 64}


PARTITIONS = {"fedlp": META, "kd_only": META, "fedpcl": META}
"""Partitions other than tiny_config's: the PM-aided methods need the meta partition's held-back pools."""
