"""Client state spilled to disk beyond a memory budget (runtime.state_memory_mb): states come back bit for
bit, the least recently used spill first, files are complete or absent and removed at the end, and runs and
checkpoints with nearly every state on disk equal the in-memory ones."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from raysim.runtime.state_store import ClientStateStore, remove_orphaned_folders
from tests.support.states import assert_identical, flame_state

_KILLED_HOST = """
import os, signal, sys
import numpy as np
from raysim.runtime.state_store import ClientStateStore
store = ClientStateStore(0, sys.argv[1])
store[0] = {"w": np.ones(10)}
print(store.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_hosts_spill_folder_is_removed_by_the_next_store(tmp_path):
    killed = subprocess.run([sys.executable, "-c", _KILLED_HOST, str(tmp_path)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    orphan = Path(killed.stdout.strip())
    assert (orphan / "client-0.npz").exists()  # SIGKILL skipped every cleanup
    alive = ClientStateStore(0, tmp_path)
    alive[0] = flame_state(1.0)
    stranger = tmp_path / "raysim-states-unlocked"  # no owner lock (being made, or not a store's): kept
    stranger.mkdir()

    with ClientStateStore(0, tmp_path) as newcomer:
        newcomer[0] = flame_state(2.0)  # its first spill makes its folder and sweeps the orphans
        assert not orphan.exists()
        assert alive.folder.exists() and stranger.exists()
        assert remove_orphaned_folders(tmp_path) == []  # live owners keep their locks
        assert_identical(alive[0], flame_state(1.0))
    alive.close()
    assert list(tmp_path.iterdir()) == [stranger]
