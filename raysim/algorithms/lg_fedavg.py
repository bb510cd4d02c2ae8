"""LG-FedAvg: personal lower layers (local representation), shared top layers (Liang et al., 2020).

Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global Representations",
arXiv:2001.01523; FedSLR's baseline (FedSLR, App. B.2: conv layers personal, the linear layers shared).

The split is FedRep's turned round: the lower layers (the local representation l_i) stay on the client, the top
layers (the global model g) are federated. A selected client trains both together on its own data, from its own
l_i and the received g (Liang et al., Algorithm 1, local update of (l_i, g)),

    (l_i, g_i) <- `epochs` epochs of SGD on f_i(l, g) from (l_i, g)

and uploads g_i only; the server averages g <- (1/|S|) sum_{i in S} g_i (`aggregation: samples`: weighted by n_i).
This is also how the FedSLR authors' code runs it (huangtiansheng/fedslr utils_methods.py, train_LGFedAvg: uniform
mean over the selected clients). Up- and downlink are the global layers alone (FedSLR, Table 2); the local layers
never leave the client. The GM is g with the common initial local layers; each client's PM is its l_i with the
latest g. Liang et al. start the local layers from a FedAvg-trained model; here every client starts from the common
initial model, as FedSLR's code does.

The global layers are `global_layers` (fnmatch patterns) or `global_preset` (the presets of
raysim.algorithms.fedapm): `output`, the layers after the last convolution (the linear layers of a CNN; for a model
without convolutions, its last layer). The whole model global is FedAvg. It stacks like FedRep.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Generator
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.shared_part import SharedPartAlgorithm, SharedPartSettings
from raysim.algorithms.families.split import Patterns, Preset, allowed_presets, preset_names
from raysim.algorithms.interface import ALGORITHMS
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector, train
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec


class LgFedAvgSettings(SharedPartSettings):
    name: Literal["lg_fedavg"] = "lg_fedavg"
    global_layers: Patterns = Field(
        None, description="fnmatch patterns over parameter names of the shared (global) layers; overrides global_preset"
    )
    global_preset: Preset = Field(
        "output",
        description="the shared (global) modules by a preset of FedAPM, Sec. 3.4: output = the layers after the last "
        "convolution (the linear layers; a model without convolutions: its last layer); the rest is personal",
    )


def global_mask(settings: LgFedAvgSettings, params: ParamSpec) -> np.ndarray:
    """True on the shared coordinates; a ConfigError when nothing is shared (the whole model shared is FedAvg)."""
    if settings.global_layers is not None:
        names = [n for n in params.names if any(fnmatch.fnmatchcase(n, p) for p in settings.global_layers)]
        source = f"algorithm.global_layers={list(settings.global_layers)}"
    else:
        if settings.global_preset not in allowed_presets(params):
            allowed = ", ".join(allowed_presets(params))
            raise ConfigError(
                f"algorithm.global_preset={settings.global_preset!r} is not defined for model {params.model!r}; "
                f"allowed: {allowed}"
            )
        names = preset_names(settings.global_preset, params)
        source = f"algorithm.global_preset={settings.global_preset!r}"
    mask = np.zeros(params.size, dtype=bool)
    for name in names:
        mask[params.slice(name)] = True
    if not mask.any():
        raise ConfigError(f"{source} shares no parameter; parameters of this model: {', '.join(params.names)}")
    return mask


@ALGORITHMS.register()
class LgFedAvg(SharedPartAlgorithm[LgFedAvgSettings]):
    """FedRep's state, server and accounting (the personal part kept, the shared part averaged), with LG-FedAvg's
    split and its one joint local phase."""

    name = "lg_fedavg"
    Settings = LgFedAvgSettings

    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """The local representation: everything but the global layers."""
        return ~global_mask(self.settings, params)

    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """(l_i, g_i): `epochs` epochs of SGD on the whole model from the client's l_i and the received g."""
        s = self.settings
        return (yield from train(s.scaled(s.local_sgd(start), num_clients))), {}
