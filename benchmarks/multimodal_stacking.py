"""Would stacking clients pay for FedAPM's multimodal models? One client at a time versus a vmapped chunk.

The vectorized executor trains a chunk of clients as one `torch.func.vmap` over their stacked parameters. The
multimodal models (raysim.models.multimodal) do not vmap as they are: their GRUs run packed
(`pack_padded_sequence`, no batching rule; an unpacked `nn.GRU` has none either) and their dropout masks come
from each client's stream. This measures the best case of a batched version before anyone builds it:

- `sequential`: `LocalTrainer.sgd`, the path these models train on (packed GRUs, dropout on);
- `vmapped`: the same steps for `--chunk` clients at once through `vmap(functional_call)`, the GRUs written as a
  step loop of torch's GRU equations (vmappable; outputs beyond a sequence's length zeroed, as run_gru's) and
  dropout off, which only flatters it: masks drawn per client would add work.

One torch thread (as each raysim host), offline substitutes, the best of `--repeats` alternating timings:

    python benchmarks/multimodal_stacking.py --chunk 8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from raysim.algorithms.requests import LocalSGD
from raysim.data.dataset import Dataset
from raysim.data.substitutes import CremaDSyntheticSettings, CrisisMMDSyntheticSettings, KUHARSyntheticSettings
from raysim.models import multimodal
from raysim.models.flat import FlatModel
from raysim.seeding import Stream, rng
from raysim.training.local import ClientData, LocalTrainer

WORKLOADS: dict[str, tuple[Callable[[int], Dataset], int]] = {
    "image_text_classifier": (lambda n: CrisisMMDSyntheticSettings(samples=n).load(1), 100),
    "har_classifier": (lambda n: KUHARSyntheticSettings(samples=n).load(1), 100),
    "mm_action_classifier": (lambda n: CremaDSyntheticSettings(samples=n).load(1), 22),
}
"""Model -> (its offline substitute, the training samples of a paper-sized client: 4,000 CrisisMMD / KU-HAR
samples over 20 clients, 2,000 Crema-D samples over 72, less the test split)."""


def gru_steps(rnn: nn.GRU, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """`run_gru` as a loop over the time steps (torch's GRU equations), which vmap can batch."""
    gates_in = nn.functional.linear(x, rnn.weight_ih_l0, rnn.bias_ih_l0)
    hidden = x.new_zeros(x.shape[0], rnn.hidden_size)
    outputs = []
    for step_in in gates_in.unbind(1):
        in_r, in_z, in_n = step_in.chunk(3, 1)
        hid_r, hid_z, hid_n = nn.functional.linear(hidden, rnn.weight_hh_l0, rnn.bias_hh_l0).chunk(3, 1)
        reset, update = torch.sigmoid(in_r + hid_r), torch.sigmoid(in_z + hid_z)
        candidate = torch.tanh(in_n + reset * hid_n)
        hidden = candidate + update * (hidden - candidate)
        outputs.append(hidden)
    stacked = torch.stack(outputs, 1)
    return stacked if lengths is None else stacked * multimodal.time_mask(lengths, stacked.shape[1], len(x))[..., None]


def measure(name: str, chunk: int, epochs: int, repeats: int) -> tuple[float, float]:
    """Seconds per client of `epochs` epochs of local SGD: (sequential, vmapped)."""
    load, samples = WORKLOADS[name]
    data = load(max(16, chunk * samples))
    model = FlatModel(name, data.modalities or (), data.num_classes)
    start = model.initial_parameters(1)
    empty = np.zeros(0, np.int64)
    clients = [
        ClientData(data.x, data.y, np.arange(i, i + 1) * samples + np.arange(samples), empty, empty)
        for i in range(chunk)
    ]
    request = LocalSGD(start=start, epochs=epochs, lr=0.01, batch_size=100)
    trainer = LocalTrainer(model)

    def sequential() -> None:
        for i, client in enumerate(clients):
            trainer.sgd(request, client, rng(1, Stream.CLIENT_TRAINING, i, 0, 0))

    packed, steps = multimodal.run_gru, epochs * -(-samples // 100)
    params = {
        key: value.expand(chunk, *value.shape).clone()
        for key, value in model.spec.unflatten(torch.from_numpy(start)).items()
    }
    x = torch.from_numpy(np.stack([data.x[c.train[:100]] for c in clients]))
    y = torch.from_numpy(np.stack([data.y[c.train[:100]] for c in clients]))
    forward = vmap(lambda p, inputs: functional_call(model.module, p, (inputs,)))

    def vmapped() -> None:
        multimodal.run_gru = gru_steps
        try:
            for _step in range(steps):
                leaves = {key: value.detach().requires_grad_(True) for key, value in params.items()}
                logits = forward(leaves, x)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                for leaf, grad in zip(leaves.values(), torch.autograd.grad(loss, tuple(leaves.values())), strict=True):
                    leaf.data.sub_(grad, alpha=0.01)
        finally:
            multimodal.run_gru = packed

    best = {sequential: float("inf"), vmapped: float("inf")}
    for _repeat in range(repeats):
        for run in best:
            began = time.perf_counter()
            run()
            best[run] = min(best[run], time.perf_counter() - began)
    return best[sequential] / chunk, best[vmapped] / chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--chunk", type=int, default=8, help="clients stacked in one vmap")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':24} {'samples':>7} {'sequential s/client':>20} {'vmapped s/client':>17} {'speed-up':>9}")
    for name in arguments.models:
        sequential, vmapped = measure(name, arguments.chunk, arguments.epochs, arguments.repeats)
        samples = WORKLOADS[name][1]
        print(f"{name:24} {samples:7d} {sequential:20.3f} {vmapped:17.3f} {sequential / vmapped:9.2f}")


if __name__ == "__main__":
    main()
