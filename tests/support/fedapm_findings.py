"""What the fedapm_findings tests of several tiers share."""

from __future__ import annotations

from tests.support.paths import ROOT

SUITES = ROOT / "configs" / "paper" / "suites"


TABLE3 = {
    "cifar10": ("digits", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "crisismmd": ("crisismmd_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "kuhar": ("kuhar_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
    "cremad": ("cremad_synthetic", {"fedapm", "fedavg", "fedalt", "fedsim", "fedprox"}),
}
"""Table 3's datasets: the substitute each suite runs by default, and the methods of the table (fedapm.md 5.1)."""
