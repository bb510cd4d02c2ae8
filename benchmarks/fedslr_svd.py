"""Seconds per round of FedSLR's server proximal step (layer-wise SVT, FedSLR, eq. (6)) for ResNet-18-GN.

    python benchmarks/fedslr_svd.py [--device cpu|cuda] [--threads N] [--repeats R]

Times `layerwise_svt` on the flat parameter vector of the CIFAR-shaped ResNet-18 with GroupNorm (21
matrices, the largest 1536 x 1536) at the paper's threshold lambda * eta_g = 1e-3, as the coordinator runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from raysim.algorithms.prox import layerwise_svt
from raysim.models.flat import FlatModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the coordinator's default is 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = FlatModel("resnet18_gn", (3, 32, 32), 10)
    flat = model.initial_parameters(0)
    layerwise_svt(flat, model.spec, args.threshold, args.device)  # warm-up (CUDA context, allocator)
    times = []
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = layerwise_svt(flat, model.spec, args.threshold, args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(
        f"resnet18_gn {model.size} params, {len(result.ranks)} matrices, device={args.device} "
        f"threads={args.threads}: median {statistics.median(times):.3f} s/round (min {min(times):.3f}, "
        f"max {max(times):.3f}, {args.repeats} repeats)"
    )


if __name__ == "__main__":
    main()
