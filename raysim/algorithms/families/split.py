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
from raysim.jit import add_square, kernel, rows, segment_distances
from raysim.models.parts import ModelPart, ParameterPatterns
from raysim.models.spec import ParamSpec, personalization

Segments = tuple[np.ndarray, np.ndarray]
"""[start, stop) ranges of a vector's tensors as int64 arrays (`shared_segments`)."""

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


def shared_segments(params: ParamSpec, shared: np.ndarray, whole: bool = False) -> Segments:
    """The [start, stop) ranges of the tensors `shared` covers whole, as `deviation` reads them: positions in the
    whole-model vector (`whole`) or in the shared part's. Fixed for an algorithm: it computes them once (Python's
    walk over the tensors cost a third of the compiled pass, once per chunk of a round)."""
    position = None if whole else np.cumsum(shared) - shared  # a shared coordinate's index within the shared part
    starts, stops = [], []
    for name in params.names:
        where = params.slice(name)
        if shared[where].all():
            starts.append(where.start if position is None else int(position[where.start]))
            stops.append(starts[-1] + where.stop - where.start)
    return np.array(starts, np.int64), np.array(stops, np.int64)


def deviation(
    params: ParamSpec,
    shared: np.ndarray,
    local: Vector,
    reference: Vector,
    whole: bool = False,
    segments: Segments | None = None,
) -> tuple[Number, Number]:
    """||u_i - u|| over the shared tensors (`local`, `reference`: shared-part vectors, or a chunk's [k, n_shared]
    rows): the sum of per-tensor Frobenius norms (the paper's curves, as the authors' code computes them) and the global
    L2 norm; numbers for one client's vectors, [k] arrays for rows. `whole`: `local` and `reference` are whole-model
    vectors, read at the shared tensors where they lie (no copy of a chunk's shared part: it cost more than the
    norms). `segments`: `shared_segments(params, shared, whole)`, when the caller keeps them."""
    starts, stops = shared_segments(params, shared, whole) if segments is None else segments
    return segment_distances(local, reference, starts, stops)  # one pass


@kernel
def _change_and_segments(a: np.ndarray, b: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple:
    count, n = a.shape
    change = np.empty(count, np.float64)
    norm_sums, l2 = np.empty(count, np.float64), np.empty(count, np.float64)
    for i in range(count):
        total = np.float32(0.0)
        for j in range(n):  # raysim.jit._row_distances' loop, written alike: the same sums in the same order
            total = add_square(total, a[i, j] - b[0, j])
        change[i] = np.sqrt(total)
        norm_sum = squares = 0.0
        for segment in range(len(starts)):  # raysim.jit._segment_distances' loops, on the row just read
            row, reference = a[i, starts[segment] : stops[segment]], b[0, starts[segment] : stops[segment]]
            sum64 = 0.0
            for j in range(len(row)):
                sum64 = add_square(sum64, np.float64(row[j]) - np.float64(reference[j]))
            norm_sum += np.sqrt(sum64)
            squares += sum64
        norm_sums[i], l2[i] = norm_sum, np.sqrt(squares)
    return change, norm_sums, l2


def change_and_deviation(local: Vector, reference: Vector, segments: Segments) -> tuple[Number, Number, Number]:
    """(||u_i - u||, then `deviation`'s two norms over the whole-model `segments`) of whole-model vectors (`local`:
    one client's or a chunk's [k, n] rows) against one `reference`, in one compiled call: the bits of
    raysim.jit.distances and of `deviation`, each row read from memory once (its segments then come from the cache),
    where the two calls read each chunk twice (FedAvg's update_norm and deviation: 0.13 ms of 0.59 a chunk of 16 MLP
    clients saved). Numbers for one client's vector, [k] arrays for rows."""
    a = np.asarray(local)
    change, sums, l2 = _change_and_segments(rows(a), rows(np.asarray(reference)), segments[0], segments[1])
    if a.ndim == 1:
        return float(change[0]), float(sums[0]), float(l2[0])
    return change, sums, l2
