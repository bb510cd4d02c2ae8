"""Resident memory (RSS) of this process and every process it started (Ray's GCS, raylet, actors, ...).

Read from /proc (Linux), so it counts what the benchmarks and the soak script need: the memory of the
whole run, not only of the driver.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def descendants(root: int) -> list[int]:
    """`root` and every process below it (from /proc)."""
    tree, found, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, []))
    return found


def sample() -> dict[str, float]:
    """RSS in MiB of this process and all its descendants, keyed by `name[pid]`."""
    found = {}
    for pid in descendants(os.getpid()):
        try:
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            title = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, IndexError):
            continue
        found[f"{title if title.startswith('ray::') else Path(name).name or title}[{pid}]"] = rss
    return found


class PeakMemory:
    """Samples the total RSS of the process tree in a background thread; `peak_mib` is the largest total seen.

    Use as a context manager around the work to measure (sampling every `interval_s` seconds).
    """

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, sum(sample().values()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, sum(sample().values()))


def wait_for_children(limit_s: float = 10.0) -> None:
    """Give processes started by an ended run (e.g. a shut-down Ray) time to exit before the next measurement."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and _children().get(os.getpid()):
        time.sleep(0.2)
