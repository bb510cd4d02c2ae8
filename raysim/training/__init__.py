"""Execution of local work (the requests algorithms yield), in plain torch: no Ray here."""

from raysim.training.local import ClientData, LocalTrainer

__all__ = ["ClientData", "LocalTrainer"]
