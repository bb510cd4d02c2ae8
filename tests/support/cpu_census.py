"""The CPU seconds each test costs, whatever ran beside it: which tests to make cheaper when `make test` is slow.

`make test` on 2 cores is CPU-bound (both cores busy for the whole run), so its time is the CPU its tests use over
two; a test's wall time says little, as it stretches with whatever runs on the other worker. Its CPU seconds are
its own: each pytest worker moves itself into a cgroup of its own, and every process it starts (a `raysim`
subprocess, a local Ray's daemons and workers, a `ray start` node that detached from it) stays in that cgroup, so
the cgroup's CPU counter, read before and after a test, is what the test cost.

    RAYSIM_CPU_CENSUS=/tmp/census.jsonl make test
    .venv/bin/python -m tests.support.cpu_census /tmp/census.jsonl

tests/conftest.py records when RAYSIM_CPU_CENSUS names a file (one JSON line per test: node id, CPU seconds, wall
seconds, worker, and when it began in seconds since the epoch, to match the processes a sampler saw to their test);
this module's `main` sums it by tier and module and lists the costliest tests. It needs write access to the cgroup
file system (root, as in CI); where it has none, the run goes on and says so once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpuacct")
"""cgroup v1's CPU accounting hierarchy: cpuacct.usage, nanoseconds."""
V2 = Path("/sys/fs/cgroup")
"""cgroup v2's unified hierarchy: cpu.stat's usage_usec, microseconds."""


class Census:
    """This process's cgroup and the file each finished test's line goes to."""

    def __init__(self, out: Path, worker: str):
        self.out, self.worker = out, worker
        self.group = self._join(f"raysim-census-{os.getpid()}")
        self.started: dict[str, tuple[float, float, float]] = {}

    @staticmethod
    def _join(name: str) -> Path | None:
        """Move this process into a new cgroup `name` under its own (a parent's CPU counter includes its children's,
        so a census run inside a measured test still counts for that test); None where that cannot be done here."""
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        for root, counter, key in ((V2, "cpu.stat", ""), (V1, "cpuacct.usage", "cpuacct")):
            path = next((path for names, path in own.items() if key in names.split(",")), "/")  # v2's: "0::/..."
            parent = root / path[1:]
            if not (parent / counter).exists() and not (parent / "cgroup.controllers").exists():
                continue
            try:
                group = parent / name
                group.mkdir(exist_ok=True)
                (group / "cgroup.procs").write_text(str(os.getpid()))
                return group
            except OSError:
                continue
        print(f"cpu census: no cgroup can be made here (root needed): {name} not measured", file=sys.stderr)
        return None

    def close(self) -> None:
        """Leave the cgroup for its parent and remove it (where no process started in it is still alive)."""
        if self.group is None:
            return
        try:
            (self.group.parent / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass

    def cpu_seconds(self) -> float:
        assert self.group is not None
        usage = self.group / "cpuacct.usage"
        if usage.exists():
            return int(usage.read_text()) / 1e9
        stat = dict(line.split() for line in (self.group / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def start(self, nodeid: str) -> None:
        if self.group is not None:
            self.started[nodeid] = (self.cpu_seconds(), time.monotonic(), time.time())

    def finish(self, nodeid: str) -> None:
        if self.group is None or nodeid not in self.started:
            return
        cpu, wall, began = self.started.pop(nodeid)
        line = {
            "test": nodeid.split("@")[0],
            "cpu_s": round(self.cpu_seconds() - cpu, 2),
            "wall_s": round(time.monotonic() - wall, 2),
            "worker": self.worker,
            "began": round(began, 1),
        }
        with open(self.out, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def summary(lines: list[dict], top: int = 25) -> str:
    """CPU and wall seconds by tier and by module, and the `top` costliest tests."""
    tiers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in lines:
        module = line["test"].split("::")[0]
        for table, key in ((tiers, module.split("/")[1] if "/" in module else module), (modules, module)):
            table[key][0] += line["cpu_s"]
            table[key][1] += line["wall_s"]
    total = sum(cpu for cpu, _ in tiers.values())
    out = [f"{len(lines)} tests, {total:,.0f} CPU seconds (two cores: at least {total / 2 / 60:.1f} minutes)", ""]
    out += ["  CPU s   wall s  tier"] + [f"{c:7.0f} {w:8.0f}  {t}" for t, (c, w) in sorted(tiers.items())]
    out += ["", "  CPU s   wall s  module (the 25 costliest)"]
    out += [f"{c:7.0f} {w:8.0f}  {m}" for m, (c, w) in sorted(modules.items(), key=lambda i: -i[1][0])[:25]]
    out += ["", f"  CPU s   wall s  test (the {top} costliest)"]
    costliest = sorted(lines, key=lambda line: -line["cpu_s"])[:top]
    out += [f"{line['cpu_s']:7.1f} {line['wall_s']:8.1f}  {line['test']}" for line in costliest]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        raise SystemExit("usage: python -m tests.support.cpu_census CENSUS_JSONL (RAYSIM_CPU_CENSUS of a test run)")
    print(summary([json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line.strip()]))


if __name__ == "__main__":
    main(sys.argv[1:])
