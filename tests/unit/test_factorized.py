"""The factorized inference form of FedSLR's GKR and mixed model (raysim.models.factorized, fedslr.md B.3.5):
where the low-rank factorization is exact, the factorized network's output is the dense network's."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from raysim.algorithms.prox import layerwise_svt
from raysim.models.factorized import factorized_network
from raysim.models.flat import param_spec


class Small(nn.Module):
    """A 3x3 conv with stride 2 and padding 1, a 1x1 conv with stride 2 (ResNet's shortcut), a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.shortcut = nn.Conv2d(8, 6, 1, stride=2, bias=False)
        self.head = nn.Linear(6 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.shortcut(torch.relu(self.conv(x)))).flatten(1))


def test_factorized_network_equals_the_dense_one_when_the_factorization_is_exact():
    """Low-rank weights (conv 24 x 9 at rank 2, shortcut 6 x 8 at rank 1, head 5 x 54 at rank 2) thresholded just
    above float32 rounding keep their rank: the (1 x kw)(kh x 1) convolutions and x V U^T reproduce the dense outputs; a
    sparse p on top (the mixed model) adds its own exact part."""
    torch.manual_seed(0)
    module = Small().eval()
    spec = param_spec(module)
    generator = np.random.default_rng(0)
    flat = torch.nn.utils.parameters_to_vector(module.parameters()).detach().numpy().copy()
    for name, (rows, cols), rank in (
        ("conv.weight", (24, 9), 2),
        ("shortcut.weight", (6, 8), 1),
        ("head.weight", (5, 54), 2),
    ):
        matrix = generator.normal(size=(rows, rank)) @ generator.normal(size=(rank, cols))
        shape = dict(zip(spec.names, spec.shapes, strict=True))[name]
        if len(shape) == 4:
            out, inp, kh, kw = shape
            matrix = matrix.reshape(out, kh, inp, kw).swapaxes(1, 2)  # pi^{-1}, written out
        flat[spec.slice(name)] = matrix.reshape(-1)
    prox = layerwise_svt(flat, spec, 1e-3)  # above float32 rounding's singular values (~1e-6)
    assert prox.ranks == {"conv.weight": 2, "shortcut.weight": 1, "head.weight": 2}
    assert set(prox.model.factors) == set(prox.ranks)  # all three are smaller factored
    x = torch.from_numpy(generator.normal(size=(4, 3, 12, 12)).astype(np.float32))
    dense = factorized_network(module, spec, prox.params, {})
    factored = factorized_network(module, spec, prox.params, prox.model.factors)
    assert any(isinstance(m, nn.Conv2d) and m.kernel_size == (1, 3) for m in factored.modules())
    with torch.no_grad():
        expected = dense(x)
        np.testing.assert_allclose(factored(x).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
        p = np.where(generator.random(spec.size) < 0.2, generator.normal(size=spec.size), 0.0).astype(np.float32)
        mixed_dense = factorized_network(module, spec, prox.params, {}, sparse=p)(x)
        mixed = factorized_network(module, spec, prox.params, prox.model.factors, sparse=p)(x)
    np.testing.assert_allclose(mixed.numpy(), mixed_dense.numpy(), rtol=1e-4, atol=1e-4)
    assert np.abs(mixed_dense.numpy() - expected.numpy()).max() > 0.1  # p changed the outputs
