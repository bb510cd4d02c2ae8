"""Proximal operators and layer matrixization for the coordinator's proximal steps (FedSLR, eq. (2); App. A.1).

- `soft_threshold`: the prox of a*||.||_1 (FedSLR, eqs. (16)/(17)), coordinate-wise.
- `matrixize` / `dematrixize`: a parameter tensor as the matrix whose nuclear norm is penalized: linear
  [o, i] as is, conv [o, i, kh, kw] -> (o*kh) x (i*kw) ("scheme 2", FedSLR, eq. (2); a 1-D conv [o, i, k] as
  [o, i, k, 1]), and back, exactly.
- `svt`: the prox of a*||.||_* (singular value thresholding, eq. 15), returning the thresholded SVD so
  the same factorization serves the low-rank downlink (FedSLR, Alg. 1 line 3).
- `layerwise_svt`: SVT of every >= 2-D tensor of a flat parameter vector; 1-D tensors pass unchanged.

torch is imported where a function needs it: importing this module (every algorithm's process does) costs none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

import numpy as np

if TYPE_CHECKING:
    import torch

from raysim.models.spec import ParamSpec


@overload
def soft_threshold(x: np.ndarray, a: float | np.ndarray) -> np.ndarray: ...


@overload
def soft_threshold(x: torch.Tensor, a: float | torch.Tensor) -> torch.Tensor: ...


def soft_threshold(x: torch.Tensor | np.ndarray, a: float | torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """S_a(x) = sign(x) max(|x| - a, 0), elementwise (a may be a scalar or per coordinate, a >= 0)."""
    if isinstance(x, np.ndarray):
        return np.sign(x) * np.maximum(np.abs(x) - a, 0.0)
    import torch

    if isinstance(a, np.ndarray):
        raise TypeError("soft_threshold: a tensor's threshold is a number or a tensor, not a numpy array")
    return torch.sign(x) * torch.clamp(torch.abs(x) - a, min=0.0)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (d1, d2) of the matrix a tensor of `shape` becomes (>= 2-D only)."""
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) == 3:  # a 1-D conv [o, i, k], as the 2-D conv [o, i, k, 1]
        out, inp, k = shape
        return out * k, inp
    if len(shape) == 4:
        out, inp, kh, kw = shape
        return out * kh, inp * kw
    raise ValueError(f"matrixize: only 2-D (linear), 3-D and 4-D (conv) tensors have a matrix form, got shape {shape}")


def matrixize(weight: torch.Tensor) -> torch.Tensor:
    """pi(w): linear weights as they are, conv [o,i,kh,kw] -> w.swapaxes(1,2).reshape(o*kh, i*kw)."""
    rows, cols = matrix_shape(tuple(weight.shape))
    if weight.dim() == 2:
        return weight
    return weight.transpose(1, 2).reshape(rows, cols)


def dematrixize(matrix: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """pi^{-1}: the inverse of `matrixize` for a tensor of `shape`."""
    if len(shape) == 2:
        return matrix.reshape(shape)
    if len(shape) == 3:
        out, inp, k = shape
        return matrix.reshape(out, k, inp).transpose(1, 2).contiguous()
    out, inp, kh, kw = shape
    return matrix.reshape(out, kh, inp, kw).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class ThresholdedSVD:
    """X's SVD with singular values soft-thresholded: prox = U diag(s) V^T, keeping only s > 0."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.s.numel())

    def matrix(self) -> torch.Tensor:
        return (self.u * self.s) @ self.vh


def svt(matrix: torch.Tensor, threshold: float) -> ThresholdedSVD:
    """Prox_{threshold ||.||_*}(X) = U diag(max(d - threshold, 0)) V^T (FedSLR, eq. (15)), computed in float64."""
    import torch

    u, d, vh = torch.linalg.svd(matrix.to(torch.float64), full_matrices=False)
    shrunk = torch.clamp(d - threshold, min=0.0)
    keep = shrunk > 0
    return ThresholdedSVD(u[:, keep], shrunk[keep], vh[keep, :])


def factored_size(shape: tuple[int, ...], rank: int) -> int:
    """Numbers sent for a tensor at `rank`: min(dense, r (d1 + d2)) for matrices, dense for 1-D
    (FedSLR, Alg. 1 line 3)."""
    dense = int(np.prod(shape))
    if len(shape) < 2:
        return dense
    d1, d2 = matrix_shape(shape)
    return min(dense, rank * (d1 + d2))


@dataclass(frozen=True, eq=False)
class FactoredModel:
    """A flat parameter vector in the form it is sent (FedSLR, Alg. 1 line 3): every matrix layer whose factors
    U sqrt(S) (d1 x r) and sqrt(S) V^T (r x d2) are smaller than the dense matrix travels as those factors,
    everything else dense. Sender and receiver both take the parameters from `params`, so the model the
    clients rebuild is exactly the server's."""

    dense: np.ndarray
    """The dense layers' entries, concatenated in parameter order."""
    factors: dict[str, tuple[np.ndarray, np.ndarray]]
    """Per factored layer: (U sqrt(S), sqrt(S) V^T), float32."""

    @property
    def size(self) -> int:
        """Numbers sent."""
        return self.dense.size + sum(left.size + right.size for left, right in self.factors.values())

    def params(self, spec: ParamSpec) -> np.ndarray:
        """The flat float32 parameter vector (factored layers rebuilt as (U sqrt(S)) (sqrt(S) V^T))."""
        import torch

        flat = np.empty(spec.size, dtype=np.float32)
        cursor = 0
        for name, shape in zip(spec.names, spec.shapes, strict=True):
            target = spec.slice(name)
            if name in self.factors:
                left, right = self.factors[name]
                matrix = torch.from_numpy(left @ right)
                flat[target] = dematrixize(matrix, shape).reshape(-1).numpy()
            else:
                size = target.stop - target.start
                flat[target] = self.dense[cursor : cursor + size]
                cursor += size
        return flat

    @classmethod
    def of_dense(cls, flat: np.ndarray) -> FactoredModel:
        return cls(np.asarray(flat, dtype=np.float32).copy(), {})


@dataclass(frozen=True)
class LayerwiseSVT:
    params: np.ndarray
    """The prox of lambda sum_l ||W_l||_* at the input, as a flat float32 vector (= `model.params`)."""
    ranks: dict[str, int]
    """Rank of every matrixized layer after thresholding."""
    spectra: dict[str, np.ndarray]
    """Every matrixized layer's thresholded singular values (the nonzero ones, descending, float64): their sum over
    all layers is the prox's sum_l ||W_l||_*."""
    model: FactoredModel
    """The same result as it is sent: low-rank layers as the factors of this very SVD."""


def layerwise_svt(flat: np.ndarray, spec: ParamSpec, threshold: float, device: str | torch.device = "cpu"):
    """SVT at `threshold` of every matrix parameter (ndim >= 2) of `flat`; 1-D parameters are left alone.
    The SVD runs on `device`; a layer whose factors are smaller than its dense matrix keeps them."""
    import torch

    source = np.asarray(flat, dtype=np.float32)
    dense: list[np.ndarray] = []
    factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ranks: dict[str, int] = {}
    spectra: dict[str, np.ndarray] = {}
    for name, shape in zip(spec.names, spec.shapes, strict=True):
        values = source[spec.slice(name)]
        if len(shape) < 2:
            dense.append(values)
            continue
        weight = torch.from_numpy(values.reshape(shape)).to(device)
        thresholded = svt(matrixize(weight), threshold)
        ranks[name] = thresholded.rank
        spectra[name] = thresholded.s.to("cpu").numpy()
        if factored_size(shape, thresholded.rank) < int(np.prod(shape)):
            root = thresholded.s.sqrt()
            left = (thresholded.u * root).to("cpu", torch.float32).numpy()
            right = (root[:, None] * thresholded.vh).to("cpu", torch.float32).numpy()
            factors[name] = (left, right)
        else:
            matrix = dematrixize(thresholded.matrix(), shape)
            dense.append(matrix.reshape(-1).to("cpu", torch.float32).numpy())
    model = FactoredModel(np.concatenate(dense) if dense else np.zeros(0, np.float32), factors)
    return LayerwiseSVT(model.params(spec), ranks, spectra, model)


def layer_spectra(flat: np.ndarray, spec: ParamSpec) -> dict[str, np.ndarray]:
    """The singular values (descending, float64, all min(d1, d2) of them) of every matrixized layer of `flat`."""
    import torch

    values = np.asarray(flat)
    return {
        name: torch.linalg.svdvals(
            matrixize(torch.from_numpy(values[spec.slice(name)].astype(np.float64)).view(shape))
        ).numpy()
        for name, shape in zip(spec.names, spec.shapes, strict=True)
        if len(shape) >= 2
    }
