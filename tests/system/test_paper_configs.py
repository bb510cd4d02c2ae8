"""Every shipped `configs/paper/*.yaml` runs as the README says, `raysim run CONFIG --set dataset.root=...`,
on a small folder in its dataset's standard layout (one round, a few clients; Fashion-MNIST is the real one); and
every other shipped config, with the first setting of every shipped suite and sweep at its first seed, runs one
round in this process on the same folders (Fashion-MNIST: a tenth of the real one)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.algorithms import ALGORITHMS
from raysim.config import (
    apply_overrides,
    is_suite_file,
    is_sweep_file,
    load_config,
    read_mapping,
    validate_config,
)
from raysim.runtime.driver import run_experiment
from raysim.studies.suite import load_suite
from raysim.studies.sweep import load_sweep
from tests.support.experiments import run_through_cli
from tests.support.inprocess import InProcess
from tests.support.light import light_training
from tests.support.logged import check_logged
from tests.support.paper_data import (
    AUGFL_STUDIES,
    BUILT_IN,
    DATA,
    FEW_SHOT_FIXTURE,
    OTHER_LOADERS,
    PAPER,
    SUITE_DATA,
    TABLE2_SUITES,
)
from tests.support.paths import ROOT


def test_every_paper_config_has_a_test():
    assert sorted(p.name for p in PAPER.glob("*.yaml")) == sorted(DATA)


IN_ONE_PROCESS = ("runtime.num_hosts=1", "runtime.actors=in_process")
"""The loaders are the subject: one host, in the test's process."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DATA))
def test_paper_config_runs_from_a_folder_in_the_standard_layout(name, tmp_path, mlflow_uri):
    """`raysim run` of the config on its dataset's folder (the hosts in process: the loaders are the subject)."""
    root = tmp_path / "data"
    root.mkdir()
    overrides = DATA[name](root)
    sets = [
        f"dataset.root={root}",
        "rounds=1",
        f"tracking.uri={mlflow_uri}",
        *IN_ONE_PROCESS,
        *overrides,
        "tracking.save_models=global",
    ]
    if name == "flame_fmnist.yaml":
        sets.remove(f"dataset.root={root}")
    run = run_through_cli(PAPER / name, mlflow_uri, *sets)
    assert 0.0 <= run.data.metrics["pm/acc"] <= 1.0 and 0.0 <= run.data.metrics["gm/acc"] <= 1.0
    config = load_config(PAPER / name, sets).model_dump(mode="json", by_alias=True)
    check_logged(MlflowClient(mlflow_uri), run.info.run_id, config)


@pytest.mark.slow
@pytest.mark.parametrize("loader", sorted(OTHER_LOADERS))
def test_the_other_loaders_run_end_to_end_with_a_cnn(loader, tmp_path, mlflow_uri):
    """The loaders no paper config names, through `raysim run` on their written files, with the CIFAR CNN."""
    root = tmp_path / "data"
    root.mkdir()
    config = yaml.safe_load((PAPER / "flame_cifar10.yaml").read_text())
    config["partition"] = {"scheme": "iid"}
    sets = [*OTHER_LOADERS[loader](root), f"dataset.root={root}", "clients.count=2", "rounds=1"]
    run = run_through_cli(config, mlflow_uri, *sets, f"tracking.uri={mlflow_uri}", *IN_ONE_PROCESS)
    assert run.info.status == "FINISHED" and run.data.params["dataset.name"] == loader


QUICKSTART = ROOT / "configs" / "quickstart.yaml"
"""Run through the CLI below in both executors (its partition switched to quality skew), so not again here."""
SHIPPED = sorted({*(ROOT / "configs").glob("*.yaml"), *(PAPER / "suites").glob("*.yaml")} - {QUICKSTART})
"""Every shipped experiment, suite and sweep but `configs/paper/*.yaml` (run through the CLI above) and the
quickstart."""

HELD_BACK = ["partition.reserved=2000", "partition.server_samples=2000"]
SCALED_DOWN = {
    name: HELD_BACK for name in ("augfl.yaml", "perfedavg.yaml", "fedlp.yaml", "kd_only.yaml", "fedpcl.yaml")
}
SCALED_DOWN["augfl_fmnist_table2.yaml"] = FEW_SHOT_FIXTURE
"""Overrides for Fashion-MNIST configs that hold back more samples than the tenth has: AugFL and the PM-aided
baselines keep 20,000 from every client for the pretrained model and D_s (here 2,000 each), and Per-FedAvg in
AugFL's setting the same 20,000 (so that its clients are AugFL's). A method that pretrains a model pretrains it for
one epoch, not five (`run_one_round`)."""


def first_setting(path: Path, tracking_uri: str) -> tuple[dict[str, Any], Path]:
    """A shipped file's experiment as a raw config tree: the file itself, a suite's first run at its first seed,
    or a sweep's first trial; and the experiment file it derives from (its `base_config`, else itself)."""
    if is_suite_file(path):
        config = validate_config(suite_trees(path)[0][1])
    elif is_sweep_file(path):
        config = load_sweep(path).trials(tracking_uri)[0].config
    else:
        return read_mapping(path), path
    base = read_mapping(path).get("base_config")
    return config.model_dump(mode="json", by_alias=True), (path.parent / base).resolve() if base else path


@functools.cache
def suite_trees(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A shipped suite's children as raw trees, read once per process: the module's parameters take what they need
    from them without validating 8,000 children in every worker's collection (a FLAME robustness suite has 260;
    test_every_registered_algorithm_runs_in_a_shipped_suite validates them all, once)."""
    return load_suite(path).trees()


@functools.cache
def _shipped_first(path: Path) -> tuple[str, Path]:
    """`first_setting` of a shipped file, as JSON, computed once (collection and two tests read it)."""
    tree, source = first_setting(path, "sqlite:///shipped.db")
    return json.dumps(tree), source


def _experiment_key(path: Path) -> str:
    """What a shipped file runs, without its run's name, length and store: files that run the same experiment
    (a suite's first child and the config it is based on) run it once."""
    tree = validate_config(json.loads(_shipped_first(path)[0])).model_dump(mode="json", by_alias=True)
    for key in ("run_name", "uri"):
        tree["tracking"].pop(key)
    tree.pop("rounds")
    return json.dumps(tree, sort_keys=True)


@functools.cache
def distinct_experiments() -> list[list[Path]]:
    """The shipped files grouped by the experiment they run, in file order."""
    groups: dict[str, list[Path]] = {}
    for path in SHIPPED:
        groups.setdefault(_experiment_key(path), []).append(path)
    return list(groups.values())


def test_every_shipped_file_is_an_experiment_suite_or_sweep_with_data_here():
    for path in SHIPPED:
        tree, source = json.loads(_shipped_first(path)[0]), _shipped_first(path)[1]
        dataset = tree.get("dataset", {}).get("name", "fashion_mnist")
        known = source.name in DATA or source.name in SUITE_DATA or dataset in ("fashion_mnist", *BUILT_IN)
        assert known, f"{path.name}: no fixture for dataset {dataset}"
    assert set(SCALED_DOWN) <= {p.name for p in SHIPPED}
    assert sorted(path for group in distinct_experiments() for path in group) == SHIPPED
    shipped = {*(ROOT / "configs").glob("*.yaml"), *PAPER.glob("*.yaml"), *(PAPER / "suites").glob("*.yaml")}
    assert shipped == {*SHIPPED, *(PAPER / name for name in DATA), QUICKSTART}


def run_one_round(
    tree: dict[str, Any], source: Path, tmp_path: Path, mlflow_uri: str, fmnist_tenth: Path, figures: bool = True
) -> None:
    """One round of a shipped experiment tree, in this process (the CLI path of each kind of file has its own tests):
    the paper datasets that are not installed come from the folders above, Fashion-MNIST is the tenth (SCALED_DOWN where
    it holds too little), the built-in ones are scaled down (BUILT_IN). Its hosts run in this process (runtime.actors:
    in_process, the code Ray's actors run: a new actor process costs most of a one-round run, and
    tests/integration/test_matrix_on_ray.py shows every method logs the same on Ray; the paper configs run through Ray
    above). Local training is light (tests/support/light.py): the test checks that the experiment runs and logs, not
    what it learns. It saves the global model, so that every shipped model is saved once, but not the clients' models
    (hundreds of MB for a suite of ResNet-18 clients: tests/integration/test_saved_models.py). Nor does it score the
    clients' training loss, a third of a one-round run: the paper configs' runs above score it (FLAME's, FedAPM's and
    FedSLR's models on their datasets), as do the matrix (every algorithm) and the algorithms' own CLI tests. It
    scores three clients at each evaluation (tracking.eval_sample), not all of the setting's: scoring every client was
    a fifth of these runs' CPU, and the paper configs' runs above and the matrix score every one. It draws the run's
    figures as PNG only: every shipped setting's figures are drawn, laid out and written once, not again as PDF and
    SVG (half a second of CPU per run; the paper configs' runs above and tests/system/test_cli.py write those); with
    `figures` false, none (a method's run in a suite setting: its curves are those of any run, drawn from the same
    keys, and a fifth of such a run's CPU)."""
    sets = [
        "rounds=1",
        f"tracking.uri={mlflow_uri}",
        "runtime.num_hosts=1",
        "runtime.actors=in_process",
        "tracking.save_models=global",
        "tracking.train_loss=false",
        f"tracking.figures={'[png]' if figures else '[]'}",
        "tracking.eval_sample=3",
    ]
    dataset = tree.get("dataset", {}).get("name", "fashion_mnist")
    if dataset == "fashion_mnist":
        sets += [f"dataset.root={fmnist_tenth}", *SCALED_DOWN.get(source.name, [])]
    elif dataset in BUILT_IN:
        sets += BUILT_IN[dataset]
    else:
        root = tmp_path / "data"
        root.mkdir()
        sets += [f"dataset.root={root}", *{**DATA, **SUITE_DATA}[source.name](root)]
    if "teacher_epochs" in ALGORITHMS.get(tree["algorithm"]["name"]).Settings.model_fields:
        sets.append("algorithm.teacher_epochs=1")
    apply_overrides(tree, sets)
    tree["algorithm"] = {**tree["algorithm"], **light_training(tree["algorithm"])}
    config = validate_config(tree)
    result = run_experiment(config, show_progress=False)
    check_logged(MlflowClient(mlflow_uri), result.run_id, config.model_dump(mode="json", by_alias=True))


FLAME_VARIANTS = {
    *(PAPER / "suites").glob("flame_sensitivity_*"),
    *(PAPER / "suites").glob("flame_robustness_*"),
} - {PAPER / "suites" / "flame_robustness_fmnist.yaml"}
"""FLAME's sensitivity suites and the robustness suites but Fashion-MNIST's hybrid-skew grid: their first settings are
FLAME on a dataset and scheme that a Table III suite's or flame_robustness_fmnist's first setting already trains (CI
time); every child of theirs is validated and partitioned, and every setting (one per robustness suite on other data
than Fashion-MNIST's) trains a round in process (tests/system/test_flame_grids.py)."""
FEDSLR_SENSITIVITY = set((PAPER / "suites").glob("fedslr_sensitivity_*"))
"""FedSLR's sensitivity suites: every setting of theirs trains a round in process
(tests/system/test_paper_suites.py)."""
FLAME_TABLE3_ELSEWHERE = {PAPER / "suites" / f"flame_table3_{name}.yaml" for name in ("mnist", "cifar10", "mmnist")}
"""FLAME's Table III suites whose first setting is its paper config's run on the same data and model
(configs/paper/flame_*.yaml, test_paper_config_runs_from_a_folder_in_the_standard_layout)."""
FEDAPM_STUDIES = {path for study in ("rho", "fraction", "lr") for path in (PAPER / "suites").glob(f"fedapm_{study}_*")}
"""FedAPM's figure studies: FedAPM on its Table 3 settings with one value changed; the first setting of each trains a
round in process (tests/system/test_paper_suites.py)."""
LEFT_OUT = {
    *TABLE2_SUITES,
    *AUGFL_STUDIES,
    *FLAME_VARIANTS,
    *FEDSLR_SENSITIVITY,
    *FLAME_TABLE3_ELSEWHERE,
    *FEDAPM_STUDIES,
}
FIRST_SETTINGS = [kept for paths in distinct_experiments() if (kept := [p for p in paths if p not in LEFT_OUT])]
"""The groups of `distinct_experiments` but AugFL's Table II suites, whose settings train a round below, its figure
studies (a setting of each trains a round in tests/system/test_paper_suites.py) and FLAME_VARIANTS."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "paths", FIRST_SETTINGS, ids=lambda paths: "=".join(str(p.relative_to(ROOT / "configs")) for p in paths)
)
def test_every_shipped_config_and_first_setting_runs_one_round(paths, tmp_path, mlflow_uri, fmnist_tenth):
    run_one_round(*first_setting(paths[0], mlflow_uri), tmp_path, mlflow_uri, fmnist_tenth)


def suite_methods() -> dict[str, tuple[Path, int]]:
    """Every algorithm that a paper suite runs, at the first child that runs it (suites in file order), but those
    whose first child is a suite's first setting (run by the test above): algorithm -> (suite, child index). Every
    child of every suite is validated (test_every_registered_algorithm_runs_in_a_shipped_suite); running each setting
    of each suite would be hundreds of runs, so each method runs one round once in a paper suite's setting (AugFL's
    Table II suites train every setting in-process, below)."""
    found: dict[str, tuple[Path, int]] = {}
    for path in sorted(set((PAPER / "suites").glob("*.yaml")) - set(TABLE2_SUITES) - set(AUGFL_STUDIES)):
        for index, (_name, tree) in enumerate(suite_trees(path)):
            found.setdefault(tree["algorithm"]["name"], (path, index))
    return {algorithm: (path, index) for algorithm, (path, index) in found.items() if index}


SUITE_METHODS = suite_methods()


def test_every_registered_algorithm_runs_in_a_shipped_suite():
    """The baselines suite (configs/compare.yaml) and the paper suites together run every method in raysim (its own
    entries: a plugin another test of this process registered is not shipped)."""
    suites = [path for path in SHIPPED if is_suite_file(path)]
    run = {config.algorithm.name for path in suites for _name, config in load_suite(path).experiments()}
    own = {name for name, algorithm in ALGORITHMS.items() if algorithm.__module__.startswith("raysim.")}
    assert own <= run and "flame" in own


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(SUITE_METHODS))
def test_every_method_of_the_shipped_suites_runs_one_round_in_a_suite_setting(
    algorithm, tmp_path, mlflow_uri, fmnist_tenth
):
    path, index = SUITE_METHODS[algorithm]
    config = validate_config(suite_trees(path)[index][1])
    assert config.algorithm.name == algorithm
    tree = config.model_dump(mode="json", by_alias=True)
    base = read_mapping(path).get("base_config")
    source = (path.parent / base).resolve() if base else path
    run_one_round(tree, source, tmp_path, mlflow_uri, fmnist_tenth, figures=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", TABLE2_SUITES, ids=lambda path: path.stem)
def test_every_setting_of_augfls_table2_suites_trains_a_round_in_process(path, tmp_path, fmnist_tenth, monkeypatch):
    """Each column of the Fashion-MNIST row (of the other rows, AugFL with its teacher) at its first seed, on its
    dataset's fixture (FEW_SHOT_FIXTURE) with the paper's ResNet8x4 clients and ResNet32x4 teacher: its data,
    partition and pretrained teacher prepared, one round trained and the held-out target client adapted and scored,
    in this process (a ResNet round through Ray and MLflow costs seconds more per setting; each method runs through
    them from its configs/<method>.yaml, above), with the local work shortened (one pretraining epoch, one Per-FedAvg
    step)."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path / "cache"))  # the pretrained teachers
    suite = load_suite(path)
    root = tmp_path / "data"
    root.mkdir()
    dataset = suite.experiments()[0][1].dataset.name
    data = [f"dataset.root={fmnist_tenth}"] if dataset == "fashion_mnist" else ["dataset.root=" + str(root)]
    data += SUITE_DATA[path.name](root) if dataset != "fashion_mnist" else SCALED_DOWN[path.name]
    children = [(name, config) for name, config in suite.experiments() if config.seed == suite.seeds[0]]
    assert [name for name, _ in children] == [run.name for run in suite.runs]
    if dataset != "fashion_mnist":  # CI time: every column on Fashion-MNIST, AugFL itself on the other rows' data
        children = [(name, config) for name, config in children if name == "augfl_with_teacher"]
        assert children, f"{path.name}: no augfl_with_teacher run"
    for name, child in children:
        tree = child.model_dump(mode="json", by_alias=True)
        shorter = [f"algorithm.{key}=1" for key in ("teacher_epochs", "local_steps") if key in tree["algorithm"]]
        apply_overrides(tree, ["rounds=1", *data, *shorter])
        config = validate_config(tree)
        assert config.model.name == "resnet8x4" and config.clients.heldout_count == 1, name
        sim = InProcess(config)
        metrics = sim.round(0)
        evaluated = sim.host.evaluate(sim.coordinator.global_model(), sim.coordinator.evaluation_context())
        assert all(np.isfinite(v) for v in metrics.values()), name
        target = evaluated.column("pm_test_acc")[2].as_py()  # the held-out client, adapted from the global model
        assert evaluated.column("client_id").to_pylist() == [0, 1, 2] and 0.0 <= target <= 1.0, name


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_the_quickstart_with_quality_skew_runs_through_the_cli(executor, mlflow_uri, fmnist_tenth):
    """Issue 29's first report: every client's empty validation split, read with its per-access noise at round-0
    evaluation, crashed both executors. The executors are the subject: the host runs in this process
    (IN_ONE_PROCESS; the README's quickstart runs on a new local Ray in tests/system/test_docs.py)."""
    sets = [
        "partition={scheme: quality, sigma: 0.1}",
        "rounds=1",
        f"runtime.client_training={executor}",
        f"dataset.root={fmnist_tenth}",
        f"tracking.uri={mlflow_uri}",
        *IN_ONE_PROCESS,
    ]
    run = run_through_cli(QUICKSTART, mlflow_uri, *sets)
    assert run.data.params["partition.scheme"] == "quality"
    config = load_config(QUICKSTART, sets).model_dump(mode="json", by_alias=True)
    check_logged(MlflowClient(mlflow_uri), run.info.run_id, config)
