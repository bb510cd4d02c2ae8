"""Local SGD of many clients: one at a time (LocalTrainer) versus together (VectorizedTrainer).

Fashion-MNIST shapes (1x28x28 inputs, 10 classes) on random data, clients holding disjoint random
samples, one torch thread; prints the best of `--repeats` alternating timings of each path and their ratio:

    python benchmarks/vectorized_training.py --clients 100 --samples 600 --batch-size 100

`--device cuda` trains the vectorized path on the GPU (one at a time stays on the CPU, as a host without a
GPU share runs it); it needs numpy, torch and pydantic only, no Ray or MLflow, e.g. on a GPU machine:

    python benchmarks/vectorized_training.py --models mlp cnn --clients 1000 --samples 60 --chunk 250 --device cuda
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from raysim.algorithms.requests import LocalSGD
from raysim.algorithms.terms import Prox
from raysim.models.flat import FlatModel
from raysim.training.local import ClientData, LocalTrainer
from raysim.training.vectorized import VectorizedTrainer


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlr", "mlp"])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--samples", type=int, default=600, help="training samples per client")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--prox", type=float, default=0.0, help="a FLAME-style prox term (0: plain FedAvg SGD)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="device of the vectorized path (cpu, cuda)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = np.random.default_rng(0)
    total = args.clients * args.samples
    x = source.normal(size=(total, 1, 28, 28)).astype(np.float32)
    y = source.integers(0, 10, total).astype(np.int64)
    owners = source.permutation(total).reshape(args.clients, args.samples)
    empty = np.array([], np.int64)
    data = [ClientData(x, y, np.sort(owned), empty, empty) for owned in owners]
    for name in args.models:
        model = FlatModel(name, (1, 28, 28), 10)
        start = model.initial_parameters(0)
        terms = (Prox(start, args.prox),) if args.prox else ()
        request = LocalSGD(start, args.epochs, 0.05, args.batch_size, momentum=args.momentum, terms=terms)
        sequential = LocalTrainer(model)
        vectorized = VectorizedTrainer(model, args.chunk, torch.device(args.device))

        def one_at_a_time(trainer=sequential, request=request):
            for i, client in enumerate(data):
                trainer.sgd(request, client, np.random.default_rng(i))

        def together(trainer=vectorized, request=request):
            trainer.sgd([(request, client, np.random.default_rng(i)) for i, client in enumerate(data)])

        one_at_a_time(), together()  # warm-up
        # Alternating, best of each: a busy machine slows both alike rather than one of them.
        timings = [(_seconds(one_at_a_time), _seconds(together)) for _ in range(args.repeats)]
        seconds_sequential, seconds_vectorized = (min(column) for column in zip(*timings, strict=True))
        print(
            f"{name}: {args.clients} clients x {args.samples} samples, batch {args.batch_size}, "
            f"{args.epochs} epoch(s), momentum {args.momentum}, prox {args.prox}, {args.threads} thread(s), "
            f"vectorized on {args.device}, chunk {args.chunk}: "
            f"sequential {seconds_sequential:.3f} s, "
            f"vectorized {seconds_vectorized:.3f} s, speed-up {seconds_sequential / seconds_vectorized:.2f}x"
        )


if __name__ == "__main__":
    main()
