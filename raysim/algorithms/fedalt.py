"""FedAlt: partial personalization by alternating updates, personal part then shared part (FedAPM, Secs. 4.4 and 6.1).

Pillutla et al.'s Gauss-Seidel baseline: a selected client resets its shared part to the received u, trains
its personal part v_i for E epochs with the shared part frozen, then the shared part for E epochs with the
new v_i frozen, and uploads the shared part; the server averages the selected clients' shared parts. It is
FedAPM with pi_i = 0, rho = 0, sigma_i = 0 and u_i <- u at every round start (FedAPM, Alg. 1).

The FedAPM authors' code runs it differently (issue 35), and two switches reproduce that:
`average_over: all` is their server, the mean of the latest shared parts of ALL m clients, stale ones included
(FedAPM's running mean, families/consensus.py); `order: shared_first` trains the received part first, which
with the body personal (`personal` patterns) and the head shared is their unimodal path: it loads and averages
the head and keeps the body local.
"""

from __future__ import annotations

from typing import Literal

from raysim.algorithms.families.partial import PartialPersonalization, PartialSettings
from raysim.algorithms.interface import ALGORITHMS


class FedAltSettings(PartialSettings):
    name: Literal["fedalt"] = "fedalt"


@ALGORITHMS.register()
class FedAlt(PartialPersonalization):
    name = "fedalt"
    Settings = FedAltSettings
