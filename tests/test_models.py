"""The networks of the papers' experiments have the authors' architectures: parameter counts of FLAME's
Table II and the authors' code (flame.md 6.1-6.2), on each dataset's input shape."""

from __future__ import annotations

import pytest
import torch

from raysim.models.zoo import build_module


@pytest.mark.parametrize(
    ("name", "input_shape", "outputs", "parameters"),
    [
        ("mlr", (1, 28, 28), 10, 7_850),  # Table II's MNIST/FMNIST count
        ("mlp", (1, 28, 28), 10, 109_386),  # the authors' 784-128-64-10
        ("cnn", (3, 32, 32), 10, 268_650),  # CIFAR-10
        ("cnn_mmnist", (3, 64, 64), 6, 206_678),  # Medical MNIST at 64x64 (CNN1)
        ("cnn_femnist", (1, 28, 28), 62, 214_590),  # FEMNIST (CNN2, 62 outputs)
        ("resnet18_gn", (3, 32, 32), 10, 11_173_962),  # FedSLR's ResNet-18, GroupNorm (same affine count as BN)
    ],
)
def test_parameter_counts_match_the_papers(name, input_shape, outputs, parameters):
    module = build_module(name, input_shape, outputs)
    assert sum(p.numel() for p in module.parameters()) == parameters
    assert module(torch.zeros(2, *input_shape)).shape == (2, outputs)


def test_a_cnn_refuses_input_that_is_not_an_image():
    with pytest.raises(ValueError, match="model.name=cnn_femnist needs image input"):
        build_module("cnn_femnist", (784,), 10)
