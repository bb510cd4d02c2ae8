"""Threats: Byzantine attacks on the messages clients upload, and the robust aggregation rules that resist
them (both act on the Upload contract of raysim.algorithms.base)."""
