"""What a process must not do with what it is given (issue 51, section 3), in real `raysim` processes: a plugin
that calls `sys.exit(0)` while imported fails the command (exit 2, one line) instead of ending it with success,
and the tracking password stays in the driver, out of every process of the local Ray it starts."""

from __future__ import annotations

import os
import uuid

import yaml

from tests.support.checkpoints import marker_plugin
from tests.support.cli import raysim
from tests.support.experiments import tiny_config


def test_a_plugin_calling_sys_exit_0_fails_the_command(tmp_path):
    plugin, marker = marker_plugin(tmp_path, "quits", "import sys\nsys.exit(0)\n")
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})))
    done = raysim("run", str(config), "--quiet", "--plugin", str(plugin), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: plugin {plugin}: it called sys.exit(0) while being imported"]
    assert done.stdout == "" and marker.exists()  # the plugin's import ran; nothing after it did
    assert not (tmp_path / "mlflow.db").exists()


def test_the_tracking_password_stays_out_of_the_local_rays_processes(tmp_path, monkeypatch):
    """A plugin records, in every process that imports it (the driver, and each host and the coordinator, which
    import the run's plugins before they unpickle anything of it), its pid and whether it holds the password."""
    secret = f"secret-{uuid.uuid4().hex}"
    seen = tmp_path / "seen.txt"
    body = (
        f"held = os.environ.get('MLFLOW_TRACKING_PASSWORD') == {secret!r}\n"
        f"with open({str(seen)!r}, 'a') as f:\n"
        "    f.write(str(os.getpid()) + ' ' + str(held) + chr(10))\n"
    )
    plugin, _ = marker_plugin(tmp_path, "looks", body)
    tracking = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "creds"}
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tiny_config(rounds=1, runtime={"num_hosts": 2}, tracking=tracking)))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "user")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    done = raysim("run", str(config), "--quiet", "--plugin", str(plugin), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in seen.read_text().splitlines()]
    (driver, holds), *workers = [(int(pid), flag == "True") for pid, flag in lines]
    assert holds, lines  # the driver imports it first, and keeps the password: the test sees it when it is there
    assert len({pid for pid, _ in workers} - {driver, os.getpid()}) >= 2, lines  # the hosts, the coordinator
    assert not any(held for _, held in workers), lines
