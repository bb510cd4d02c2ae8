"""KD only: AugFL's ablation without federated learning (Yue et al., 2025, arXiv:2503.02154; Sec. VI,
Fig. 7: "server distillation, no FL, R_h alone").

The server moves the model by AugFL's knowledge-transfer step alone: eq. 13 with every client as if it never
trained (y_i = 0, theta_i = theta^t, so sum_i (y_i + rho theta_i) = m rho theta^t),

    theta^{t+1} = theta^t - (lambda / (m rho)) grad R_h(theta^t, theta_p)

a gradient step on R_h with AugFL's step size, R_h being AugFL's (`regularizer`: CRD from the pretrained teacher on
the transfer set D_s, or ||theta - theta_p||^2 to a teacher of the clients' architecture; `transfer` as AugFL's).
It is computed by AugFL's own server step (raysim.algorithms.augfl), on the teacher and D_s that AugFL's server_data
prepares. Clients do no training, send nothing and need nothing per round (traffic 0 both ways); their data never
reach the model. Held-out clients (`clients.heldout`) adapt as in AugFL: one gradient step from theta on their
support set (eq. 7); training clients deploy theta.

Nothing to stack: a client step does no work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import model_validator

from raysim.algorithms.augfl.algorithm import AugFl, AugFlServerState, AugFlUpload
from raysim.algorithms.augfl.settings import AugFlSettings, TransferStepSettings
from raysim.algorithms.interface import (
    ALGORITHMS,
    AdaptStep,
    Algorithm,
    ClientInfo,
    ClientStep,
    ClientUpdate,
    ServerContext,
    Upload,
)
from raysim.algorithms.requests import ServerDataStep, Vector
from raysim.examples import ExampleContext, Fragment
from raysim.models.spec import ParamSpec


class KdOnlySettings(TransferStepSettings):
    name: Literal["kd_only"] = "kd_only"

    @model_validator(mode="after")
    def _transfers(self) -> KdOnlySettings:
        if self.regularizer == "none":
            raise ValueError("algorithm.regularizer: KD only needs R_h; allowed: crd, l2")
        if self.lam <= 0:
            raise ValueError("algorithm.lambda: KD only moves the model by lambda grad R_h alone; it must be > 0")
        return self

    def augfl(self) -> AugFlSettings:
        """AugFL's settings with these: its server step and adaptation are KD only's."""
        return AugFlSettings.model_validate({**self.model_dump(exclude={"name"}), "name": "augfl"})


@dataclass
class KdOnlyClientState:
    """A client keeps nothing: it never trains."""


@dataclass
class NoUpload(Upload):
    """A client sends nothing."""


@ALGORITHMS.register()
class KdOnly(Algorithm[KdOnlySettings, KdOnlyClientState, AugFlServerState, None, NoUpload]):
    name = "kd_only"
    Settings = KdOnlySettings
    Upload = NoUpload

    def __init__(self, settings: KdOnlySettings, params: ParamSpec):
        super().__init__(settings, params)
        self.augfl = AugFl(settings.augfl(), params)
        """AugFL with these settings: its teacher, transfer set, server step and adaptation."""

    @classmethod
    def example(cls, context: ExampleContext) -> Fragment:
        """AugFL's example (CRD from a small pretrained teacher on the meta partition, held-out clients)."""
        fragment = AugFl.example(context)
        return {**fragment, "algorithm": {**fragment["algorithm"], "name": cls.name}}

    def server_data(self, context: ServerContext) -> ServerDataStep | None:
        return self.augfl.server_data(context)

    def setup_server(self, data: Any) -> None:
        self.augfl.setup_server(data)

    def init_server(self, init_params: Vector, num_clients: int) -> AugFlServerState:
        return self.augfl.init_server(init_params, num_clients)

    def init_client(self, client: ClientInfo, init_params: Vector) -> KdOnlyClientState:
        return KdOnlyClientState()

    def broadcast(self, server: AugFlServerState) -> None:
        """Clients need nothing: they do no training."""
        return None

    def client_step(self, client: ClientInfo, state: KdOnlyClientState, broadcast: None) -> ClientStep:
        yield from ()  # no request: no training
        return ClientUpdate(state, NoUpload())

    def server_step(self, server: AugFlServerState, total: NoUpload, num_selected: int):
        """AugFL's eq. 13 with sum_i (y_i + rho theta_i) = m rho theta^t and no client change."""
        rho = self.augfl.settings.rho
        agreed = dataclasses.replace(server, total=server.num_clients * rho * server.theta.astype(np.float64))
        unchanged = np.zeros(server.theta.shape, np.float64)
        return self.augfl.server_step(agreed, AugFlUpload(unchanged, unchanged), num_selected)

    def global_model(self, server: AugFlServerState) -> Vector:
        return server.theta

    def adapt(self, client: ClientInfo, global_params: Vector) -> AdaptStep:
        """A held-out client's model: one step from theta on its support set, as AugFL's (eq. 7)."""
        return self.augfl.adapt(client, global_params)
