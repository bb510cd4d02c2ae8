"""FedRep: a shared body, a personal head per client, trained head first (Collins et al., ICML 2021).

Collins, Hassani, Mokhtari, Shakkottai, arXiv:2102.07078; FedSLR's baseline (FedSLR, App. B.2: conv layers shared, the
last linear layer personal).

A selected client i, given the global body phi, runs (Algorithm 1 of Collins et al.)

    h_i   <- tau_h epochs of SGD over h on f_i(phi, h), the body frozen            (head update)
    phi_i <- tau_phi epochs of SGD over phi on f_i(phi, h_i), the new head frozen    (representation update)

and uploads phi_i only; the server averages the selected clients' bodies, phi <- (1/|S|) sum_{i in S} phi_i
(`aggregation: samples` weights them by n_i instead). The head never leaves the client: its uplink and downlink
are the body alone (FedSLR, Table 2: FedRep counts only its shared part). The GM is the global body with the common
initial head; each client's PM is the latest global body with its own head.

`phases: joint` is FedRep as the FedSLR authors' code runs it (huangtiansheng/fedslr utils_methods.py, train_FedRep):
head and body trained together for `epochs` epochs from the received body, the body averaged uniformly.

The head is `personal` (fnmatch patterns) or `preset` (raysim.algorithms.fedapm.personal_mask); an empty head
(`personal: []`) is FedAvg. The step is written over rows, so it stacks (vectorized hosts).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Literal

import numpy as np
from pydantic import Field

from raysim.algorithms.families.shared_part import SharedPartAlgorithm, SharedPartSettings
from raysim.algorithms.families.split import Preset, SplitSettings, personal_mask
from raysim.algorithms.interface import (
    ALGORITHMS,
)
from raysim.algorithms.requests import Number, Request, Result, SGDResult, Vector, train
from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec


class FedRepSettings(SharedPartSettings, SplitSettings):
    name: Literal["fedrep"] = "fedrep"
    preset: Preset = Field(
        "last_layer",
        description="the personal head (FedAPM's presets, Sec. 3.4); last_layer: the final linear layer "
        "(FedSLR, App. B.2)",
    )
    epochs: int = Field(1, ge=1, description="tau_phi: epochs on the body, head frozen (1 in Collins et al.)")
    head_epochs: int = Field(10, ge=0, description="tau_h: epochs on the head, body frozen (10 in Collins et al.)")
    phases: Literal["alternating", "joint"] = Field(
        "alternating",
        description="head then body (Collins et al., Algorithm 1), or head and body together for `epochs` epochs "
        "(the FedSLR authors' code; head_epochs unused)",
    )


@ALGORITHMS.register()
class FedRep(SharedPartAlgorithm[FedRepSettings]):
    name = "fedrep"
    Settings = FedRepSettings

    def personal_part(self, params: ParamSpec) -> np.ndarray:
        """The head: may be empty (FedAvg), not the whole model (nothing would be shared)."""
        settings = self.settings
        head = personal_mask(settings, params, allow_empty=True)
        if head.all():
            patterns = settings.personal
            source = f"personal={list(patterns)}" if patterns is not None else f"preset={settings.preset!r}"
            raise ConfigError(
                f"algorithm.{source} makes the whole model the personal head: nothing is shared; parameters of this "
                f"model: {', '.join(params.names)}"
            )
        return head

    def local_training(
        self, start: Vector, num_clients: int
    ) -> Generator[Request, Result, tuple[SGDResult, dict[str, Number]]]:
        """Head then body (Algorithm 1), or both at once (`phases: joint`); an empty head trains the whole model."""
        s = self.settings
        if s.phases == "joint" or not self.personal.any():
            return (yield from train(s.scaled(s.local_sgd(start), num_clients))), {}
        metrics: dict[str, Number] = {}
        if s.head_epochs:
            head = yield from train(s.scaled(s.local_sgd(start, s.head_epochs, mask=self.personal), num_clients))
            start, metrics = head.params, {"head_train_loss": head.mean_loss}
        body = yield from train(s.scaled(s.local_sgd(start, mask=self.shared), num_clients))
        return body, metrics
