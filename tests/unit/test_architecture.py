"""The house's floors: raysim's modules import only downwards, and no module takes part in an import cycle.

The import graph is read from the source with `ast` (nothing is imported), counting every import: at module level,
inside functions and under `if TYPE_CHECKING:`. `from package import name` is an edge to `package` and, when `name`
is a module, to `package.name` too. docs/concepts.md draws the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raysim.algorithms import HOUSE
from tests.support.paths import ROOT

PACKAGE = ROOT / "raysim"


# fmt: off
# (one floor a line, from the ground up, as docs/concepts.md draws them)
FLOORS = (
    ("raysim.errors", "raysim.plugins", "raysim.registry", "raysim.settings", "raysim.seeding",
     "raysim.jit", "raysim.credentials", "raysim.examples", "raysim.torchvision_compat", "raysim.files"),
    ("raysim.data",),
    ("raysim.models",),
    ("raysim.algorithms",),
    ("raysim.execution",),
    ("raysim.threats", "raysim.training", "raysim.executors"),
    ("raysim.evaluation",),
    ("raysim.config",),
    ("raysim.tracking",),
    ("raysim.runtime",),
    ("raysim.studies", "raysim.launch", "raysim.reference", "raysim.api", "raysim.docs_site"),
    ("raysim.jobs", "raysim.cli", "raysim"),
)
# fmt: on
"""From the ground up: the modules and packages of each floor. A module may import its own floor and those below."""


def module_files() -> dict[str, Path]:
    """Every module of raysim by dotted name (a package by its own name, for its __init__.py)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names `module` imports anywhere in its source, relative imports made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def innermost_module(name: str, modules: dict[str, Path]) -> str | None:
    """The raysim module a dotted name is or lies in (`raysim.data.partitions.label_counts` -> raysim.data.partitions),
    None outside raysim."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(raysim module -> the raysim modules it imports, raysim module -> the outside packages it imports)."""
    modules = module_files()
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = imported_names(module, path)
        targets = {innermost_module(name, modules) for name in names}
        inside[module] = {target for target in targets if target is not None and target != module}
        outside[module] = {name.partition(".")[0] for name in names if innermost_module(name, modules) is None}
    return inside, outside


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            following = next(successors, None)
            if following is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif following not in index:
                index[following] = low[following] = len(index)
                stack.append(following)
                on_stack.add(following)
                work.append((following, iter(sorted(graph[following]))))
            elif following in on_stack:
                low[node] = min(low[node], index[following])
    return found


def floor_of(module: str) -> int:
    """The floor of a module: that of the longest name in FLOORS it is or lies in (`raysim` itself is its
    __init__.py only, so that a new top-level module must be given a floor)."""
    best, floor = "", -1
    for number, names in enumerate(FLOORS):
        for name in names:
            inside = module == name or (name != "raysim" and module.startswith(name + "."))
            if inside and len(name) > len(best):
                best, floor = name, number
    if floor < 0:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS (and to docs/architecture.md)")
    return floor


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph()


def test_the_graph_sees_what_the_modules_import(graph):
    """The reader itself: known edges of every kind are found (else the tests below would pass on an empty graph)."""
    inside, outside = graph
    assert "raysim.runtime.rounds" in inside["raysim.runtime.driver"]  # module level
    assert "raysim.runtime.driver" in inside["raysim.cli"]  # inside a function
    assert "raysim.config" in inside["raysim.tracking.artifacts"]  # under TYPE_CHECKING
    assert "raysim.data.authors_draw" in inside["raysim.data.partitions"]  # `import a.b as b`
    assert "raysim.runtime.checkpoint" in inside["raysim.runtime.host"]  # `from package import module`
    assert "torch" in outside["raysim.runtime.host"] and "ray" in outside["raysim.runtime.driver"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_takes_part_in_an_import_cycle(graph):
    inside, _ = graph
    assert cycles(inside) == []


def test_every_module_imports_only_its_floor_and_those_below(graph):
    inside, _ = graph
    upward = sorted(
        f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
        for module, targets in inside.items()
        for target in targets
        if floor_of(target) > floor_of(module)
    )
    assert upward == []


def test_the_named_rules_hold(graph):
    """The rules the floors exist for: algorithms know nothing of Ray or the runtime; evaluation scores without
    the runtime or tracking; nothing below the runtime reaches it."""
    inside, outside = graph
    runtime = FLOORS.index(("raysim.runtime",))
    for module, targets in inside.items():
        if module.startswith("raysim.algorithms"):
            assert "ray" not in outside[module], module
            assert not any(t.startswith("raysim.runtime") for t in targets), module
        if module.startswith("raysim.evaluation"):
            assert not any(t.startswith(("raysim.runtime", "raysim.tracking")) for t in targets), module
        if floor_of(module) < runtime:
            assert not any(t.startswith("raysim.runtime") for t in targets), module
            assert "ray" not in outside[module], module


def method_of(module: str) -> str | None:
    """The method a module of raysim.algorithms belongs to (its module, or its package), None for the house."""
    parts = module.split(".")
    if parts[:2] != ["raysim", "algorithms"] or len(parts) < 3 or parts[2] in HOUSE:
        return None
    return parts[2]


def test_a_method_imports_families_never_another_method(graph):
    """What several methods share lives in raysim.algorithms.families (averaging, consensus, split, ...), so that a
    method is one module (or package) that a new contributor reads alone and a plugin imitates; the families and
    the house import no method at all."""
    inside, _ = graph
    assert method_of("raysim.algorithms.augfl.kd_only") == "augfl" and method_of("raysim.algorithms.families") is None
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in inside.items()
        if module.startswith("raysim.algorithms.") and module != "raysim.algorithms"
        for target in targets
        if method_of(target) is not None and method_of(target) != method_of(module)
    )
    assert crossing == []
