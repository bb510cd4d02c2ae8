"""The driver of one run: checks what can be refused, opens the MLflow run, starts the actors, runs the
rounds, and ends the run FINISHED, FAILED or KILLED; it is the only MLflow writer.

The jobs behind it, one module each: `problem` (data, partition, initial model, host assignment and client
sampling), `session` (Ray), `simulation` (the actors and one round of them), `rounds` (the loop with
checkpoints, recovery and resume); the progress bar and the artifacts are round callbacks (raysim.tracking).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import ray
import yaml
from rich.console import Console

from raysim.config import ExperimentConfig
from raysim.credentials import connect_uri, redact_text
from raysim.errors import CheckpointError, Interrupted, RayLost, RaysimError, as_raised, check_output
from raysim.plugins import PluginError, failed_in_worker
from raysim.runtime import checkpoint
from raysim.runtime.exact_sum import UploadRangeError
from raysim.runtime.memory import StoreChoice, choose_store
from raysim.runtime.problem import Problem, assign_to_hosts, host_layout, prepare
from raysim.runtime.rounds import Rounds
from raysim.runtime.session import new_local_ray, ray_session
from raysim.runtime.simulation import NoUsableUpload, Simulation
from raysim.tracking.artifacts import RunArtifacts
from raysim.tracking.callbacks import RoundCallback, RunResult
from raysim.tracking.identity import default_run_name, log_dataset, standard_tags
from raysim.tracking.mlflow_writer import (
    MlflowWriter,
    git_commit,
    local_artifact_folder,
    resolve_tracking_uri,
    waiting_for_writers,
)
from raysim.tracking.progress import ProgressBar
from raysim.tracking.runs import DRIVER_TAG, RUN_COLOR_TAG, run_checkpoints
from raysim.tracking.views import GROUP_TAG

STATE_STORE_TAG = "raysim.state_store"
"""The run's tag naming where its client state lived (runtime.state_store resolved: hosts, memory or disk)."""


class DivergenceError(RaysimError):
    """A client's upload had NaN/inf (runtime.on_nonfinite = stop); the message names the round and client."""


def run_experiment(
    config: ExperimentConfig,
    show_progress: bool = True,
    inspect: Callable[[int, Simulation], None] | None = None,
    parent: str | None = None,
    resume: Path | None = None,
    tracking_uri: str | None = None,
    command: str | None = None,
    round_callbacks: Sequence[RoundCallback] = (),
) -> RunResult:
    """Run one experiment end to end and log it to MLflow.

    `inspect(round_index, simulation)`, if given, is called after every round (tests use it to check
    invariants on live state). `parent` is the MLflow run id to nest this run under (raysim.studies.suite).
    `resume` is a checkpoint folder: the same MLflow run continues from it (see `resume_experiment`), logged
    to `tracking_uri` if given, else to the URI the checkpoint names. `command`: what the user typed, for the
    run's source and description (default: this process's command line; a sweep's trial runs in a Ray worker).
    `round_callbacks`: more round callbacks, called after the run's own (a sweep's trial reports its rounds to
    Ray Tune through one: raysim.studies.sweep), so that the runtime knows nothing of who watches it.

    Everything that can be refused is checked before Ray or MLflow work: the data and partition, the hosts
    against a new local Ray's CPUs and GPUs, a checkpoint folder that cannot be written, and the tracking store's
    scheme, database driver and reachability (joining a cluster, the hosts are checked once connected, still
    before the MLflow run is created).
    """
    problem = prepare(config)
    if config.tracking.checkpoint_every:
        checkpoint.check_writable(resume.resolve().parent if resume else Path(config.tracking.checkpoint_dir))
    in_process = config.runtime.actors == "in_process"
    local = None if in_process else new_local_ray(config.runtime)
    if local is not None:
        host_layout(config.runtime, problem.clients, local, local)
    if config.runtime.spill_dir is not None and (in_process or local is not None):  # the hosts run on this node
        check_output(config.runtime.spill_dir, "runtime.spill_dir", "folder")
    artifact_folder = local_artifact_folder(config.tracking.artifact_root or "")
    if config.tracking.artifact_root and artifact_folder is not None:
        check_output(artifact_folder, "tracking.artifact_root", "folder")
    manifest = checkpoint.read_manifest(resume) if resume is not None else None
    uri = tracking_uri or (manifest["tracking_uri"] if manifest else resolve_tracking_uri(config.tracking.uri))
    # The store opens in the background while Ray starts (a new sqlite store takes about 1.5 s to create).
    writer = MlflowWriter(
        uri,
        config.tracking.experiment,
        connect_timeout_s=config.tracking.connect_timeout_s,
        background=True,
        artifact_root=config.tracking.artifact_root,
    )
    result = RunResult(None, malicious=sorted(problem.malicious))
    rounds: Rounds | None = None
    timeout = config.tracking.flush_timeout_s
    try:
        with contextlib.nullcontext() if in_process else ray_session(config):
            if in_process:
                layout = assign_to_hosts(problem.clients, min(config.runtime.num_hosts or 1, len(problem.clients)))
            else:
                available, cluster = ray.available_resources(), ray.cluster_resources()
                layout = host_layout(config.runtime, problem.clients, available, cluster)
            nodes = 1 if in_process or local is not None else _ray_nodes()
            store = choose_store(config.runtime, problem.state_bytes * len(problem.clients), len(layout), nodes)
            if manifest is not None and config.runtime.state_store == "auto":  # the store its checkpoint was made in
                store = StoreChoice(yaml.safe_load(manifest["config"])["runtime"]["state_store"])
            result.run_id = _open_run(config, problem, writer, manifest, parent, command)
            callbacks: list[RoundCallback] = [RunArtifacts(config, problem, writer, resumed=resume is not None)]
            # The run goes on with the store resolved: its checkpoints' config names it, so a resume uses the same.
            config = config.model_copy(
                update={"runtime": config.runtime.model_copy(update={"state_store": store.store})}
            )
            if show_progress:
                console = Console(stderr=True)
                if store.note is not None:
                    console.print(store.note, soft_wrap=True, style="yellow")
                verb = f"resuming from {resume}" if resume else "run"
                console.print(
                    f"[bold]raysim[/] {config.algorithm.name} on {config.dataset.name}: {verb} {result.run_id} "
                    f"at {writer.shown_uri}",
                    soft_wrap=True,  # one line in a log too (a console that is not a terminal is 80 columns wide)
                )
                callbacks.append(ProgressBar(console, config.rounds))
            callbacks.extend(round_callbacks)
            rounds = Rounds(config, writer, result, problem, resume, callbacks, inspect)
            simulation = Simulation(config, problem, layout)
            writer.set_tags({"raysim.hosts": str(len(simulation.hosts)), STATE_STORE_TAG: store.store})
            monitor = _system_metrics(config, uri, result.run_id, resumed=resume is not None)
            finished = False
            try:
                rounds.run(simulation)
                finished = True
            finally:
                simulation.close(finished=finished)
                if monitor is not None:
                    monitor.finish()
    except (UploadRangeError, NoUsableUpload) as error:
        message = str(getattr(error, "cause", None) or error).strip().splitlines()[-1]
        writer.set_tags({"raysim.error": message})
        writer.finish("FAILED", timeout)
        kept = f"; last good checkpoint {rounds.latest}" if rounds is not None and rounds.latest else ""
        switch = "runtime.on_nonfinite=stop"
        if isinstance(error, NoUsableUpload):
            switch = f"runtime.on_nonfinite=drop_client, runtime.max_empty_rounds={config.runtime.max_empty_rounds}"
        raise DivergenceError(f"run {result.run_id} stopped: {message}{kept} ({switch})") from None
    except KeyboardInterrupt as interrupt:
        raise _interrupted(interrupt, config, writer, result, rounds) from None
    except BaseException as error:
        plugin_failure = failed_in_worker(error)  # a plugin that imports here but not in an actor's worker
        if result.run_id is not None:
            writer.set_tags(
                {
                    "raysim.error": redact_text(
                        plugin_failure or (str(error).strip().splitlines()[-1] if str(error) else type(error).__name__)
                    )
                }
            )
        writer.finish("FAILED", timeout)
        with contextlib.suppress(AttributeError):  # for the Python API's one line (raysim.api.RunFailed)
            error.raysim_run_id = result.run_id  # type: ignore[attr-defined]  # any exception's own attribute
        if plugin_failure is not None:
            where = "in a Ray worker; it imports in the driver"
            raise PluginError(f"run {result.run_id} failed: {plugin_failure} ({where})") from None
        raise
    writer.finish("FINISHED", timeout)
    return result


def _ray_nodes() -> int:
    """The alive nodes of the Ray the run joined, plus one for a Ray Client's driver (its machine is none of
    them): past one, the hosts may run where the driver's folders are not."""
    from ray.util.client import ray as client

    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    return alive + (1 if client.is_connected() else 0)


def _system_metrics(config: ExperimentConfig, uri: str, run_id: str | None, resumed: bool):
    """MLflow's own system-metrics monitor on the run (tracking.system_metrics), started; None when off. It opens
    the store by the writer's URI (a local sqlite file's with its busy timeout), so that MLflow reuses the writer's
    open store instead of opening it again, and its writes wait for the writer's as the writer's wait for others'."""
    if not config.tracking.system_metrics or run_id is None:
        return None
    import logging

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop lines on the console
    monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=waiting_for_writers(connect_uri(uri)))
    monitor.start()
    return monitor


def _open_run(
    config: ExperimentConfig,
    problem: Problem,
    writer: MlflowWriter,
    manifest: dict | None,
    parent: str | None,
    command: str | None = None,
) -> str:
    """Create the MLflow run (or reopen a resumed one), tagged with this driver's host and process id so that a
    run whose driver was killed outright (it stays RUNNING) can be told apart (`raysim resume` lists them)."""
    if manifest is not None:
        run_id = manifest["run_id"]
        writer.reopen(run_id)
    else:
        tags = {
            "algorithm": config.algorithm.name,
            "dataset": config.dataset.name,
            "partition": config.partition.scheme,
            "attack": config.attack.kind,
            "aggregation": config.aggregation.rule,
            **standard_tags(config, git_commit(), command),
        }
        if problem.malicious:
            tags["malicious_clients"] = ",".join(str(c) for c in sorted(problem.malicious))
        if config.tracking.color is not None:
            tags[RUN_COLOR_TAG] = config.tracking.color
        if config.tracking.group is not None:
            tags[GROUP_TAG] = config.tracking.group
        name = config.tracking.run_name or default_run_name(config)
        run_id = writer.start(name, config.flat(), tags, parent=parent)
        log_dataset(writer.client, run_id, config, problem.y, [split for _, split in problem.clients])
    writer.set_tags({DRIVER_TAG: f"{socket.gethostname()}:{os.getpid()}"})
    return run_id


def _interrupted(
    interrupt: KeyboardInterrupt,
    config: ExperimentConfig,
    writer: MlflowWriter,
    result: RunResult,
    rounds: Rounds | None,
) -> KeyboardInterrupt:
    """Ctrl-C, SIGTERM or SIGHUP: the run is marked KILLED (what it had logged stays) and the user is told how to
    go on; a local Ray lost under the run (RayLost): marked FAILED, likewise. One line, no traceback
    (raysim.launch)."""
    interrupt = as_raised(interrupt)
    done = max(result.history, default=0)
    latest = rounds.latest if rounds is not None else None
    hint = f"; continue with `raysim resume {result.run_id}`" if latest else ""
    if isinstance(interrupt, RayLost):
        if result.run_id is None:
            writer.finish("FAILED", 0)
            return RayLost(f"{interrupt} (before the run started)")
        writer.set_tags({"raysim.error": f"{interrupt} after round {done}"})
        writer.finish("FAILED", config.tracking.flush_timeout_s)
        return RayLost(
            f"run {result.run_id} failed after round {done} of {config.rounds}: {interrupt}: marked FAILED{hint}"
        )
    number = getattr(interrupt, "signal_number", signal.SIGINT)
    name = signal.Signals(number).name
    if result.run_id is None:
        writer.finish("KILLED", 0)
        return Interrupted(f"interrupted by {name} before the run started", number)
    writer.set_tags({"raysim.error": f"interrupted by {name} after round {done}"})
    writer.finish("KILLED", config.tracking.flush_timeout_s)
    return Interrupted(
        f"run {result.run_id} interrupted by {name} after round {done} of {config.rounds}: marked KILLED{hint}", number
    )


def resume_experiment(
    target: str,
    tracking_uri: str | None = None,
    show_progress: bool = True,
    inspect=None,
    plugins: list[str] | tuple[str, ...] = (),
    round_callbacks: Sequence[RoundCallback] = (),
):
    """Continue a run from its last complete checkpoint: `target` is a checkpoint folder (a run's or one
    round's) or an MLflow run id whose `raysim.checkpoint` tag names one. `tracking_uri` is where to look the
    run id up and, if given, where the run is logged (a checkpoint stores its URI with credentials redacted:
    give them in MLflow's variables, or here). `plugins` (`--plugin`, relative to the current directory) are
    imported first; the plugins the checkpoint's config lists are not: each must be among them or imported in
    this process already, else one PluginError names it before anything runs (raysim.plugins.for_checkpoint).
    `round_callbacks`: as run_experiment's."""
    import raysim.plugins as plugin_files
    from raysim.config import validate_config

    plugin_files.load_all(plugin_files.resolve(list(plugins), None, "--plugin"))
    path = Path(target)
    if not path.exists():
        path = run_checkpoints(target, tracking_uri)
    directory = checkpoint.latest_checkpoint(path)
    manifest = directory / checkpoint.MANIFEST
    tree = yaml.safe_load(str(checkpoint.read_manifest(directory).get("config", "")))
    if not isinstance(tree, dict):
        raise CheckpointError(f"{manifest}: its config is not a mapping of sections")
    tree["plugins"] = plugin_files.for_checkpoint(tree.get("plugins"), str(manifest))
    config = validate_config(tree)
    return run_experiment(
        config, show_progress, inspect, resume=directory, tracking_uri=tracking_uri, round_callbacks=round_callbacks
    )
