"""A plugin's entries join the configuration matrix (tests/support/matrix.py) without editing it: checked in a
fresh interpreter that imports the plugin first, as an installed plugin's entry point is imported."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT

PLUGIN = '''
from typing import Literal

import numpy as np

from raysim.algorithms import ALGORITHMS
from raysim.algorithms.fedavg import FedAvg, FedAvgSettings
from raysim.data import PARTITIONS, SchemeSettings
from raysim.models import MODELS
from raysim.threats import ATTACKS, ROBUST_RULES
from raysim.threats.attacks import AttackKind


class PluginSettings(FedAvgSettings):
    name: Literal["plugin_algorithm"] = "plugin_algorithm"


@ALGORITHMS.register()
class PluginAlgorithm(FedAvg):
    name = "plugin_algorithm"
    Settings = PluginSettings


@PARTITIONS.register()
class PluginScheme(SchemeSettings):
    scheme: Literal["plugin_scheme"] = "plugin_scheme"

    def assign(self, labels, num_clients, generator, groups):
        return np.array_split(np.arange(len(labels)), num_clients)


@MODELS.register("plugin_model")
def plugin_model(input_shape, outputs):
    """Never built here."""


@ATTACKS.register()
class PluginAttack(AttackKind):
    kind = "plugin_attack"

    @staticmethod
    def forge(settings, honest, broadcast, generator):
        return np.zeros_like(honest)


@ROBUST_RULES.register("plugin_rule")
def plugin_rule(settings, messages, byzantine, reference):
    return messages[0]
'''


def test_a_plugins_entries_join_the_matrix_without_editing_it(tmp_path):
    """An algorithm, scheme, model, attack kind and robust rule registered by a plugin imported before the tests are
    collected (as an installed plugin's entry point is) are values of the matrix's axes, meet every other value in
    a run or a refusal, and the model runs in a cell (in a fresh interpreter: this one's registries stay as they
    are)."""
    (tmp_path / "matrix_plugin.py").write_text(PLUGIN)
    check = (
        "import matrix_plugin\n"
        "import tests.support.matrix as matrix\n"
        "assert 'plugin_algorithm' in matrix.AXES['algorithm'] and 'plugin_scheme' in matrix.AXES['scheme']\n"
        "assert {'plugin_attack', 'plugin_rule'} <= {value for threat in matrix.AXES['threat'] for value in threat}\n"
        "assert 'plugin_model' in {cell.model for cell in matrix.RUNS}\n"
        "assert any(cell.algorithm == 'plugin_algorithm' and cell.scheme == 'plugin_scheme' for cell in matrix.RUNS)\n"
        "matrix.check_cover()\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
