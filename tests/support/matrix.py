"""The configuration matrix's plan (issue 29): every partition scheme x every algorithm x every executor x {no
validation split, a validation split} x {no attack, an attack with a robust rule}, built from the registries and
each choice's own example (raysim.examples: the companion settings it needs), pruned to a pairwise cover
(tests.support.pairwise) in which every two values of two axes meet at least once; every model runs in at least
one cell. `RAY_SAMPLE`: the cells that also run on real Ray hosts (each algorithm, executor and scheme once).

A cell that combines choices which cannot run together (their examples set one section differently, or a
Byzantine attack or robust rule with an algorithm whose uploads name no message) must be refused before any Ray
or MLflow work with one ConfigError line naming the key (`REFUSALS`)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any, NamedTuple

from raysim.algorithms import ALGORITHMS
from raysim.data import PARTITIONS
from raysim.examples import ExampleContext, Fragment, model_example
from raysim.executors import EXECUTORS
from raysim.models import MODELS
from raysim.threats import ATTACKS, ROBUST_RULES
from tests.support.experiments import NO_FIGURES
from tests.support.light import light_training
from tests.support.pairwise import pairs_of, pairwise


@dataclass(frozen=True)
class Registries:
    """The registered choices the matrix spans."""

    algorithms: Mapping[str, Any]
    """name -> algorithm class (with `example`, and its `Upload`)."""
    schemes: Mapping[str, Any]
    """partition.scheme -> settings class (with `example`)."""
    executors: tuple[str, ...]
    """The executors (runtime.client_training values but `auto`, which picks one)."""
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
        executors=EXECUTORS.names(),
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
checks (the shipped configs' runs in tests/system/test_paper_configs.py draw them); no saved models
(tests/integration/test_saved_models.py checks them)."""


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
    whose uploads name no message (Upload.carries_message)."""
    algorithm = row.get("algorithm")
    if algorithm is not None and row.get("scheme") is not None:
        own, scheme = fragments(Cell(algorithm, row["scheme"], NO_ATTACK, "", 0.0), context)
        clash = sorted(section for section in own.keys() & scheme.keys() if own[section] != scheme[section])
        if clash:
            return clash[0]
    threat = row.get("threat")
    if threat in (None, NO_ATTACK) or algorithm is None or REGISTRIES.algorithms[algorithm].Upload.carries_message():
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
    the model can run in it (the file scheme replays the base dataset's partition: none of its own), the algorithm
    names no model of its own and takes this one's layout (`fits`)."""
    algorithm, scheme = fragments(cell, PLANNING)
    if "model" in algorithm:  # an algorithm that names its model (FedBN: a BatchNorm one) runs that one
        return False
    own = model_sections(model, PLANNING)
    if not own:
        return fits(cell.algorithm, model)
    return cell.scheme != "file" and not (own.keys() & (algorithm.keys() | scheme.keys()) - {"algorithm"})


@functools.cache
def fits(algorithm: str, model: str) -> bool:
    """Whether the algorithm, at its example's settings, takes the model's layout on the few-shot cells' images: a
    split method refuses a model of one layer (everything or nothing would be personal). Only such a model is tried
    (building some algorithms costs in the model's size: Lp-Proj's projection)."""
    from raysim.algorithms import build_algorithm
    from raysim.errors import ConfigError

    layout = _layout(model)
    if layout is None or len({name.rsplit(".", 1)[0] for name in layout.names}) > 1:
        return True
    entry = REGISTRIES.algorithms[algorithm]
    try:
        build_algorithm(entry.Settings.model_validate(entry.example(PLANNING)["algorithm"]), layout)
    except ConfigError:
        return False
    return True


@functools.cache
def _layout(model: str) -> Any:
    """The model's parameter layout on Fashion-MNIST's images (the few-shot cells' dataset), built on torch's meta
    device: shapes without values, in no time whatever the model's size. None when it cannot be built so (a plugin's
    model may need other input): its cell then shows what happens."""
    import torch

    from raysim.models.flat import param_spec
    from raysim.models.zoo import build_module

    try:
        with torch.device("meta"):
            return param_spec(build_module(model, (1, 28, 28), 10), model)
    except Exception:  # the planner only prefers cells; running the cell reports the model's own error
        return None


def with_every_model(cells: list[Cell]) -> list[Cell]:
    """The cells with every model but the base's given to the few-shot cells (a few-shot cell copied when there are
    more models than such cells); a model whose example sets sections (its dataset) only to a cell whose examples
    leave those sections alone. The largest models first (`_size`), each to the fitting cell whose algorithm does the
    least besides the steps every algorithm has (`_extra_steps`; ties: the earlier cell): a model's size multiplies
    every pass over it, so ResNet-32x4 in FedSLR's cell (two training phases, three models scored, an SVD of every
    layer on the server and again for the final spectra) cost three times what it costs in SCAFFOLD's."""
    others = sorted(
        (model for model in REGISTRIES.models if model != BASE["model"]["name"]), key=lambda model: -_size(model)
    )
    cells = list(cells)
    free = [position for position, cell in enumerate(cells) if cell.scheme == FEW_SHOT]
    for model in others:
        fitting = [position for position in free if takes(cells[position], model)]
        if fitting:
            chosen = min(fitting, key=lambda position: (_extra_steps(cells[position].algorithm), position))
            cells[chosen] = cells[chosen]._replace(model=model)
            free.remove(chosen)
        else:
            source = next(cell for cell in cells if cell.scheme == FEW_SHOT and takes(cell, model))
            cells.append(source._replace(model=model))
    return cells


def _size(model: str) -> int:
    """The model's parameter count on the few-shot cells' images (0 when its layout cannot be built so)."""
    layout = _layout(model)
    return 0 if layout is None else int(layout.size)


@functools.cache
def _extra_steps(algorithm: str) -> int:
    """How many of the algorithm interface's methods the algorithm overrides (raysim.algorithms.interface.Algorithm):
    each is work of its own on the model's parameters (a personal or extra model scored, a server step per client,
    tables of the final model, ...) beyond the initial states, the client and server steps every algorithm has."""
    from raysim.algorithms.interface import Algorithm

    entry = REGISTRIES.algorithms[algorithm]
    hooks = [name for name, member in vars(Algorithm).items() if callable(member) and not name.startswith("_")]
    return sum(getattr(entry, name, None) is not getattr(Algorithm, name) for name in hooks)


RUNS, REFUSALS = plan()


def ray_sample(cells: list[Cell]) -> list[Cell]:
    """A few of `cells` in which every algorithm, every executor and every scheme runs at least once (greedy: each
    next cell the one that brings the most values not yet covered; ties to the earliest)."""
    axes = ("algorithm", "executor", "scheme")
    missing = {(axis, getattr(cell, axis)) for cell in cells for axis in axes}
    chosen: list[Cell] = []
    while missing:
        best = max(cells, key=lambda cell: len({(axis, getattr(cell, axis)) for axis in axes} & missing))
        chosen.append(best)
        missing -= {(axis, getattr(best, axis)) for axis in axes}
    return chosen


RAY_SAMPLE = ray_sample([cell for cell in RUNS if cell.model == BASE["model"]["name"]])
"""The cells that run on real Ray hosts too: every algorithm, executor and scheme once, on the base's model."""


def experiment(cell: Cell, context: ExampleContext, uri: str, actors: str = "in_process") -> dict[str, Any]:
    """The cell's raw config: the base, its algorithm's example, then its scheme's (which wins a section both
    set), its validation split, executor and threat, logged to `uri` under the cell's name, and the sections its
    model's example sets (`takes`: none that the algorithm or scheme set); its hosts where `actors` says
    (runtime.actors: in_process, or ray with the actors of the cell before, runtime.reuse_actors)."""
    own, scheme = fragments(cell, context)
    tree = {**copy.deepcopy(dict(context.base)), **copy.deepcopy(own), **copy.deepcopy(scheme)}
    if cell.val:
        tree["partition"] = {**tree["partition"], "val_fraction": cell.val}
    tree["runtime"] = {**tree["runtime"], "client_training": cell.executor, "actors": actors}
    if actors == "ray":
        tree["runtime"]["reuse_actors"] = True
    tree["tracking"] = {**tree["tracking"], "uri": uri, "run_name": f"{cell.name}-{actors}"}
    if cell.threat != NO_ATTACK:
        kind, rule = cell.threat
        tree["attack"] = {"kind": kind, "fraction": ATTACK_FRACTION}
        tree["aggregation"] = {"rule": rule}
    if "model" not in own:  # else the algorithm's own model (`takes` gave it no other)
        tree["model"] = {**tree["model"], "name": cell.model}
    tree.update(copy.deepcopy(model_sections(cell.model, context)))
    tree["algorithm"] = {**tree["algorithm"], **light_training(tree["algorithm"])}
    return tree


def check_cover() -> None:
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
