"""The actors of one run: client hosts and the coordinator, and what one round asks of them.

Per round: the coordinator's broadcast goes to the hosts through the object store (one copy); each host
runs its selected clients and sends the exact sum of their uploads straight to the coordinator, only
per-client records come back to the driver; the coordinator runs the server step. The hosts' and the coordinator's
settings reach them `carry`-ed: each actor imports the run's plugins before it unpickles them.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from raysim.config import ExperimentConfig
from raysim.errors import RaysimError
from raysim.evaluation.columns import evaluation_table, round_records
from raysim.evaluation.summaries import mean_client_metrics
from raysim.plugins import carry
from raysim.runtime import checkpoint
from raysim.runtime.coordinator import Coordinator
from raysim.runtime.crews import Crew, crew_key, dismiss_parked, park, take
from raysim.runtime.host import ClientHost
from raysim.runtime.host_settings import HostSettings
from raysim.runtime.placement import HostPlacement
from raysim.runtime.problem import Problem, sample_clients
from raysim.runtime.session import ray_usable


class NoUsableUpload(RaysimError):
    """Every selected client's upload was dropped for too many rounds in a row (runtime.max_empty_rounds)."""


class RecoveryError(RaysimError):
    """An actor that died was not back within runtime.restore_timeout_s; the message names it."""


class Simulation:
    """The actors of one run and the round loop over them."""

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        """`host_clients`: the clients each host owns (`host_layout`)."""
        self.config = config
        self.uplink_total: float = 0
        self.downlink_total: float = 0
        self.empty_rounds = 0
        """Consecutive rounds in which every selected upload was dropped (runtime.on_nonfinite = drop_client)."""
        self.broadcast_model: ray.ObjectRef | None = None
        """The global model as the last round started (before its server step)."""
        runtime = config.runtime
        self.host_clients = host_clients
        by_id = {info.id: (info, split) for info, split in problem.clients}
        x_ref, y_ref, init_ref = ray.put(problem.x), ray.put(problem.y), ray.put(problem.init_params)
        server_ref = ray.put(problem.server_data)
        clients_refs = [ray.put([by_id[c] for c in ids]) for ids in host_clients]
        # The driver keeps every constructor argument alive: a host or coordinator that dies is replaced by a new
        # actor built from the same references (`_replace`), at most runtime.max_restarts times. Ray's own
        # restarts are off: with object-store arguments they are not reliable (ray-project/ray#53727).
        self._host_arguments = [(x_ref, y_ref, clients_ref, init_ref) for clients_ref in clients_refs]
        self._coordinator_arguments = (init_ref, server_ref)
        self._settings = HostSettings.from_config(config, problem)
        self._params, self._num_training = problem.params, problem.num_training
        self.replacements: dict[str, int] = {}
        """How many times each actor ("host 1", "coordinator") was replaced after dying."""
        self.crew_name = f"raysim-{secrets.token_hex(3)}"
        """The actors' names in Ray's dashboard start with it (`raysim-3fa2c1/host-0`, `.../coordinator`): unique,
        since the trials of a sweep share one Ray namespace."""
        self._crew_key = crew_key(runtime, len(host_clients)) if runtime.reuse_actors else None
        parked = take(self._crew_key) if self._crew_key is not None else None
        if parked is None or not self._renewed(parked):
            self._start_crew()

    def _start_crew(self) -> None:
        """A placement group and new actors, after ending the parked crews: their resources may be what the group
        waits for."""
        dismiss_parked()
        self.placement = HostPlacement.reserve(self.config.runtime, len(self.host_clients))
        self.hosts = [self._start_host(index) for index in range(len(self.host_clients))]
        self.coordinator = self._start_coordinator()

    def _host_arguments_of(self, index: int) -> tuple:
        return (carry(self._settings), *self._host_arguments[index])

    def _coordinator_arguments_of(self) -> tuple[tuple, dict]:
        runtime, config = self.config.runtime, self.config
        init_ref, server_ref = self._coordinator_arguments
        arguments = (carry(config.algorithm), self._params, init_ref, self._num_training, runtime.torch_threads)
        keywords = {
            "robust": config.aggregation,
            "attack": config.attack,
            "server_data": server_ref,
            "deterministic": runtime.deterministic,
        }
        return arguments, keywords

    def actor_name(self, actor: str) -> str:
        """The Ray name of `actor` ("host 2" -> `raysim-3fa2c1/host-2`, "coordinator"), with its replacement count
        when it was replaced (a dead actor's name may not be free yet)."""
        replaced = self.replacements.get(actor, 0)
        return f"{self.crew_name}/{actor.replace(' ', '-')}" + (f"-r{replaced}" if replaced else "")

    def _start_host(self, index: int) -> ray.actor.ActorHandle:
        runtime = self.config.runtime
        host = (
            ray.remote(ClientHost)
            .options(
                name=self.actor_name(f"host {index}"),
                num_cpus=runtime.host_cpus,
                num_gpus=runtime.host_gpus,
                resources=runtime.host_resources,
                scheduling_strategy=self.placement.strategy(index),
                max_restarts=0,
                max_task_retries=0,
            )
            .remote(*self._host_arguments_of(index))
        )
        assert isinstance(host, ray.actor.ActorHandle)  # Ray types a started actor as its handle or its class
        return host

    def _start_coordinator(self) -> ray.actor.ActorHandle:
        runtime = self.config.runtime
        arguments, keywords = self._coordinator_arguments_of()
        coordinator = (
            ray.remote(Coordinator)
            .options(
                name=self.actor_name("coordinator"),
                num_cpus=runtime.coordinator_cpus,
                num_gpus=runtime.coordinator_gpus,
                resources=runtime.coordinator_resources,
                max_restarts=0,
                max_task_retries=0,
            )
            .remote(*arguments, **keywords)
        )
        assert isinstance(coordinator, ray.actor.ActorHandle)  # as a host's (_start_host)
        return coordinator

    def _renewed(self, crew: Crew) -> bool:
        """Set up a parked crew's actors for this run (runtime.reuse_actors); False, with the crew dismissed, when
        one of its actors died since."""
        self.placement, self.hosts, self.coordinator = crew.placement, crew.hosts, crew.coordinator
        arguments, keywords = self._coordinator_arguments_of()
        renewing = [host.renew.remote(*self._host_arguments_of(i)) for i, host in enumerate(self.hosts)]
        renewing.append(self.coordinator.renew.remote(*arguments, **keywords))
        try:
            ray.get(renewing)
        except ray.exceptions.RayActorError:
            crew.dismiss()
            return False
        except BaseException:
            crew.dismiss()
            raise
        return True

    def _replace(self, name: str) -> None:
        """Start a new actor in place of a dead one (`name`: "host 2" or "coordinator"), or raise RecoveryError
        when runtime.max_restarts replacements of it are used up."""
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

    def train_round(self, round_index: int) -> dict[str, float]:
        """One round of client steps and the server step; returns the round's metrics."""
        start = time.perf_counter()
        selected = set(
            sample_clients(
                self.config.seed,
                round_index,
                self.config.clients.training_count,
                self.config.clients.per_round_count(),
                self.config.clients.sampling,
            )
        )
        broadcast = self.coordinator.broadcast.remote()
        downlink = self.coordinator.broadcast_bytes.remote()
        partials, record_refs = [], []
        for host, owned in zip(self.hosts, self.host_clients, strict=True):
            chosen = [c for c in owned if c in selected]
            if chosen:
                partial, records = host.train.options(num_returns=2).remote(round_index, chosen, broadcast)
                partials.append(partial)
                record_refs.append(records)
        records = round_records(get_all(record_refs, siblings=partials))
        self.dropped = records.filter(records["dropped"])["client_id"].to_pylist()
        self._check_usable(round_index, len(selected))
        trained = time.perf_counter()
        if self.config.tracking.gm_scored == "before_aggregation":  # the global model before the server step
            self.broadcast_model = self.coordinator.global_model.remote()
        server_metrics = ray.get(self.coordinator.aggregate.remote(*partials))
        aggregated = time.perf_counter()
        return {
            **self._communication(records, ray.get(downlink), len(selected)),
            **mean_client_metrics(records),
            **{f"server/{k}": v for k, v in server_metrics.items()},
            "round/selected_clients": float(len(selected)),
            **({"round/dropped_clients": float(len(self.dropped))} if self.dropped else {}),
            **self._state_memory(),
            "time/clients": trained - start,
            "time/aggregation": aggregated - trained,
        }

    def _check_usable(self, round_index: int, selected: int) -> None:
        """A round whose every upload was dropped moves nothing: after runtime.max_empty_rounds of them in a
        row the run stops, as a non-finite upload stops it with on_nonfinite = stop."""
        self.empty_rounds = self.empty_rounds + 1 if len(self.dropped) == selected else 0
        limit = self.config.runtime.max_empty_rounds
        if self.empty_rounds > limit:
            raise NoUsableUpload(
                f"round {round_index}: all {selected} selected uploads were non-finite and dropped"
                + (f", {self.empty_rounds} rounds in a row" if limit else "")
            )

    def _state_memory(self) -> dict[str, float]:
        """The hosts' state/* counts summed (runtime.state_memory_mb set: how many client states spilled)."""
        if self.config.runtime.state_memory_mb is None:
            return {}
        totals: dict[str, float] = {}
        for counts in get_all([host.state_memory.remote() for host in self.hosts]):
            for key, value in counts.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def _communication(self, records: pa.Table, broadcast: int, selected: int) -> dict[str, float]:
        """Bytes sent this round (uplink: each selected client's upload; downlink: the broadcast to each selected
        client) and since the start; with a simulated network (config.network), the round's communication time:
        the broadcast's transfer, then the uploads'."""
        uploads = [float(b) for b in records["uplink_bytes"].to_pylist()]
        uplink, downlink = sum(uploads), float(broadcast) * selected
        self.uplink_total += uplink
        self.downlink_total += downlink
        network = self.config.network
        timing = {}
        if network.bandwidth_mbps is not None:
            timing["traffic/round_seconds"] = network.seconds([float(broadcast)] * selected) + network.seconds(uploads)
        return {
            "traffic/uplink_bytes": float(uplink),
            "traffic/downlink_bytes": float(downlink),
            "traffic/uplink_bytes_total": float(self.uplink_total),
            "traffic/downlink_bytes_total": float(self.downlink_total),
            **timing,
        }

    def evaluate(self) -> pa.Table:
        """Every client's scores as one table (raysim.evaluation.columns.evaluation_batch): PM, extra models and the GM,
        which is the coordinator's current global model, or with tracking.gm_scored = before_aggregation the one of
        the last round's start (the current one before any round of this process)."""
        global_params, context = self._scored_global()
        return evaluation_table(get_all([host.evaluate.remote(global_params, context) for host in self.hosts]))

    def _scored_global(self) -> tuple[ray.ObjectRef, ray.ObjectRef]:
        """The global model an evaluation scores (see `evaluate`) and the coordinator's evaluation context."""
        global_params = self.coordinator.global_model.remote()
        if self.config.tracking.gm_scored == "before_aggregation" and self.broadcast_model is not None:
            global_params = self.broadcast_model
        return global_params, self.coordinator.evaluation_context.remote()

    def personalized_models(self) -> tuple[np.ndarray, np.ndarray]:
        """(client ids, float32 rows) of every client in id order: the model the last evaluation scored it with
        (ClientHost.personalized_models). They all pass through the driver: clients x parameters x 4 bytes, filled
        into one array host by host."""
        global_params, context = self._scored_global()
        refs = [host.personalized_models.remote(global_params, context) for host in self.hosts]
        parts = get_all(refs)
        ids = np.sort(np.concatenate([host_ids for host_ids, _ in parts]))
        width = parts[0][1].shape[1] if parts else 0
        params = np.empty((len(ids), width), dtype=np.float32)
        for index, (host_ids, rows) in enumerate(parts):
            params[np.searchsorted(ids, host_ids)] = rows
            parts[index] = (host_ids, rows[:0])  # the host's rows are in `params`: drop them
        return ids, params

    def client_states(self) -> dict[int, object]:
        return {c: s for states in get_all([h.client_states.remote() for h in self.hosts]) for c, s in states.items()}

    def server_state(self) -> object:
        return ray.get(self.coordinator.server_state.remote())

    def global_model(self) -> object:
        """The algorithm's global model (GM) now, whatever its server state holds."""
        return ray.get(self.coordinator.global_model.remote())

    def save_checkpoint(self, directory: Path) -> None:
        """Every host writes its own clients' file in parallel; the coordinator writes the server state. A write
        that failed is a CheckpointError with its line."""
        failures = get_all(
            [host.save_checkpoint.remote(str(directory / f"host-{i}.npz")) for i, host in enumerate(self.hosts)]
            + [self.coordinator.save_checkpoint.remote(str(directory / "coordinator.npz"))]
        )
        failed = [failure for failure in failures if failure is not None]
        if failed:
            raise checkpoint.CheckpointError(failed[0])

    def restore_checkpoint(self, directory: Path) -> None:
        """Load a checkpoint into every actor, replacing those that died (`_replace`) and waiting up to
        runtime.restore_timeout_s for them; a RecoveryError names those that did not come back."""
        wait_s = self.config.runtime.restore_timeout_s
        names = [f"host {i}" for i in range(len(self.hosts))] + ["coordinator"]

        def restore(name: str) -> ray.ObjectRef:
            if name == "coordinator":
                return self.coordinator.restore_checkpoint.remote(str(directory / "coordinator.npz"))
            return self.hosts[int(name.removeprefix("host "))].restore_checkpoint.remote(str(directory))

        pending = {name: restore(name) for name in names}
        deadline = time.monotonic() + wait_s
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            for name, ref in list(pending.items()):
                if ref not in done:
                    continue
                try:
                    ray.get(ref)
                    del pending[name]
                except ray.exceptions.RayActorError:  # dead: a new actor takes its clients and state
                    self._replace(name)
                    pending[name] = restore(name)
            if pending and time.monotonic() > deadline:
                raise RecoveryError(
                    f"{', '.join(pending)} not back {wait_s:g} s after dying (a replacement actor was started; "
                    "wait longer with runtime.restore_timeout_s)"
                )

    def close(self, wait_s: float = 10.0, finished: bool = False) -> None:
        """End the actors, or with runtime.reuse_actors and a `finished` run park them for the next run (crews);
        hosts first remove their spilled client state (ray.kill skips Python's cleanup). Nothing to do once the
        local Ray is gone (its actors went with it; the calls would wait for it)."""
        if not ray_usable():
            return
        if self.config.runtime.state_memory_mb is not None:
            ray.wait([host.close.remote() for host in self.hosts], num_returns=len(self.hosts), timeout=wait_s)
        crew = Crew(self.placement, self.hosts, self.coordinator)
        if finished and self._crew_key is not None:
            park(self._crew_key, crew)
        else:
            crew.dismiss()


SIBLING_WAIT_S = 60.0


def get_all(refs: list[ray.ObjectRef], siblings: Sequence[ray.ObjectRef] = ()) -> list[Any]:
    """`ray.get` of a call fanned out to the hosts; if one fails, the others' results (and `siblings`', the same
    tasks' other returns) are got too before its error is raised (`_retrieve_siblings`)."""
    try:
        return ray.get(refs)
    except Exception:
        _retrieve_siblings([*refs, *siblings])
        raise


def _retrieve_siblings(refs: list[ray.ObjectRef], wait_s: float = SIBLING_WAIT_S) -> None:
    """Get the results of a failed fan-out's other tasks, errors included, waiting up to `wait_s` for those still
    running: Ray logs every error result dropped without being got as an "Unhandled error" with its traceback, on
    the console of a study that goes on after the run (a sibling host fails the same way a little later)."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in ready:
        with contextlib.suppress(Exception):  # the round's error is already raised; these are its siblings
            ray.get(ref)
