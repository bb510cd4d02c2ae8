"""One run's rounds over its actors: what a round, an evaluation, a checkpoint asks of the hosts and the
coordinator (raysim.runtime.actors: Ray actors, or objects of this process).

Per round: the coordinator's broadcast goes to the hosts (through Ray's object store: one copy); each host
runs its selected clients and sends the exact sum of their uploads straight to the coordinator, only
per-client records come back to the driver; the coordinator runs the server step. The hosts' and the coordinator's
settings reach them `carry`-ed: each actor imports the run's plugins before it unpickles them.
"""

from __future__ import annotations

import io
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from raysim.config import ExperimentConfig
from raysim.errors import RaysimError
from raysim.evaluation.columns import evaluation_table, round_records
from raysim.evaluation.summaries import mean_client_metrics
from raysim.runtime import checkpoint
from raysim.runtime.actors import Actors, RecoveryError, start_actors
from raysim.runtime.problem import Problem, sample_clients

__all__ = ["NoUsableUpload", "RecoveryError", "Simulation"]


class NoUsableUpload(RaysimError):
    """Every selected client's upload was dropped for too many rounds in a row (runtime.max_empty_rounds)."""


class Simulation:
    """The actors of one run and the round loop over them."""

    def __init__(self, config: ExperimentConfig, problem: Problem, host_clients: list[list[int]]):
        """`host_clients`: the clients each host owns (`host_layout`)."""
        self.config = config
        self.uplink_total: float = 0
        self.downlink_total: float = 0
        self.empty_rounds = 0
        """Consecutive rounds in which every selected upload was dropped (runtime.on_nonfinite = drop_client)."""
        self.broadcast_model: Any = None
        """The global model as the last round started (before its server step)."""
        self.host_clients = host_clients
        self.model_size = problem.init_params.size
        """Parameters of the model (the size of a client's saved model but for a personalized network's)."""
        self.shared = config.runtime.state_store != "hosts"
        """Client state in one store every host reads and writes: a round's clients are dealt (`deal`)."""
        self.costs = {info.id: info.num_train for info, _ in problem.clients}
        """A client step's expected cost, in units of one sample's training (the model's cost is the same for all)."""
        owner = {client: index for index, owned in enumerate(host_clients) for client in owned}
        self.pinned = {client: owner[client] for client in problem.malicious if client in owner}
        """Clients that always train on the host that owns them: an attacker keeps the messages it sent."""
        self.actors: Actors = start_actors(config, problem, host_clients)
        self.chunk = self.actors.get(self.hosts[0].clients_at_once.remote()) if self.shared else 1
        """The clients a host's executor steps at once (the same on every host): the group `deal` deals."""

    @property
    def hosts(self) -> list[Any]:
        return self.actors.hosts

    @property
    def coordinator(self) -> Any:
        return self.actors.coordinator

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
        partials, record_refs, busy_refs = [], [], []
        if self.shared:
            dealt = deal(sorted(selected), self.costs, len(self.hosts), self.pinned, self.chunk)
        else:
            dealt = [[c for c in owned if c in selected] for owned in self.host_clients]
        self.dealt = dealt
        """Each host's clients of the last round."""
        for host, chosen in zip(self.hosts, dealt, strict=True):
            if chosen:
                partial, records = host.train.options(num_returns=2).remote(round_index, chosen, broadcast)
                partials.append(partial)
                record_refs.append(records)
                busy_refs.append(host.last_train_seconds.remote())  # an actor runs its calls in order
        records = round_records(self.actors.get(record_refs, siblings=[*partials, *busy_refs]))
        busy = self.actors.get(busy_refs)
        self.dropped = records.filter(records["dropped"])["client_id"].to_pylist()
        self._check_usable(round_index, len(selected))
        trained = time.perf_counter()
        if self.config.tracking.gm_scored == "before_aggregation":  # the global model before the server step
            self.broadcast_model = self.coordinator.global_model.remote()
        server_metrics = self.actors.get(self.coordinator.aggregate.remote(*partials))
        aggregated = time.perf_counter()
        return {
            **self._communication(records, self.actors.get(downlink), len(selected)),
            **mean_client_metrics(records),
            **{f"server/{k}": v for k, v in server_metrics.items()},
            "round/selected_clients": float(len(selected)),
            **({"round/dropped_clients": float(len(self.dropped))} if self.dropped else {}),
            **self._state_memory(),
            "time/clients": trained - start,
            "time/hosts_busy_max": max(busy, default=0.0),
            "time/hosts_busy_balanced": sum(busy) / len(self.hosts),
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
        """The hosts' state/* counts summed (runtime.state_memory_mb set: how many client states spilled; a shared
        store: clients written and its files' bytes on disk)."""
        if self.config.runtime.state_memory_mb is None and not self.shared:
            return {}
        totals: dict[str, float] = {}
        hosts = self.hosts[:1] if self.shared else self.hosts  # a shared store's counts are every host's
        for counts in self.actors.get([host.state_memory.remote() for host in hosts]):
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
        return evaluation_table(self.actors.get([host.evaluate.remote(global_params, context) for host in self.hosts]))

    def _scored_global(self) -> tuple[Any, Any]:
        """The global model an evaluation scores (see `evaluate`) and the coordinator's evaluation context."""
        global_params = self.coordinator.global_model.remote()
        if self.config.tracking.gm_scored == "before_aggregation" and self.broadcast_model is not None:
            global_params = self.broadcast_model
        return global_params, self.coordinator.evaluation_context.remote()

    def personalized_models(
        self, block_bytes: int = 32 * 2**20, node: str | None = None, scratch: Path | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(client ids, float32 rows) blocks of every client in id order, about `block_bytes` each: the model the
        last evaluation scored each client with (ClientHost.personalized_models); the driver holds one block, never
        clients x parameters x 4 bytes. A host on the driver's `node` (default: this process's Ray node; None
        without Ray, as an in-process host reports) writes all its rows to a file in a scratch folder (made under
        `scratch`, default the system's temporary folder; removed at the end) that the driver reads the blocks from:
        through Ray's object store each block's shared pages counted in both the host's and the driver's RSS, 0.5 GB
        of a FLAME run's peak (issue 49). A host on another node (or that cannot see the folder) is asked a block of
        ids at a time."""
        global_params, context = self._scored_global()
        here = _node_id() if node is None else node
        nodes = self.actors.get([host.node_id.remote() for host in self.hosts])
        folder = Path(tempfile.mkdtemp(prefix="raysim-models-", dir=scratch))
        try:
            local = [index for index, host_node in enumerate(nodes) if host_node == here]
            written = self.actors.get(
                [
                    self.hosts[index].write_personalized_models.remote(
                        global_params, context, str(folder / f"host-{index}.rows")
                    )
                    for index in local
                ]
            )
            parts = {index: part for index, part in zip(local, written, strict=True) if part is not None}
            files = {index: (folder / f"host-{index}.rows").open("rb") for index in parts}
            try:
                yield from self._model_blocks(block_bytes, global_params, context, parts, files)
            finally:
                for rows_file in files.values():
                    rows_file.close()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _model_blocks(
        self,
        block_bytes: int,
        global_params: Any,
        context: Any,
        parts: dict[int, tuple[np.ndarray, int]],
        files: dict[int, io.BufferedReader],
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The blocks of `personalized_models`: the rows of the hosts in `parts` ((client ids, row width) of the
        rows each wrote to its file in `files`) read from the files, the other hosts' asked for."""
        owner = {client: index for index, owned in enumerate(self.host_clients) for client in owned}
        place = {
            int(client): (index, position) for index, (ids, _) in parts.items() for position, client in enumerate(ids)
        }
        widths = {index: width for index, (_, width) in parts.items()}
        ordered = sorted(owner)
        step = max(1, block_bytes // max(1, 4 * self.model_size))
        for begin in range(0, len(ordered), step):
            asked: dict[int, list[int]] = {}
            read: list[int] = []
            for client in ordered[begin : begin + step]:
                if owner[client] in parts:
                    if client in place:  # a client without a saved row (FedCP's held-out) is not in its host's file
                        read.append(client)
                else:
                    asked.setdefault(owner[client], []).append(client)
            replies = self.actors.get(
                [
                    self.hosts[index].personalized_models.remote(global_params, context, ids)
                    for index, ids in asked.items()
                ]
            )
            parts_read = [_read_rows(files, widths, [place[client] for client in read], read)] if read else []
            if not replies:  # read in id order
                width = next(iter(widths.values()), self.model_size)
                yield parts_read[0] if read else (np.zeros(0, np.int64), np.zeros((0, width), np.float32))
                continue
            ids = np.concatenate([host_ids for host_ids, _ in replies + parts_read])
            order = np.argsort(ids, kind="stable")
            block = ids[order], np.concatenate([rows for _, rows in replies + parts_read])[order]
            del replies, parts_read  # the hosts' replies (views of the object store) go before the block is written
            yield block

    def client_states(self) -> dict[int, object]:
        parts = self.actors.get([host.client_states.remote() for host in self.hosts])
        return {client: state for states in parts for client, state in states.items()}

    def server_state(self) -> object:
        return self.actors.get(self.coordinator.server_state.remote())

    def global_model(self) -> object:
        """The algorithm's global model (GM) now, whatever its server state holds."""
        return self.actors.get(self.coordinator.global_model.remote())

    def evaluation_context(self) -> object:
        """What evaluation needs of the server state besides the global model (Algorithm.evaluation_context)."""
        return self.actors.get(self.coordinator.evaluation_context.remote())

    def save_checkpoint(self, directory: Path) -> None:
        """Every host writes its own clients' file in parallel; the coordinator writes the server state. A write
        that failed is a CheckpointError with its line."""
        snapshot = str(directory) if self.shared else None  # host 0 writes the shared store's snapshot
        failures = self.actors.get(
            [
                host.save_checkpoint.remote(str(directory / f"host-{i}.npz"), snapshot if i == 0 else None)
                for i, host in enumerate(self.hosts)
            ]
            + [self.coordinator.save_checkpoint.remote(str(directory / "coordinator.npz"))]
        )
        failed = [failure for failure in failures if failure is not None]
        if failed:
            raise checkpoint.CheckpointError(failed[0])

    def restore_checkpoint(self, directory: Path) -> None:
        """Load a checkpoint into every actor, replacing those that died (`Actors.replace`) and waiting up to
        runtime.restore_timeout_s for them; a RecoveryError names those that did not come back."""
        wait_s = self.config.runtime.restore_timeout_s
        names = [f"host {i}" for i in range(len(self.hosts))] + ["coordinator"]

        def restore(name: str) -> Any:
            if name == "coordinator":
                return self.coordinator.restore_checkpoint.remote(str(directory / "coordinator.npz"))
            return self.hosts[int(name.removeprefix("host "))].restore_checkpoint.remote(str(directory))

        pending = {name: restore(name) for name in names}
        deadline = time.monotonic() + wait_s
        while pending:
            done = self.actors.wait(list(pending.values()), 1.0)
            for name, ref in list(pending.items()):
                if ref not in done:
                    continue
                try:
                    self.actors.get(ref)
                    del pending[name]
                except ray.exceptions.RayActorError:  # dead: a new actor takes its clients and state
                    self.actors.replace(name)
                    pending[name] = restore(name)
            if pending and time.monotonic() > deadline:
                raise RecoveryError(
                    f"{', '.join(pending)} not back {wait_s:g} s after dying (a replacement actor was started; "
                    "wait longer with runtime.restore_timeout_s)"
                )
        if self.shared:  # once every host has ended what it was doing: no host writes rows while this runs
            self.actors.get(self.hosts[0].restore_states.remote(str(directory)))

    def close(self, wait_s: float = 10.0, finished: bool = False) -> None:
        """End the actors, or with runtime.reuse_actors and a `finished` run keep them for the next run."""
        self.actors.close(wait_s, finished)


GROUPS_PER_HOST = 8
"""Dealing in groups of a host's chunk size needs this many groups a host at least (else client by client): the
busiest host is then at most one group's cost over the mean, about an eighth of a host's work when costs are alike."""


def deal(
    clients: list[int], costs: dict[int, int], hosts: int, pinned: dict[int, int], chunk: int = 1
) -> list[list[int]]:
    """A round's `clients` dealt to `hosts` by expected cost (longest processing time first: each client, costliest
    first, to the host with the least cost so far; ties to the lower host, then the lower id), so that no host idles
    while another has work; the `pinned` clients go to their host first. LPT is within 4/3 of the best makespan
    (Graham 1969). Each host's clients in id order.

    With `chunk` > 1 (the hosts' executor steps that many clients at once) and at least GROUPS_PER_HOST groups a
    host, the unit dealt is a group of `chunk` clients that follow each other in that order, the chunk a host makes
    of them (ClientSteps.round_blocks): clients of equal cost (an IID split) then go to a host in runs of
    consecutive ids, whose rows in a mapped store a step reads and updates in place instead of copying them
    (raysim.runtime.state_columns; 1,000 FLAME MLP clients on one host: 0.88-1.07 CPU s a round, not 1.12-1.16).
    LPT over groups leaves the busiest host at most one group's cost over the mean."""
    loads = [0] * hosts
    dealt: list[list[int]] = [[] for _ in range(hosts)]
    free = []
    for client in clients:
        if client in pinned:
            dealt[pinned[client]].append(client)
            loads[pinned[client]] += costs[client]
        else:
            free.append(client)
    order = sorted(free, key=lambda c: (-costs[c], c))
    size = chunk if len(order) >= GROUPS_PER_HOST * hosts * chunk else 1
    runs = [order[i : i + size] for i in range(0, len(order), size)]
    groups = [(sum(costs[c] for c in run), run) for run in runs]
    for cost, group in sorted(groups, key=lambda g: -g[0]):  # stable: equal costs keep their order
        target = loads.index(min(loads))
        dealt[target].extend(group)
        loads[target] += cost
    return [sorted(chosen) for chosen in dealt]


def _node_id() -> str | None:
    """This process's Ray node (None without Ray: in-process hosts only)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _read_rows(
    files: dict[int, io.BufferedReader], widths: dict[int, int], places: list[tuple[int, int]], ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, their rows): row `position` of host `index`'s file for each (index, position) of `places`, read into
    one block (plain reads: a mapped file's pages would count in the driver's RSS)."""
    width = widths[places[0][0]]
    rows = np.empty((len(places), width), np.float32)
    for row, (index, position) in zip(rows, places, strict=True):
        rows_file = files[index]
        rows_file.seek(position * width * 4)
        if rows_file.readinto(row.data.cast("B")) != width * 4:
            raise OSError(f"{rows_file.name}: row {position} cut short")
    return np.asarray(ids, dtype=np.int64), rows
