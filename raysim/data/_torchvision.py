"""Import torchvision on top of a CPU-only torch build.

torchvision 0.28.0 on PyPI is a CUDA build. With the CPU torch wheel this project pins, importing it
fails with "operator torchvision::nms does not exist" (pytorch/vision#9085): its Python code registers
fake kernels for `nms`/`qnms`, whose schemas live in the native library that could not load. Defining
those two schemas first, and only after a failed import, makes datasets, transforms and models work;
`torchvision.ops.nms` and `io.decode_jpeg` then raise, and raysim uses neither.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

_schemas: torch.library.Library | None = None


def import_torchvision() -> ModuleType:
    """Return the torchvision module, registering the missing operator schemas if needed."""
    global _schemas
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as error:
        if "torchvision::nms" not in str(error) or _schemas is not None:
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    _schemas = torch.library.Library("torchvision", "DEF")
    _schemas.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _schemas.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return importlib.import_module("torchvision")
