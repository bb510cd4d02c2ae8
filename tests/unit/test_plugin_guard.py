"""A plugin's import is one guarded step (issue 51, section 3): a plugin that calls `sys.exit(0)` made `raysim run`
exit 0 with nothing run, one that raised KeyboardInterrupt was reported as Ctrl-C. Whatever ends an import but
success is one `error:` line naming the plugin (exit 2), before any Ray or MLflow work; the process's own signals
are not involved (the subprocess case: tests/system/test_untrusted_inputs.py)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import yaml

from raysim.cli import main
from tests.support.experiments import tiny_config

ENDINGS = {
    "exit-0": ("import sys\nsys.exit(0)\n", "it called sys.exit(0) while being imported"),
    "exit-none": ("raise SystemExit\n", "it called sys.exit(None) while being imported"),
    "exit-text": ("import sys\nsys.exit('bye')\n", "it called sys.exit('bye') while being imported"),
    "ctrl-c": ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
    "ctrl-c-text": ("raise KeyboardInterrupt('stop here')\n", "KeyboardInterrupt: stop here"),
    "generator-exit": ("raise GeneratorExit\n", "GeneratorExit"),
    "error": ("1 / 0\n", "ZeroDivisionError: division by zero"),
}


@pytest.fixture
def untouched(monkeypatch):
    """Ray and MLflow fail the test if anything starts them."""
    import ray

    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)


@pytest.mark.parametrize("how", ["--plugin", "plugins:", "module"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_plugin_that_ends_its_import_is_one_error_line_naming_it(
    tmp_path, monkeypatch, capsys, untouched, how, ending
):
    body, expected = ENDINGS[ending]
    name = f"ends_{ending.replace('-', '_')}_{how.strip(':-')}"
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(body)
    tree = tiny_config(tracking={"experiment": "tests", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    options: list[str] = []
    if how == "plugins:":
        tree["plugins"] = [plugin.name]
        named = str(plugin)
    elif how == "--plugin":
        options, named = ["--plugin", str(plugin)], str(plugin)
    else:
        monkeypatch.syspath_prepend(str(tmp_path))
        options, named = ["--plugin", name], name
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tree))
    monkeypatch.chdir(tmp_path)

    code = main(["run", str(config), "--quiet", *options])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.strip().splitlines() == [f"error: plugin {named}: {expected}"] and out == ""
    assert name not in sys.modules  # a later import tries it afresh
    assert not (tmp_path / "mlflow.db").exists()
