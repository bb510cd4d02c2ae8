"""The documentation: the site builds in strict mode (no broken page or link), the configuration reference it
generates lists every key the config models accept, and the shell examples marked runnable run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.reference import config_keys, config_reference

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = "<!-- test: runnable -->"


def test_the_site_builds_in_strict_mode_with_the_generated_reference(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = Path(sys.executable).parent / "mkdocs"
    done = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "index.html").read_text()
    missing = [key for key in config_keys() if f"<code>{key}</code>" not in page]
    assert not missing, missing[:10]
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()


def test_the_reference_covers_every_section_and_choice():
    keys = config_keys()
    for key in ("rounds", "seed", "runtime.max_restarts", "tracking.train_loss", "partition.q", "partition.beta",
                "partition.path", "algorithm.lambda", "algorithm.rho", "attack.kind", "aggregation.rule"):  # fmt: skip
        assert key in keys, key
    text = config_reference()
    assert "### `algorithm.name: augfl`" in text and "### `partition.scheme: file`" in text
    assert "`local` \\| `global`" in text  # FLAME's prox_center choices, as allowed values


def runnable_blocks() -> list[tuple[str, str]]:
    """(file, script) of every ```bash block marked runnable in the README and the docs."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for part in text.split(RUNNABLE)[1:]:
            blocks.append((path.name, part.split("```bash\n", 1)[1].split("\n```", 1)[0]))
    return blocks


def test_there_are_runnable_examples():
    assert any(name == "getting-started.md" for name, _ in runnable_blocks())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "script"), runnable_blocks(), ids=lambda value: str(value)[:30])
def test_marked_shell_examples_run_as_written(name, script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"  # nothing written into the checkout
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, f"{name}:\n{script}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert re.search(r"pm/acc", done.stdout) or "run " in done.stdout
