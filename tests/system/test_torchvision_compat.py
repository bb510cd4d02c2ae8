"""A plain `import torchvision` works in the project's venv (issue 34): the CPU torch this project pins beside
PyPI's CUDA torchvision fails with "operator torchvision::nms does not exist" unless raysim.torchvision_compat
defines the two missing schemas first, which the .pth file `make setup` writes does at the first import."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from raysim.torchvision_compat import PTH_LINE, PTH_NAME

NOTEBOOK = """
import sys
assert "torch" not in sys.modules, "the start-up hook imported torch"
import torchvision
from torchvision import datasets, models
from torchvision.transforms import v2
print(models.resnet18(num_classes=3).fc.out_features, datasets.FashionMNIST.__name__, type(v2.ToImage()).__name__)
"""


def test_plain_import_of_torchvision_works_in_the_venv():
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    assert pth.read_text() == PTH_LINE, f"{pth} is missing or stale: `make setup` writes it"
    done = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "FashionMNIST", "ToImage"]


SECOND_COPY = """
import importlib, sys
import raysim.torchvision_compat as first
first.import_torchvision()
del sys.modules["raysim.torchvision_compat"], sys.modules["torchvision"]
second = importlib.import_module("raysim.torchvision_compat")
assert second is not first
print(second.import_torchvision().__name__)
"""


def test_a_second_copy_of_the_module_imports_torchvision_again():
    """A renewed host actor builds ResNet-18 in a process where another copy of this module already defined the
    schemas (the matrix's resnet18_gn cell crashed with "Only a single TORCH_LIBRARY")."""
    done = subprocess.run([sys.executable, "-c", SECOND_COPY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["torchvision"]
