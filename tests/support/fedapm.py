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
