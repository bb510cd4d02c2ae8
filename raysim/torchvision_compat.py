"""Import torchvision on top of a CPU-only torch build, in raysim and in a researcher's own code.

torchvision 0.28.0 on PyPI is a CUDA build. With the CPU torch wheel this project pins, importing it
fails with "operator torchvision::nms does not exist" (pytorch/vision#9085): its Python code registers
fake kernels for `nms`/`qnms`, whose schemas live in the native library `_C` that cannot load. Defining
those two schemas first, only when `_C` does not load, makes datasets, transforms and models work;
`torchvision.ops.nms` and `io.decode_jpeg` then raise, and raysim uses neither.

So that a plain `import torchvision` works in the project's venv (a notebook's, a plugin's), `make setup`
runs `python -m raysim.torchvision_compat`, which writes `raysim-torchvision.pth` into the venv's
site-packages; at interpreter start-up its one line puts `BeforeTorchvision` first on `sys.meta_path`. That
costs no torch import: the schemas are defined when torchvision is first imported, and only then.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PTH_NAME = "raysim-torchvision.pth"
PTH_LINE = "import raysim.torchvision_compat as _raysim_tv; _raysim_tv.install_import_hook()\n"

_schemas: Any = None
"""The torch.library.Library holding the two schemas, once defined (kept alive: dropping it undefines them)."""


def define_missing_schemas() -> bool:
    """Define `torchvision::nms` and `torchvision::qnms` if torchvision's native library does not load.

    Returns whether they were defined (now or earlier). Call it before torchvision is first imported."""
    global _schemas
    if _schemas is not None:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    import torch

    native = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if native is not None:
        try:
            torch.ops.load_library(str(native))
            return False
        except OSError:
            pass
    if _schema_defined(torch, "torchvision::nms"):
        return True  # defined in this process by another copy of this module (a worker's re-imported raysim)
    _schemas = torch.library.Library("torchvision", "DEF")
    _schemas.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _schemas.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


def _schema_defined(torch: Any, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True


def import_torchvision() -> ModuleType:
    """Return the torchvision module, with the missing operator schemas defined first if needed."""
    if "torchvision" not in sys.modules:
        define_missing_schemas()
    return importlib.import_module("torchvision")


class BeforeTorchvision(importlib.abc.MetaPathFinder):
    """A meta-path finder that finds nothing: on the first `import torchvision` it defines the missing schemas
    and steps aside, so the regular finders import torchvision as usual."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_schemas()
        return None


def install_import_hook() -> None:
    """Put BeforeTorchvision first on sys.meta_path (once), unless torchvision is already imported."""
    if "torchvision" in sys.modules or any(isinstance(f, BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, BeforeTorchvision())


def write_pth(site_packages: Path | None = None) -> Path:
    """Write raysim-torchvision.pth into this interpreter's site-packages (or `site_packages`); idempotent."""
    target = (site_packages or Path(sysconfig.get_paths()["purelib"])) / PTH_NAME
    if not target.exists() or target.read_text() != PTH_LINE:
        partial = target.with_suffix(".tmp")
        partial.write_text(PTH_LINE)
        partial.replace(target)
    return target


if __name__ == "__main__":
    print(f"wrote {write_pth()}")
