"""The space of settings, tested (issue 29): every partition scheme x every algorithm x every executor x {no
validation split, a validation split} x {no attack, an attack with a robust rule}, built from the registries and
each choice's own example (raysim.examples: the companion settings it needs), pruned to a pairwise cover
(tests.pairwise) in which every two values of two axes meet at least once; every model runs in at least one cell.

A cell runs end to end on real Fashion-MNIST (a tenth of it, in its standard IDX layout: the loader, the uint8
normalization and the data's structure are the real ones), 4 clients, 1 round, in this process
(raysim.runtime.driver.run_experiment) on the session's one Ray instance, on the actors of the cells before it
(runtime.reuse_actors: a new actor process costs seconds, most of a cell; tests/test_crews.py shows renewed
actors give a new crew's results), logging to one sqlite MLflow store, and
is read back from the store: FINISHED, every metric finite, every documented metric key logged once at every step.
A cell that combines choices which cannot run together (their examples set one section differently, or a
Byzantine attack or robust rule with an algorithm whose uploads name no message) must be refused before any Ray
or MLflow work with one ConfigError line naming the key, and leave no run behind."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any, NamedTuple, get_args

import pytest
from mlflow.tracking import MlflowClient

from raysim.algorithms import ALGORITHMS
from raysim.config import RuntimeSettings, validate_config
from raysim.data import PARTITIONS
from raysim.errors import ConfigError
from raysim.examples import ExampleContext, Fragment, model_example
from raysim.models import MODELS
from raysim.runtime.driver import run_experiment
from raysim.runtime.problem import save_partition
from raysim.threats import ATTACKS, ROBUST_RULES
from tests.cluster import ROOT
from tests.conftest import NO_FIGURES
from tests.light import light_training
from tests.logged import check_logged
from tests.pairwise import pairs_of, pairwise


@dataclass(frozen=True)
class Registries:
    """The registered choices the matrix spans."""

    algorithms: Mapping[str, Any]
    """name -> algorithm class (with `example` and `sends_messages`)."""
    schemes: Mapping[str, Any]
    """partition.scheme -> settings class (with `example`)."""
    executors: tuple[str, ...]
    """runtime.client_training values that name an executor (not `auto`, which picks one)."""
    attacks: Mapping[str, Any]
    """attack.kind -> attack class (with `byzantine`), other than none."""
    rules: tuple[str, ...]
    """aggregation.rule values other than mean."""
    models: tuple[str, ...]
    """model.name values."""


def registries() -> Registries:
    """The registries as they stand when the tests are collected: raysim's own entries and those of every installed
    plugin (raysim.registry; the first lookup imports the installed plugins), so that a plugin's entry joins too."""
    return Registries(
        algorithms=dict(ALGORITHMS.items()),
        schemes=dict(PARTITIONS.items()),
        executors=tuple(v for v in get_args(RuntimeSettings.model_fields["client_training"].annotation) if v != "auto"),
        attacks={kind: attack for kind, attack in ATTACKS.items() if kind != "none"},
        rules=tuple(rule for rule in ROBUST_RULES.names() if rule != "mean"),
        models=MODELS.names(),
    )


REGISTRIES = registries()
NO_ATTACK = ("none", "mean")
VALIDATION = (0.0, 0.2)
"""partition.val_fraction: no validation split, and a validation split (HM-val is then logged)."""
ATTACK_FRACTION = 0.25
"""One attacker among the base's 4 clients."""


def threats(registered: Registries) -> list[tuple[str, str]]:
    """No attack, then every attack kind with a robust rule, every kind and every rule at least once."""
    kinds = list(registered.attacks)
    count = max(len(kinds), len(registered.rules))
    paired = [(kinds[i % len(kinds)], registered.rules[i % len(registered.rules)]) for i in range(count)]
    return [NO_ATTACK, *paired]


AXES: dict[str, list[Any]] = {
    "algorithm": list(REGISTRIES.algorithms),
    "scheme": list(REGISTRIES.schemes),
    "threat": threats(REGISTRIES),
    "executor": list(REGISTRIES.executors),
    "val": list(VALIDATION),
}

BASE: dict[str, Any] = {
    "algorithm": {"name": "fedavg"},
    "dataset": {"name": "fashion_mnist"},
    "partition": {"scheme": "iid"},
    "model": {"name": "mlp"},
    "clients": {"count": 4, "per_round": 3},
    "rounds": 1,
    "seed": 1,
    "runtime": {"num_hosts": 1},
    "tracking": {"experiment": "matrix", "system_metrics": False, **NO_FIGURES},
}
"""The experiment every cell starts from; the cell's choices replace its sections with their examples'. No
figures: drawing them took 1-1.5 s of a cell's 2.5 s, and they depend on the logged keys only, which every cell
checks (the shipped configs' runs in tests/test_paper_configs.py draw them); no saved models
(tests/test_saved_models.py checks them)."""


class Cell(NamedTuple):
    algorithm: str
    scheme: str
    threat: tuple[str, str]
    executor: str
    val: float
    model: str = BASE["model"]["name"]
    """Not a pairwise axis: every model runs at least once, on the few-shot scheme (see `with_every_model`)."""

    @property
    def name(self) -> str:
        attack = "clean" if self.threat == NO_ATTACK else "+".join(self.threat)
        model = "" if self.model == BASE["model"]["name"] else f"-{self.model}"
        return f"{self.algorithm}-{self.scheme}-{attack}-{self.executor}-val{self.val:g}{model}"

    @property
    def axes(self) -> dict[str, Any]:
        """The cell's values of the pairwise axes."""
        return {axis: getattr(self, axis) for axis in AXES}


def base_tree(val: float, root: Path | None = None) -> dict[str, Any]:
    tree = copy.deepcopy(BASE)
    if val:
        tree["partition"]["val_fraction"] = val
    if root is not None:
        tree["dataset"]["root"] = str(root)
    return tree


def fragments(cell: Cell, context: ExampleContext) -> tuple[Fragment, Fragment]:
    """The examples of the cell's algorithm and scheme."""
    algorithm = REGISTRIES.algorithms[cell.algorithm].example(context)
    scheme = REGISTRIES.schemes[cell.scheme].example(context)
    return algorithm, scheme


def refused_key(row: Mapping[str, Any], context: ExampleContext) -> str | None:
    """The config key at which raysim must refuse a (partial) row, None when it must run: the section that the
    algorithm's and the scheme's examples set differently, or a Byzantine attack / robust rule for an algorithm
    whose uploads name no message (Algorithm.sends_messages)."""
    algorithm = row.get("algorithm")
    if algorithm is not None and row.get("scheme") is not None:
        own, scheme = fragments(Cell(algorithm, row["scheme"], NO_ATTACK, "", 0.0), context)
        clash = sorted(section for section in own.keys() & scheme.keys() if own[section] != scheme[section])
        if clash:
            return clash[0]
    threat = row.get("threat")
    if threat in (None, NO_ATTACK) or algorithm is None or REGISTRIES.algorithms[algorithm].sends_messages():
        return None
    return "attack.kind" if REGISTRIES.attacks[threat[0]].byzantine else "aggregation.rule"


PLANNING = ExampleContext(base_tree(0.0), Path("partition.parquet"))
"""The context the cells are planned in (only which sections the examples set matters; the runs use contexts of
their own, with the real files)."""


def plan() -> tuple[list[Cell], list[tuple[Cell, str]]]:
    """The cells that must run (a pairwise cover of the allowed combinations), and for every pair of values that
    cannot run together a cell holding it (the other axes at values allowed with both), with the key it must be
    refused at."""
    allowed = lambda row: refused_key(row, PLANNING) is None  # noqa: E731
    runs = with_every_model([Cell(**row) for row in pairwise(AXES, allowed)])
    refusals = []
    for first, second in combinations(AXES, 2):
        for pair in product(AXES[first], AXES[second]):
            held = dict(zip((first, second), pair, strict=True))
            if allowed(held):
                continue
            for axis in AXES:
                held.setdefault(
                    axis,
                    next(
                        v
                        for v in AXES[axis]
                        if all(allowed({axis: v, other: held[other]}) for other in (first, second))
                    ),
                )
            cell = Cell(**held)
            key = refused_key(cell.axes, PLANNING)
            assert key is not None
            refusals.append((cell, key))
    return runs, refusals


FEW_SHOT = "meta"
"""The scheme whose cells take the other models: its few-shot clients hold a few dozen samples, so that even
ResNet-18 trains and scores in seconds."""


def model_sections(model: str, context: ExampleContext) -> Fragment:
    """The sections the model's own example sets (raysim.examples.model_example: a multimodal model's dataset)."""
    return model_example(MODELS.get(model), context)


def takes(cell: Cell, model: str) -> bool:
    """Whether the cell's algorithm and scheme examples leave the sections the model's example sets alone, so that
    the model can run in it (the file scheme replays the base dataset's partition: none of its own)."""
    own = model_sections(model, PLANNING)
    if not own:
        return True
    algorithm, scheme = fragments(cell, PLANNING)
    return cell.scheme != "file" and not (own.keys() & (algorithm.keys() | scheme.keys()) - {"algorithm"})


def with_every_model(cells: list[Cell]) -> list[Cell]:
    """The cells with every model but the base's given to the few-shot cells in turn (a few-shot cell copied
    when there are more models than such cells); a model whose example sets sections (its dataset) only to a cell
    whose examples leave those sections alone."""
    others = [model for model in REGISTRIES.models if model != BASE["model"]["name"]]
    cells = list(cells)
    free = [position for position, cell in enumerate(cells) if cell.scheme == FEW_SHOT]
    for model in others:
        fitting = [position for position in free if takes(cells[position], model)]
        if fitting:
            cells[fitting[0]] = cells[fitting[0]]._replace(model=model)
            free.remove(fitting[0])
        else:
            source = next(cell for cell in cells if cell.scheme == FEW_SHOT and takes(cell, model))
            cells.append(source._replace(model=model))
    return cells


RUNS, REFUSALS = plan()


# Session set-up: the partition files the examples replay, one MLflow store (the tenth of Fashion-MNIST:
# tests/conftest.py).


@pytest.fixture(scope="session")
def matrix_store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('matrix-mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def contexts(tmp_path_factory, fmnist_tenth) -> dict[float, ExampleContext]:
    """One example context per validation setting: the base on the tenth, its partition written as a file."""
    folder = tmp_path_factory.mktemp("matrix-partitions")
    made = {}
    for val in VALIDATION:
        base = base_tree(val, fmnist_tenth)
        path = folder / f"partition-val{val:g}.parquet"
        save_partition(validate_config(base), path)
        made[val] = ExampleContext(base, path)
    return made


@pytest.fixture(scope="session")
def pretrained_cache(tmp_path_factory):
    """AugFL's pretrained teachers are cached in a folder of the session, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYSIM_CACHE", str(tmp_path_factory.mktemp("raysim-cache")))
        yield


def experiment(cell: Cell, context: ExampleContext, uri: str) -> dict[str, Any]:
    """The cell's raw config: the base, its algorithm's example, then its scheme's (which wins a section both
    set), its validation split, executor and threat, logged to `uri` under the cell's name, and the sections its
    model's example sets (`takes`: none that the algorithm or scheme set)."""
    own, scheme = fragments(cell, context)
    tree = {**copy.deepcopy(dict(context.base)), **copy.deepcopy(own), **copy.deepcopy(scheme)}
    if cell.val:
        tree["partition"] = {**tree["partition"], "val_fraction": cell.val}
    tree["runtime"] = {**tree["runtime"], "client_training": cell.executor, "reuse_actors": True}
    if cell.threat != NO_ATTACK:
        kind, rule = cell.threat
        tree["attack"] = {"kind": kind, "fraction": ATTACK_FRACTION}
        tree["aggregation"] = {"rule": rule}
    tree["tracking"] = {**tree["tracking"], "uri": uri, "run_name": cell.name}
    tree["model"] = {**tree["model"], "name": cell.model}
    tree.update(copy.deepcopy(model_sections(cell.model, context)))
    tree["algorithm"] = {**tree["algorithm"], **light_training(tree["algorithm"])}
    return tree


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("cell", RUNS, ids=lambda cell: cell.name)
def test_cell_runs_and_logs_every_key_once_per_step(cell, contexts, matrix_store, ray_local, pretrained_cache):
    config = experiment(cell, contexts[cell.val], matrix_store)
    result = run_experiment(validate_config(config), show_progress=False)
    client = MlflowClient(matrix_store)
    check_logged(client, result.run_id, config)
    assert not [a.path for a in client.list_artifacts(result.run_id) if a.path.endswith(".png")]  # figures: []


@pytest.mark.parametrize(("cell", "key"), REFUSALS, ids=lambda item: getattr(item, "name", item))
def test_cell_that_cannot_run_is_refused_with_one_line(cell, key, contexts, matrix_store, ray_local, pretrained_cache):
    config = experiment(cell, contexts[cell.val], matrix_store)
    with pytest.raises(ConfigError) as refused:
        run_experiment(validate_config(config), show_progress=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(key), message
    client = MlflowClient(matrix_store)
    found = client.get_experiment_by_name(config["tracking"]["experiment"])
    if found is not None:
        assert not client.search_runs([found.experiment_id], f"attributes.run_name = '{cell.name}'")


def test_every_pair_of_values_meets_in_a_run_or_a_refusal():
    """Every two values of two axes meet in a cell that runs, or, when no allowed combination holds them, in a
    refused cell; no run is a combination refused on purpose."""
    axes = list(AXES)
    allowed = {
        pair
        for values in product(*AXES.values())
        if refused_key(row := dict(zip(axes, values, strict=True)), PLANNING) is None
        for pair in pairs_of(row, axes)
    }
    ran = set().union(*(pairs_of(cell.axes, axes) for cell in RUNS))
    refused = set().union(*(pairs_of(cell.axes, axes) for cell, _ in REFUSALS))
    every = {
        pair for a, b in combinations(axes, 2) for pair in product(((a, v) for v in AXES[a]), ((b, v) for v in AXES[b]))
    }
    assert allowed <= ran
    assert every - allowed <= refused
    assert {cell.model for cell in RUNS} == set(REGISTRIES.models)
    assert all(refused_key(cell.axes, PLANNING) is None for cell in RUNS)
    assert all(refused_key(cell.axes, PLANNING) == key for cell, key in REFUSALS)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (3, 3, 3, 3), (5, 4, 3, 2, 2), (12, 11, 5, 2, 2)])
def test_the_pairwise_cover_meets_every_pair_in_few_rows(sizes):
    axes = {f"axis{i}": list(range(size)) for i, size in enumerate(sizes)}
    rows = pairwise(axes)
    rows_of_product = (dict(zip(axes, values, strict=True)) for values in product(*axes.values()))
    every = {pair for row in rows_of_product for pair in pairs_of(row, list(axes))}
    assert set().union(*(pairs_of(row, list(axes)) for row in rows)) == every
    assert sizes[0] * sizes[1] <= len(rows) <= sizes[0] * sizes[1] + sizes[0]


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
        "import tests.test_matrix as matrix\n"
        "assert 'plugin_algorithm' in matrix.AXES['algorithm'] and 'plugin_scheme' in matrix.AXES['scheme']\n"
        "assert {'plugin_attack', 'plugin_rule'} <= {value for threat in matrix.AXES['threat'] for value in threat}\n"
        "assert 'plugin_model' in {cell.model for cell in matrix.RUNS}\n"
        "assert any(cell.algorithm == 'plugin_algorithm' and cell.scheme == 'plugin_scheme' for cell in matrix.RUNS)\n"
        "matrix.test_every_pair_of_values_meets_in_a_run_or_a_refusal()\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
