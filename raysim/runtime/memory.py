"""Refuse, before loading, a run whose data, partition and client state will not fit in memory.

A run holds three things that grow with its settings: the dataset (`dataset.samples` of a substitute, the images of
a folder), the partition (one int64 index per sample in some client's split) and the clients' states (one per client,
kept by the hosts between rounds: three model-sized vectors for an ADMM method). Estimated from the settings alone,
before anything is loaded (`DatasetSettings.footprint`, raysim.data.footprint; one client's initial state measured),
they are compared with `runtime.memory_limit_mb` or, without it, with what the machine has available; a run past it is
refused in one line naming the setting to lower, where without the check the process would fill the machine's memory
until the kernel killed it (issue 51: 13.8 GB in 110 s for a substitute of 10^9 samples).

Two checks, because the model's size is known only once the data say its input shape: `check_data` before loading
(the data while loading, and loaded with the partition), `check_client_state` once the algorithm is built (the loaded
data's real bytes, the partition, their copy in a new local Ray's object store, and the clients' states, capped by
`runtime.state_memory_mb` where states spill to disk). Joining a Ray cluster (`runtime.address`, RAY_ADDRESS), the
hosts' states live on its nodes and only the data is checked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysim.config import ExperimentConfig, RuntimeSettings
from raysim.errors import ConfigError
from raysim.runtime.placement import default_num_hosts
from raysim.runtime.state_store import state_nbytes

MB = 2**20
PARTITION_BYTES = 8
"""The partition's cost per sample: an int64 index in one client's train, val or test split."""
MEMINFO = Path("/proc/meminfo")
CGROUPS = Path("/proc/self/cgroup")
"""This process's cgroups, one `number:controllers:path` a line (`0::path` is cgroup v2's)."""
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Budget:
    """What a run may take: bytes, and where the figure comes from (for the refusal's line)."""

    nbytes: int
    limit_mb: float | None
    """runtime.memory_limit_mb, as given; None: the machine's available memory."""
    source: str

    def exceeded(self, what: str, needed: int, lower: str | None, also: str = "") -> ConfigError:
        """The refusal, one line: `what` (ending in its verb) `needed` bytes, more than the budget; lower `lower`
        (None: nothing makes it smaller) or raise the limit, and `also`, another way out."""
        if self.limit_mb is not None:
            than = f"more than runtime.memory_limit_mb={self.limit_mb:g}"
            advice = f"lower {lower} or raise runtime.memory_limit_mb" if lower else "raise runtime.memory_limit_mb"
        else:
            than = f"more than the {megabytes(self.nbytes)} MB this machine has available ({self.source})"
            advice = f"lower {lower}" if lower else "run it on a machine with more memory"
        return ConfigError(f"{what} about {megabytes(needed)} MB, {than}; {advice}{also}")


def megabytes(nbytes: float) -> str:
    """MiB as a refusal writes them: whole and grouped (16,721), one decimal below 10 (0.7)."""
    return f"{nbytes / MB:,.0f}" if nbytes >= 10 * MB else f"{nbytes / MB:.1f}"


def available_memory(meminfo: Path = MEMINFO, cgroups: Path = CGROUPS, root: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes, where from): /proc/meminfo's MemAvailable, or the process's cgroup's limit less its usage when that
    is lower (cgroup v2 memory.max, v1 memory.limit_in_bytes, under `root`); None where neither can be read (not
    Linux)."""
    found: list[tuple[int, str]] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in _cgroup_files(cgroups, root):
        try:
            maximum, used = limit.read_text().strip(), usage.read_text().strip()
            if maximum != "max" and int(maximum) < 2**60:  # v1 writes its "no limit" as a huge number
                found.append((max(int(maximum) - int(used), 0), f"its cgroup's {limit.name} less its usage"))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _cgroup_files(cgroups: Path, root: Path) -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's memory cgroup, v2 and v1, as `cgroups` names it, under `root`: the
    cgroup's own folder, and the root's where the container mounts its cgroup there."""
    files = []
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.lstrip("/")
        if number == "0" and controllers == "":
            for base in (root, root / "unified"):
                for folder in (base / relative, base):
                    files.append((folder / "memory.max", folder / "memory.current"))
        elif "memory" in controllers.split(","):
            for folder in (root / "memory" / relative, root / "memory"):
                files.append((folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"))
    return list(dict.fromkeys(files))


def memory_budget(runtime: RuntimeSettings) -> Budget | None:
    """runtime.memory_limit_mb, else the machine's available memory; None where the machine says nothing."""
    if runtime.memory_limit_mb is not None:
        return Budget(int(runtime.memory_limit_mb * MB), runtime.memory_limit_mb, "runtime.memory_limit_mb")
    available = available_memory()
    return None if available is None else Budget(available[0], None, available[1])


def check_data(config: ExperimentConfig) -> Budget | None:
    """Before loading: the data at the peak of loading, and loaded with the partition, within the budget; refused
    in one line naming the setting that makes them smaller (`dataset.samples`). Returns the budget, for
    `check_client_state`."""
    budget = memory_budget(config.runtime)
    footprint = config.dataset.footprint()
    if budget is None or footprint is None:
        return budget
    partition = PARTITION_BYTES * (footprint.samples or 0)
    needed = max(footprint.peak, footprint.nbytes + partition)
    if needed > budget.nbytes:
        rows = f" ({footprint.samples:,} samples)" if footprint.samples else ""
        what = f"{_value(config, footprint.setting)}loading dataset {config.dataset.name}{rows} needs"
        raise budget.exceeded(what, needed, footprint.setting)
    return budget


def check_client_state(
    config: ExperimentConfig, budget: Budget | None, data_bytes: int, samples: int, one_state: Any, num_clients: int
) -> None:
    """Once the algorithm is built: the loaded data (`data_bytes`, with its copy in a new local Ray's object store),
    the partition of its `samples` and `num_clients` states the size of `one_state` (a client's initial state; at most
    what runtime.state_memory_mb lets the hosts keep) within the budget; refused naming clients.count, or the
    data's setting when the data are most of it."""
    runtime = config.runtime
    if budget is None or joins_cluster(runtime):
        return  # joining, the hosts' states and the object store are the cluster's; the data were checked already
    per_client = state_nbytes(one_state)
    states = states_in_memory(runtime, per_client, num_clients)
    data = data_in_memory(runtime, data_bytes, samples)
    if data + states <= budget.nbytes:
        return
    if states >= data:
        what = (
            f"clients.count={num_clients}: the data and {num_clients:,} clients' states ({per_client / 1024:,.0f} KB "
            f"each for {config.algorithm.name} on model {config.model.name}: {megabytes(states)} MB) need"
        )
        if runtime.state_memory_mb is not None:
            raise budget.exceeded(what, data + states, "runtime.state_memory_mb or clients.count")
        spill = " (or set runtime.state_memory_mb: the states past it spill to disk)"
        raise budget.exceeded(what, data + states, "clients.count", spill)
    footprint = config.dataset.footprint()
    setting = footprint.setting if footprint is not None else None
    what = (
        f"{_value(config, setting)}dataset {config.dataset.name} and the clients' states ({megabytes(states)} MB) need"
    )
    raise budget.exceeded(what, data + states, setting)


def joins_cluster(runtime: RuntimeSettings) -> bool:
    """The run's hosts run on a Ray cluster it joins (runtime.address, RAY_ADDRESS), not on this machine."""
    return runtime.actors == "ray" and bool(runtime.address or os.environ.get("RAY_ADDRESS"))


def states_in_memory(runtime: RuntimeSettings, per_client: int, num_clients: int) -> int:
    """The bytes of `num_clients` states of `per_client` each that the hosts keep in memory: all of them, or with
    runtime.state_memory_mb each host's budget and the one state it reads (the rest spill to disk), or with
    runtime.state_store = disk (or auto choosing it: choose_store) the chunks the hosts are training."""
    states = per_client * num_clients
    store = choose_store(runtime, states, _num_hosts(runtime, num_clients)).store  # auto: as the driver resolves it
    if store == "disk":  # the hosts hold the chunk each trains; the page cache gives back the rest
        return min(states, _num_hosts(runtime, num_clients) * runtime.vectorize_chunk * per_client)
    if runtime.state_memory_mb is None or store != "hosts":
        return states
    return min(states, _num_hosts(runtime, num_clients) * (int(runtime.state_memory_mb * MB) + per_client))


def data_in_memory(runtime: RuntimeSettings, data_bytes: int, samples: int) -> int:
    """The loaded data in the driver, its copy in a new local Ray's object store (up to runtime.object_store_mb:
    the rest spills to disk) and the partition's index per sample."""
    stored = min(data_bytes, runtime.object_store_mb * MB) if runtime.actors == "ray" else 0
    return data_bytes + stored + PARTITION_BYTES * samples


def _value(config: ExperimentConfig, setting: str | None) -> str:
    """`dataset.samples=N: ` for a setting of the dataset section, else nothing."""
    if setting is None or not setting.startswith("dataset."):
        return ""
    value = getattr(config.dataset, setting.removeprefix("dataset."), None)
    return "" if value is None else f"{setting}={value}: "


def _num_hosts(runtime: RuntimeSettings, num_clients: int) -> int:
    """The hosts the run will start (as raysim.runtime.session and placement choose them), at most one a client."""
    if runtime.num_hosts is not None:
        hosts = runtime.num_hosts
    elif runtime.actors == "in_process":
        hosts = 1
    else:
        cpus = runtime.num_cpus or len(os.sched_getaffinity(0))
        gpus = runtime.num_gpus if runtime.num_gpus is not None else (_gpus() if runtime.host_gpus else 0)
        hosts = default_num_hosts(runtime, {"CPU": float(cpus), "GPU": float(gpus)})
    return max(1, min(hosts, num_clients))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


SHARED_MEMORY = Path("/dev/shm")
SHM_HEADROOM = 0.5
"""Of /dev/shm's free bytes and of the memory the run may take (runtime.memory_limit_mb, else what the machine has
available), the share `state_store: auto` lets the columns take in memory (the rest stays for the data, Ray's object
store, which a new local Ray also puts in /dev/shm, and the processes)."""


@dataclass(frozen=True)
class StoreChoice:
    """runtime.state_store as a run resolves it: `store` (hosts, memory or disk) and, when `auto` chose otherwise
    than the user would expect, the one console line that says why (`note`)."""

    store: str
    note: str | None = None


def choose_store(
    runtime: RuntimeSettings, column_bytes: int, num_hosts: int, nodes: int = 1, shm: Path = SHARED_MEMORY
) -> StoreChoice:
    """runtime.state_store, `auto` resolved for a run whose client states take `column_bytes` as columns, on
    `num_hosts` hosts over `nodes` Ray nodes (1: every host on the driver's node): `memory` (/dev/shm, which is
    memory) when the columns fit in SHM_HEADROOM of its free bytes and of the memory the run may take
    (memory_budget) and, with runtime.state_memory_mb set, in the hosts' budgets together;
    else `disk` (the system temp folder, one line saying so). With runtime.spill_dir set, `disk` there. Hosts on
    other nodes than the driver's and no spill_dir: `hosts`, one line saying why (the store's folder must be one
    path every node sees)."""
    if runtime.state_store != "auto":
        return StoreChoice(runtime.state_store)
    if runtime.spill_dir is not None:
        return StoreChoice("disk")
    if nodes > 1:
        return StoreChoice(
            "hosts",
            f"runtime.state_store=auto: the Ray cluster has {nodes} nodes and runtime.spill_dir is unset, so each host "
            "keeps its own clients' states (hosts); set runtime.spill_dir to a folder every node shares for the "
            "shared store",
        )
    limits = [(shutil.disk_usage(shm).free if shm.is_dir() else 0, f"the {{}} MiB free in {shm}")]
    budget = memory_budget(runtime)
    if budget is not None:
        limits.append((budget.nbytes, f"the {{}} MiB of memory the run may take ({budget.source})"))
    over = [(room, what) for room, what in limits if column_bytes > SHM_HEADROOM * room]
    if runtime.state_memory_mb is not None and column_bytes > int(runtime.state_memory_mb * 2**20) * num_hosts:
        why = f"runtime.state_memory_mb={runtime.state_memory_mb:g} on {num_hosts} hosts"
    elif over:
        why = "half " + over[0][1].format(_mib(over[0][0]))
    else:
        return StoreChoice("memory")
    return StoreChoice(
        "disk",
        f"runtime.state_store=auto: the client states' columns ({_mib(column_bytes)} MiB) exceed {why}: they live "
        f"on disk in {tempfile.gettempdir()} (runtime.state_store=disk; runtime.spill_dir names the folder)",
    )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"
