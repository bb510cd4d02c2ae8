"""The networks of the papers' experiments (FLAME, Table II; FedSLR, Sec. 6.1), registered by name (`model.name`) as any
plugin's model is: a factory (input shape, outputs) -> torch.nn.Module whose docstring's first line describes it.

A factory may carry attributes: `example` (the config sections it needs, raysim.examples.model_example) and
`personalization` (strategy -> personal module names, FedAPM, Sec. 3.4;
raysim.models.spec.personalization).

Importing this module does not import torch (the coordinator process registers the names without loading it);
each factory imports torch when it builds. Every model here is a deterministic function of its parameters
(training draws come from the per-client streams).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from raysim.examples import ExampleContext, Fragment
from raysim.models.spec import MODELS

if TYPE_CHECKING:
    import torch
    from torch import nn


def _image_input(name: str, input_shape: tuple[int, ...], smallest: int = 4) -> tuple[int, int, int]:
    """(channels, height, width), or a ValueError naming the model when the input is not an image that big."""
    if len(input_shape) != 3 or min(input_shape[1:]) < smallest:
        raise ValueError(f"model.name={name} needs image input (channels, height, width), got {input_shape}")
    return input_shape


@MODELS.register("mlr")
def mlr(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """Multinomial logistic regression (784 -> 10: 7,850 parameters, FLAME's Table II)."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), outputs))


@MODELS.register("mlp")
def mlp(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """784-128-64-10 with ReLU (109,386 parameters, the FLAME authors' code)."""
    from torch import nn

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, outputs),
    )


@MODELS.register("mlp_bn")
def mlp_bn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """784-128-64-10 with BatchNorm1d before each ReLU (109,770 parameters; FedBN's and FL-bench's BN variant)."""
    from torch import nn

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, outputs),
    )


@MODELS.register("cnn", personalization={"output": ("7", "9")})  # fc1, fc2 (FedAPM, Sec. 3.4; code layer_num=4)
def cnn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """The CIFAR-10 CNN: conv3x3(16)-pool-conv3x3(32)-pool-FC128-FC (268,650 parameters on 3x32x32)."""
    from torch import nn

    channels, height, width = _image_input("cnn", input_shape)
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


@MODELS.register("cnn_bn", personalization={"output": ("9", "11")})  # fc1, fc2
def cnn_bn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """The CIFAR-10 CNN with BatchNorm2d after each convolution (268,746 parameters on 3x32x32; FedBN's variant)."""
    from torch import nn

    channels, height, width = _image_input("cnn_bn", input_shape)
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), 128),
        nn.ReLU(),
        nn.Linear(128, outputs),
    )


def _cnn1(name: str, input_shape: tuple[int, ...], outputs: int, dropout: float) -> nn.Module:
    """CNN1 of the FLAME authors' code (FLAME, Table II), with Dropout(`dropout`) after the flatten when positive."""
    from torch import nn

    channels, height, width = _image_input(name, input_shape, smallest=10)
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 16, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *([nn.Dropout(dropout)] if dropout > 0 else []),
        nn.Linear(16 * (((height - 2) // 2 - 2) // 2) * (((width - 2) // 2 - 2) // 2), 64),
        nn.ReLU(),
        nn.Linear(64, outputs),
    )


@MODELS.register("cnn_mmnist")
def cnn_mmnist(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CNN1 of the FLAME authors' code for Medical MNIST without its dropout (206,678 parameters on 3x64x64).

    conv3x3(32, no padding)-pool-conv3x3(16)-pool-FC64-FC, deterministic (cnn_mmnist_dropout is their network)."""
    return _cnn1("cnn_mmnist", input_shape, outputs, 0.0)


@MODELS.register("cnn_mmnist_dropout")
def cnn_mmnist_dropout(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CNN1 of the FLAME authors' code for Medical MNIST, with their Dropout(0.2) before FC64 (206,678 parameters).

    Its masks come from each client's stream (raysim.models.flat), so the clients train one at a time, and their
    mini-batches cannot be replayed (their masks draw from the torch stream their DataLoader seeds come from)."""
    return _cnn1("cnn_mmnist_dropout", input_shape, outputs, 0.2)


@MODELS.register("cnn_femnist")
def cnn_femnist(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CNN2 of the FLAME authors' code for FEMNIST (214,590 parameters on 1x28x28, 62 outputs).

    conv7x7(32, padding 3)-pool-conv3x3(64, padding 1)-pool-FC."""
    from torch import nn

    channels, height, width = _image_input("cnn_femnist", input_shape)
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


@MODELS.register("linear")
def linear(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """A bias-free linear model for regression (the convex analysis of FLAME, App. B-A)."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), outputs, bias=False))


@MODELS.register("resnet18_gn")
def resnet18_gn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """torchvision's ResNet-18 with GroupNorm(2) for BatchNorm (FedSLR's model, FedSLR, Sec. 6.1).

    Inputs of at most 32 px get the CIFAR model of the authors' code: a 3x3 stem conv with stride 1, no max-pool and
    a last linear layer without bias (11,173,952 parameters for 10 classes); larger ones (Tiny-ImageNet) torchvision's
    7x7 stem and a last layer with bias, as their code builds it."""
    from torch import nn

    return _resnet18("resnet18_gn", input_shape, outputs, lambda channels: nn.GroupNorm(2, channels))


@MODELS.register("resnet18_bn")
def resnet18_bn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """resnet18_gn with torchvision's own BatchNorm2d (its running statistics carried after the parameters)."""
    from torch import nn

    return _resnet18("resnet18_bn", input_shape, outputs, nn.BatchNorm2d)


def _resnet18(
    name: str, input_shape: tuple[int, ...], outputs: int, norm_layer: Callable[[int], nn.Module]
) -> nn.Module:
    from torch import nn

    from raysim.torchvision_compat import import_torchvision

    if len(input_shape) != 3:
        raise ValueError(f"model.name={name} needs image input (channels, height, width), got {input_shape}")
    torchvision = import_torchvision()
    net = torchvision.models.resnet18(num_classes=outputs, norm_layer=norm_layer)
    channels, height, width = input_shape
    if max(height, width) <= 32:
        net.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
        net.fc = nn.Linear(net.fc.in_features, outputs, bias=False)
    elif channels != 3:
        net.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return net


@MODELS.register("resnet8x4")
def resnet8x4(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CRD's CIFAR ResNet8x4 with GroupNorm(2) for BatchNorm (AugFL's client model: 1,233,540 parameters, 100 classes).

    One basic block per stage of 64/128/256 channels (raysim.models.cifar_resnet; AugFL, Sec. VI)."""
    from raysim.models.cifar_resnet import CifarResNet

    channels, _, _ = _image_input("resnet8x4", input_shape)
    return CifarResNet(blocks=1, channels=channels, outputs=outputs)


@MODELS.register("resnet32x4")
def resnet32x4(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CRD's CIFAR ResNet32x4 with GroupNorm(2) for BatchNorm (AugFL's teacher: 7,433,860 parameters, 100 classes).

    Five basic blocks per stage of 64/128/256 channels (raysim.models.cifar_resnet; AugFL, Sec. VI)."""
    from raysim.models.cifar_resnet import CifarResNet

    channels, _, _ = _image_input("resnet32x4", input_shape)
    return CifarResNet(blocks=5, channels=channels, outputs=outputs)


@MODELS.register("resnet8x4_bn")
def resnet8x4_bn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CRD's CIFAR ResNet8x4 as the authors built it, with BatchNorm (AugFL's client model in their code)."""
    from raysim.models.cifar_resnet import CifarResNet

    channels, _, _ = _image_input("resnet8x4_bn", input_shape)
    return CifarResNet(blocks=1, channels=channels, outputs=outputs, norm="batch")


@MODELS.register("resnet32x4_bn")
def resnet32x4_bn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """CRD's CIFAR ResNet32x4 as the authors built it, with BatchNorm (AugFL's teacher in their code)."""
    from raysim.models.cifar_resnet import CifarResNet

    channels, _, _ = _image_input("resnet32x4_bn", input_shape)
    return CifarResNet(blocks=5, channels=channels, outputs=outputs, norm="batch")


def _crisismmd_example(context: ExampleContext) -> Fragment:
    """A small CrisisMMD-shaped substitute: the model needs an image and a token sequence (raysim.examples)."""
    return {"dataset": {"name": "crisismmd_synthetic", "samples": 1000}}


IMAGE_TEXT_PERSONALIZATION = {"input": ("img_proj", "text_rnn"), "output": ("classifier",)}
"""Input personalization: the image projection and the text GRU (FedAPM, Sec. 3.4; the code's layer_num=8)."""


@MODELS.register("image_text_classifier", personalization=IMAGE_TEXT_PERSONALIZATION, example=_crisismmd_example)
def image_text_classifier(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FedAPM's CrisisMMD model, code sizes: image projection + text GRU + attention fusion (545,870 parameters)."""
    from raysim.models.multimodal import ImageTextClassifier, needs_modalities

    return ImageTextClassifier(needs_modalities("image_text_classifier", input_shape, ("image", "text")), outputs)


@MODELS.register("image_text_classifier_paper", personalization=IMAGE_TEXT_PERSONALIZATION, example=_crisismmd_example)
def image_text_classifier_paper(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FedAPM's CrisisMMD model with the paper's sizes (hidden 64, 4 attention heads) instead of the code's."""
    from raysim.models.multimodal import ImageTextClassifier, needs_modalities

    modalities = needs_modalities("image_text_classifier_paper", input_shape, ("image", "text"))
    return ImageTextClassifier(modalities, outputs, paper=True)


@MODELS.register(
    "har_classifier",
    personalization={
        "split_input": ("acc_conv",),  # the paper: the accelerometer encoder; the gyroscope's sees the other slice
        "split_input_code": ("acc_conv", "gyro_conv"),  # the authors' code, layer_num=12: both Conv1d encoders
        "output": ("classifier",),
    },
    example=lambda context: {"dataset": {"name": "kuhar_synthetic", "samples": 1000}},
)
def har_classifier(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FedAPM's KU-HAR model: accelerometer and gyroscope Conv1d encoders + GRUs + attention (420,814 parameters)."""
    from raysim.models.multimodal import HARClassifier, needs_modalities

    return HARClassifier(needs_modalities("har_classifier", input_shape, ("acc", "gyro")), outputs)


@MODELS.register(
    "mm_action_classifier",
    personalization={
        "input": ("audio_conv", "audio_rnn", "video_rnn"),  # FedAPM, Sec. 3.4; the code's layer_num=14
        "output": ("classifier",),
    },
    example=lambda context: {"dataset": {"name": "cremad_synthetic", "samples": 1000, "frames": 96}},
)
def mm_action_classifier(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FedAPM's Crema-D model: audio Conv1d encoder + GRU, video GRU, attention (823,338 parameters)."""
    from raysim.models.multimodal import MMActionClassifier, needs_modalities

    return MMActionClassifier(needs_modalities("mm_action_classifier", input_shape, ("audio", "video")), outputs)


def build_module(name: str, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """A freshly initialized network of the model registered as `name` (torch's default init; seed it with
    torch.random.fork_rng)."""
    return MODELS.get(name)(as_shape(input_shape), outputs)


def as_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """A sample's shape as a tuple; Modalities (a tuple with named parts, raysim.data.modalities) as they are."""
    return input_shape if isinstance(input_shape, tuple) else tuple(input_shape)


def reset_parameters(module: nn.Module) -> None:
    """Initialize every layer of `module` afresh from torch's global generator, in the order the layers were built
    (the draws of building the module)."""
    for layer in module.modules():
        reset = getattr(layer, "reset_parameters", None)
        if reset is not None:
            reset()


def carried_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a model's vector carries after its parameters: the floating-point ones (BatchNorm's running mean
    and variance); its integer batch counter is not (BatchNorm with a momentum never reads it)."""
    return [(name, buffer) for name, buffer in module.named_buffers() if buffer.is_floating_point()]


def initial_parameters(module: nn.Module, seed: int) -> torch.Tensor:
    """Re-initialize `module` from `seed` and return its parameters, then its running statistics (carried_buffers),
    as one flat float32 vector."""
    import torch

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        reset_parameters(module)
    finally:
        torch.random.set_rng_state(generator_state)
    tensors = [*module.parameters(), *(buffer for _, buffer in carried_buffers(module))]
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors]).to(torch.float32)
