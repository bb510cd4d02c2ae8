"""The networks of FLAME's experiments (flame.md 6.2), built for the dataset's input shape.

- `mlr`: multinomial logistic regression (784 -> 10: 7,850 parameters, Table II's count);
- `mlp`: 784-128-64-10 with ReLU (109,386 parameters, the authors' code);
- `cnn`: the CIFAR-10 CNN: conv3x3(16)-pool-conv3x3(32)-pool-FC128-FC (268,650 parameters on 3x32x32);
- `cnn_mmnist`: CNN1 of the authors' code for Medical MNIST: conv3x3(32, no pad)-pool-conv3x3(16)-pool-FC64-FC
  (206,678 parameters on 3x64x64 with 6 classes); their Dropout(0.2) before FC64 is left out, so that every
  model here is a deterministic function of its parameters (training draws come from the per-client streams);
- `cnn_femnist`: CNN2 of the authors' code for FEMNIST: conv7x7(32, pad 3)-pool-conv3x3(64, pad 1)-pool-FC
  (214,590 parameters on 1x28x28 with 62 outputs);
- `linear`: a bias-free linear model for regression (the convex analysis of flame.md 1.6);
- `resnet18_gn`: torchvision's ResNet-18 with every BatchNorm replaced by GroupNorm(2) (FedSLR's model,
  fedslr.md 6.2); inputs of at most 32 px get the CIFAR stem of the authors' code (3x3 conv, stride 1,
  no max-pool).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from raysim.models.spec import MODELS


def _cifar_cnn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), 128),
        nn.ReLU(),
        nn.Linear(128, outputs),
    )


def _mmnist_cnn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 16, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * (((height - 2) // 2 - 2) // 2) * (((width - 2) // 2 - 2) // 2), 64),
        nn.ReLU(),
        nn.Linear(64, outputs),
    )


def _femnist_cnn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, 7, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (height // 4) * (width // 4), outputs),
    )


def _resnet18_gn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    from raysim.data._torchvision import import_torchvision

    if len(input_shape) != 3:
        raise ValueError(f"model.name=resnet18_gn needs image input (channels, height, width), got {input_shape}")
    torchvision = import_torchvision()
    net = torchvision.models.resnet18(num_classes=outputs, norm_layer=lambda channels: nn.GroupNorm(2, channels))
    channels, height, width = input_shape
    if max(height, width) <= 32:
        net.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return net


def build_module(name: str, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """A freshly initialized network (torch's default init; seed it with torch.random.fork_rng)."""
    features = math.prod(input_shape)
    if name == "mlr":
        return nn.Sequential(nn.Flatten(), nn.Linear(features, outputs))
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, outputs),
        )
    if name == "cnn":
        if len(input_shape) != 3 or input_shape[1] < 4 or input_shape[2] < 4:
            raise ValueError(f"model.name=cnn needs image input (channels, height>=4, width>=4), got {input_shape}")
        return _cifar_cnn(input_shape, outputs)
    if name in ("cnn_mmnist", "cnn_femnist"):
        if len(input_shape) != 3 or min(input_shape[1:]) < (10 if name == "cnn_mmnist" else 4):
            raise ValueError(f"model.name={name} needs image input (channels, height, width), got {input_shape}")
        return (_mmnist_cnn if name == "cnn_mmnist" else _femnist_cnn)(input_shape, outputs)
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(features, outputs, bias=False))
    if name == "resnet18_gn":
        return _resnet18_gn(input_shape, outputs)
    raise ValueError(f"model.name: unknown model {name!r}; allowed: {', '.join(MODELS)}")


def reset_parameters(module: nn.Module) -> None:
    """Initialize every layer of `module` afresh from torch's global generator, in the order the layers were built
    (the draws of building the module)."""
    for layer in module.modules():
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()


def initial_parameters(module: nn.Module, seed: int) -> torch.Tensor:
    """Re-initialize `module` from `seed` and return its parameters as one flat float32 vector."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        reset_parameters(module)
    finally:
        torch.random.set_rng_state(generator_state)
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).to(torch.float32)
