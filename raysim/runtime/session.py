"""The Ray session of a run: join a cluster or start a local Ray, and leave Ray as it was found."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray
import torch

from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.errors import sigterm_interrupts


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
    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray's own step after setting the mode (ray._private.authentication)


@contextmanager
def ray_session(config: ExperimentConfig) -> Iterator[None]:
    """Connect to `runtime.address` / $RAY_ADDRESS, or start a local Ray; leave Ray as it was found."""
    if ray.is_initialized():
        yield
        return
    address = config.runtime.address or os.environ.get("RAY_ADDRESS")
    local = new_local_ray(config.runtime)
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    if local is None:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        _token_auth_explicitly()
        ray.init(
            address="local",
            num_cpus=int(local["CPU"]),
            num_gpus=config.runtime.num_gpus,
            object_store_memory=config.runtime.object_store_mb * 2**20,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    try:
        with sigterm_interrupts():  # ray.init installed a SIGTERM handler that exits on the spot
            yield
    finally:
        ray.shutdown()
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
