"""Checkpoint files as an attacker might craft them."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml


def crafted_npz(path, structure) -> None:
    """An .npz laid out as save_tree writes it, whose JSON structure is whatever an attacker chose."""
    with zipfile.ZipFile(path, "w") as archive, archive.open("__structure__.npy", "w") as member:
        np.lib.format.write_array(member, np.frombuffer(json.dumps(structure).encode(), dtype=np.uint8))


def marker_plugin(folder, name: str, body: str = "") -> tuple[Path, Path]:
    """A plugin file `folder/<name>.py` that, when imported, writes a marker file beside it (then runs `body`):
    the marker tells whether anything imported it. Returns (plugin, marker)."""
    plugin, marker = Path(folder) / f"{name}.py", Path(folder) / f"{name}.ran"
    plugin.write_text(f"import os\nfrom pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n{body}")
    return plugin, marker


def interrupted_run(tmp_path, uri: str, **sections: Any) -> tuple[str, Path]:
    """A tiny in-process run (3 rounds, checkpointed every round into tmp_path/ckpt) stopped after its first
    round, as Ctrl-C would: (its run id, its run's checkpoint folder)."""
    import pytest
    from mlflow.tracking import MlflowClient

    from raysim.config import validate_config
    from raysim.runtime.driver import run_experiment
    from tests.support.experiments import IN_PROCESS, tiny_config

    tracking = {"experiment": "tests", "uri": uri, "checkpoint_every": 1, "checkpoint_dir": str(tmp_path / "ckpt")}
    config = validate_config(tiny_config(runtime=IN_PROCESS, tracking=tracking, **sections))

    def stop(round_index: int, _simulation: Any) -> None:
        if round_index == 1:
            raise KeyboardInterrupt("driver stopped")

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, show_progress=False, inspect=stop)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    return run.info.run_id, tmp_path / "ckpt" / run.info.run_id


def edit_manifests(folder: Path, **config: Any) -> None:
    """Give the saved config of every checkpoint of a run's folder these top-level keys, as an attacker could."""
    for manifest in folder.glob("round-*/manifest.json"):
        data = json.loads(manifest.read_text())
        data["config"] = yaml.safe_dump({**yaml.safe_load(data["config"]), **config})
        manifest.write_text(json.dumps(data))
