"""Tracking: the driver's MLflow writer (the only one) and the run's plots and tables."""

from raysim.tracking.mlflow_writer import MlflowWriter, resolve_tracking_uri

__all__ = ["MlflowWriter", "resolve_tracking_uri"]
