"""Read torch's kernel flags inside an actor's process (`actor.__ray_call__.remote(kernel_flags)`). A module of its
own that imports nothing: a probe defined in a test module would import that module in the actor, and torch with
it, before reading whether the actor had loaded torch."""

from __future__ import annotations

import sys
from typing import Any


def kernel_flags(_actor: Any) -> tuple[bool, bool, bool] | None:
    """cuDNN deterministic, cuDNN benchmark, torch's deterministic algorithms; None if torch is not loaded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cudnn = torch.backends.cudnn
    return cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled()


def load_torch(_actor: Any) -> None:
    """Load torch, as a coordinator whose server step runs torch (FedSLR's SVD) does."""
    import torch  # noqa: F401
