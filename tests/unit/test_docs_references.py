"""The pages cite only what a reader of the repository has: every file or folder of the repository a page names
(`raysim/...`, `configs/...`, a `*.md` page) is shipped, and the papers are cited as papers (their sections,
equations, tables and figures), never through notes that are not part of the repository; so do the code's
docstrings, comments and setting descriptions, the configs and the generated configuration reference."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from tests.support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("raysim/", "tests/", "configs/", "docs/", "benchmarks/", "jobs/", "docker/", ".ci/")
"""A name that starts with one of the repository's folders is a path in it."""
GENERATED = {"reference.md"}
"""Pages the site makes at build time (docs/hooks.py: the configuration reference)."""
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(map(re.escape, TOP)) + r")[\w./{},*-]*)")
PAGE = re.compile(r"(?<![\w/.-])([\w./{},*-]+\.md)\b")
UNSHIPPED_NOTES = re.compile(r"\b(flame|fedapm|fedslr|augfl)\.md\b")


def _expand(name: str) -> list[str]:
    """`flame_table3_{fmnist,mnist}.yaml` as the names it stands for."""
    found = re.search(r"\{([^{}]*)\}", name)
    if found is None:
        return [name]
    return [
        full
        for alternative in found.group(1).split(",")
        for full in _expand(name[: found.start()] + alternative + name[found.end() :])
    ]


def _shipped(name: str, page: Path) -> bool:
    """Whether the name (a glob, with `{a,b}` alternatives) names something in the repository, relative to its root
    or to the page; a placeholder segment (`configs/X.yaml`, `NAME.yaml`) stands for any file."""
    for one in _expand(name.rstrip(".,:;*")):  # not the sentence's full stop, nor the bold's asterisks
        if any(part.split(".")[0].isupper() for part in one.split("/")):  # a placeholder: X, NAME
            continue
        if Path(one).name in GENERATED:
            continue
        if not any(glob.glob(str(base / one)) for base in (ROOT, page.parent)):
            return False
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_page_names_only_files_the_repository_ships(page):
    text = page.read_text()
    named = {match.group(1) for pattern in (PATH, PAGE) for match in pattern.finditer(text)}
    missing = sorted(name for name in named if not _shipped(name, page))
    assert not missing, f"{page.name} names what the repository does not ship: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_page_cites_the_papers_not_notes_that_are_not_shipped(page):
    """The specification digests (flame.md, ...) are the project's working notes, outside the repository: a page
    cites the paper's section, equation, table or figure instead."""
    cited = sorted({match.group(0) for match in UNSHIPPED_NOTES.finditer(page.read_text())})
    assert not cited, f"{page.name} cites notes the repository does not ship: {cited}; cite the paper instead"


SHIPPED_TREES = ("raysim", "configs", "jobs", "benchmarks")
"""The folders whose docstrings, comments and setting descriptions a reader meets (API reference, `--help`, configs)."""
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".json", ".toml", ".sh", ".txt", ".cfg"}


def _notes_cited(text: str) -> list[str]:
    return sorted({match.group(0) for match in UNSHIPPED_NOTES.finditer(text)})


def test_the_code_and_configs_cite_the_papers_not_notes_that_are_not_shipped():
    """No docstring, comment or config comment under raysim/, configs/, jobs/ or benchmarks/ cites a digest: the
    paper's own section, equation, table or algorithm, or the authors' code, instead."""
    files = [
        path
        for tree in SHIPPED_TREES
        for path in sorted((ROOT / tree).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
    ]
    assert len([path for path in files if path.suffix == ".py"]) > 100  # the walk found the package
    cited = {str(path.relative_to(ROOT)): found for path in files if (found := _notes_cited(path.read_text()))}
    assert not cited, f"files citing notes the repository does not ship: {cited}; cite the paper instead"


def test_the_configuration_reference_cites_the_papers_not_notes_that_are_not_shipped():
    """The generated configuration reference (raysim.reference, the page docs/hooks.py builds from the settings'
    descriptions) cites no digest either."""
    from raysim.reference import config_reference

    text = config_reference()
    assert "| `rounds`" in text  # the reference was built, with its rows
    cited = _notes_cited(text)
    assert not cited, f"the configuration reference cites notes the repository does not ship: {cited}"


def test_the_checks_catch_an_unshipped_name():
    """The two checks fail on what they are for (a missing config, a digest) and pass a placeholder and a glob."""
    page = ROOT / "docs" / "usage.md"
    assert not _shipped("configs/paper/suites/no_such_suite.yaml", page)
    assert not _shipped("flame.md", page)
    assert _shipped("configs/X.yaml", page) and _shipped("configs/paper/suites/flame_table3_{fmnist,mnist}.yaml", page)
    assert _shipped("docs/*.md", page) and _shipped("reference.md", page)
    assert UNSHIPPED_NOTES.search("(fedslr.md 6.3)")
    assert _notes_cited("(spec/augfl.md 2.3; FLAME, Sec. VI-A; the authors' code)") == ["augfl.md"]


def _section(page: Path, title: str) -> str:
    text = page.read_text()
    start = text.index(f"## {title}\n")
    return text[start : text.index("\n## ", start + 1)]


def test_extending_names_what_a_personalized_method_uses_and_the_api_reference_documents_each():
    """Every name of extending.md's table is importable from the module it names; the API reference renders each
    (`::: module.Name` of the same object); the Dataset row names each of Dataset's fields, `groups` included."""
    import dataclasses
    import importlib

    table = _section(ROOT / "docs" / "extending.md", "The names a personalized method uses")
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    reference = {line.removeprefix("::: ").strip() for line in (ROOT / "docs" / "api.md").read_text().splitlines()}
    rendered = set()
    for target in (line for line in reference if line.startswith("raysim.")):
        module, _, name = target.rpartition(".")
        rendered.add(getattr(importlib.import_module(module), name))
    named = {}
    for cells in rows:
        module = importlib.import_module(cells[1].strip("` "))
        for name in re.findall(r"`(\w+)(?:\([^)]*\))?`", cells[0]):
            named[name] = getattr(module, name)
    assert {"Prox", "Linear", "Term", "Upload", "WeightedUpload", "DeltaUpload", "Dataset"} <= set(named)
    assert not [name for name, entry in named.items() if entry not in rendered]
    dataset_row = next(cells for cells in rows if cells[0] == "| `Dataset`")
    fields = [field.name for field in dataclasses.fields(named["Dataset"])]
    assert "groups" in fields and all(f"`{field}`" in dataset_row[2] for field in fields)


def test_every_configuration_reference_row_says_what_its_key_is_for():
    """The generated reference (raysim.reference): no row whose `what` is only the key's bounds, e.g. `(>= 1)`."""
    from raysim.reference import config_reference

    bare = []
    for line in config_reference().splitlines():
        if line.startswith("| `"):
            key, *_, what = (cell.strip() for cell in line.strip("|").split(" | "))
            if re.fullmatch(r"(\((?:[<>]=? ?-?[\d.e+-]+(?:, )?)+\))?", what):
                bare.append(key)
    assert not bare, f"rows that give only bounds: {sorted(set(bare))}"
