"""AugFL's settings: the algorithm's (`algorithm`), the knowledge transfer's (`algorithm.transfer`) and the
teacher's, the pretrained model theta_p (`algorithm.teacher_*`). The teacher's keys were `pm_*` before PM came
to mean the personalized model only; the old keys are still accepted."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator

from raysim.algorithms.families.teacher import PretrainingSettings
from raysim.algorithms.settings import AlgorithmSettings
from raysim.models.spec import ModelChoice
from raysim.settings import Settings


class TransferSettings(Settings):
    """`algorithm.transfer`: how the teacher's knowledge reaches the meta-model (AugFL, Sec. V)."""

    mode: Literal["paper", "code"] = Field(
        "paper", description="grad of the CRD bound at theta^t (paper) or the code's epoch-averaged CE + CRD gradient"
    )
    feat_dim: int = Field(128, ge=1, description="dimension of the common embedding space of f^s and f^c")
    temperature: float = Field(0.07, gt=0, description="tau, the NCE temperature")
    negatives: int = Field(16384, ge=1, description="K negatives per positive (capped at |D_s| - 1)")
    memory_momentum: float = Field(0.5, ge=0, lt=1, description="momentum of the memory-bank updates")
    batch_size: int = Field(128, ge=1, description="knowledge-transfer batch size (Table I)")
    lr: float = Field(0.002, gt=0, description="SGD rate of the heads (and, in code mode, of the student copy)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum of the knowledge transfer")
    weight_decay: float = Field(5e-4, ge=0, description="L2 weight decay of the knowledge transfer")
    ce_weight: float = Field(1.0, ge=0, description="code mode: weight of the cross-entropy on D_s's labels")
    crd_weight: float = Field(0.8, ge=0, description="code mode: weight of the CRD term")
    student_step: Literal["weight_decay", "gradient", "none"] | None = Field(
        None,
        description="code mode: how the student copy moves between the epoch's batches: weight_decay (the authors' "
        "code zeroes its gradient before optimizer.step(), so it moves by SGD's weight decay and momentum alone and "
        "every batch's gradient is taken near theta^t), gradient (along its CE + CRD gradient: raysim before issue "
        "48) or none (it stays at theta^t); default: weight_decay in code mode, none in paper mode (the only value it "
        "allows)",
    )
    momentum_buffers: Literal["reset", "kept"] | None = Field(
        None,
        description="SGD momentum of the heads (and of the student copy) at the start of a round: reset (the "
        "authors' code builds a new optimizer in every CRD.train call) or kept from the last round; default: reset "
        "in code mode, kept in paper mode",
    )
    negatives_from: Literal["other_classes", "others"] | None = Field(
        None,
        description="where each positive's K negatives are drawn: other_classes (the authors' CRD sampler: uniform "
        "over the samples of D_s of other classes than the positive's, without replacement unless K exceeds them; K "
        "as set) or others (uniform over all the other samples, with replacement; K capped at |D_s| - 1); default: "
        "other_classes in code mode, others in paper mode",
    )

    @model_validator(mode="after")
    def _student_moves_in_code_mode_only(self) -> TransferSettings:
        if self.mode == "paper" and self.student_step not in (None, "none"):
            raise ValueError(
                f"algorithm.transfer.student_step={self.student_step}: paper mode takes grad R_h at theta^t, the "
                "student copy never moves; set transfer.mode=code or student_step none"
            )
        return self

    @property
    def code(self) -> bool:
        return self.mode == "code"

    @property
    def student_path(self) -> Literal["weight_decay", "gradient", "none"]:
        """`student_step`, the mode's default resolved."""
        return self.student_step or ("weight_decay" if self.code else "none")

    @property
    def reset_momentum(self) -> bool:
        """Whether `momentum_buffers` (resolved) restarts the SGD momentum every round."""
        return (self.momentum_buffers or ("reset" if self.code else "kept")) == "reset"

    @property
    def negative_pool(self) -> Literal["other_classes", "others"]:
        """`negatives_from`, the mode's default resolved."""
        return self.negatives_from or ("other_classes" if self.code else "others")


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
    server_augment: Literal["none", "crop_flip"] = Field(
        "none",
        description="augmentation of the transfer set D_s, drawn afresh every round from the server's stream: none "
        "(the paper says none) or crop_flip (the authors' CRD loaders: RandomCrop with 4 pixels of padding, then "
        "RandomHorizontalFlip; teacher and meta-model see the same augmented images); clients' data never",
    )
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
    delta_offset: float = Field(100.0, gt=0, description="the offset of the step size delta_k (see delta_scale)")
    query_split: Literal["train", "val", "test"] = Field(
        "test", description="the client's split used as D^q (the meta partition's test split is the query set)"
    )
    start: Literal["broadcast", "own"] = Field(
        "broadcast",
        description="round 0's starting model: theta^0, sent by the server to every client (the paper's Algorithm 1, "
        "line 2), or each client's own initialization, drawn from the run's initial model and the client id (the "
        "authors' code never sends theta^0: every client builds its own model; nothing is sent in round 0)",
    )
    diagnostics: bool = Field(
        False,
        description="two more gradients per client and round for the augmented Lagrangian (5), and the server's "
        "eps-FOSP norm ||sum_i w_i d_i + lambda grad R_h||, R_h and, with a teacher, the meta-model's loss, accuracy "
        "and gradient norm on the teacher's pretraining pool (forgetting, Theorem 3); docs/algorithms.md, AugFL",
    )
