"""Averaging: clients run local SGD from the global model; the server averages the results (FLAME, Sec. IV-E).

Every client logs the deviation ||theta_i - w|| over the shared tensors of FedAPM's split (`personal` / `preset`;
FedAPM's footnote 3: for the non-personalized methods the "shared components" are the same tensors), so that
Table 3's methods compare on one measure; a model the preset cannot split (one layer) counts whole.

`shared_only` is the FedAPM authors' code: a client trains only the shared part (the personal part
stays at the common initial model, as the broadcast carries it), and the server averages the latest shared parts of
ALL m clients, stale ones included (u = (1/m) sum_i u_i, the running mean FedAPM's server keeps), unweighted.
`shared_start: local` adds their unimodal path (the MLP/CNN rows): `load_remaining_layers` loads only the head from
the server, so a client's shared part continues from its own latest one and is never synchronized (their Averaging is
local training of the shared part, FedProx's prox centre is the client's own previous model), and each client's own
model is scored (the PM), not the global one.
"""

from __future__ import annotations

from typing import Literal

from raysim.algorithms.families.averaging import Averaging, AveragingSettings
from raysim.algorithms.interface import ALGORITHMS


class FedAvgSettings(AveragingSettings):
    name: Literal["fedavg"] = "fedavg"


@ALGORITHMS.register()
class FedAvg(Averaging):
    name = "fedavg"
    Settings = FedAvgSettings
