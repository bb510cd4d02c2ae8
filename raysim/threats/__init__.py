"""Threats: Byzantine attacks on the messages clients upload, and the robust aggregation rules that resist
them (both act on the Upload contract of raysim.algorithms.interface)."""

from raysim.threats.attacks import ATTACKS, AttackKind, AttackSettings
from raysim.threats.robust import ROBUST_RULES, RobustSettings

__all__ = ["ATTACKS", "ROBUST_RULES", "AttackKind", "AttackSettings", "RobustSettings"]
