"""The Python API (raysim.run, raysim.run_suite): real runs on the shared local Ray, read back from a sqlite MLflow
store. The result's tables are what MLflow logged, its final models score on the clients' test splits what the run
logged, and every way of giving a config gives the same one; bad input is the command line's one line."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT


def test_import_raysim_starts_nothing_heavy():
    """`import raysim` and reaching `raysim.run` import neither Ray, torch nor pandas: only calling it does."""
    script = (
        "import sys, raysim\n"
        "run, result = raysim.run, raysim.Result\n"
        "print(sorted({'ray', 'torch', 'pandas', 'mlflow'} & set(sys.modules)))\n"
        "try:\n    raysim.nothing\nexcept AttributeError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "module 'raysim' has no attribute 'nothing'"]


def test_plugins_are_imported_before_the_config_is_validated_as_with_plugin(tmp_path):
    """`plugins=[...]` as `--plugin`: docs/extending.md's FedAvgM file names an algorithm the config can then use, and
    the config lists it for Ray's workers; a missing one is the command line's one line. In a subprocess, so that
    this process's registries stay as raysim ships them."""
    from tests.support.pages import page_files

    (tmp_path / "fedavgm.py").write_text(page_files()["fedavgm.py"])
    script = (
        "import raysim.api, tests.support.experiments as c\n"
        "tree = c.tiny_config(algorithm={'name': 'my_fedavgm', 'lr': 0.05, 'batch_size': 32, 'server_momentum': 0.5})\n"
        "config = raysim.api.experiment_config(tree, ['rounds=1'], plugins=['fedavgm.py'])\n"
        "print(config.algorithm.name, config.algorithm.server_momentum, config.plugins)\n"
        "try:\n    raysim.api.experiment_config(tree, plugins=['nowhere.py'])\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"my_fedavgm 0.5 ['{tmp_path / 'fedavgm.py'}']",
        f"PluginError plugin {tmp_path / 'nowhere.py'}: no such file",
    ]
