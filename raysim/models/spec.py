"""What describes a model without building it (no torch here): the layout of its flat parameter vector and
what a process needs to build the network. Processes that only move vectors (the coordinator of most
algorithms) import this and never torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
from pydantic import Field

from raysim.settings import Settings

if TYPE_CHECKING:
    from raysim.data.sources import Task
    from raysim.models.flat import FlatModel


ModelName = Literal["mlr", "mlp", "cnn", "cnn_mmnist", "cnn_femnist", "linear", "resnet18_gn"]
MODELS: tuple[str, ...] = get_args(ModelName)
"""The networks of raysim.models.zoo, by name."""


class ModelSettings(Settings):
    name: ModelName = "mlp"
    init: Literal["raysim", "authors"] = Field(
        "raysim",
        description="initial parameters from raysim's model-init stream, or as the FLAME authors' code draws them "
        "(torch.manual_seed(seed), then the layers built in order: their seed N gives their initial model)",
    )


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and offset of every parameter tensor inside the flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        last = self.shapes[-1] if self.shapes else ()
        return (self.offsets[-1] + int(np.prod(last))) if self.offsets else 0

    def slice(self, name: str) -> slice:
        index = self.names.index(name)
        return slice(self.offsets[index], self.offsets[index] + int(np.prod(self.shapes[index])))

    def unflatten(self, flat: Any) -> dict[str, Any]:
        """`flat` shaped like the module's parameters: a vector [size] gives views (gradients flow back into it),
        stacked vectors [k, size] give [k, *shape] per parameter."""
        leading = tuple(flat.shape[:-1])
        return {
            name: flat[..., offset : offset + int(np.prod(shape))].reshape(*leading, *shape)
            for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True)
        }


@dataclass(frozen=True)
class ModelSpec:
    """What a host needs to build the model: name, input shape, outputs, task."""

    name: str
    input_shape: tuple[int, ...]
    outputs: int
    task: Task

    def build(self) -> FlatModel:
        from raysim.models.flat import FlatModel

        return FlatModel(self.name, self.input_shape, self.outputs, self.task)
