"""FLAME's update equations as one compiled pass over a memory store's rows: in the process's own memory (numpy asks
for transparent huge pages) against rows mapped from /dev/shm (huge pages only where the kernel's `shmem_enabled`
allows them), side by side in one run.

    .venv/bin/python benchmarks/huge_pages.py [--clients 1000] [--entries 109386] [--chunk 16] [--passes 3]

Prints each layout's seconds a pass (all clients, in chunks as a host steps them) and the huge-page memory it got.
"""

from __future__ import annotations

import argparse
import mmap
import tempfile
import time
from pathlib import Path

import numpy as np

from raysim.jit import kernel

FIELDS = 3
"""theta_i, w_i and pi_i."""


@kernel
def _flame_pass(theta, w, pi, lam, rho, lr):
    """The shape of FLAME's client update (w, then pi, then a theta step): reads and writes every entry once."""
    for i in range(theta.shape[0]):
        for j in range(theta.shape[1]):
            t = theta[i, j]
            w[i, j] = (lam * t + rho * w[i, j] - pi[i, j]) / (lam + rho)
            pi[i, j] = pi[i, j] + lam * (w[i, j] - t)
            theta[i, j] = t - lr * pi[i, j]


def private(clients: int, entries: int) -> list[np.ndarray]:
    return [np.full((clients, entries), 0.1, np.float32) for _ in range(FIELDS)]


def mapped(clients: int, entries: int) -> list[np.ndarray]:
    """Each field a file in /dev/shm, mapped (as raysim.runtime.state_columns maps a memory store's columns)."""
    fields = []
    for _ in range(FIELDS):
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as handle:
            handle.truncate(clients * entries * 4)
            mapping = mmap.mmap(handle.fileno(), clients * entries * 4)
        field = np.frombuffer(mapping, np.float32).reshape(clients, entries)
        field[:] = 0.1
        fields.append(field)
    return fields


def huge_pages_kb() -> int:
    """AnonHugePages of this process (kB)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def seconds_a_pass(fields: list[np.ndarray], chunk: int, passes: int) -> list[float]:
    constants = np.float32(1.0), np.float32(0.1), np.float32(0.001)
    _flame_pass(*(field[:1] for field in fields), *constants)  # compiled (or loaded) before the clock
    times = []
    for _ in range(passes):
        began = time.perf_counter()
        for start in range(0, len(fields[0]), chunk):
            _flame_pass(*(field[start : start + chunk] for field in fields), *constants)
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--entries", type=int, default=109_386, help="a client's vector (FLAME's MLP: 109,386)")
    parser.add_argument("--chunk", type=int, default=16, help="clients a step (the vectorized executor's chunk)")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.clients} clients x {args.entries} float32 x {FIELDS} fields, chunks of {args.chunk}")
    for name, build in (("private", private), ("/dev/shm", mapped), ("private", private), ("/dev/shm", mapped)):
        before = huge_pages_kb()
        fields = build(args.clients, args.entries)
        got = huge_pages_kb() - before
        times = seconds_a_pass(fields, args.chunk, args.passes)
        print(f"{name:9s} s a pass {' '.join(f'{t:.3f}' for t in times)}  huge pages {got:,} kB")
        del fields


if __name__ == "__main__":
    main()
