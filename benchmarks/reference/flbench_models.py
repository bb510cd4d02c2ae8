"""FL-bench's two Fashion-MNIST models as raysim plugin models, layer for layer (benchmarks/reference/README.md).

`flbench_2nn` is FL-bench's `2nn` (src/utils/models.py, TwoNN: 784-200-200-10 with ReLU; its `base` is the two
hidden layers, its `classifier` the last Linear), `flbench_lenet5` its `lenet5` (LeNet5 with BatchNorm after each
convolution, its default model; for FedBN). The layers are built in FL-bench's order, so that torch's default
initialization drawn after `torch.manual_seed(s)` gives the same initial weights on both sides: raysim's
`model.init: authors` seeds torch with the run's `seed` and re-initializes the layers in module order, FL-bench calls
`torch.manual_seed(common.seed)` and builds the model (tests/integration/test_reference_curves.py checks the two
initial vectors agree). Written here, not imported from FL-bench: raysim never loads the library's code.
"""

from __future__ import annotations

from torch import nn

from raysim.models import MODELS


@MODELS.register("flbench_2nn")
def flbench_2nn(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FL-bench's 2NN: Flatten-784-200-ReLU-200-ReLU-outputs (its base, then its classifier)."""
    features = 1
    for size in input_shape:
        features *= size
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, outputs),
    )


@MODELS.register("flbench_lenet5")
def flbench_lenet5(input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """FL-bench's LeNet5 with BatchNorm: conv5(6)-BN-ReLU-pool-conv5(16)-BN-ReLU-pool-120-84-outputs."""
    channels, height, width = input_shape
    side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(channels, 6, 5),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side_h * side_w, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, outputs),
    )
