"""AugFL's settings: the algorithm's (`algorithm`), the knowledge transfer's (`algorithm.transfer`) and the
teacher's, the pretrained model theta_p (`algorithm.teacher_*`). The teacher's keys were `pm_*` before PM came
to mean the personalized model only; the old keys are still accepted."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field

from raysim.algorithms.families.teacher import PretrainingSettings
from raysim.algorithms.settings import AlgorithmSettings
from raysim.models.spec import ModelChoice
from raysim.settings import Settings


class TransferSettings(Settings):
    """`algorithm.transfer`: how the teacher's knowledge reaches the meta-model (augfl.md 2, 8.5)."""

    mode: Literal["paper", "code"] = Field(
        "paper", description="grad of the CRD bound at theta^t (paper) or the code's epoch-averaged CE + CRD gradient"
    )
    feat_dim: int = Field(128, ge=1, description="dimension of the common embedding space of f^s and f^c")
    temperature: float = Field(0.07, gt=0, description="tau, the NCE temperature")
    negatives: int = Field(16384, ge=1, description="K negatives per positive (capped at |D_s| - 1)")
    memory_momentum: float = Field(0.5, ge=0, lt=1, description="momentum of the memory-bank updates")
    batch_size: int = Field(128, ge=1, description="knowledge-transfer batch size (Table I)")
    lr: float = Field(0.002, gt=0, description="SGD rate of the heads (and, in code mode, of the student copy)")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    ce_weight: float = Field(1.0, ge=0, description="code mode: weight of the cross-entropy on D_s's labels")
    crd_weight: float = Field(0.8, ge=0, description="code mode: weight of the CRD term")


class TransferStepSettings(AlgorithmSettings, PretrainingSettings):
    """What AugFL's server knowledge-transfer step (eq. 13) and its held-out adaptation (eq. 7) take; shared by AugFL
    and the KD-only ablation (raysim.algorithms.augfl.kd_only)."""

    alpha: float = Field(0.03, gt=0, description="alpha: one-step adaptation rate (0.03 in the paper, Table I)")
    rho: float = Field(0.7, gt=0, description="rho_i: ADMM penalty, the same for every client (Table I)")
    lam: float = Field(5.0, ge=0, alias="lambda", description="lambda: weight of the regularizer R_h (Table I)")
    support_split: Literal["train", "val", "test"] = Field("train", description="the client's split used as D^s")
    regularizer: Literal["crd", "l2", "none"] = Field(
        "crd",
        description="R_h: contrastive distillation from the pretrained teacher (paper), ||theta - theta_p||^2 (same "
        "architecture) or none (AugFL without the teacher)",
    )
    transfer: TransferSettings = Field(default_factory=TransferSettings, description="CRD settings (regularizer crd)")
    teacher_model: ModelChoice | None = Field(
        None,
        validation_alias=AliasChoices("teacher_model", "pm_model"),
        description="the teacher's (pretrained model's) architecture; default: the next larger model (mlp -> cnn), "
        "the clients' model for l2",
    )


class AugFlSettings(TransferStepSettings):
    name: Literal["augfl"] = "augfl"
    hessian: Literal["finite_difference", "first_order"] = Field(
        "finite_difference", description="g_i by eq. 10 (paper) or g_i = 0 (first-order ablation)"
    )
    delta_scale: float = Field(10.0, gt=0, description="delta_k = 1/(delta_scale k + delta_offset): 1/(10k + 100)")
    delta_offset: float = Field(100.0, gt=0)
    query_split: Literal["train", "val", "test"] = Field(
        "test", description="the client's split used as D^q (the meta partition's test split is the query set)"
    )
