"""FedAPM's Table 4 ResNet-18 columns and its figure studies as suites (configs/paper/suites/fedapm_table4_cifar100,
_tiny_imagenet and fedapm_{rho,fraction,lr}_*.yaml): each is a Table 3 run with only what the paper changes changed.
One child of each trains a round in tests/system/test_paper_suites.py (the studies) and
tests/system/test_paper_configs.py (the Table 4 suites' first settings)."""

from __future__ import annotations

from raysim.config import ExperimentConfig, flatten
from raysim.studies.suite import load_suite
from tests.support.fedapm import STUDIES, SUITES, TABLE3, TABLE4_RESNET

RUN_LABELS = {"seed", "tracking.experiment", "tracking.run_name", "tracking.color", "tracking.group"}


def _flat(config: ExperimentConfig) -> dict:
    return flatten(config.model_dump(mode="json", by_alias=True))


def test_every_study_suite_varies_one_setting_of_its_table3_fedapm_run():
    """fedapm_{study}_{dataset}.yaml for each study and Table 3 dataset, and no other: every child is the dataset's
    Table 3 FedAPM run at the same seed with only the studied setting changed, over the study's values and the
    Table 3 suite's seeds, and no run touches `dataset` (the data switch reaches every child)."""
    names = {p.name for p in SUITES.glob("fedapm_*.yaml") if p.stem.split("_")[1] in STUDIES}
    assert names == {f"fedapm_{study}_{dataset}.yaml" for study in STUDIES for dataset in TABLE3}
    for dataset in TABLE3:
        table3 = load_suite(SUITES / f"fedapm_table3_{dataset}.yaml")
        fedapm = {config.seed: _flat(config) for name, config in table3.experiments() if name == "fedapm"}
        for study, (key, values) in STUDIES.items():
            suite = load_suite(SUITES / f"fedapm_{study}_{dataset}.yaml")
            assert not any(k.split(".")[0] == "dataset" for run in suite.runs for k in run.overrides), suite.name
            seen = set()
            for name, config in suite.experiments():
                flat = _flat(config)
                changed = {k for k, v in flat.items() if fedapm[config.seed].get(k) != v} - RUN_LABELS
                assert changed <= {key}, (suite.name, name, changed)
                seen.add((flat[key], config.seed))
            assert seen == {(value, seed) for value in values for seed in table3.seeds}, suite.name


def test_table4s_resnet_columns_run_cifar10s_methods_and_setting_on_resnet18():
    """Each of CIFAR-100's and Tiny-ImageNet's suites runs Table 3's and Table 4's CIFAR-10 methods with exactly
    their algorithm settings, CIFAR-10's partition, participation, rounds and seeds, on ResNet-18-GN and its own
    data, which no run touches."""
    cifar10 = [
        *load_suite(SUITES / "fedapm_table3_cifar10.yaml").experiments(),
        *load_suite(SUITES / "fedapm_table4_cifar10.yaml").experiments(),
    ]
    reference = {(name, config.seed): config for name, config in cifar10}
    for dataset in TABLE4_RESNET:
        suite = load_suite(SUITES / f"fedapm_table4_{dataset}.yaml")
        assert not any(k.split(".")[0] == "dataset" for run in suite.runs for k in run.overrides), dataset
        children = {(name, config.seed): config for name, config in suite.experiments()}
        assert set(children) == set(reference) and len(children) == 60
        for key, config in children.items():
            other = reference[key]
            assert config.algorithm == other.algorithm, key
            assert (config.partition, config.clients, config.rounds) == (other.partition, other.clients, other.rounds)
            assert (config.model.name, config.dataset.name) == ("resnet18_gn", dataset)
