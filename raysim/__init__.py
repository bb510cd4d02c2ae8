"""raysim: Ray-based simulation of personalized federated learning solved with ADMM."""

__version__ = "0.1.0"
