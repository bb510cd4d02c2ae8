"""Table 9's inference latency measured on a trained GKR (FedSLR, App. B.3.5): a finished FedSLR (or GPGD) run's final
global model, loaded from its `global_model` artifact, factorized at the ranks the run logged last
(`server/rank/<layer>`), and timed dense against factorized (raysim.models.factorized) on the same batches.

`python benchmarks/fedslr_latency.py --run RUN_ID` prints it; without --run the benchmark cuts the initial weights
to synthetic rank fractions instead.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raysim.algorithms.prox import dematrixize, factored_size, matrixize
from raysim.errors import RaysimError

if TYPE_CHECKING:
    import torch

    from raysim.models.spec import ParamSpec


class LatencyError(RaysimError):
    """A run whose GKR cannot be timed (no saved global model, no logged ranks): one line naming what is missing."""


@dataclass(frozen=True)
class TrainedGkr:
    """A run's final global model with the ranks its server logged last."""

    module: torch.nn.Module
    spec: ParamSpec
    params: np.ndarray
    ranks: dict[str, int]
    global_params: float | None
    """The run's last `server/global_params` (FedSLR, Table 2's #params), when logged."""


def load_trained_gkr(tracking_uri: str, run_id: str) -> TrainedGkr:
    """The final GKR of run `run_id`: its global_model artifact (tracking.save_models: global or all) and its last
    `server/rank/<layer>` metrics."""
    import mlflow.pytorch
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.credentials import connect_uri
    from raysim.models.flat import param_spec

    client = MlflowClient(connect_uri(tracking_uri))
    try:
        metrics = client.get_run(run_id).data.metrics
    except MlflowException:
        raise LatencyError(f"run {run_id}: no such run in the tracking store") from None
    ranks = {key.removeprefix("server/rank/"): int(v) for key, v in metrics.items() if key.startswith("server/rank/")}
    if not ranks:
        raise LatencyError(f"run {run_id}: no server/rank/<layer> metrics (a FedSLR or GPGD run logs them)")
    mlflow.set_tracking_uri(connect_uri(tracking_uri))
    try:
        module = mlflow.pytorch.load_model(f"runs:/{run_id}/global_model").eval()
    except (MlflowException, OSError) as error:
        raise LatencyError(
            f"run {run_id}: no global_model artifact (run it with tracking.save_models: global or all; "
            f"{str(error).splitlines()[0]})"
        ) from None
    spec = param_spec(module)
    state = module.state_dict()
    params = np.concatenate([state[name].detach().cpu().numpy().reshape(-1) for name in spec.names])
    return TrainedGkr(module, spec, params.astype(np.float32), ranks, metrics.get("server/global_params"))


def factors_at_ranks(
    params: np.ndarray, spec: ParamSpec, ranks: dict[str, int]
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """`params` with every matrix layer cut to its top ranks[layer] singular values (the GKR after SVT is that
    already, up to float32 rounding), and the factors U sqrt(S), sqrt(S) V^T of the layers that are smaller factored
    (the downlink's rule, FedSLR, Alg. 1 line 3)."""
    import torch

    flat = np.array(params, dtype=np.float32)
    factors = {}
    for name, shape in zip(spec.names, spec.shapes, strict=True):
        if len(shape) < 2 or name not in ranks:
            continue
        matrix = matrixize(torch.from_numpy(flat[spec.slice(name)].astype(np.float64)).view(shape))
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        rank = min(ranks[name], len(s))
        root = s[:rank].sqrt()
        left, right = u[:, :rank] * root, root[:, None] * vh[:rank]
        flat[spec.slice(name)] = dematrixize(left @ right, shape).reshape(-1).numpy()
        if factored_size(shape, rank) < int(np.prod(shape)):
            factors[name] = (left.float().numpy(), right.float().numpy())
    return flat, factors


def parameter_count(spec: ParamSpec, ranks: dict[str, int]) -> int:
    """#params of the GKR at `ranks` (FedSLR, Table 2): min(d1 d2, r (d1 + d2)) per matrix, the 1-D ones whole."""
    return sum(
        factored_size(shape, ranks[name]) if len(shape) >= 2 and name in ranks else int(np.prod(shape))
        for name, shape in zip(spec.names, spec.shapes, strict=True)
        if name not in spec.statistics
    )


@dataclass(frozen=True)
class Latency:
    dense_ms: float
    factorized_ms: float
    factored_layers: int
    params: int
    max_diff: float
    """max |logits(dense) - logits(factorized)| on the first batch: the factorized network computes the dense one."""


def timed(network: torch.nn.Module, batch: torch.Tensor, device: str) -> float:
    """Milliseconds of one forward pass of `batch` (without gradients; on CUDA, between two synchronizations)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        network(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def gkr_latency(
    gkr: TrainedGkr, input_shape: tuple[int, ...], batch: int = 20, repeats: int = 20, device: str = "cpu"
) -> Latency:
    """Median ms per batch of `batch` random inputs, dense against factorized, timed alternately (Table 9: 20)."""
    import torch

    from raysim.models.factorized import factorized_network

    flat, factors = factors_at_ranks(gkr.params, gkr.spec, gkr.ranks)
    generator = np.random.default_rng(0)
    batches = [
        torch.from_numpy(generator.normal(size=(batch, *input_shape)).astype(np.float32)).to(device) for _ in range(4)
    ]
    ways = {
        "dense": factorized_network(gkr.module, gkr.spec, flat, {}).to(device),
        "factorized": factorized_network(gkr.module, gkr.spec, flat, factors).to(device),
    }
    with torch.no_grad():
        diff = float((ways["dense"](batches[0]) - ways["factorized"](batches[0])).abs().max())
    for network in ways.values():  # warm-up
        timed(network, batches[0], device)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for repeat in range(repeats):
        for name, network in ways.items():
            times[name].append(timed(network, batches[repeat % len(batches)], device))
    ranks = {name: gkr.ranks[name] for name in gkr.ranks if name in gkr.spec.names}
    return Latency(
        statistics.median(times["dense"]),
        statistics.median(times["factorized"]),
        len(factors),
        parameter_count(gkr.spec, ranks),
        diff,
    )
