"""What `raysim submit` ships with a job (config, code package, never a credential), and where it finds the
cluster token (the submission itself runs against a real cluster in tests/system/test_cluster.py)."""

from __future__ import annotations

import pytest

from raysim.jobs import JobError


def test_stop_nodes_stops_what_writes_into_its_folder_and_nothing_else(tmp_path):
    """What `raysim stop-nodes DIR` selects, on real processes (the Ray daemons themselves are
    covered by tests/system/test_cluster.py): output into DIR selects a process, a reader of DIR's logs or a process
    of a sibling folder (DIR2) is left alone."""
    import subprocess

    from raysim.jobs import node_pids, stop_nodes

    root, sibling = tmp_path / "ray", tmp_path / "ray2"
    (root / "logs").mkdir(parents=True)
    sibling.mkdir()
    (root / "logs" / "worker.out").write_text("")
    started = []
    try:
        with open(root / "logs" / "driver.out", "w") as log, open(sibling / "other.out", "w") as other:
            node = subprocess.Popen(["sleep", "120"], stdout=log, stderr=log)
            bystanders = [
                subprocess.Popen(["sleep", "120"], stdout=other),
                subprocess.Popen(["tail", "-f", str(root / "logs" / "worker.out")], stdout=subprocess.DEVNULL),
            ]
        started = [node, *bystanders]
        assert node_pids(root) == [node.pid]
        assert stop_nodes(root, grace_s=5) == 1
        assert node.wait(timeout=5) == -15 and all(p.poll() is None for p in bystanders)
        with pytest.raises(JobError, match="no such folder"):
            stop_nodes(tmp_path / "missing")
    finally:
        for process in started:
            process.kill()
            process.wait()
