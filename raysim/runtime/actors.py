"""Where a run's hosts and coordinator live, and how the driver calls them.

`RayActors` (runtime.actors = ray, the default) starts them as Ray actors: the hosts in one placement group, a
finished run's crew kept for the next run of the driver (runtime.reuse_actors), an actor that died replaced by a
new one built from the same arguments. `InProcessActors` (runtime.actors = in_process) builds the same ClientHost
and Coordinator as objects of the driver's process: no Ray starts, a debugger steps into a client step, and a whole
experiment runs at the speed of its math (the tests' matrix).

Both are called alike, as Ray actors are: `handle.method.remote(...)` gives a reference, `actors.get(refs)` its
value, and a reference passed as an argument arrives as its value. In process every argument and result crosses a
pickle as it would cross Ray's object store (its numpy arrays arrive as read-only views of the pickled buffers, as
Ray's zero-copy reads do), so that a host never shares a mutable object with the driver or another host: what
runs in process runs the same on Ray (tests/integration/test_matrix_on_ray.py compares them bit for bit).
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray import cloudpickle
from threadpoolctl import ThreadpoolController

from raysim.config import ExperimentConfig
from raysim.errors import RaysimError
from raysim.plugins import carry
from raysim.runtime.coordinator import Coordinator, CoordinatorSettings
from raysim.runtime.crews import Crew, crew_key, dismiss_parked, park, take
from raysim.runtime.host import ClientHost
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.placement import HostPlacement
from raysim.runtime.problem import Problem
from raysim.runtime.session import ray_usable
from raysim.runtime.state_columns import ClientColumns, store_folder


class RecoveryError(RaysimError):
    """An actor that died was not back within runtime.restore_timeout_s; the message names it."""


class Actors(ABC):
    """The hosts and the coordinator of one run, wherever they live."""

    hosts: list[Any]
    coordinator: Any

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        """`host_clients`: the clients each host owns (`host_layout`)."""
        self.config = config
        by_id = {info.id: (info, split) for info, split in problem.clients}
        x, y, init = self.put(problem.x), self.put(problem.y), self.put(problem.init_params)
        host_settings = HostSettings.from_config(config, problem)
        self.remove_state_folder: Callable[[], None] | None = None
        """Removes the shared client-state folder (runtime.state_store = memory or disk) this driver made."""
        host_arguments: list[tuple] = []
        if config.runtime.state_store == "hosts":
            clients = [self.put([by_id[c] for c in ids]) for ids in host_clients]
            host_arguments = [(x, y, owned, init) for owned in clients]
        else:  # every host may be dealt any client: one copy of every client's split, each host evaluates its own
            folder, self.remove_state_folder = store_folder(config.runtime.state_store, config.runtime.spill_dir)
            host_settings = dataclasses.replace(host_settings, state_folder=str(folder))
            everyone = self.put(ClientColumns(problem.clients))  # 100,000 pairs as a list: 30 s of start-up
            host_arguments = [(x, y, everyone, init, ids) for ids in host_clients]
        # Every constructor argument is kept: a host or coordinator that dies is replaced by a new actor built from
        # the same references (RayActors.replace).
        self.host_arguments = [(carry(host_settings), *arguments) for arguments in host_arguments]
        self.coordinator_arguments = (
            carry(CoordinatorSettings.from_config(config, problem)),
            init,
            self.put(problem.server_data),
        )

    def forget_state_folder(self) -> None:
        """Remove the shared client-state folder, if this run made one (its hosts have let go of it)."""
        if self.remove_state_folder is not None:
            self.remove_state_folder()
            self.remove_state_folder = None

    @abstractmethod
    def put(self, value: Any) -> Any:
        """A reference to `value` that every actor call can take as an argument."""

    @abstractmethod
    def get(self, refs: Any, siblings: Sequence[Any] = ()) -> Any:
        """The value of a reference, or of each of a list of them; if one failed, the others' results (and
        `siblings'`, the same calls' other returns) are got too before its error is raised."""

    @abstractmethod
    def wait(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Those of `refs` whose calls have ended, waiting at most `timeout_s` for all of them."""

    @abstractmethod
    def replace(self, name: str) -> None:
        """Start a new actor in place of a dead one (`name`: "host 2" or "coordinator")."""

    @abstractmethod
    def close(self, wait_s: float = 10.0, finished: bool = False) -> None:
        """End the actors (hosts first remove their spilled client state), or keep a `finished` run's for the next
        run (runtime.reuse_actors)."""


def start_actors(config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]) -> Actors:
    """The run's actors, where runtime.actors says."""
    if config.runtime.actors == "in_process":
        return InProcessActors(config, problem, host_clients)
    return RayActors(config, problem, host_clients)


class RayActors(Actors):
    """Ray actors: the hosts in one placement group (raysim.runtime.placement), each actor named in Ray's dashboard
    after the run's crew (`raysim-3fa2c1/host-0`, `.../coordinator`)."""

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        super().__init__(config, problem, host_clients)
        self.replacements: dict[str, int] = {}
        """How many times each actor ("host 1", "coordinator") was replaced after dying."""
        self.crew_name = f"raysim-{secrets.token_hex(3)}"
        """Unique: the trials of a sweep share one Ray namespace."""
        runtime = config.runtime
        self._crew_key = crew_key(runtime, len(host_clients)) if runtime.reuse_actors else None
        parked = take(self._crew_key) if self._crew_key is not None else None
        if parked is None or not self._renewed(parked):
            self._start_crew(len(host_clients))

    def put(self, value: Any) -> Any:
        return ray.put(value)

    def get(self, refs: Any, siblings: Sequence[Any] = ()) -> Any:
        return get_all(refs, siblings)

    def wait(self, refs: list[Any], timeout_s: float) -> list[Any]:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return done

    def _start_crew(self, num_hosts: int) -> None:
        """A placement group and new actors, after ending the parked crews: their resources may be what the group
        waits for."""
        dismiss_parked()
        self.placement = HostPlacement.reserve(self.config.runtime, num_hosts)
        self.hosts = [self._start_host(index) for index in range(num_hosts)]
        self.coordinator = self._start_coordinator()

    def actor_name(self, actor: str) -> str:
        """The Ray name of `actor` ("host 2" -> `raysim-3fa2c1/host-2`, "coordinator"), with its replacement count
        when it was replaced (a dead actor's name may not be free yet)."""
        replaced = self.replacements.get(actor, 0)
        return f"{self.crew_name}/{actor.replace(' ', '-')}" + (f"-r{replaced}" if replaced else "")

    def _start_host(self, index: int) -> Any:
        runtime = self.config.runtime
        return (
            ray.remote(ClientHost)
            .options(
                name=self.actor_name(f"host {index}"),
                num_cpus=runtime.host_cpus,
                num_gpus=runtime.host_gpus,
                resources=runtime.host_resources,
                scheduling_strategy=self.placement.strategy(index),
                max_restarts=0,  # with object-store arguments Ray's own restarts are not reliable
                max_task_retries=0,  # (ray-project/ray#53727): `replace` starts a new actor instead
            )
            .remote(*self.host_arguments[index])
        )

    def _start_coordinator(self) -> Any:
        runtime = self.config.runtime
        return (
            ray.remote(Coordinator)
            .options(
                name=self.actor_name("coordinator"),
                num_cpus=runtime.coordinator_cpus,
                num_gpus=runtime.coordinator_gpus,
                resources=runtime.coordinator_resources,
                scheduling_strategy="DEFAULT",  # placed by its resources, never in a caller's placement group
                max_restarts=0,
                max_task_retries=0,
            )
            .remote(*self.coordinator_arguments)
        )

    def _renewed(self, crew: Crew) -> bool:
        """Set up a parked crew's actors for this run (runtime.reuse_actors); False, with the crew dismissed, when
        one of its actors died since."""
        self.placement, self.hosts, self.coordinator = crew.placement, crew.hosts, crew.coordinator
        renewing = [host.renew.remote(*self.host_arguments[i]) for i, host in enumerate(self.hosts)]
        renewing.append(self.coordinator.renew.remote(*self.coordinator_arguments))
        try:
            ray.get(renewing)
        except ray.exceptions.RayActorError:
            crew.dismiss()
            return False
        except BaseException:
            crew.dismiss()
            raise
        return True

    def replace(self, name: str) -> None:
        """A RecoveryError when runtime.max_restarts replacements of it are used up."""
        limit = self.config.runtime.max_restarts
        used = self.replacements.get(name, 0)
        if used >= limit:
            raise RecoveryError(
                f"{name} died and cannot be replaced: runtime.max_restarts={limit} "
                f"replacement{'s' if limit != 1 else ''} used up"
            )
        self.replacements[name] = used + 1
        if name == "coordinator":
            ray.kill(self.coordinator)
            self.coordinator = self._start_coordinator()
        else:
            index = int(name.removeprefix("host "))
            ray.kill(self.hosts[index])
            self.hosts[index] = self._start_host(index)

    def close(self, wait_s: float = 10.0, finished: bool = False) -> None:
        """Ending an actor skips Python's cleanup: hosts first remove their spilled state. Nothing to do once the
        local Ray is gone (its actors went with it; the calls would wait for it)."""
        try:
            if not ray_usable():
                return
            if self.config.runtime.state_memory_mb is not None or self.remove_state_folder is not None:
                self.wait([host.close.remote() for host in self.hosts], wait_s)
            crew = Crew(self.placement, self.hosts, self.coordinator)
            if finished and self._crew_key is not None:
                park(self._crew_key, crew)
            else:
                crew.dismiss()
        finally:
            self.forget_state_folder()


SIBLING_WAIT_S = 60.0


def get_all(refs: Any, siblings: Sequence[Any] = ()) -> Any:
    """`ray.get` of a call fanned out to the hosts; if one fails, the others' results (and `siblings`', the same
    calls' other returns) are got too before its error is raised (`_retrieve_siblings`)."""
    try:
        return ray.get(refs)
    except Exception:
        _retrieve_siblings([*(refs if isinstance(refs, list) else [refs]), *siblings])
        raise


def _retrieve_siblings(refs: list[Any], wait_s: float = SIBLING_WAIT_S) -> None:
    """Get the results of a failed fan-out's other calls, errors included, waiting up to `wait_s` for those still
    running: Ray logs every error result dropped without being got as an "Unhandled error" with its traceback, on
    the console of a study that goes on after the run (a sibling host fails the same way a little later)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # the round's error is already raised; these are its siblings
            continue


class InProcessActors(Actors):
    """The hosts and the coordinator as objects of this process, called one after another."""

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        super().__init__(config, problem, host_clients)
        threads = config.runtime.torch_threads
        self.hosts = [InProcess(ClientHost, arguments, threads) for arguments in self.host_arguments]
        self.coordinator = InProcess(Coordinator, self.coordinator_arguments, threads)

    def put(self, value: Any) -> Any:
        return Done(crossed(value))

    def get(self, refs: Any, siblings: Sequence[Any] = ()) -> Any:
        return [ref.value for ref in refs] if isinstance(refs, list) else refs.value

    def wait(self, refs: list[Any], timeout_s: float) -> list[Any]:
        return list(refs)  # every call ended when it was made

    def replace(self, name: str) -> None:
        raise RecoveryError(f"{name} cannot be replaced: runtime.actors=in_process starts no actors")

    def close(self, wait_s: float = 10.0, finished: bool = False) -> None:
        for host in self.hosts:
            host.close.remote()
        self.forget_state_folder()


@dataclass(frozen=True, eq=False)
class Done:
    """A reference to a value that is there already (an in-process call has ended when it returns)."""

    value: Any


class InProcess:
    """An object of this process called as a Ray actor is (`handle.method.remote(...)`, `.options(num_returns=2)`):
    the call runs at once, on crossed arguments, and its result crosses back (`crossed`). Its numpy runs on
    `threads` BLAS threads, as an actor's does (Ray sets OMP_NUM_THREADS for it), so that its reductions sum in the
    same order."""

    def __init__(self, cls: type, arguments: tuple, threads: int = 1):
        self.threads = threads
        with blas_threads(threads):
            self.instance = cls(*crossed(_values(arguments)))

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.instance, name), self.threads)


class _Method:
    def __init__(self, method: Any, threads: int, num_returns: int = 1):
        self.method = method
        self.threads = threads
        self.num_returns = num_returns

    def options(self, num_returns: int = 1, **_: Any) -> _Method:
        return _Method(self.method, self.threads, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = crossed((_values(args), {k: _values((v,))[0] for k, v in kwargs.items()}))
        with blas_threads(self.threads):
            result = crossed(self.method(*args, **kwargs))
        return tuple(Done(part) for part in result) if self.num_returns > 1 else Done(result)


_controllers: dict[bool, ThreadpoolController] = {}


def blas_threads(threads: int) -> Any:
    """threadpoolctl's limit to `threads` through a controller made once (listing the loaded libraries takes about
    4 ms, which every in-process call paid), made again once torch has loaded its own OpenMP."""
    torch_loaded = "torch" in sys.modules
    if torch_loaded not in _controllers:
        _controllers[torch_loaded] = ThreadpoolController()
    return _controllers[torch_loaded].limit(limits=threads)


def _values(arguments: tuple) -> tuple:
    """Arguments with each reference replaced by its value, as Ray resolves top-level references."""
    return tuple(argument.value if isinstance(argument, Done) else argument for argument in arguments)


def crossed(value: Any) -> Any:
    """`value` as it arrives on the other side of Ray's object store: pickled (cloudpickle, protocol 5, as Ray
    pickles) with its buffers out of band, read back with those buffers read-only, so that numpy arrays are
    zero-copy views that cannot be written, as Ray's are."""
    buffers: list[pickle.PickleBuffer] = []
    data = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[buffer.raw().toreadonly() for buffer in buffers])
