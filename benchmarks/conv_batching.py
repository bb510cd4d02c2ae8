"""Can a chunk of clients go through the CIFAR CNN together faster than one at a time on a CPU?

One SGD step's forward and backward pass of `--clients` clients, each with its own parameters and its own batch,
three ways on one torch thread (a host's share of a CPU), best of `--repeats` alternating timings:

- `one at a time`: each client's `nn.Module`, what the sequential executor runs;
- `vmap`: `torch.func.vmap(grad(functional_call))` over the stacked parameters, what the vectorized executor runs
  for conv models (raysim.training.vectorized);
- `grouped`: the clients as groups of one convolution (`groups = clients`, the clients' channels side by side) and
  their linear layers as batched matrix products, written out for the registered `cnn` (conv 3x3 16, pool, conv
  3x3 32, pool, linear 128, linear classes); its gradients are checked against one-at-a-time's first.

    python benchmarks/conv_batching.py --clients 16 --batch-size 20 50

`--profile` prints, per model and batch size, where one-at-a-time's step spends its time: torch's operators grouped
into convolutions, normalization, the rest of the forward and backward pass (torch.profiler, self CPU time).

Measured results are in docs/performance.md ("The papers' convolutional models").
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from raysim.models.zoo import build_module

SHAPE, CLASSES = (3, 32, 32), 10


def grouped_cnn_loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed per-client mean losses of the `cnn` zoo model, every client at once: `params` stacked
    [clients, ...] per layer, `x` [clients, batch, 3, 32, 32], `y` [clients, batch]."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    clients, batch = y.shape
    h = x.transpose(0, 1).reshape(batch, clients * SHAPE[0], *SHAPE[1:])
    h = F.max_pool2d(F.relu(F.conv2d(h, w1.flatten(0, 1), b1.flatten(), padding=1, groups=clients)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, w2.flatten(0, 1), b2.flatten(), padding=1, groups=clients)), 2)
    h = h.reshape(batch, clients, -1).transpose(0, 1)  # [clients, batch, features], as nn.Flatten per client
    h = F.relu(torch.baddbmm(b3.unsqueeze(1), h, w3.transpose(1, 2)))
    logits = torch.baddbmm(b4.unsqueeze(1), h, w4.transpose(1, 2))
    return F.cross_entropy(logits.reshape(clients * batch, -1), y.reshape(-1), reduction="sum") / batch


def _best(ways: dict, repeats: int) -> dict[str, float]:
    """Best time of each way, the ways alternating so that a busy machine slows them alike."""
    for run in ways.values():
        run()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for name, run in ways.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


OPERATOR_KINDS = (
    ("convolution", ("conv",)),
    ("normalization", ("norm",)),
    ("linear", ("addmm", "mm", "linear")),
    ("pooling", ("pool",)),
    ("activation", ("relu", "threshold")),
)


def time_shares(step) -> dict[str, float]:
    """The share of `step`'s self CPU time in each of OPERATOR_KINDS' operators (by name), the rest as `other`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    totals = dict.fromkeys([kind for kind, _ in OPERATOR_KINDS] + ["other"], 0.0)
    for event in profiler.key_averages():
        kind = next((k for k, words in OPERATOR_KINDS if any(w in event.key for w in words)), "other")
        totals[kind] += event.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {kind: value / whole for kind, value in totals.items()}


def measure(name: str, clients: int, batch: int, repeats: int, profile: bool = False) -> dict[str, float]:
    """Best seconds of each way for one model and batch size (`grouped` for the `cnn` only, after checking that
    its gradients are one-at-a-time's); with `profile`, also one-at-a-time's time shares (keys `share/<kind>`)."""
    modules = []
    for seed in range(clients):
        torch.manual_seed(seed)
        modules.append(build_module(name, SHAPE, CLASSES))
    names = [key for key, _ in modules[0].named_parameters()]
    stacked = tuple(torch.stack([dict(m.named_parameters())[key].detach() for m in modules]) for key in names)

    def loss(params, x, y):
        return F.cross_entropy(functional_call(modules[0], dict(zip(names, params, strict=True)), (x,)), y)

    batched_grad = vmap(grad(loss))
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(clients, batch, *SHAPE, generator=generator)
    y = torch.randint(0, CLASSES, (clients, batch), generator=generator)

    def one_at_a_time():
        for module, xi, yi in zip(modules, x, y, strict=True):
            module.zero_grad()
            F.cross_entropy(module(xi), yi).backward()

    ways = {"one at a time": one_at_a_time, "vmap": lambda: batched_grad(stacked, x, y)}
    if name == "cnn":
        leaves = [p.clone().requires_grad_() for p in stacked]
        ways["grouped"] = lambda: torch.autograd.grad(grouped_cnn_loss(leaves, x, y), leaves)
        one_at_a_time()
        for key, grouped in zip(names, ways["grouped"](), strict=True):
            expected = torch.stack([dict(m.named_parameters())[key].grad for m in modules])
            torch.testing.assert_close(grouped, expected, rtol=1e-4, atol=1e-5)
    best = _best(ways, repeats)
    if profile:
        best |= {f"share/{kind}": share for kind, share in time_shares(one_at_a_time).items()}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="clients in a chunk")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet8x4", "resnet18_gn"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also where one-at-a-time's time goes, by operator")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.clients} clients, one SGD step's forward and backward, {args.threads} torch thread(s)")
    print("| model | batch | one at a time s | vmap s | grouped s | vmap / one at a time | grouped / one at a time |")
    print("|---|---|---|---|---|---|---|")
    shares = []
    for name in args.models:
        for batch in args.batch_size:
            best = measure(name, args.clients, batch, args.repeats, args.profile)
            found = {key.removeprefix("share/"): v for key, v in best.items() if key.startswith("share/")}
            if found:
                shares.append(f"{name}, batch {batch}: " + ", ".join(f"{k} {v:.0%}" for k, v in found.items()))
            base, grouped = best["one at a time"], best.get("grouped")
            print(
                f"| {name} | {batch} | {base:.3f} | {best['vmap']:.3f} | "
                + ("- | " if grouped is None else f"{grouped:.3f} | ")
                + f"{best['vmap'] / base:.2f} | "
                + ("- |" if grouped is None else f"{grouped / base:.2f} |")
            )
    if shares:
        print("\nWhere one at a time's step spends its time (self CPU time by operator):")
        print("\n".join(shares))


if __name__ == "__main__":
    main()
