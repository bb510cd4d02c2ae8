"""Where the actors of a run go on a (multi-node) Ray cluster.

Host actors share one placement group, one bundle per host, with strategy PACK (few nodes, cheap
transfers) or SPREAD (one host per node where possible: more memory and cores per host). Custom
resources (`runtime.host_resources`, `runtime.coordinator_resources`) pin hosts or the coordinator to
the nodes that offer them, e.g. the coordinator on a GPU node for a server step with large SVDs. Reserving the
group also queues concurrent sweep trials: a trial waits until the cluster can hold all its hosts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysim.config import RuntimeSettings
from raysim.errors import ConfigError


def host_bundle(runtime: RuntimeSettings) -> dict[str, float]:
    """Resources one host actor needs (the placement-group bundle)."""
    bundle = {"CPU": runtime.host_cpus, **runtime.host_resources}
    if runtime.host_gpus:
        bundle["GPU"] = runtime.host_gpus
    return bundle


def coordinator_resources(runtime: RuntimeSettings) -> dict[str, float]:
    bundle = {"CPU": runtime.coordinator_cpus, **runtime.coordinator_resources}
    if runtime.coordinator_gpus:
        bundle["GPU"] = runtime.coordinator_gpus
    return bundle


def default_num_hosts(runtime: RuntimeSettings, available: dict[str, float]) -> int:
    """As many hosts as the free CPUs hold at `host_cpus` each and, with `host_gpus`, the free GPUs (less the
    coordinator's share) at `host_gpus` each: 4 hosts on one GPU at 0.25, however many CPUs (at least 1)."""
    hosts = available.get("CPU", 1.0) / runtime.host_cpus
    if runtime.host_gpus:
        hosts = min(hosts, (available.get("GPU", 0.0) - runtime.coordinator_gpus) / runtime.host_gpus)
    return max(1, math.floor(hosts + 1e-9))


def check_capacity(runtime: RuntimeSettings, num_hosts: int, cluster: dict[str, float]) -> None:
    """Fail at once, naming the keys, when the hosts and the coordinator need more CPUs or GPUs than the whole
    cluster has (the placement group would wait forever)."""
    for resource, key, per_host, coordinator in (
        ("CPU", "runtime.host_cpus", runtime.host_cpus, runtime.coordinator_cpus),
        ("GPU", "runtime.host_gpus", runtime.host_gpus, runtime.coordinator_gpus),
    ):
        needed = num_hosts * per_host + coordinator
        if needed > cluster.get(resource, 0.0) + 1e-9:
            raise ConfigError(
                f"{num_hosts} hosts (runtime.num_hosts={runtime.num_hosts or 'default'}, at most one per client) x "
                f"{key}={per_host:g} (+ coordinator {coordinator:g}) needs "
                f"{needed:g} {resource}s but the Ray cluster has {cluster.get(resource, 0.0):g}; lower {key} "
                "(fractions allowed) or runtime.num_hosts"
            )


def check_feasible(key: str, needed: dict[str, float]) -> None:
    """Fail at once, naming the config key, when no alive node could ever hold `needed` (Ray would wait forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(all(node.get(name, 0.0) >= amount for name, amount in needed.items() if amount) for node in nodes):
        offered = sorted({name for node in nodes for name in node if not name.startswith("node:")})
        raise ConfigError(f"{key}: no node of the Ray cluster offers {needed} (resources there: {', '.join(offered)})")


@dataclass
class HostPlacement:
    """A ready placement group with one bundle per host actor."""

    group: PlacementGroup

    @classmethod
    def reserve(cls, runtime: RuntimeSettings, num_hosts: int) -> HostPlacement:
        bundle = host_bundle(runtime)
        check_feasible("runtime.host_resources", bundle)
        check_feasible("runtime.coordinator_resources", coordinator_resources(runtime))
        group = placement_group([dict(bundle) for _ in range(num_hosts)], strategy=runtime.placement.upper())
        ray.get(group.ready())
        return cls(group)

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy of host `index` (its own bundle)."""
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

    def release(self) -> None:
        remove_placement_group(self.group)
