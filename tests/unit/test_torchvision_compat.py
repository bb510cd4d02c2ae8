"""A plain `import torchvision` works in the project's venv (issue 34): the CPU torch this project pins beside
PyPI's CUDA torchvision fails with "operator torchvision::nms does not exist" unless raysim.torchvision_compat
defines the two missing schemas first, which the .pth file `make setup` writes does at the first import."""

from __future__ import annotations

from raysim.torchvision_compat import PTH_LINE, PTH_NAME, write_pth


def test_write_pth_is_idempotent_and_atomic(tmp_path):
    first = write_pth(tmp_path)
    assert write_pth(tmp_path) == first and first.read_text() == PTH_LINE
    assert [p.name for p in tmp_path.iterdir()] == [PTH_NAME]
