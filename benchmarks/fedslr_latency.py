"""Inference latency of FedSLR's global model, dense against factorized (FedSLR, App. B.3.5, Table 9), side by side.

    python benchmarks/fedslr_latency.py [--device cpu|cuda] [--threads N] [--batch 20] [--repeats R]
                                        [--rank-fractions 1 0.5 0.25 0.1] [--p-density 0.1] [--classes 10]
    python benchmarks/fedslr_latency.py --run RUN_ID [--tracking-uri URI] [--input-shape 3 32 32] [--device ...]

With --run, the GKR timed is a finished FedSLR run's final global model (its `global_model` artifact) at the ranks
its server logged last (raysim.studies.latency): Table 9 measured on a trained GKR. Without it:

ResNet-18-GN on CIFAR-shaped input (3 x 32 x 32). For each rank fraction f, every conv and linear layer of the
initial weights is cut to its top r = ceil(f min(d1, d2)) singular values (the GKR at a larger lambda keeps fewer:
an n x n layer at rank f n costs 2 f n^2 numbers, so Table 3's 5.54M of 11.17M at lambda = 1e-4 is about
f = 0.25); a layer whose factors U sqrt(S), sqrt(S) V^T are smaller than its dense matrix is factored, as the
downlink (FedSLR, Alg. 1 line 3). The rows time, on the same batches, alternating:

- `dense`: the network with the low-rank weights multiplied out (what the dense model costs at any rank);
- `factorized`: the factored layers as two convolutions (1 x kw then kh x 1) or two linear maps (Table 9's GKR);
- `factorized + sparse`: the mixed model w + p_i with a random p of density `--p-density` over every parameter
  (Table 4: about 10 % at mu = 1e-3), the factored layers adding p's product from its nonzeros only (CSR).

ms/batch is the median of `--repeats` timings of one batch each (after warm-up); `max |diff|` checks that the
factorized network computes the dense one's logits.
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch

from raysim.algorithms.prox import dematrixize, factored_size, matrix_shape, matrixize
from raysim.models.factorized import factorized_network
from raysim.models.flat import FlatModel
from raysim.studies.latency import timed


def truncated(model: FlatModel, fraction: float) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The initial weights with every matrix layer cut to rank ceil(fraction min(d1, d2)), and the factors of the
    layers that are smaller factored."""
    flat = model.initial_parameters(0)
    factors = {}
    for name, shape in zip(model.spec.names, model.spec.shapes, strict=True):
        if len(shape) < 2:
            continue
        matrix = matrixize(torch.from_numpy(flat[model.spec.slice(name)].astype(np.float64)).view(shape))
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        rank = max(1, math.ceil(fraction * min(matrix_shape(shape))))
        root = s[:rank].sqrt()
        left, right = u[:, :rank] * root, root[:, None] * vh[:rank]
        flat[model.spec.slice(name)] = dematrixize(left @ right, shape).reshape(-1).numpy()
        if factored_size(shape, rank) < int(np.prod(shape)):
            factors[name] = (left.float().numpy(), right.float().numpy())
    return flat, factors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--batch", type=int, default=20, help="batch size (Table 9: 20)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rank-fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--p-density", type=float, default=0.1, help="share of nonzeros of the sparse part p")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--run", help="time this finished run's trained GKR instead of synthetic rank fractions")
    parser.add_argument("--tracking-uri", help="the run's store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--input-shape", type=int, nargs="+", default=[3, 32, 32], help="a sample's shape (--run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.run:
        from raysim.studies.latency import gkr_latency, load_trained_gkr
        from raysim.tracking.mlflow_writer import resolve_tracking_uri

        gkr = load_trained_gkr(resolve_tracking_uri(args.tracking_uri), args.run)
        found = gkr_latency(gkr, tuple(args.input_shape), args.batch, args.repeats, args.device)
        print(
            f"run {args.run}: batch {args.batch}, device={args.device}, threads={args.threads}, "
            f"median of {args.repeats}"
        )
        print("| GKR params (M) | factored layers | dense ms/batch | factorized ms/batch | ratio | max |diff| |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {found.params / 1e6:.3f} | {found.factored_layers} | {found.dense_ms:.2f} | "
            f"{found.factorized_ms:.2f} | {found.factorized_ms / found.dense_ms:.2f} | {found.max_diff:.1e} |"
        )
        return
    model = FlatModel("resnet18_gn", (3, 32, 32), args.classes)
    generator = np.random.default_rng(0)
    batches = [torch.from_numpy(generator.normal(size=(args.batch, 3, 32, 32)).astype(np.float32)) for _ in range(4)]
    batches = [b.to(args.device) for b in batches]
    p = np.where(generator.random(model.size) < args.p_density, 0.01 * generator.normal(size=model.size), 0.0)
    print(
        f"resnet18_gn ({model.size:,} params), batch {args.batch}, device={args.device}, threads={args.threads}, "
        f"p density {args.p_density}, median of {args.repeats}"
    )
    header = (
        "rank fraction",
        "factored layers",
        "GKR params (M)",
        "dense ms/batch",
        "factorized ms/batch",
        "ratio",
        "factorized + sparse ms/batch",
        "ratio",
        "max |diff|",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for fraction in args.rank_fractions:
        flat, factors = truncated(model, fraction)
        ranks = {name: left.shape[1] for name, (left, _) in factors.items()}
        layers = zip(model.spec.names, model.spec.shapes, strict=True)
        params = sum(
            factored_size(shape, ranks[name]) if name in ranks else int(np.prod(shape)) for name, shape in layers
        )
        ways = {
            "dense": factorized_network(model.module, model.spec, flat, {}),
            "factorized": factorized_network(model.module, model.spec, flat, factors),
            "mixed": factorized_network(model.module, model.spec, flat, factors, sparse=p.astype(np.float32)),
        }
        ways = {name: network.to(args.device) for name, network in ways.items()}
        with torch.no_grad():
            diff = float((ways["dense"](batches[0]) - ways["factorized"](batches[0])).abs().max())
        for network in ways.values():  # warm-up
            timed(network, batches[0], args.device)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for repeat in range(args.repeats):
            for name, network in ways.items():  # alternating, so that the machine's load falls on every way alike
                times[name].append(timed(network, batches[repeat % len(batches)], args.device))
        dense, factored, mixed = (statistics.median(times[name]) for name in ("dense", "factorized", "mixed"))
        print(
            f"| {fraction:g} | {len(factors)} | {params / 1e6:.2f} | {dense:.1f} | {factored:.1f} | "
            f"{factored / dense:.2f} | {mixed:.1f} | {mixed / dense:.2f} | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
