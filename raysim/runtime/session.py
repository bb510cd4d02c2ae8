"""The Ray session of a run: join a cluster or start a local Ray, and leave Ray as it was found.

A local Ray's daemons (GCS server, raylet and their helpers) are started each in a session of its own. Ray
starts them in the driver's process group, so a signal to the whole group (a closed terminal's SIGHUP,
`kill -- -PGID`, a batch scheduler, a container stop) killed them under the driver: its next Ray call then
waited for a GCS server that was not coming back until Ray ended the process after 60 s, with the run left
RUNNING. In sessions of their own they get only the signals sent to them; the driver ends the run as for a
signal to its PID (marked KILLED) and then stops them. They still die with the driver if it is killed outright
(Ray starts them with PR_SET_PDEATHSIG).

A local Ray starts only what a run needs: no autoscaler monitor (a local Ray never autoscales), no dashboard head
(`include_dashboard=False` still started one, with its usage-statistics module only, and ray.init waited for it to
import before it started the raylet), a minimal dashboard agent (without the servers only a dashboard head talks
to), as many workers at first as the run has actors (Ray starts one per CPU), and those workers import what every
actor imports (the coordinator's module: numba, the compiled passes' module, the algorithms; not torch, which only
the hosts import) as they start, while the driver opens the MLflow run, rather than once each is given its actor.
Kept: the GCS server, the raylet, its two agents (it cannot run without them) and the log monitor, which brings the
workers' output (a failing actor's traceback among it) to the driver's console.

If the GCS server or the raylet dies anyway (killed, out of memory), a watch thread raises RayLost in the main
thread within `WATCH_EVERY_S`, so the run is marked FAILED with one line instead of hanging; `ray_usable()`
tells the code that ends the actors to skip Ray calls that would wait for the dead GCS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import torch

from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.credentials import without_credentials
from raysim.errors import Interrupted, RayLost, RaysimError, raise_from_handler, sigterm_interrupts
from raysim.plugins import PluginError, import_in_worker, loaded
from raysim.runtime.placement import default_num_hosts

WATCH_EVERY_S = 0.5
VITAL = {"gcs_server": "GCS server", "raylet": "raylet"}
"""The daemons (executable name: what the message calls it) without which a local Ray is gone."""
MONITOR = os.path.join("autoscaler", "_private", "monitor.py"), os.path.join("autoscaler", "v2", "monitor.py")
"""The autoscaler monitor's script (Ray 2.x, either autoscaler), one of the first items of its command line: a local
Ray that raysim starts has none (`lean_head`)."""
PRELOAD = ("raysim.runtime.coordinator",)
"""What a local Ray's workers import as they start (Ray's `preload_python_modules`), before they are given an actor:
the part of a host's imports that the coordinator shares (about half of them), so that the coordinator, which
does not import torch, does not get it."""
PRESTART_FLAG = "--num_prestart_python_workers="
"""The raylet's option for the workers it starts at once (Ray sets one per CPU)."""
LOST_SIGNAL = signal.SIGUSR1
"""What the watch thread sends the main thread when a vital daemon died: it wakes a sleeping system call and
is seen inside Ray's blocking calls, which check for signals."""


def new_local_ray(runtime: RuntimeSettings) -> dict[str, float] | None:
    """The CPUs and GPUs of the local Ray this run will start, or None when it joins a running Ray or a
    cluster (whose capacity is known only once connected)."""
    if ray.is_initialized() or runtime.address or os.environ.get("RAY_ADDRESS"):
        return None
    cpus = runtime.num_cpus or len(os.sched_getaffinity(0))
    gpus = runtime.num_gpus if runtime.num_gpus is not None else torch.cuda.device_count()
    return {"CPU": float(cpus), "GPU": float(gpus)}


def _token_auth_explicitly() -> None:
    """What ray.init does for a new local instance when RAY_AUTH_MODE is unset (token authentication, a token
    generated once into ~/.ray, the mode left set for this process and its children, as Ray leaves it), done
    before ray.init so that Ray does not warn on every run that it chose this default."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    from ray._raylet import Config  # type: ignore[attr-defined]  # Ray's _raylet.pyi leaves it out

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray's own step after setting the mode (ray._private.authentication)


def run_actors(config: ExperimentConfig, local: dict[str, float]) -> int:
    """The actors a run of `config` starts on a new local Ray of `local`'s CPUs and GPUs: its hosts (as
    raysim.runtime.placement counts them, at most one a client) and the coordinator."""
    hosts = config.runtime.num_hosts or default_num_hosts(config.runtime, local)
    return min(hosts, config.clients.count) + 1


@contextmanager
def lean_head(log_monitor: bool = True) -> Iterator[None]:
    """Inside: a new local Ray's head starts no autoscaler monitor, no dashboard head and a minimal dashboard agent
    (no gRPC nor HTTP server: what a dashboard head would ask it for; Ray's own mode for an install without the
    dashboard's dependencies, which it chooses by `ray._private.utils.get_dashboard_dependency_error`), and, with
    `log_monitor=False`, no log monitor (`ray._private.node.Node`'s steps, Ray 2.x, left out; a Ray lacking a step
    starts what it starts). The raylet waits for its agent before it takes work: a minimal agent made a local Ray
    take 1.9 s to start instead of 3.3-3.9, and 6.4-6.5 CPU s instead of 7.0-9.3 (docs/performance.md)."""
    from ray._private import node, utils

    names = ("start_monitor", "start_api_server") + (() if log_monitor else ("start_log_monitor",))
    steps = {name: getattr(node.Node, name, None) for name in names}
    for name, step in steps.items():
        if step is not None:
            setattr(node.Node, name, lambda self, **_: None)
    dependencies = getattr(utils, "get_dashboard_dependency_error", None)
    if dependencies is not None:
        minimal = ImportError("raysim starts a minimal dashboard agent")
        utils.get_dashboard_dependency_error = lambda: minimal
    try:
        yield
    finally:
        for name, step in steps.items():
            if step is not None:
                setattr(node.Node, name, step)
        if dependencies is not None:
            utils.get_dashboard_dependency_error = dependencies


class LocalDaemons:
    """The processes a local Ray starts (its GCS server, raylet, log monitor...), each in a session of its own,
    and a watch on the vital ones."""

    def __init__(self, workers: int | None = None) -> None:
        """`workers`: how many workers the raylet starts at once (None: Ray's choice, one per CPU)."""
        self.workers = workers
        self.started: list[subprocess.Popen] = []
        self.lost: str | None = None
        """What happened to the local Ray, once a vital daemon is gone."""
        self._watching = threading.Event()

    @contextmanager
    def own_sessions(self) -> Iterator[None]:
        """Inside: every process Ray starts through its one process launcher (`ray._private.services.
        ConsolePopen`, Ray 2.x) gets a session of its own (setsid), an environment without the tracking
        credentials (raysim.credentials: its workers inherit the raylet's) and is remembered; the raylet starts
        `workers` workers at once. Should a Ray version lack the launcher, its daemons stay in the driver's process
        group (the watch still ends a run that loses them)."""
        from ray._private import services

        original: Any = getattr(services, "ConsolePopen", None)  # a class, looked up: a Ray may lack it
        if original is None:
            yield
            return
        daemons = self

        class OwnSessionPopen(original):
            def __init__(self, *args, **kwargs) -> None:
                if daemons.workers is not None and args and isinstance(args[0], list):
                    args = (daemons.prestarting(args[0]), *args[1:])
                kwargs["start_new_session"] = True
                kwargs["env"] = without_credentials(kwargs.get("env") or os.environ)
                super().__init__(*args, **kwargs)
                daemons.started.append(self)

        services.ConsolePopen = OwnSessionPopen  # type: ignore[misc]  # patching Ray's launcher class
        try:
            yield
        finally:
            services.ConsolePopen = original  # type: ignore[misc]  # restoring it

    def prestarting(self, command: list[str]) -> list[str]:
        """`command`, the raylet's with `workers` workers to start at once; any other process's as it is."""
        return [f"{PRESTART_FLAG}{self.workers}" if str(part).startswith(PRESTART_FLAG) else part for part in command]

    def gone(self) -> str | None:
        """Which vital daemon has exited, as a phrase ("its raylet (pid 12) was killed by SIGKILL"), or None."""
        for process in self.started:
            name = VITAL.get(os.path.basename(process.args[0])) if isinstance(process.args, list) else None
            code = process.poll() if name else None
            if code is None:
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            return f"its {name} (pid {process.pid}) {how}"
        return None

    def end_monitor(self) -> None:
        """Kill the autoscaler monitor before Ray's shutdown, should a Ray have started one despite `lean_head`: sent
        SIGTERM after the GCS server is gone (Ray's shutdown order), it spends its full second of grace trying to
        report its own death to that GCS server, on every run's way out."""
        for process in self.started:
            if isinstance(process.args, list) and any(str(a).endswith(MONITOR) for a in process.args[:4]):
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait()

    def end_leftovers(self) -> None:
        """Kill what is left in the daemons' sessions once a Ray that lost a vital daemon is shut down: the
        raylet's agents outlive a raylet that lost its GCS server by a minute or more."""
        for process in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    @contextmanager
    def watched(self) -> Iterator[None]:
        """Inside (main thread only): a vital daemon's death raises RayLost in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        main = threading.main_thread().ident
        assert main is not None  # the main thread has started

        def raise_lost(_signum: int, _frame: object) -> None:
            if self.lost is not None:
                raise_from_handler(RayLost(self.lost))

        def watch() -> None:
            while not self._watching.wait(WATCH_EVERY_S):
                reason = self.gone()
                if reason is not None:
                    self.lost = f"the local Ray is gone: {reason}"
                    signal.pthread_kill(main, LOST_SIGNAL)
                    return

        previous = signal.signal(LOST_SIGNAL, raise_lost)
        thread = threading.Thread(target=watch, name="local-ray-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._watching.set()
            thread.join()
            signal.signal(LOST_SIGNAL, previous)


_local: LocalDaemons | None = None
"""The daemons of the local Ray this process started (None when it joined a running Ray or a cluster)."""


def started_here() -> bool:
    """Whether the Ray in use is a local one this process started (its workers are this machine's, started
    without the tracking credentials), rather than a running Ray or a cluster joined."""
    return _local is not None


def ray_usable() -> bool:
    """False once the local Ray this process started has lost its GCS server or raylet: Ray calls that need
    them (ending actors, removing a placement group) would wait until Ray ends the process."""
    return _local is None or _local.gone() is None


START_ATTEMPTS = 3
"""Tries at starting a local Ray (`_start_local`)."""
SLOW_START = "timed out during startup"
"""What ray.init says when the raylet it started never registered: on a loaded machine, because its agents wrote
their port files after the raylet's fixed wait for them (ray-project/ray#65983), and the raylet exited."""


class RayStartError(RaysimError):
    """A local Ray did not start; the message says why and where Ray's logs are."""


SHORT_TMPDIR = "AF_UNIX path length"
"""What Ray says when its session folder is too deep for a Unix socket's path (107 bytes): a long $TMPDIR, as
cluster schedulers set."""


def ray_logs() -> str:
    """Where the local Ray this process tried to start keeps its logs: the newest session folder named after this
    process (`session_<date>_<pid>`) under Ray's temp folder ($RAY_TMPDIR, else $TMPDIR, else /tmp, then `ray`),
    or, when no try got that far, the temp folder itself."""
    from ray._common.utils import get_default_ray_temp_dir

    temp = Path(get_default_ray_temp_dir())
    try:
        sessions = sorted(temp.glob(f"session_*_{os.getpid()}"), key=lambda folder: folder.stat().st_mtime)
    except OSError:
        sessions = []
    return str(sessions[-1] / "logs") if sessions else f"none written (Ray's temp folder: {temp})"


def _start_failure(error: Exception, attempt: int) -> RayStartError:
    """The one line a local Ray that did not start ends the command with: what Ray said (its first line), after
    how many tries, where its logs are."""
    said = str(error).strip().splitlines()
    tries = f" in {attempt} tries" if attempt > 1 else ""
    hint = " (set RAY_TMPDIR to a shorter folder)" if SHORT_TMPDIR in str(error) else ""
    what = f"{type(error).__name__}: {said[0]}" if said else type(error).__name__
    return RayStartError(f"the local Ray did not start{tries}: {what}{hint}; Ray's logs: {ray_logs()}")


def _start_local(runtime: RuntimeSettings, local: dict[str, float], workers: int | None = None) -> LocalDaemons:
    """Start a local Ray of `local`'s CPUs with only what a run needs (module docstring), `workers` workers at
    once, its daemons in sessions of their own; start it again, up to START_ATTEMPTS times, when it did not come up
    in time (SLOW_START), after ending what the failed try started. A start that fails for good is one
    RayStartError line (`_start_failure`), not Ray's traceback."""
    global _local
    _token_auth_explicitly()
    for attempt in range(1, START_ATTEMPTS + 1):
        daemons = _local = LocalDaemons(workers)
        try:
            with daemons.own_sessions(), lean_head():
                ray.init(
                    address="local",
                    num_cpus=int(local["CPU"]),
                    num_gpus=runtime.num_gpus,
                    object_store_memory=runtime.object_store_mb * 2**20,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    _system_config={"preload_python_modules": list(PRELOAD)},
                )
            return daemons
        except BaseException as error:  # SystemExit too: ray.init's own SIGTERM handler (ray_session)
            ray.shutdown()
            daemons.end_leftovers()
            _local = None
            if not isinstance(error, Exception):
                raise  # a signal (SystemExit from ray.init's own SIGTERM handler, Ctrl-C): ray_session's to report
            if SLOW_START not in str(error) or attempt == START_ATTEMPTS:
                raise _start_failure(error, attempt) from None
            logging.getLogger(__name__).warning(
                "the local Ray did not start in time (try %d of %d; a loaded machine?): starting it again",
                attempt,
                START_ATTEMPTS,
            )
    raise AssertionError("unreachable: the last try returns or raises")


PLUGIN_CHECK_S = 120.0
"""How long `check_plugins_in_workers` waits for the nodes' answers before it lets the run go on unchecked."""


def check_plugins_in_workers() -> None:
    """Import this process's plugins (raysim.plugins.loaded) in a Ray worker on every live node, before anything of
    the run starts: a plugin that imports in the driver but not in Ray's workers (a module that only the driver's
    environment has, a file missing on a node) failed every actor's creation and printed some 130 lines of Ray's
    tracebacks. Now one PluginError line names the plugin, what ended its import and the node. The worker returns
    the failure instead of raising it, so Ray prints nothing. Nodes that have not answered within PLUGIN_CHECK_S
    are not waited for (their actors' failure is still one line: raysim.plugins.failed_in_worker)."""
    specs = loaded()
    if not specs:
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check = ray.remote(num_cpus=0, max_retries=0)(import_in_worker)
    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    answers = {
        check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(specs): address
        for node, address in nodes.items()
    }
    ready, _ = ray.wait(list(answers), num_returns=len(answers), timeout=PLUGIN_CHECK_S) if answers else ([], [])
    for answer in ready:
        try:
            failure = ray.get(answer)
        except ray.exceptions.RayError:  # the check itself did not run there (a node lost meanwhile): not its subject
            continue
        if failure is not None:
            raise PluginError(f"{failure} (in a Ray worker on node {answers[answer]}; it imports in the driver)")


@contextmanager
def ray_session(config: ExperimentConfig, workers: int | None = None) -> Iterator[None]:
    """Connect to `runtime.address` / $RAY_ADDRESS, or start a local Ray; leave Ray as it was found. `workers`: how
    many workers a new local Ray starts at once (None: as many as a run of `config` has actors, `run_actors`)."""
    global _local
    if ray.is_initialized():
        yield
        return
    address = config.runtime.address or os.environ.get("RAY_ADDRESS")
    local = new_local_ray(config.runtime)
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    daemons: LocalDaemons | None = None
    try:
        try:
            if local is None:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                daemons = _start_local(config.runtime, local, run_actors(config, local) if workers is None else workers)
        except SystemExit as stop:  # ray.init's own SIGTERM handler, which exits on the spot, ran
            if stop.code != signal.SIGTERM:
                raise
            raise Interrupted("", signal.SIGTERM) from None
        with sigterm_interrupts():  # in place of ray.init's SIGTERM handler
            if daemons is None:
                check_plugins_in_workers()
                yield
            else:
                with daemons.watched():
                    check_plugins_in_workers()
                    yield
    finally:
        lost = daemons if daemons is not None and daemons.gone() is not None else None
        if daemons is not None:
            daemons.end_monitor()
        ray.shutdown()
        if lost is not None:
            lost.end_leftovers()
        _local = None
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
