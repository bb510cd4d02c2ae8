"""Checkpoint files as an attacker might craft them."""

from __future__ import annotations

import json
import zipfile

import numpy as np


def crafted_npz(path, structure) -> None:
    """An .npz laid out as save_tree writes it, whose JSON structure is whatever an attacker chose."""
    with zipfile.ZipFile(path, "w") as archive, archive.open("__structure__.npy", "w") as member:
        np.lib.format.write_array(member, np.frombuffer(json.dumps(structure).encode(), dtype=np.uint8))
