"""Tracking: the driver's MLflow writer (the only one), credentials handling, and the run's plots and tables."""
