"""The split-model family (partial personalization): a model split into a shared part the server aggregates and a
personal part each client keeps, chosen by a layer preset or by name patterns (FedAPM, Sec. 6.1; FedRep, LG-FedAvg,
FedAlt, FedSim, and FedAvg/FedProx's deviation of the shared part).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import numpy as np
from pydantic import Field

from raysim.algorithms.requests import Number, Vector
from raysim.algorithms.settings import AlgorithmSettings
from raysim.errors import ConfigError
from raysim.jit import segment_distances
from raysim.models.parts import ModelPart, ParameterPatterns
from raysim.models.spec import ParamSpec, personalization

SplitPreset = Literal[
    "output", "input", "split_input", "split_input_code", "first_layer", "last_layer", "normalization"
]


@dataclass(frozen=True)
class PresetOfModel(ModelPart):
    """A split preset the model defines (`allowed_presets`), checked before Ray starts (raysim.models.parts)."""

    def problem(self, value: Any, params: ParamSpec) -> str | None:
        if value in allowed_presets(params):
            return None
        model = f"model {params.model!r}" if params.model else "this model"
        return f"not defined for {model}; allowed: {', '.join(allowed_presets(params))}"

    def outside(self, params: ParamSpec) -> Any:
        return next(preset for preset in get_args(SplitPreset) if preset not in allowed_presets(params))


Preset = Annotated[SplitPreset, PresetOfModel()]
"""A setting naming a split preset: one the run's model defines."""
Patterns = Annotated[tuple[str, ...] | None, ParameterPatterns()]
"""A setting of fnmatch patterns over parameter names: each matches one of the run's model's."""


class SplitSettings(AlgorithmSettings):
    """Which parameters are personal; shared by FedAPM and its baselines (the shared part is what they sync, and
    the tensors the deviation is taken over)."""

    personal: Patterns = Field(
        None, description="fnmatch patterns over parameter names (e.g. ['7.*', '9.*']); overrides `preset`"
    )
    preset: Preset = Field(
        "output",
        description="the personal modules: a strategy of FedAPM, Sec. 3.4 from the model's table (input, output, "
        "split_input, split_input_code: the authors' code's both encoders), or for a model without a table "
        "`output` = the layers after the last convolution (the last layer without convolutions); any model: "
        "first_layer, last_layer; a model with normalization layers: normalization (their parameters and running "
        "statistics, FedBN)",
    )


def _layers(params: ParamSpec) -> list[str]:
    """Module prefixes ('0', '3', ...) in parameter order: a layer's weight and bias share one."""
    layers: list[str] = []
    for name in params.names:
        prefix = name.rsplit(".", 1)[0]
        if prefix not in layers:
            layers.append(prefix)
    return layers


def allowed_presets(params: ParamSpec) -> tuple[str, ...]:
    """The presets that mean something for this model: its table's strategies (or `output` by the generic rule
    when it has none), the positional first_layer and last_layer, and normalization for a model that has such
    layers."""
    table = personalization(params.model)
    normalization = ("normalization",) if params.normalization else ()
    return (*(table if table else ("output",)), "first_layer", "last_layer", *normalization)


def preset_names(preset: str, params: ParamSpec) -> list[str]:
    """The parameter names `preset` makes personal: by module prefix from the model's table, else by position.
    An unknown preset for this model is a ConfigError naming the allowed ones."""
    table = personalization(params.model)
    if preset not in allowed_presets(params):
        model = f"model {params.model!r}" if params.model else "this model"
        allowed = ", ".join(allowed_presets(params))
        raise ConfigError(f"algorithm.preset={preset!r} is not defined for {model}; allowed: {allowed}")
    if preset in table:
        names = []
        for module in table[preset]:
            matched = [n for n in params.names if n.startswith(module + ".")]
            if not matched:
                raise TypeError(
                    f"model {params.model!r}: its personalization {preset!r} names module {module!r}, which has no "
                    "parameters"
                )
            names += matched
        return names
    if preset == "normalization":
        return [n for n in params.names if n.rsplit(".", 1)[0] in params.normalization]
    layers = _layers(params)
    if preset == "first_layer":
        chosen = layers[:1]
    elif preset == "last_layer":
        chosen = layers[-1:]
    else:
        conv = [n.rsplit(".", 1)[0] for n, shape in zip(params.names, params.shapes, strict=True) if len(shape) > 2]
        chosen = layers[layers.index(conv[-1]) + 1 :] if conv else layers[-1:]
    return [n for n in params.names if n.rsplit(".", 1)[0] in chosen]


def personal_mask(settings: SplitSettings, params: ParamSpec, allow_empty: bool = False) -> np.ndarray:
    """Boolean mask over the flat vector: True on personal coordinates. A ConfigError if either part is empty,
    unless `allow_empty`."""
    if settings.personal is not None:
        personal = [n for n in params.names if any(fnmatch.fnmatchcase(n, p) for p in settings.personal)]
        source = f"algorithm.personal={list(settings.personal)}"
    else:
        personal = preset_names(settings.preset, params)
        source = f"algorithm.preset={settings.preset!r}"
    mask = np.zeros(params.size, dtype=bool)
    for name in personal:
        mask[params.slice(name)] = True
    if (mask.all() or not mask.any()) and not allow_empty:
        kind = "every" if mask.all() else "no"
        raise ConfigError(
            f"{source} makes {kind} parameter personal; parameters of this model: {', '.join(params.names)}"
        )
    return mask


def deviation(
    params: ParamSpec, shared: np.ndarray, local: Vector, reference: Vector, whole: bool = False
) -> tuple[Number, Number]:
    """||u_i - u|| over the shared tensors (`local`, `reference`: shared-part vectors, or a chunk's [k, n_shared]
    rows): the sum of per-tensor Frobenius norms (the paper's curves, as the authors' code computes them) and the global
    L2 norm; numbers for one client's vectors, [k] arrays for rows. `whole`: `local` and `reference` are whole-model
    vectors, read at the shared tensors where they lie (no copy of a chunk's shared part: it cost more than the
    norms)."""
    position = None if whole else np.cumsum(shared) - shared  # a shared coordinate's index within the shared part
    starts, stops = [], []
    for name in params.names:
        where = params.slice(name)
        if shared[where].all():
            starts.append(where.start if position is None else int(position[where.start]))
            stops.append(starts[-1] + where.stop - where.start)
    return segment_distances(local, reference, np.array(starts, np.int64), np.array(stops, np.int64))  # one pass
