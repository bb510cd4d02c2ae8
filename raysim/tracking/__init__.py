"""Tracking: the driver's MLflow writer (the only one), the round callbacks and the run's result, the store's runs,
and the run's plots and tables. It sits below the runtime and never imports it; credentials handling is on the ground
floor (raysim.credentials)."""
