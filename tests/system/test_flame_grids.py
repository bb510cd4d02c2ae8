"""FLAME's grids as suites (issue 33; flame.md 4.2, 6.3-6.4, 8, 9.15): Table III on every dataset, the robustness grid
on every partition the appendix uses, the sensitivity studies of Figs. 9-12. Every child of every FLAME suite is dealt
(its partition at every seed and its attackers, as `raysim run` does before any run) on a tenth of its dataset (or its
labels), and every setting trains one round in this process; the first setting of every suite runs one round through
Ray and MLflow in tests/system/test_paper_configs.py (the FEMNIST row's on files in TFF's layout), every method of the
suites in a suite setting there too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raysim.config import ExperimentConfig, validate_config
from raysim.studies.suite import SuiteConfig, check_partitions, load_suite
from tests.support.inprocess import InProcess
from tests.support.light import light_training
from tests.support.paper_data import SUITE_DATA
from tests.support.paths import ROOT

SUITES = ROOT / "configs" / "paper" / "suites"
FLAME_SUITES = sorted(SUITES.glob("flame_*.yaml"))
DATASETS = ("mnist", "fmnist", "mmnist", "cifar10", "femnist")
"""Table III's datasets, as the suites' file names spell them."""
ROBUSTNESS_ELSEWHERE = sorted(
    set(SUITES.glob("flame_robustness_*.yaml")) - set(SUITES.glob("flame_robustness_fmnist*"))
)
"""The robustness grids on the other datasets (issue 48): Fashion-MNIST's settings (methods, attacks, fractions)
with another dataset and model, which the Table III suites train on that data; one setting of each trains a round
(`test_one_attacked_setting_of_each_robustness_suite_on_other_data_trains_one_round`), the others are dealt."""
TABLE3_PARTITIONS = {"q2", "q3", "q4", "q5", "q6", "dir_label", "quality", "dir_quantity", "hybrid"}
ATTACKS = {"same_value", "sign_flip", "gaussian", "label_poisoning"}
APPENDIX_ATTACKS = {"q2": ATTACKS, "dir_label": ATTACKS - {"gaussian"}, "quality": ATTACKS, "dir_quantity": ATTACKS}
"""The attacks of the appendix's figures by partition (flame.md 4.2: Figs. 21-35; no Gaussian one for Dir label)."""
CLASS_SIZES = {
    "mnist": [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958],  # train + test: 70,000
    "cifar10": [6000] * 10,
    "mmnist": [10000, 8954, 10000, 10000, 10000, 10000],  # Kaggle's Medical MNIST: 58,954, read class by class
}
"""The pooled datasets' samples per class (flame.md 6.1): who holds what depends on the labels only, so the dealing
is checked on labels at a tenth of these sizes, as on the tenth of Fashion-MNIST (the small image fixtures are too
small: Dirichlet shares of a few hundred samples leave clients empty)."""
TRAINING_SHARE = 40
"""The settings that train a round do so on a fortieth of CLASS_SIZES (their dealing is checked on the tenth): the
round checks that a setting trains, which three clients of about a hundred samples do as well as of four hundred,
while every sample is a pass of the dataset's model (Medical MNIST's CNN on 64x64 RGB images: its Table III suite's
27 settings took about 2.7 s of CPU each at a tenth, 0.4 s at a fortieth, its data made and loaded included)."""


def _settings(path) -> set[tuple[str, ...]]:
    return {tuple(run.name.split("/")) for run in load_suite(path).runs}


def test_the_flame_suites_hold_the_papers_grids():
    for data in ("mnist", "fmnist", "mmnist", "cifar10"):
        assert _settings(SUITES / f"flame_table3_{data}.yaml") == {
            (method, partition) for method in ("flame", "pfedme", "ditto") for partition in TABLE3_PARTITIONS
        }
        sensitivity = load_suite(SUITES / f"flame_sensitivity_{data}.yaml").experiments()
        studies = {name.split("/")[0] for name, _ in sensitivity}
        assert studies == {"lambda", "H", "rho", "s"} and {c.algorithm.name for _, c in sensitivity} == {"flame"}
        assert {c.clients.per_round_count() for name, c in sensitivity if name.startswith("s/")} == {10, 30, 50}
        assert {c.clients.count for name, c in sensitivity} == {10, 100}
    assert _settings(SUITES / "flame_table3_femnist.yaml") == {(m, "writers") for m in ("flame", "pfedme", "ditto")}
    for partition, attacks in APPENDIX_ATTACKS.items():
        settings = _settings(SUITES / f"flame_robustness_fmnist_{partition}.yaml")
        assert {s[1] for s in settings if len(s) == 3} == attacks
        assert {s[0] for s in settings} == {"flame", "pfedme", "ditto", "multi_krum"}
        for data in ("mnist", "mmnist", "cifar10"):  # every Table III dataset: the same grid
            assert _settings(SUITES / f"flame_robustness_{data}_{partition}.yaml") == settings
    hybrid = _settings(SUITES / "flame_robustness_fmnist.yaml")
    assert {s[1:] for s in hybrid if len(s) == 3} == {(a, f) for a in ATTACKS for f in ("0.2", "0.5", "0.8")}
    for data in ("mnist", "mmnist", "cifar10", "femnist"):
        assert _settings(SUITES / f"flame_robustness_{data}.yaml") == hybrid
    for path in ROBUSTNESS_ELSEWHERE:  # Fashion-MNIST's grid but for the data and the model of the dataset's Table III
        table3 = load_suite(SUITES / f"flame_table3_{_dataset(path)}.yaml").experiments()[0][1]
        (_, config), fmnist = load_suite(path).experiments()[0], load_suite(SUITES / "flame_robustness_fmnist.yaml")
        assert (config.dataset, config.model) == (table3.dataset, table3.model), path.name
        assert config.algorithm == fmnist.experiments()[0][1].algorithm and config.clients.count == 50, path.name


def _dataset(path: Path) -> str:
    """The Table III dataset a FLAME suite's file name names."""
    (data,) = set(path.stem.split("_")) & set(DATASETS)
    return data


def _grid_data(
    path: Path, tmp_path: Path, fmnist_tenth: Path, input_shape: tuple[int, ...] = (1,), share: int = 10
) -> list[str]:
    """The overrides that put a FLAME suite on test data: the installed Fashion-MNIST's tenth, TFF's layout for
    FEMNIST (five writers: two clients), or a .npz of labels at a `share`-th of the others' class sizes
    (CLASS_SIZES) with samples of `input_shape` (random pixels of 0 or 1, the scale of normalized images: the dealing
    depends on the labels only)."""
    data = _dataset(path)
    root = tmp_path / "data"
    if data in CLASS_SIZES:
        labels = np.repeat(np.arange(len(CLASS_SIZES[data])), [size // share for size in CLASS_SIZES[data]])
        if data != "mmnist":
            np.random.default_rng(0).shuffle(labels)
        x = np.random.default_rng(1).integers(0, 2, size=(len(labels), *input_shape), dtype=np.uint8)
        np.savez(tmp_path / "labels.npz", x=x, y=labels)
        return [f"dataset={{name: npz, path: {tmp_path / 'labels.npz'}}}"]
    if data == "femnist":
        return [f"dataset.root={root}", *SUITE_DATA[path.name](root)]
    return [f"dataset.root={fmnist_tenth}"]


@pytest.mark.parametrize("path", FLAME_SUITES, ids=lambda path: path.name)
def test_every_setting_of_a_flame_suite_is_dealt_on_its_data(path, tmp_path, fmnist_tenth):
    """Every distinct partition (and attacker count) of every child, at every seed."""
    children = load_suite(path, _grid_data(path, tmp_path, fmnist_tenth)).experiments()
    check_partitions([(c.tracking.run_name, c) for _, c in children])


INPUT_SHAPES = {"mnist": (1, 28, 28), "cifar10": (3, 32, 32), "mmnist": (3, 64, 64)}
"""The samples the suites' models take on the datasets that are not installed (the Medical MNIST suites read its
JPEGs as 64x64 RGB)."""


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(set(FLAME_SUITES) - set(ROBUSTNESS_ELSEWHERE)), ids=lambda path: path.name)
def test_every_setting_of_a_flame_suite_trains_one_round(path, tmp_path, fmnist_tenth):
    """Each distinct setting (method, partition, attack, hyperparameters) at the suite's first seed: its data dealt (a
    TRAINING_SHARE of the pooled datasets), one round trained through the real client host and coordinator in this
    process (tests/support/inprocess.py; Ray and MLflow run each suite's first setting and each method in
    tests/system/test_paper_configs.py), by three clients, an attacker among them in an attacked setting, with light
    local work (tests/support/light.py)."""
    overrides = _grid_data(path, tmp_path, fmnist_tenth, INPUT_SHAPES.get(_dataset(path), (1,)), TRAINING_SHARE)
    suite = load_suite(path, overrides)
    children = _at_first_seed(suite)
    assert [name for name, _ in children] == [run.name for run in suite.runs]
    assert all(c.seed == suite.seeds[0] for _, c in children)
    for name, child in children:
        _train_one_round(name, child)


def _at_first_seed(suite: SuiteConfig) -> list[tuple[str, ExperimentConfig]]:
    """The suite's children at its first seed, validated without its other seeds' (a robustness suite has 260
    children, 52 of them at a seed)."""
    return suite.model_copy(update={"seeds": suite.seeds[:1]}).experiments()


def _train_one_round(name: str, child) -> None:
    """One round of a suite's child by three clients, an attacker among them in an attacked setting, with light
    local work: finite metrics and a finite step of the global model."""
    tree = child.model_dump(mode="json", by_alias=True)
    tree["algorithm"] = {**tree["algorithm"], **light_training(tree["algorithm"])}
    run = InProcess(validate_config(tree))
    honest = sorted(set(range(run.problem.num_training)) - run.problem.malicious)
    selected = sorted({*honest[:2], *sorted(run.problem.malicious)[:1]})
    assert (child.attack.kind == "none") == (not run.problem.malicious), name
    before = np.array(run.coordinator.global_model(), copy=True)
    metrics = run.round(0, selected)
    after = run.coordinator.global_model()
    assert metrics and all(np.isfinite(v) for v in metrics.values() if isinstance(v, float)), name
    assert np.isfinite(after).all() and not np.array_equal(before, after), f"{name}: no finite step of w"


ONE_SETTING = {"": "multi_krum/label_poisoning/0.5", "q2": "flame/sign_flip/0.2", "quality": "ditto/gaussian/0.8"}
ONE_SETTING |= {"dir_label": "pfedme/same_value/0.5", "dir_quantity": "flame/label_poisoning/0.8"}
"""The one setting of each robustness suite on other data that trains, by its partition ("" the hybrid main grid):
together every method and every attack on the models of MNIST, Medical MNIST and CIFAR-10 (FEMNIST's one suite:
Multi-Krum under label poisoning)."""


@pytest.mark.slow
@pytest.mark.parametrize("path", ROBUSTNESS_ELSEWHERE, ids=lambda path: path.name)
def test_one_attacked_setting_of_each_robustness_suite_on_other_data_trains_one_round(path, tmp_path, fmnist_tenth):
    """The setting ONE_SETTING names, at the suite's first seed, on the dataset's stand-in (CLASS_SIZES' labels with
    samples of its input shape; FEMNIST in TFF's layout) with the dataset's model: one round through the real client
    host and coordinator in this process."""
    partition = path.stem.removeprefix(f"flame_robustness_{_dataset(path)}").removeprefix("_")
    overrides = _grid_data(path, tmp_path, fmnist_tenth, INPUT_SHAPES.get(_dataset(path), (1,)))
    suite = load_suite(path, overrides)
    (child,) = [c for n, c in _at_first_seed(suite) if n == ONE_SETTING[partition] and c.seed == 1]
    assert child.seed == suite.seeds[0] and child.attack.kind != "none"
    _train_one_round(ONE_SETTING[partition], child)
