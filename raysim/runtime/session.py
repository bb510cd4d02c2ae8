"""The Ray session of a run: join a cluster or start a local Ray, and leave Ray as it was found.

A local Ray's daemons (GCS server, raylet and their helpers) are started each in a session of its own. Ray
starts them in the driver's process group, so a signal to the whole group (a closed terminal's SIGHUP,
`kill -- -PGID`, a batch scheduler, a container stop) killed them under the driver: its next Ray call then
waited for a GCS server that was not coming back until Ray ended the process after 60 s, with the run left
RUNNING. In sessions of their own they get only the signals sent to them; the driver ends the run as for a
signal to its PID (marked KILLED) and then stops them. They still die with the driver if it is killed outright
(Ray starts them with PR_SET_PDEATHSIG).

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
from typing import Any

import ray
import torch

from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.errors import Interrupted, RayLost, raise_from_handler, sigterm_interrupts

WATCH_EVERY_S = 0.5
VITAL = {"gcs_server": "GCS server", "raylet": "raylet"}
"""The daemons (executable name: what the message calls it) without which a local Ray is gone."""
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


class LocalDaemons:
    """The processes a local Ray starts (its GCS server, raylet, log monitor...), each in a session of its own,
    and a watch on the vital ones."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.lost: str | None = None
        """What happened to the local Ray, once a vital daemon is gone."""
        self._watching = threading.Event()

    @contextmanager
    def own_sessions(self) -> Iterator[None]:
        """Inside: every process Ray starts through its one process launcher (`ray._private.services.
        ConsolePopen`, Ray 2.x) gets a session of its own (setsid) and is remembered. Should a Ray version lack
        the launcher, its daemons stay in the driver's process group (the watch still ends a run that loses
        them)."""
        from ray._private import services

        original: Any = getattr(services, "ConsolePopen", None)  # a class, looked up: a Ray may lack it
        if original is None:
            yield
            return
        daemons = self

        class OwnSessionPopen(original):
            def __init__(self, *args, **kwargs) -> None:
                kwargs["start_new_session"] = True
                super().__init__(*args, **kwargs)
                daemons.started.append(self)

        services.ConsolePopen = OwnSessionPopen  # type: ignore[misc]  # patching Ray's launcher class
        try:
            yield
        finally:
            services.ConsolePopen = original  # type: ignore[misc]  # restoring it

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


def ray_usable() -> bool:
    """False once the local Ray this process started has lost its GCS server or raylet: Ray calls that need
    them (ending actors, removing a placement group) would wait until Ray ends the process."""
    return _local is None or _local.gone() is None


START_ATTEMPTS = 3
"""Tries at starting a local Ray (`_start_local`)."""
SLOW_START = "timed out during startup"
"""What ray.init says when the raylet it started never registered: on a loaded machine, because its agents wrote
their port files after the raylet's fixed wait for them (ray-project/ray#65983), and the raylet exited."""


def _start_local(runtime: RuntimeSettings, local: dict[str, float]) -> LocalDaemons:
    """Start a local Ray of `local`'s CPUs, its daemons in sessions of their own; start it again, up to
    START_ATTEMPTS times, when it did not come up in time (SLOW_START), after ending what the failed try started."""
    global _local
    _token_auth_explicitly()
    for attempt in range(1, START_ATTEMPTS + 1):
        daemons = _local = LocalDaemons()
        try:
            with daemons.own_sessions():
                ray.init(
                    address="local",
                    num_cpus=int(local["CPU"]),
                    num_gpus=runtime.num_gpus,
                    object_store_memory=runtime.object_store_mb * 2**20,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            return daemons
        except BaseException as error:  # SystemExit too: ray.init's own SIGTERM handler (ray_session)
            ray.shutdown()
            daemons.end_leftovers()
            _local = None
            if not (isinstance(error, Exception) and SLOW_START in str(error)) or attempt == START_ATTEMPTS:
                raise
            logging.getLogger(__name__).warning(
                "the local Ray did not start in time (try %d of %d; a loaded machine?): starting it again",
                attempt,
                START_ATTEMPTS,
            )
    raise AssertionError("unreachable: the last try returns or raises")


@contextmanager
def ray_session(config: ExperimentConfig) -> Iterator[None]:
    """Connect to `runtime.address` / $RAY_ADDRESS, or start a local Ray; leave Ray as it was found."""
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
                daemons = _start_local(config.runtime, local)
        except SystemExit as stop:  # ray.init's own SIGTERM handler, which exits on the spot, ran
            if stop.code != signal.SIGTERM:
                raise
            raise Interrupted("", signal.SIGTERM) from None
        with sigterm_interrupts():  # in place of ray.init's SIGTERM handler
            if daemons is None:
                yield
            else:
                with daemons.watched():
                    yield
    finally:
        lost = daemons if daemons is not None and daemons.gone() is not None else None
        ray.shutdown()
        if lost is not None:
            lost.end_leftovers()
        _local = None
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
