"""What describes a model without building it (no torch here): the layout of its flat parameter vector and
what a process needs to build the network. Processes that only move vectors (the coordinator of most
algorithms) import this and never torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field

from raysim.registry import OneOf, Registry
from raysim.settings import Settings

if TYPE_CHECKING:
    from raysim.data.dataset import Task
    from raysim.models.flat import FlatModel




def _check_model(name: str, entry: object) -> None:
    if not callable(entry):
        raise TypeError(f"model {name!r}: register a function (input_shape, outputs) -> torch.nn.Module, not {entry!r}")


MODELS: Registry[Callable[[tuple[int, ...], int], Any]] = Registry("model", "model.name", check=_check_model)
"""The networks by `model.name`: factories (input shape, number of outputs) -> torch.nn.Module, each registered with
`@MODELS.register(name)` and described by its docstring's first line (raysim.models.zoo holds the built-ins)."""

ModelChoice = Annotated[str, OneOf(MODELS)]
"""A field holding a model name."""


class ModelSettings(Settings):
    """The clients' (and global) network: a registered model (raysim.models.zoo, or a plugin's)."""

    name: ModelChoice = Field("mlp", description="the network (`raysim models` lists them)")
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
