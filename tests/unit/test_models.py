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
        ("cnn_mmnist_dropout", (3, 64, 64), 6, 206_678),  # CNN1 with the authors' Dropout(0.2): no parameters
        ("cnn_femnist", (1, 28, 28), 62, 214_590),  # FEMNIST (CNN2, 62 outputs)
        ("resnet18_gn", (3, 32, 32), 10, 11_173_952),  # FedSLR's CIFAR ResNet-18-GN, last layer without bias
        ("resnet18_gn", (3, 32, 32), 100, 11_220_032),  # the same for CIFAR-100 (fedslr.md 6.2)
        ("resnet8x4", (3, 32, 32), 100, 1_233_540),  # AugFL's client model, CIFAR-100 (augfl.md 4.2: about 1.23M)
        ("resnet32x4", (3, 32, 32), 100, 7_433_860),  # AugFL's teacher, CIFAR-100 (augfl.md 4.2: about 7.43M)
    ],
)
def test_parameter_counts_match_the_papers(name, input_shape, outputs, parameters):
    module = build_module(name, input_shape, outputs)
    assert sum(p.numel() for p in module.parameters()) == parameters
    assert module(torch.zeros(2, *input_shape)).shape == (2, outputs)


def test_cnn1_with_the_authors_dropout_is_cnn1_with_its_masks_drawn_from_the_given_seed():
    """Dropout has no parameters: the same initial model for a seed (model.init: authors draws the layers in order);
    training draws masks from the seed it is given (the same seed, the same gradient), evaluation none."""
    import numpy as np

    from raysim.models.flat import FlatModel

    plain, dropout = FlatModel("cnn_mmnist", (3, 16, 16), 6), FlatModel("cnn_mmnist_dropout", (3, 16, 16), 6)
    assert not plain.stochastic and dropout.stochastic
    flat = torch.from_numpy(dropout.initial_parameters(1))
    assert torch.equal(flat, torch.from_numpy(plain.initial_parameters(1)))
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(8, 3, 16, 16)).astype(np.float32))
    y = torch.arange(8) % 6
    _, seeded = dropout.loss_and_grad(flat, x, y, dropout_seed=5)
    _, again = dropout.loss_and_grad(flat, x, y, dropout_seed=5)
    _, other = dropout.loss_and_grad(flat, x, y, dropout_seed=6)
    _, off = dropout.loss_and_grad(flat, x, y)
    assert torch.equal(seeded, again) and not torch.equal(seeded, other)
    assert torch.allclose(off, plain.loss_and_grad(flat, x, y)[1])
    assert np.array_equal(dropout.predict(flat.numpy(), x.numpy()), plain.predict(flat.numpy(), x.numpy()))


@pytest.mark.parametrize("name", ["cnn_femnist", "resnet8x4", "resnet32x4"])
def test_a_cnn_refuses_input_that_is_not_an_image(name):
    with pytest.raises(ValueError, match=rf"model.name={name} needs image input \(channels, height, width\)"):
        build_module(name, (784,), 10)


@pytest.mark.parametrize(
    ("name", "blocks", "cifar10_parameters"), [("resnet8x4", 1, 1_210_410), ("resnet32x4", 5, 7_410_730)]
)
def test_the_cifar_resnets_have_the_layout_of_crds_definition(name, blocks, cifar10_parameters):
    """CRD's models/resnet.py: a 32-channel 3x3 stem, stages of 64/128/256 channels with `blocks` basic blocks, a
    1x1 projection on each stage's first block (the first stage's too: 32 -> 64 channels), the parameters in CRD's
    order and names (BatchNorm's affine weight and bias are GroupNorm's), an 8x8 map pooled into 256-d features on
    32x32 input and a 7x7 map on Fashion-MNIST's 1x28x28. On CIFAR-10: 90 x 257 parameters fewer than on CIFAR-100."""
    module = build_module(name, (3, 32, 32), 10)
    assert sum(p.numel() for p in module.parameters()) == cifar10_parameters
    names = [n for n, _ in module.named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"] and names[-2:] == ["fc.weight", "fc.bias"]
    assert len(names) == 3 + 3 * (6 * blocks + 3) + 2
    for stage, (inputs, width) in enumerate([(32, 64), (64, 128), (128, 256)], start=1):
        first = getattr(module, f"layer{stage}")[0]
        assert first.conv1.weight.shape == (width, inputs, 3, 3) and first.conv1.stride == (1 if stage == 1 else 2,) * 2
        assert first.downsample[0].weight.shape == (width, inputs, 1, 1)
        assert len(getattr(module, f"layer{stage}")) == blocks
        assert all(block.downsample is None for block in getattr(module, f"layer{stage}")[1:])
    assert not [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    maps = []
    fashion_mnist = build_module(name, (1, 28, 28), 10)
    for network, shape in ((module, (3, 32, 32)), (fashion_mnist, (1, 28, 28))):
        network.avgpool.register_forward_hook(lambda _module, inputs, _output: maps.append(inputs[0].shape[1:]))
        assert network(torch.zeros(2, *shape)).shape == (2, network.fc.out_features)
    assert maps == [(256, 8, 8), (256, 7, 7)]


class _TheirMLP(torch.nn.Module):
    """The FLAME authors' MLP (src/models.py), built as their main.py builds it."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 128)
        self.relu1 = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(128, 64)
        self.relu2 = torch.nn.ReLU()
        self.fc3 = torch.nn.Linear(64, 10)


class _TheirCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 8 * 8, 128)
        self.fc2 = torch.nn.Linear(128, 10)


@pytest.mark.parametrize(
    ("name", "input_shape", "theirs"), [("mlp", (1, 28, 28), _TheirMLP), ("cnn", (3, 32, 32), _TheirCNN)]
)
@pytest.mark.parametrize("seed", [1, 10000])
def test_the_authors_seed_gives_the_authors_initial_model(name, input_shape, theirs, seed):
    """setup_seed(seed) (torch.manual_seed), then the model's constructor: the same draws in the same order."""
    from raysim.models.zoo import initial_parameters

    torch.manual_seed(seed)
    expected = torch.cat([p.detach().reshape(-1) for p in theirs().parameters()])
    assert torch.equal(initial_parameters(build_module(name, input_shape, 10), seed), expected)


def test_model_init_authors_starts_the_run_from_the_authors_initial_model():
    from raysim.config import validate_config
    from raysim.runtime.problem import prepare

    torch.manual_seed(10)
    expected = torch.cat([p.detach().reshape(-1) for p in _TheirMLP().parameters()]).numpy()
    tree = {"algorithm": {"name": "fedavg"}, "model": {"name": "mlp", "init": "authors"}, "seed": 10}
    assert (prepare(validate_config(tree)).init_params == expected).all()
    tree["model"]["init"] = "raysim"
    assert not (prepare(validate_config(tree)).init_params == expected).all()


@pytest.mark.parametrize(("name", "input_shape"), [("mlp", (1, 28, 28)), ("cnn", (3, 32, 32)), ("mlr", (1, 28, 28))])
def test_scores_of_a_group_do_not_depend_on_the_groups_scored_with_it(name, input_shape):
    """A host scores the global model on many clients' splits in shared passes (Scorer.scores_many); each
    client's scores must be exactly those of a pass over its own split, whatever its neighbours and the block
    boundaries, or results would depend on how clients are spread over hosts."""
    import numpy as np

    from raysim.evaluation.batched import Scorer
    from raysim.models.flat import FlatModel

    torch.set_num_threads(1)
    model = FlatModel(name, input_shape, 10)
    scorer = Scorer(model)
    params = model.initial_parameters(3)
    generator = np.random.default_rng(0)
    sizes = [1, 2, 3, 5, 17, 40, 0, 130, 7, 64]
    groups = [
        (generator.random((n, *input_shape), dtype=np.float32), generator.integers(0, 10, n).astype(np.int64))
        for n in sizes
    ]
    alone = [scorer.scores(params, x, y, sum_batch=4, keep_outputs=True) for x, y in groups]
    for chunk in (32, 100, 2048):
        together = scorer.scores_many(params, groups, sum_batch=4, keep_outputs=True, chunk=chunk)
        for a, b in zip(alone, together, strict=True):
            assert (a.loss, a.loss_sum) == (b.loss, b.loss_sum)
            assert a.accuracy == b.accuracy or (np.isnan(a.accuracy) and np.isnan(b.accuracy))
            assert np.array_equal(a.outputs, b.outputs)


@pytest.mark.parametrize(("name", "input_shape"), [("mlp", (1, 28, 28)), ("mlr", (1, 28, 28)), ("cnn", (3, 32, 32))])
def test_each_group_scored_at_its_own_parameters_equals_scoring_it_alone(name, input_shape):
    """Every client's PM is scored on its own split in batched products (Scorer.scores_each): each group's
    scores must be exactly those of `scores` on it alone, whatever groups share its pack and however they are
    padded, or an evaluation would depend on how clients are spread over hosts."""
    import numpy as np

    from raysim.evaluation.batched import Scorer
    from raysim.models.flat import FlatModel

    torch.set_num_threads(1)
    model = FlatModel(name, input_shape, 10)
    scorer = Scorer(model)
    generator = np.random.default_rng(1)
    sizes = [1, 2, 3, 5, 17, 40, 0, 130, 7, 64, 300]
    groups = [
        (generator.random((n, *input_shape), dtype=np.float32), generator.integers(0, 10, n).astype(np.int64))
        for n in sizes
    ]
    params = [model.initial_parameters(seed) * np.float32(1 + seed / 4) for seed in range(len(groups))]
    alone = [scorer.scores(p, x, y, sum_batch=4, keep_outputs=True) for p, (x, y) in zip(params, groups, strict=True)]
    for rows in (16, 200, 8192):
        each = scorer.scores_each(params, groups, sum_batch=4, keep_outputs=True, rows=rows)
        for a, b in zip(alone, each, strict=True):
            assert (a.loss, a.loss_sum) == (b.loss, b.loss_sum)
            assert np.array_equal(a.outputs, b.outputs)
            assert a.accuracy == b.accuracy or (np.isnan(a.accuracy) and np.isnan(b.accuracy))
    with pytest.raises(ValueError, match="2 parameter vectors for 11 groups"):
        scorer.scores_each(params[:2], groups)


@pytest.mark.parametrize("name", ["mlr", "mlp"])
def test_the_direct_forward_of_a_perceptron_equals_the_module_call(name):
    """FlatModel runs Flatten/Linear/ReLU stacks as the torch ops their modules call, without functional_call:
    outputs and gradients must be exactly the module's."""
    from torch.func import functional_call

    from raysim.models.flat import FlatModel

    model = FlatModel(name, (1, 28, 28), 10)
    flat = torch.from_numpy(model.initial_parameters(5)).requires_grad_(True)
    x = torch.rand(37, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    ours = model.forward(flat, x)
    theirs = functional_call(model.module, model.spec.unflatten(flat), (x,))
    assert model.layers is not None and torch.equal(ours, theirs)
    (grad_ours,) = torch.autograd.grad(ours.square().sum(), flat)
    (grad_theirs,) = torch.autograd.grad(theirs.square().sum(), flat)
    assert torch.equal(grad_ours, grad_theirs)


def _small_input(name: str) -> tuple:
    """An input shape each registered model builds on (small multimodal parts)."""
    from raysim.data.modalities import Modalities, Modality

    multimodal = {
        "image_text_classifier": [Modality("image", (1, 12)), Modality("text", (5, 4), sequence=True)],
        "image_text_classifier_paper": [Modality("image", (1, 12)), Modality("text", (5, 4), sequence=True)],
        "har_classifier": [Modality("acc", (16, 3)), Modality("gyro", (16, 3))],
        "mm_action_classifier": [Modality("audio", (16, 5), sequence=True), Modality("video", (3, 7))],
    }
    if name in multimodal:
        return Modalities(multimodal[name])
    images = ("cnn", "cnn_femnist", "cnn_mmnist", "cnn_mmnist_dropout", "resnet18_gn", "resnet8x4", "resnet32x4")
    return (1, 12, 12) if name in images else (1, 6, 6)


@pytest.mark.parametrize(
    "name",
    [
        "mlr",
        "mlp",
        "cnn",
        "cnn_mmnist",
        "cnn_mmnist_dropout",
        "cnn_femnist",
        "linear",
        "resnet18_gn",
        "resnet8x4",
        "resnet32x4",
        "image_text_classifier",
        "image_text_classifier_paper",
        "har_classifier",
        "mm_action_classifier",
    ],
)
def test_every_model_splits_into_body_and_head(name):
    """ParamSpec.head names the last linear layer, whose input is FlatModel.features: the logits are the head
    applied to the features, for every model of the zoo (the multimodal ones' classifier, ResNet-18's fc)."""
    import numpy as np

    from raysim.models import MODELS
    from raysim.models.flat import FlatModel

    assert name in MODELS.names()
    shape = _small_input(name)
    model = FlatModel(name, shape, 5)
    spec = model.spec
    assert spec.head and spec.head_outputs == 5 and spec.head_mask().sum() == spec.head_size
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(3, *shape)).astype(np.float32))
    if hasattr(shape, "parts"):  # packed multimodal rows: sequence lengths of 2 steps
        x[:, list(shape.length_columns)] = 2.0
    flat = torch.from_numpy(model.initial_parameters(1))
    with torch.no_grad():
        features, logits = model.features(flat, x)
        params = spec.unflatten(flat)
        bias = params[spec.head[1]] if len(spec.head) > 1 else None
        head = torch.nn.functional.linear(features, params[spec.head[0]], bias)
    assert features.shape == (3, spec.feature_dim)
    torch.testing.assert_close(logits, head)
    torch.testing.assert_close(logits, model.forward(flat, x))


def test_a_composed_network_described_outside_the_models_package_is_scored_through_its_own_module():
    """A method's own kind of personalized model (raysim.models.composed.ComposedNetwork) is one class in its file:
    its `module` builds the torch module around the network, and FlatModel.composed lays out and scores its vectors."""
    from dataclasses import dataclass

    import torch
    from torch import nn

    from raysim.models.composed import ComposedNetwork
    from raysim.models.flat import FlatModel

    class ScaledLogits(nn.Module):
        def __init__(self, network: nn.Module):
            super().__init__()
            self.network = network
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale * self.network(x)

    @dataclass(frozen=True)
    class Scaled(ComposedNetwork):
        def module(self, network: nn.Module) -> nn.Module:
            return ScaledLogits(network)

    base = FlatModel("mlp", (6,), 3)
    composed = base.composed(Scaled())
    assert composed.size == base.size + 1 and base.composed(Scaled()) is composed
    params = base.initial_parameters(0)
    x = torch.randn(4, 6)
    for scale in (1.0, 2.5):
        vector = torch.cat([torch.tensor([scale]), torch.from_numpy(params)])  # its own parameter first
        torch.testing.assert_close(composed.forward(vector, x), scale * base.forward(torch.from_numpy(params), x))
