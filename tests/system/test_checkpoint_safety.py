"""A checkpoint file runs no code it names: only raysim's state dataclasses (and registered plugin classes)
are rebuilt; anything else a crafted file names is refused before it is imported or called."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raysim.runtime import checkpoint
from tests.support.checkpoints import crafted_npz
from tests.support.experiments import tiny_config


def test_a_crafted_checkpoint_imports_no_module_outside_raysim(tmp_path):
    """The refusal comes before any import: a module that is not loaded stays unloaded."""
    path = tmp_path / "x.npz"
    crafted_npz(path, {"__dataclass__": "smtplib:SMTP", "fields": {}})
    code = (
        "import sys; from raysim.runtime import checkpoint\n"
        f"try: checkpoint.load_tree({str(path)!r})\n"
        "except checkpoint.CheckpointError as e: print('refused', e)\n"
        "print('smtplib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused") and out.strip().endswith("False")


RAYSIM = str(Path(sys.executable).parent / "raysim")


def _unshare() -> list[str]:
    """The `unshare` command that gives a shell a mount namespace in which it may mount a tmpfs; skips the test
    where the machine allows none (no util-linux, user namespaces off)."""
    unshare = shutil.which("unshare")
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    if unshare is not None:
        probe = subprocess.run(
            [unshare, *flags, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, text=True
        )
        if probe.returncode == 0:
            return [unshare, *flags]
    pytest.skip("no mount namespace for a small tmpfs here (unshare missing or user namespaces disabled)")


def _run_config(tmp_path: Path, checkpoint_dir: Path, rounds: int) -> tuple[Path, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = {"experiment": "disk", "uri": uri, "checkpoint_every": 1, "checkpoint_dir": str(checkpoint_dir)}
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(tiny_config(rounds=rounds, runtime={"num_hosts": 2, "num_cpus": 2}, tracking=tracking))
    )
    return path, uri


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}


@pytest.mark.parametrize("case", ["below-a-file", "read-only"])
def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_ray(tmp_path, case):
    """Both were a traceback once the run had started."""
    if case == "below-a-file":
        (tmp_path / "notes.txt").write_text("a file")
        folder = tmp_path / "notes.txt" / "checkpoints"
        command = [RAYSIM, "run", str(_run_config(tmp_path, folder, 2)[0]), "--quiet"]
        expected = f"error: tracking.checkpoint_dir={folder}: {tmp_path / 'notes.txt'} is a file, not a folder"
    else:
        folder = tmp_path / "readonly"
        folder.mkdir()
        config = _run_config(tmp_path, folder, 2)[0]
        script = f'mount -t tmpfs -o ro,size=64k tmpfs "{folder}" && exec "{RAYSIM}" run "{config}" --quiet'
        command = [*_unshare(), "sh", "-c", script]
        expected = f"error: tracking.checkpoint_dir={folder}: checkpoints cannot be written there (Read-only file"
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=_environment(), timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(expected), line
    assert not (tmp_path / "mlflow.db").exists() and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120  # no Ray was started (a refusal before it takes seconds)


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_one_line_and_leaves_only_whole_checkpoints(tmp_path):
    """The disk fills up once a checkpoint is complete: a later one cannot be written. The run is FAILED with one
    line naming the last complete checkpoint (resumable), and no round folder without its manifest is left: a
    round's folder is renamed into place only whole."""
    from mlflow.tracking import MlflowClient

    folder, snapshot = tmp_path / "checkpoints", tmp_path / "snapshot"
    folder.mkdir()
    snapshot.mkdir()
    config, uri = _run_config(tmp_path, folder, 10_000)
    script = (
        f'mount -t tmpfs -o size=4m tmpfs "{folder}" && "{RAYSIM}" run "{config}" --quiet '
        "--set runtime.actors=in_process 2> stderr.txt; "  # the disk is the subject: hosts in process
        f'code=$?; cp -a "{folder}/." "{snapshot}/"; exit $code'
    )
    shell = subprocess.Popen(
        [*_unshare(), "sh", "-c", script],
        cwd=tmp_path,
        env=_environment(),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    inside = Path(f"/proc/{shell.pid}/root") / folder.relative_to("/")  # the tmpfs, seen through the namespace
    try:
        deadline = time.monotonic() + 240
        while not list(inside.glob("*/round-*/manifest.json")):  # any: only the newest two are kept
            assert shell.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
            time.sleep(0.05)
        with open(inside / "filler", "wb", buffering=0) as filler, pytest.raises(OSError, match="No space left"):
            while True:
                filler.write(bytes(2**16))
        shell.wait(timeout=180)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, 9)
    err = (tmp_path / "stderr.txt").read_text()
    assert shell.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("disk").experiment_id])
    run_id = run.info.run_id
    assert last.startswith(f"error: checkpoint {folder / run_id}/round-") and "No space left on device" in last, last
    named = last.split("the last complete one is ")[1].split(":")[0]
    assert last.endswith(f"free space and continue with `raysim resume {run_id}`"), last
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["raysim.error"]
    rounds = sorted(p.name for p in (snapshot / run_id).iterdir())
    assert rounds and all(name.startswith("round-") for name in rounds), rounds  # no hidden partial folder
    assert all((snapshot / run_id / name / "manifest.json").is_file() for name in rounds), rounds
    assert Path(named).name == rounds[-1]
    assert checkpoint.read_manifest(snapshot / run_id / rounds[-1])["run_id"] == run_id
