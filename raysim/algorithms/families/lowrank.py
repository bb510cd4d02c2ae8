"""The low-rank family: a global model kept low-rank (plus sparse) by a proximal step on the server, singular value
thresholding of each weight matrix (FedSLR, eq. (6)), with the broadcast and upload it takes; FedSLR and its
ablations (GPGD, LPGD).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from raysim.algorithms.interface import Upload
from raysim.algorithms.prox import (
    FactoredModel,
    LayerwiseSVT,
    factored_size,
    layer_spectra,
    layerwise_svt,
    matrix_shape,
)
from raysim.algorithms.requests import Number, Vector
from raysim.models.spec import ParamSpec


@dataclass(frozen=True, eq=False)
class LowRankBroadcast:
    model: FactoredModel
    """The GKR w_t, factored where that is smaller; clients rebuild it with `model.params`."""
    ranks: dict[str, int]
    """Per-layer rank of w (for the mixed model's parameter count)."""


@dataclass
class LowRankUpload(Upload):
    w: Vector
    count: Number = 1.0
    """1 per client (one per row of a chunk's stacked upload: GPGD stacks), so that a robust aggregate replacing the
    sum of w_i is still divided correctly."""

    message_field = "w"
    weight_field = "count"


@dataclass(frozen=True)
class LowRankProx:
    """FedSLR's server prox (FedSLR, eq. (6), Alg. 2; Alg. 1 line 3; Table 2): layer-wise SVT of the aggregate, whose
    factors are the next downlink, and what it logs (ranks, parameter count, SVD time). GPGD's server is the same
    prox of a plain mean (FedSLR, App. A.2, eq. (21))."""

    params: ParamSpec
    svd_device: str
    """auto, cpu or cuda (the settings' `svd_device`)."""

    def full_ranks(self) -> dict[str, int]:
        layers = zip(self.params.names, self.params.shapes, strict=True)
        return {name: min(matrix_shape(shape)) for name, shape in layers if len(shape) > 1}

    def parameter_count(self, ranks: dict[str, int]) -> int:
        """#params of a low-rank model (FedSLR, Table 2): min(d1 d2, r (d1 + d2)) per matrix plus the 1-D ones."""
        layers = zip(self.params.names, self.params.shapes, strict=True)
        return sum(factored_size(shape, ranks.get(name, 0)) for name, shape in layers)

    def device(self) -> str:
        import torch  # the server step's SVD runs in torch (only this coordinator imports it)

        if self.svd_device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.svd_device == "cuda" and not torch.cuda.is_available():
            raise ValueError("algorithm.svd_device: cuda requested but the coordinator has no GPU; use auto or cpu")
        return self.svd_device

    def __call__(self, before: np.ndarray, threshold: float, previous: Vector) -> tuple[LayerwiseSVT, dict[str, float]]:
        """Prox_{threshold sum_l ||W_l||_*}(before) and the server metrics (`previous`: the current global model)."""
        start = time.perf_counter()
        prox = layerwise_svt(before, self.params, threshold, self.device())
        seconds = time.perf_counter() - start
        full = self.full_ranks()
        metrics = {
            "global_change": float(np.linalg.norm(prox.params - previous)),
            "svd_seconds": seconds,
            "rank_fraction": sum(prox.ranks.values()) / max(sum(full.values()), 1),
            "global_params": float(self.parameter_count(prox.ranks)),
            "nuclear_norm": float(sum(values.sum() for values in prox.spectra.values())),  # sum_l ||W_l||_*, R/lambda
            **{f"rank/{name}": float(rank) for name, rank in prox.ranks.items()},
        }
        return prox, metrics

    def spectra_table(self, global_params: Vector) -> dict[str, dict[str, list]]:
        """`spectra`: every singular value of every matrixized layer of the global model (beyond the
        paper's per-layer ranks), computed afresh from the flat vector, as rows (layer, index, singular_value),
        largest first per layer."""
        columns: dict[str, list] = {"layer": [], "index": [], "singular_value": []}
        for name, values in layer_spectra(global_params, self.params).items():
            columns["layer"] += [name] * len(values)
            columns["index"] += list(range(len(values)))
            columns["singular_value"] += [float(v) for v in values]
        return {"spectra": columns}
