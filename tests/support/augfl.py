"""AugFL's small settings: the few-shot partitions its tests train on and the CRD regularizer with an MLP teacher."""

from __future__ import annotations

META = {"scheme": "meta", "shots": 20, "reserved": 300, "server_samples": 256, "val_fraction": 0.5}
"""Few-shot clients with held-back pools for the teacher and the server's transfer set, and a validation split."""
PRETRAIN_META = {"scheme": "meta", "shots": 10, "reserved": 300, "server_samples": 128}
"""The pools `raysim pretrain` trains a teacher on."""
CRD = {"name": "augfl", "regularizer": "crd", "lambda": 5.0, "teacher_model": "mlp", "transfer": {"negatives": 32}}
"""AugFL with the CRD regularizer and an MLP teacher (fast to pretrain)."""
