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


def coordinator_flags(_actor: Any, arguments: tuple, kernels: str) -> tuple[bool, bool, bool] | None:
    """Set torch's flags to the opposite of what `kernels` asks, construct a real Coordinator(settings with
    deterministic=kernels, *rest of `arguments`) in this process (which has torch loaded) and return the flags it
    left."""
    import dataclasses

    import torch

    from raysim.runtime.coordinator import Coordinator

    torch.backends.cudnn.deterministic = kernels == "fast"
    torch.backends.cudnn.benchmark = kernels != "fast"
    torch.use_deterministic_algorithms(kernels != "all")
    settings, *rest = arguments
    Coordinator(dataclasses.replace(settings, deterministic=kernels), *rest)
    return kernel_flags(None)
