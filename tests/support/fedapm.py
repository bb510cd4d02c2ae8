"""FedAPM's shipped suites: Table 3's substitutes and the authors' ordering."""

from __future__ import annotations

from tests.support.paths import ROOT

SUITE = ROOT / "configs" / "paper" / "suites" / "fedapm_authors_fmnist.yaml"


SUITES = ROOT / "configs" / "paper" / "suites"


TABLE3 = {
    "cifar10": ("digits", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "crisismmd": ("crisismmd_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "kuhar": ("kuhar_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "cremad": ("cremad_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
}
"""Table 3's datasets: the substitute each suite runs by default, and the methods of the table (fedapm.md 5.1)."""


STUDIES = {
    "rho": ("algorithm.rho", (0.001, 0.01, 0.02, 0.05, 0.1)),
    "fraction": ("clients.fraction", (0.1, 0.2, 0.3, 0.5)),
    "lr": ("algorithm.lr", (0.1, 0.2, 0.5, 1.0)),
}
"""FedAPM's figure studies (fedapm.md 6), one suite per study and Table 3 dataset (fedapm_{study}_{dataset}.yaml):
the setting each varies and its values."""


TABLE4_RESNET = ("cifar100", "tiny_imagenet")
"""Table 4's ResNet-18 columns (fedapm.md 4.3), fedapm_table4_{dataset}.yaml: CIFAR-10's methods and setting."""
