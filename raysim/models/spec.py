"""What describes a model without building it (no torch here): the registry of networks, the model settings and
the layout of its flat parameter vector. Processes that only move vectors (the coordinator of most algorithms)
import this and never torch; what builds the network (ModelSpec) is in raysim.models.flat."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from raysim.registry import OneOf, Registry
from raysim.settings import Settings

Factory = Callable[[tuple[int, ...], int], Any]
"""(input shape, number of outputs) -> a freshly built torch.nn.Module."""


@dataclass(frozen=True)
class ModelEntry:
    """A registered network: how to build it, and what the rest of raysim may know of it without building it.
    `@MODELS.register(name, personalization=..., example=...)` on a factory makes one."""

    definition: Factory
    """The factory; its docstring's first line describes the model (`raysim models`)."""
    personalization: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Strategy (`algorithm.preset`: input, output, split_input, split_input_code) -> the module name prefixes whose
    parameters are personal (FedAPM, Sec. 3.4); a model without one gets `output` by the generic
    rule."""
    example: Callable[[Any], dict[str, Any]] | None = None
    """(raysim.examples.ExampleContext) -> the config sections it cannot run without (a multimodal model's dataset),
    for the configuration matrix; None: it runs on any dataset."""

    def __call__(self, input_shape: tuple[int, ...], outputs: int) -> Any:
        return self.definition(input_shape, outputs)

    @property
    def description(self) -> str:
        return (self.definition.__doc__ or "").strip().split("\n", 1)[0]


def _model_entry(
    definition: Factory,
    personalization: Mapping[str, tuple[str, ...]] | None = None,
    example: Callable[[Any], dict[str, Any]] | None = None,
) -> ModelEntry:
    if not callable(definition):
        raise TypeError(f"register a function (input_shape, outputs) -> torch.nn.Module as a model, not {definition!r}")
    return ModelEntry(definition, dict(personalization or {}), example)


MODELS: Registry[ModelEntry] = Registry("model", "model.name", entry=_model_entry)
"""The networks by `model.name`, each registered with `@MODELS.register(name)` on its factory (raysim.models.zoo
holds the built-ins): a ModelEntry."""

ModelChoice = Annotated[str, OneOf(MODELS)]
"""A field holding a model name."""


class ModelSettings(Settings):
    """The clients' (and global) network: a registered model (raysim.models.zoo, or a plugin's)."""

    name: ModelChoice = Field("mlp", description="the network (`raysim models` lists them)")
    init: Literal["raysim", "authors", "zeros"] = Field(
        "raysim",
        description="initial parameters from raysim's model-init stream, or as the FLAME authors' code draws them "
        "(torch.manual_seed(seed), then the layers built in order: their seed N gives their initial model), or all "
        "zero, as the linear-regression analysis of FLAME's appendix starts (w_i^0 = pi_i^0 = w^0 = 0, "
        "FLAME, App. B-A; a ReLU network's hidden units then get no gradient)",
    )


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and offset of every parameter tensor inside the flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    model: str = ""
    """The registered model (`model.name`) these parameters belong to; "" when unknown (a hand-made layout)."""
    head: tuple[str, ...] = ()
    """The parameters of the network's head, its last linear layer: its weight [outputs, features], then its bias if
    it has one. The head's input is the network's features z = f(x) (raysim.models.flat.FlatModel.features), its
    output the logits; everything before it is the body (feature extractor). () when unknown (a hand-made layout)."""
    statistics: tuple[str, ...] = ()
    """The running statistics among `names` (BatchNorm's running mean and variance: the module's floating-point
    buffers), laid out after every parameter. They are part of a client's vector, so they are kept, sent, averaged
    and checkpointed wherever the vector is, and personal where their layer is; no gradient moves them: training
    writes the statistics of its batches into them (raysim.models.flat.FlatModel.batch_statistics)."""

    @property
    def size(self) -> int:
        last = self.shapes[-1] if self.shapes else ()
        return (self.offsets[-1] + int(np.prod(last))) if self.offsets else 0

    normalization: tuple[str, ...] = ()
    """The module prefixes of the normalization layers (BatchNorm, GroupNorm, LayerNorm, InstanceNorm): what the
    `normalization` split preset keeps personal (FedBN)."""
    input_shape: tuple[int, ...] = ()
    """A sample's shape, which the network was built for (raysim.models.zoo.build_module builds it again: AugFL's
    clients draw their own initial models, raysim.algorithms.augfl); () when unknown (a hand-made layout)."""

    @property
    def parameter_count(self) -> int:
        """The number of trainable values: the vector's size less its running statistics."""
        return self.size - sum(int(np.prod(self.shapes[self.names.index(name)])) for name in self.statistics)

    def statistics_mask(self) -> np.ndarray:
        """Boolean, vector-sized: True on the running statistics' coordinates."""
        mask = np.zeros(self.size, dtype=bool)
        for name in self.statistics:
            mask[self.slice(name)] = True
        return mask

    def slice(self, name: str) -> slice:
        index = self.names.index(name)
        return slice(self.offsets[index], self.offsets[index] + int(np.prod(self.shapes[index])))

    def head_mask(self) -> np.ndarray:
        """Boolean, parameter-sized: True on the head's coordinates (`head`), False on the body's."""
        mask = np.zeros(self.size, dtype=bool)
        for name in self.require_head():
            mask[self.slice(name)] = True
        return mask

    @property
    def head_size(self) -> int:
        """Number of the head's parameters (weight and bias)."""
        return sum(int(np.prod(self.shapes[self.names.index(name)])) for name in self.require_head())

    @property
    def feature_dim(self) -> int:
        """d: the size of the features z = f(x), the head's input."""
        return self.shapes[self.names.index(self.require_head()[0])][1]

    @property
    def head_outputs(self) -> int:
        """The head's outputs (the number of classes of a classifier)."""
        return self.shapes[self.names.index(self.require_head()[0])][0]

    def require_head(self) -> tuple[str, ...]:
        """`head`, or a ValueError when this layout does not know it."""
        if not self.head:
            raise ValueError(
                f"the parameter layout of model {self.model or '(unnamed)'!r} names no head (last linear "
                "layer); build it with raysim.models.flat.param_spec"
            )
        return self.head

    def unflatten(self, flat: Any) -> dict[str, Any]:
        """`flat` shaped like the module's parameters: a vector [size] gives views (gradients flow back into it),
        stacked vectors [k, size] give [k, *shape] per parameter."""
        leading = tuple(flat.shape[:-1])
        return {
            name: flat[..., offset : offset + int(np.prod(shape))].reshape(*leading, *shape)
            for name, shape, offset in zip(self.names, self.shapes, self.offsets, strict=True)
        }


def personalization(model: str) -> dict[str, tuple[str, ...]]:
    """The personalization strategies a registered model declares (FedAPM, Sec. 3.4): strategy (`algorithm.preset`) ->
    the module prefixes whose parameters are personal, from its factory's `personalization` attribute (as
    `example` in raysim.examples); {} for a model that declares none or an unknown name."""
    if not model or model not in MODELS:
        return {}
    return dict(MODELS.get(model).personalization)
