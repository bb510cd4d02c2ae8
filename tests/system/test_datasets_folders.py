"""File-backed image datasets (MedMNIST .npz, ImageFolder, Tiny-ImageNet, LEAF FEMNIST) read from small files
written here in each publisher's real layout, plus two runs through the CLI and a download from a local server."""

from __future__ import annotations

from pathlib import Path

import pytest

# ---------------------------------------------------------------- writers of the real formats
from tests.support.data_files import write_image_folder, write_png_bomb
from tests.support.experiments import tiny_config


@pytest.mark.parametrize("case", ["bomb", "root-link"])
def test_raysim_run_refuses_a_bomb_or_a_link_loop_in_one_line_before_ray(tmp_path, case):
    """Both were a traceback (the bomb) or a silently wrong dataset (the link): a real `raysim run`."""
    import os
    import subprocess
    import sys

    import yaml

    root = write_image_folder(tmp_path / "pets")
    if case == "bomb":
        culprit = write_png_bomb(root / "bee" / "bomb.png")
    else:
        culprit = root / "all"
        culprit.symlink_to(root)
    config = tiny_config(
        dataset={"name": "image_folder", "root": str(root)},
        partition={"scheme": "iid"},
        tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    raysim = str(Path(sys.executable).parent / "raysim")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [raysim, "run", str(tmp_path / "run.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    expected = f"error: {culprit}: not read: Image size" if case == "bomb" else f"error: dataset.root: {culprit} is a"
    assert line.startswith(expected), line
    assert not (tmp_path / "mlflow.db").exists()
