"""What a host spends per client outside the matrix products, numpy against raysim's compiled passes, side by side.

FLAME's client algebra after the theta-step (eqs. 12, 13, the message change and the three norms it logs) and the
exact-sum encoding of the upload, for `--clients` clients of the MLP (109,386 parameters; more state than the
caches hold, as on a host):

- `numpy, one client at a time`: the equations as numpy expressions, each a pass with a fresh temporary (how
  raysim computed them before the compiled passes), and the fixed-point encoding of one upload in numpy;
- `compiled, one client at a time`: FLAME's `admm_update` on copies of one client's w_i and pi_i (its state is
  not donated), `add_rows` of one upload;
- `compiled, chunks in place`: `admm_update` on a chunk's rows written in place, `add_rows` of the chunk.

    python benchmarks/client_algebra.py [--clients 512] [--chunk 16] [--size 109386]

Prints microseconds per client and the ratios to numpy. Measured on the project's 2-core machine (glibc told to
keep freed memory, as a host does):

    512 clients of 109,386 parameters, chunks of 16
    way                              algebra us  encode us  total us  vs numpy
    numpy, one client at a time           568.3      232.9     801.2      1.00
    compiled, one client at a time        228.5       82.4     310.9      0.39
    compiled, chunks in place             148.7       58.6     207.3      0.26

The compiled passes are memory-bound: a chunk in place reads theta_i, w_i, pi_i once and writes w_i, pi_i and the
message change once (about 2.6 MB a client), where numpy made about 25 passes with fresh temporaries.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raysim.algorithms.families.consensus import DeltaUpload, admm_update, paper_message, paper_update
from raysim.runtime.exact_sum import SCALE, add_rows
from raysim.runtime.steps import keep_freed_memory


def numpy_step(theta, w_i, pi, w, lam_alpha, rho):
    """FLAME's algebra and diagnostics as numpy expressions over one client's vectors."""
    new_w, new_pi = paper_update(theta, w_i, pi, w, lam_alpha, rho)
    delta = paper_message(new_w, new_pi, rho) - paper_message(w_i, pi, rho)
    norms = np.linalg.norm(new_w - w), np.linalg.norm(new_pi - pi), np.linalg.norm(new_pi - lam_alpha * (theta - new_w))
    return new_w, new_pi, delta, norms


def numpy_encode(delta: np.ndarray, total: np.ndarray, limit: float) -> None:
    """One upload checked and rounded to fixed point in numpy, added to the integer total."""
    peak = float(np.max(np.abs(delta)))
    assert np.isfinite(peak) and peak < limit
    total += np.rint(delta.astype(np.float64) * SCALE).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--size", type=int, default=109_386, help="parameters per client (MLP 784-128-64-10)")
    args = parser.parse_args()
    keep_freed_memory()
    generator = np.random.default_rng(0)
    count, chunk, size = args.clients - args.clients % args.chunk, args.chunk, args.size
    theta, w_i, pi = (generator.standard_normal((count, size), dtype=np.float32) for _ in range(3))
    w = generator.standard_normal(size, dtype=np.float32)
    lam_alpha, rho = np.full(count, 1e-3, np.float32), np.float32(0.1)
    limit = 2.0**31 / count
    rows: list[tuple[str, float, float]] = []
    small = theta[:2, :8].copy()  # load the compiled passes (numba's first call) before timing
    delta, *_ = admm_update(small, small.copy(), small.copy(), w[:8], lam_alpha[:2], rho)
    add_rows(None, DeltaUpload(delta), [0, 1], count)

    total = np.zeros(size, np.int64)
    algebra = encode = 0.0
    for i in range(count):
        start = time.perf_counter()
        _, _, delta, _ = numpy_step(theta[i], w_i[i], pi[i], w, lam_alpha[i], rho)
        middle = time.perf_counter()
        numpy_encode(delta, total, limit)
        algebra, encode = algebra + middle - start, encode + time.perf_counter() - middle
    rows.append(("numpy, one client at a time", algebra, encode))

    partial, algebra, encode = None, 0.0, 0.0
    for i in range(count):
        start = time.perf_counter()
        new_w, new_pi = w_i[i : i + 1].copy(), pi[i : i + 1].copy()  # not donated: the step updates copies
        delta, *_ = admm_update(theta[i : i + 1], new_w, new_pi, w, lam_alpha[i : i + 1], rho)
        middle = time.perf_counter()
        partial, _ = add_rows(partial, DeltaUpload(delta), [i], count)
        algebra, encode = algebra + middle - start, encode + time.perf_counter() - middle
    rows.append(("compiled, one client at a time", algebra, encode))

    partial, algebra, encode = None, 0.0, 0.0
    for begin in range(0, count, chunk):
        part = slice(begin, begin + chunk)
        start = time.perf_counter()
        delta, *_ = admm_update(theta[part], w_i[part], pi[part], w, lam_alpha[part], rho)  # in place
        middle = time.perf_counter()
        partial, _ = add_rows(partial, DeltaUpload(delta), list(range(begin, begin + chunk)), count)
        algebra, encode = algebra + middle - start, encode + time.perf_counter() - middle
    rows.append(("compiled, chunks in place", algebra, encode))

    print(f"{count} clients of {size:,} parameters, chunks of {chunk}")
    print(f"{'way':32} {'algebra us':>10} {'encode us':>10} {'total us':>9} {'vs numpy':>9}")
    baseline = (rows[0][1] + rows[0][2]) / count
    for name, algebra, encode in rows:
        per_client = (algebra + encode) / count
        print(
            f"{name:32} {algebra / count * 1e6:10.1f} {encode / count * 1e6:10.1f} {per_client * 1e6:9.1f} "
            f"{per_client / baseline:9.2f}"
        )


if __name__ == "__main__":
    main()
