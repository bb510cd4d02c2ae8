"""AugFL (Yue et al., 2025): federated meta-learning by inexact ADMM whose server is regularized by a pretrained
teacher.

`algorithm`: the client and server steps (registered as `augfl`); `settings`: its settings; `teacher`: the
teacher's architecture, pretraining and cache (`raysim pretrain`); `crd`: the contrastive knowledge transfer from
the teacher (imports torch; only the coordinator of a run with the CRD regularizer imports it)."""

from __future__ import annotations

from raysim.algorithms.augfl.algorithm import AugFl, AugFlClientState, AugFlServerData, AugFlServerState
from raysim.algorithms.augfl.settings import AugFlSettings, TransferSettings

__all__ = ["AugFl", "AugFlClientState", "AugFlServerData", "AugFlServerState", "AugFlSettings", "TransferSettings"]
