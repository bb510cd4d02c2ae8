"""Actors kept between the runs of one driver process (runtime.reuse_actors).

Starting a host actor costs seconds (a new process that imports torch and the model code): a driver that runs
many short runs on one Ray, such as a notebook looping over raysim.api.run or the test matrix, spends most of
its time there. With runtime.reuse_actors a finished run parks its crew here (placement group, hosts and
coordinator, emptied); the next run of this process that asks for the same resources takes it and renews every
actor with its own arguments. `Renewable.renew` runs `__init__` again on an empty object, so a renewed actor
holds exactly what a new one would (same seed, same results: tests/integration/test_crews.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from raysim.config import RuntimeSettings
from raysim.runtime.placement import HostPlacement, coordinator_resources, host_bundle


class Renewable:
    """Lets an actor be built again in place, for another run."""

    def renew(self, *args: Any, **kwargs: Any) -> None:
        """Forget everything, then set up as `type(self)(*args, **kwargs)` would."""
        self.__dict__.clear()
        self.__init__(*args, **kwargs)  # type: ignore[misc]  # re-running the constructor is the point

    def vacate(self) -> None:
        """Drop the last run's data and state while parked (the process and its imports stay)."""
        self.__dict__.clear()


@dataclass
class Crew:
    """The actors of one run and the placement group that holds its hosts."""

    placement: HostPlacement
    hosts: list[Any]
    coordinator: Any

    def dismiss(self) -> None:
        for actor in [*self.hosts, self.coordinator]:
            ray.kill(actor)
        self.placement.release()


_parked: dict[tuple, list[Crew]] = {}


def crew_key(runtime: RuntimeSettings, num_hosts: int) -> tuple:
    """What a crew must match to serve a run: this Ray session (the driver's actors die with its connection), the
    number of hosts and every resource and placement setting of its actors."""
    return (
        *_session(),
        num_hosts,
        tuple(sorted(host_bundle(runtime).items())),
        runtime.placement,
        tuple(sorted(coordinator_resources(runtime).items())),
    )


def _session() -> tuple[str, str]:
    """This driver's Ray session: its node and job (a crew's actors die with the driver's connection)."""
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


def take(key: tuple) -> Crew | None:
    """A parked crew for `key`, if any; crews of other Ray sessions are forgotten (their actors are gone)."""
    for other in [k for k in _parked if k[:2] != key[:2]]:
        del _parked[other]
    crews = _parked.get(key)
    return crews.pop() if crews else None


def park(key: tuple, crew: Crew) -> None:
    """Empty the crew's actors and keep it for the next run; a crew with a dead actor is dismissed instead."""
    try:
        ray.get([actor.vacate.remote() for actor in [*crew.hosts, crew.coordinator]])
    except ray.exceptions.RayError:
        crew.dismiss()
        return
    _parked.setdefault(key, []).append(crew)


def dismiss_parked() -> None:
    """End every parked crew of this process: they hold CPUs and GPUs that a run needing other resources, or
    anything else on this Ray, may be waiting for."""
    session = _session() if ray.is_initialized() else None
    while _parked:
        key, crews = _parked.popitem()
        if key[:2] == session:  # the crews of an earlier Ray session are gone with it
            for crew in crews:
                crew.dismiss()
