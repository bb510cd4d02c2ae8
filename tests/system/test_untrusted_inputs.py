"""What a process must not do with what it is given (issue 51, section 3), in a real `raysim` process: a plugin
that calls `sys.exit(0)` while imported fails the command (exit 2, one line) instead of ending it with success. That
the tracking password stays in the driver, out of every process of the local Ray it starts, is checked on the
shipped quickstart's run in tests/system/test_run_identity.py."""

from __future__ import annotations

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
