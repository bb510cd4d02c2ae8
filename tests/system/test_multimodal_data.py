"""Issue 31's data: natural ids grouped several to a client as FedAPM's KU-HAR code does (`partition.id_offsets`),
one global test split for every client (`partition.test_split: global`, its CrisisMMD code), and the loaders of the
real CrisisMMD, KU-HAR and Crema-D features, read from fixture pickles written in the authors' layout."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_datasets_command_lists_the_real_sets_and_finds_a_converted_one(tmp_path):
    (tmp_path / "kuhar.npz").write_bytes(b"")
    environment = {**os.environ, "RAYSIM_DATA": str(tmp_path / "empty")}
    command = [sys.executable, "-m", "raysim.cli", "datasets", "--root", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert f"found in {tmp_path}" in lines["kuhar"]
    assert "missing" in lines["crisismmd"] and "missing" in lines["cremad"]
    assert "raysim.data.fedmultimodal convert crisismmd" in out
