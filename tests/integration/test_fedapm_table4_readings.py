"""FedAPM's Table 4 suites run FedADMM as Zhou & Li define it and Lp-Proj as Lin et al. solve it (the paper's
references [79] and [43], fedapm.md 4.3): each suite's fedadmm and lp_proj children train one round in process on
the offline substitute (tests/support/paper_data.py BUILT_IN), the readings chosen by the suite itself."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.studies.suite import load_suite
from tests.support.fedapm import SUITES, TABLE3
from tests.support.inprocess import InProcess
from tests.support.light import light_training
from tests.support.paper_data import BUILT_IN


@pytest.mark.parametrize("dataset", sorted(set(TABLE3) - {"cifar10"}))
def test_the_table4_suites_run_zhou_li_fedadmm_and_lin_lp_proj(dataset):
    substitute, _ = TABLE3[dataset]
    suite = load_suite(SUITES / f"fedapm_table4_{dataset}.yaml", [*BUILT_IN[substitute], "clients.count=6"])
    children = [config for _, config in suite.experiments() if config.seed == suite.seeds[0]]
    readings = {"fedadmm": ("reading", "zhou_li"), "lp_proj": ("solver", "lin")}
    for method, (field, value) in readings.items():
        (config,) = [c for c in children if c.algorithm.name == method]
        assert getattr(config.algorithm, field) == value
        tree = config.model_dump(mode="json", by_alias=True)
        tree["algorithm"] |= light_training(tree["algorithm"])
        run = InProcess(validate_config(tree))
        run.round(0, [0, 1])
        moved = run.coordinator.broadcast()
        assert np.isfinite(moved).all(), method
        assert all(np.isfinite(s.theta).all() for s in run.states.values()), method
