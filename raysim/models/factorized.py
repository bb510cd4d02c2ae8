"""A network with its matrix layers factorized at low rank, plus an optional sparse part: the inference form of
FedSLR's GKR w (Table 9, FedSLR, App. B.3.5, Table 9) and of its mixed model w + p_i.

A layer whose matrixized weight (FedSLR, eq. (2)) is W = U V^T (U: d1 x r, V^T: r x d2) runs as

- conv [o, i, kh, kw], W of (o kh) x (i kw): two convolutions (the authors' code; FedSLR, App. B.3.5),
  a (1 x kw) one from i to r channels (stride (1, s), padding (0, p)) with weights V^T.reshape(r, i, 1, kw), then a
  (kh x 1) one from r to o channels (stride (s, 1), padding (p, 0)) with U.reshape(o, kh, r).transpose to [o, r, kh, 1];
- linear [o, i]: x -> (x V) U^T;

and, with a sparse part P (the layer's entries of p_i), adds P's output computed from P's nonzeros only: a
sparse-times-dense product with the unfolded input (im2col) for a conv, with the input for a linear layer. The
output equals the dense layer with weight pi^{-1}(U V^T) + P, up to rounding.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import torch
from torch import nn

from raysim.models.spec import ParamSpec


def _csr(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix in CSR form (without torch's notice that CSR support is in beta: it is used for products only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return matrix.to_sparse_csr()


class SparseLinearPart(nn.Module):
    """x -> x P^T with P held as a sparse CSR matrix (only its nonzeros are multiplied)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = _csr(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], -1)


class SparseConvPart(nn.Module):
    """The convolution with a sparse kernel P [o, i, kh, kw], as P (o x i kh kw, CSR) times the unfolded input."""

    def __init__(self, weight: torch.Tensor, conv: nn.Conv2d):
        super().__init__()
        self.out_channels = weight.shape[0]
        if isinstance(conv.padding, str):
            raise ValueError("SparseConvPart: only convolutions with numeric padding")
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.weight = _csr(weight.reshape(weight.shape[0], -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        columns = nn.functional.unfold(x, self.kernel_size, padding=self.padding, stride=self.stride)  # [B, ikk, L]
        out_h = (height + 2 * self.padding[0] - self.kernel_size[0]) // self.stride[0] + 1
        out_w = (width + 2 * self.padding[1] - self.kernel_size[1]) // self.stride[1] + 1
        flat = columns.transpose(0, 1).reshape(columns.shape[1], -1)  # [ikk, B L]
        out = (self.weight @ flat).reshape(self.out_channels, batch, out_h * out_w).transpose(0, 1)
        return out.reshape(batch, self.out_channels, out_h, out_w)


class FactorizedConv2d(nn.Module):
    """Conv2d with weight pi^{-1}(U V^T) (+ a sparse part) as a (1 x kw) then a (kh x 1) convolution."""

    def __init__(self, conv: nn.Conv2d, left: torch.Tensor, right: torch.Tensor, sparse: torch.Tensor | None):
        super().__init__()
        if conv.groups != 1 or conv.dilation != (1, 1) or not isinstance(conv.padding, tuple):
            raise ValueError("FactorizedConv2d: only ungrouped, undilated convolutions with numeric padding")
        out, inp, kh, kw = conv.weight.shape
        rank = left.shape[1]
        (stride_h, stride_w), (pad_h, pad_w) = conv.stride, conv.padding
        self.first = nn.Conv2d(inp, rank, (1, kw), stride=(1, stride_w), padding=(0, pad_w), bias=False)
        self.second = nn.Conv2d(
            rank, out, (kh, 1), stride=(stride_h, 1), padding=(pad_h, 0), bias=conv.bias is not None
        )
        with torch.no_grad():
            self.first.weight.copy_(right.reshape(rank, inp, 1, kw))
            self.second.weight.copy_(left.reshape(out, kh, rank).permute(0, 2, 1).unsqueeze(-1))
            if conv.bias is not None and self.second.bias is not None:
                self.second.bias.copy_(conv.bias)
        self.sparse = None if sparse is None else SparseConvPart(sparse, conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.second(self.first(x))
        return out if self.sparse is None else out + self.sparse(x)


class FactorizedLinear(nn.Module):
    """Linear with weight U V^T (+ a sparse part): x -> (x V) U^T + b."""

    def __init__(self, linear: nn.Linear, left: torch.Tensor, right: torch.Tensor, sparse: torch.Tensor | None):
        super().__init__()
        self.left, self.right = nn.Parameter(left.clone()), nn.Parameter(right.clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.sparse = None if sparse is None else SparseLinearPart(sparse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(nn.functional.linear(x, self.right), self.left, self.bias)
        return out if self.sparse is None else out + self.sparse(x)


def factorized_network(
    module: nn.Module,
    spec: ParamSpec,
    params: np.ndarray,
    factors: dict[str, tuple[np.ndarray, np.ndarray]],
    sparse: np.ndarray | None = None,
) -> nn.Module:
    """A copy of `module` at the flat `params`, in eval mode, whose conv and linear layers named in `factors`
    (weight name -> (U, V^T) of its matrixized weight, as FactoredModel.factors) run factorized; with `sparse` (a
    flat vector shaped like `params`, e.g. p_i) those layers add its entries as a sparse part and every other
    parameter takes params + sparse (the mixed model w + p_i)."""
    network = copy.deepcopy(module).eval()
    total = params if sparse is None else params + sparse
    values = spec.unflatten(torch.from_numpy(np.asarray(total, np.float32)))
    with torch.no_grad():
        for name, parameter in network.named_parameters():
            parameter.copy_(values[name])
    shapes = dict(zip(spec.names, spec.shapes, strict=True))
    for name, (left, right) in factors.items():
        owner_name, _, attribute = name.rpartition(".")
        if attribute != "weight":
            raise ValueError(f"factorized_network: {name} is not a layer's weight")
        parent_name, _, child = owner_name.rpartition(".")
        parent = network.get_submodule(parent_name) if parent_name else network
        layer = getattr(parent, child)
        part = None
        if sparse is not None:
            part = torch.from_numpy(np.asarray(sparse[spec.slice(name)], np.float32)).reshape(shapes[name])
        u, vt = torch.from_numpy(np.asarray(left, np.float32)), torch.from_numpy(np.asarray(right, np.float32))
        if isinstance(layer, nn.Conv2d):
            setattr(parent, child, FactorizedConv2d(layer, u, vt, part))
        elif isinstance(layer, nn.Linear):
            setattr(parent, child, FactorizedLinear(layer, u, vt, part))
        else:
            raise ValueError(f"factorized_network: {owner_name} is a {type(layer).__name__}, not a Conv2d or Linear")
    return network.eval()
