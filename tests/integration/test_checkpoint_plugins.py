"""A checkpoint runs no code (issue 51, section 1): the config saved in a checkpoint's manifest may list `plugins:`,
and `raysim resume` imports none of them; it imports what the user names with `--plugin` (or what the study being
resumed names), and refuses a checkpoint that needs a plugin not given, in one line naming it, before anything
runs."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from raysim.cli import main
from tests.support.checkpoints import edit_manifests, interrupted_run, marker_plugin


def _history(uri: str, run_id: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "pm/acc")]


def test_a_plugin_named_only_by_the_checkpoint_is_refused_and_never_imported(tmp_path, mlflow_uri, capsys):
    run_id, folder = interrupted_run(tmp_path, mlflow_uri)
    plugin, marker = marker_plugin(tmp_path, f"planted_{tmp_path.name.replace('-', '_')}")
    edit_manifests(folder, plugins=[str(plugin)])
    before = _history(mlflow_uri, run_id)
    capsys.readouterr()

    for target in (str(folder), run_id):
        assert main(["resume", target, "--tracking-uri", mlflow_uri, "--quiet"]) == 2
        out, err = capsys.readouterr()
        (line,) = err.strip().splitlines()
        assert line.startswith("error: ") and line.endswith(f"add --plugin {plugin} if you trust that file"), err
        assert f"the checkpoint needs plugin {plugin}, which was not given" in line and out == ""
        assert not marker.exists()  # nothing imported it
    run = MlflowClient(mlflow_uri).get_run(run_id)
    assert run.info.status == "KILLED" and _history(mlflow_uri, run_id) == before  # nothing reopened or logged

    assert main(["resume", str(folder), "--tracking-uri", mlflow_uri, "--quiet", "--plugin", str(plugin)]) == 0
    assert marker.exists()  # the user named it
    run = MlflowClient(mlflow_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and [step for step, _ in _history(mlflow_uri, run_id)] == [0, 1, 2, 3]
    (manifest,) = [p for p in sorted(folder.glob("round-*/manifest.json"))][-1:]
    assert str(plugin) in manifest.read_text()  # the plugin given is what the next checkpoint names


def test_a_checkpoint_plugin_is_matched_by_module_name_wherever_the_given_file_is(tmp_path, mlflow_uri, capsys):
    """The checkpoint names the file where it was when the run started; the user gives the same module from
    another folder (a copy of the project): the resume takes the file given, and imports nothing from the old
    path."""
    run_id, folder = interrupted_run(tmp_path, mlflow_uri)
    name = f"moved_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, old_marker = marker_plugin(tmp_path / "old", name)
    new, new_marker = marker_plugin(tmp_path / "new", name)
    edit_manifests(folder, plugins=[str(old)])
    assert main(["resume", run_id, "--tracking-uri", mlflow_uri, "--quiet", "--plugin", str(new)]) == 0
    assert new_marker.exists() and not old_marker.exists()
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
