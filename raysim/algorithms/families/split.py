"""The split-model family (partial personalization): a model split into a shared part the server aggregates and a
personal part each client keeps, chosen by a layer preset or by name patterns (fedapm.md 4.4; FedRep, LG-FedAvg,
FedAlt, FedSim, and FedAvg/FedProx's deviation of the shared part); `SharedPartAlgorithm`, the server and client
steps of the methods that train the personal part first and then the shared part.
"""

from __future__ import annotations

import fnmatch
from abc import abstractmethod
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
from pydantic import Field

from raysim.algorithms.families.averaging import WeightedUpload, upload_weight, weighted_average
from raysim.algorithms.interface import (
    Algorithm,
    ClientChunk,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    per_row,
)
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector
from raysim.algorithms.settings import AlgorithmSettings, SGDSettings
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec, personalization

SplitPreset = Literal["output", "input", "split_input", "split_input_code", "first_layer", "last_layer"]


class SplitSettings(AlgorithmSettings):
    """Which parameters are personal; shared by FedAPM and its baselines (the shared part is what they sync, and
    the tensors the deviation is taken over)."""

    personal: tuple[str, ...] | None = Field(
        None, description="fnmatch patterns over parameter names (e.g. ['7.*', '9.*']); overrides `preset`"
    )
    preset: SplitPreset = Field(
        "output",
        description="the personal modules: a strategy of fedapm.md 2 from the model's table (input, output, "
        "split_input, split_input_code: the authors' code's both encoders), or for a model without a table "
        "`output` = the layers after the last convolution (the last layer without convolutions); any model: "
        "first_layer, last_layer",
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
    when it has none), and the positional first_layer and last_layer."""
    table = personalization(params.model)
    return (*(table if table else ("output",)), "first_layer", "last_layer")


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


def deviation(params: ParamSpec, shared: np.ndarray, local: Vector, reference: Vector) -> tuple[Number, Number]:
    """||u_i - u|| over the shared tensors (`local`, `reference`: shared-part vectors, or a chunk's [k, n_shared]
    rows): the sum of per-tensor Frobenius norms (the paper's curves, fedapm.md 1.5) and the global L2 norm; numbers
    for one client's vectors, [k] arrays for rows."""
    position = np.cumsum(shared) - shared  # a shared coordinate's index within the shared part
    per_tensor: Number = 0.0
    squares: Number = 0.0
    for name in params.names:  # one tensor at a time: a chunk's rows are never copied whole
        where = params.slice(name)
        if shared[where].all():
            start = int(position[where.start])
            stop = start + where.stop - where.start
            norm = np.linalg.norm(np.asarray(local[..., start:stop], np.float64) - reference[start:stop], axis=-1)
            per_tensor, squares = per_tensor + norm, squares + norm**2
    l2 = np.sqrt(squares)
    if np.ndim(local) == 1:
        return float(per_tensor), float(l2)
    return per_tensor, l2


class SharedPartSettings(SGDSettings):
    """Local SGD and the weights of the shared part's average (FedRep, LG-FedAvg)."""

    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="weights of the shared part's average: equal (the papers; FedSLR's code) or n_i"
    )


@dataclass
class PersonalPartState:
    """The part of the model that never leaves the client (FedRep: the head; LG-FedAvg: the local layers)."""

    personal: Vector


@dataclass
class SharedPartServerState:
    shared: Vector
    """The global shared part (FedRep: the body; LG-FedAvg: the global layers)."""
    template: Vector
    """The initial full model: the personal part of the GM."""


P = TypeVar("P", bound=SharedPartSettings)


class SharedPartAlgorithm(Algorithm[P, PersonalPartState, SharedPartServerState, Vector, WeightedUpload]):
    """A personal part kept by each client and a shared part averaged over the selected clients, the only part
    sent either way; subclasses say which part is personal and how a client trains."""

    Upload = WeightedUpload
    stacks = True
    scales_loss = True

    def __init__(self, settings: P, params: ParamSpec):
        super().__init__(settings, params)
        self.personal = self.personal_part(params)
        self.shared = ~self.personal

    @abstractmethod
    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """Boolean mask of the personal coordinates (a ConfigError when nothing would be shared)."""

    @abstractmethod
    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """The round's local SGD from the full model `start`: the result whose params are the new model, and
        metrics of earlier phases."""

    def init_server(self, init_params: Vector, num_clients: int) -> SharedPartServerState:
        return SharedPartServerState(init_params[self.shared].copy(), init_params.copy())

    def init_client(self, client: ClientInfo, init_params: Vector) -> PersonalPartState:
        return PersonalPartState(init_params[self.personal].copy())

    def broadcast(self, server: SharedPartServerState) -> Vector:
        return server.shared

    def assemble(self, personal: Vector, shared: Vector) -> Vector:
        """The full model(s) of a personal part (one, or a chunk's rows) and a shared part."""
        full = np.empty((*personal.shape[:-1], self.params.size), np.float32)
        full[..., self.personal] = personal
        full[..., self.shared] = shared
        return full

    def client_step(self, client: ClientInfo | ClientChunk, state: PersonalPartState, broadcast: Vector) -> ClientStep:
        start = self.assemble(state.personal, broadcast)
        result, metrics = yield from self.local_training(start, client.num_clients)
        params = np.asarray(result.params, np.float32)
        shared = params[..., self.shared]
        weight = upload_weight(client.num_train, self.settings.aggregation)  # a number, or one per row of a chunk
        metrics = {
            "train_loss": result.mean_loss,
            "shared_change": np.linalg.norm(np.asarray(shared, np.float64) - broadcast, axis=-1),
            **metrics,
        }
        new = PersonalPartState(params[..., self.personal])
        return ClientUpdate(new, WeightedUpload(per_row(weight) * shared, weight), metrics)

    def server_step(self, server: SharedPartServerState, total: WeightedUpload, num_selected: int):
        shared, metrics = weighted_average(total, server.shared)  # sum_i a_i x_i / sum_i a_i over the selected
        return SharedPartServerState(shared, server.template), metrics

    def message_coordinates(self, params: Vector) -> Vector:
        return params[self.shared]

    def global_model(self, server: SharedPartServerState) -> Vector:
        return self.assemble(server.template[self.personal], server.shared)

    def evaluated_model(self, state: PersonalPartState, global_params: Vector) -> Vector:
        """The latest global shared part with the client's own personal part."""
        return self.assemble(state.personal, global_params[self.shared])
