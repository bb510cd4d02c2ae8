"""Models: the networks of the papers, selected by name, and the flat-vector view used everywhere else."""

from raysim.models.flat import FlatModel, ParamSpec
from raysim.models.zoo import MODELS, ModelSettings, build_module

__all__ = ["MODELS", "FlatModel", "ModelSettings", "ParamSpec", "build_module"]
