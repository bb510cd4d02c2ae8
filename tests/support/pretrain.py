"""What the pretrain tests of several tiers share."""

from __future__ import annotations

META = {"scheme": "meta", "shots": 10, "reserved": 300, "server_samples": 128}


CRD = {"name": "augfl", "regularizer": "crd", "lambda": 5.0, "teacher_model": "mlp", "transfer": {"negatives": 32}}
