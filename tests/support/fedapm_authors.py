"""What the fedapm_authors tests of several tiers share."""

from __future__ import annotations

from tests.support.paths import ROOT

SUITE = ROOT / "configs" / "paper" / "suites" / "fedapm_authors_fmnist.yaml"
