"""The papers' tables as suites (`configs/paper/suites/`): each validates child by child, FLAME's make every
partition they name, and a slice of FLAME's Table III suite runs from the shipped file and is summarized by
`raysim table`, as the README says."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.config import ExperimentConfig, apply_overrides, flatten, validate_config
from raysim.studies.suite import check_partitions, load_suite
from raysim.studies.table import make_table
from tests.support.fedapm import STUDIES
from tests.support.fedapm import TABLE3 as FEDAPM_DATA
from tests.support.inprocess import InProcess
from tests.support.light import light_training
from tests.support.paper_data import AUGFL_STUDIES, BUILT_IN, FEW_SHOT_FIXTURE, SUITE_DATA
from tests.support.paths import ROOT
from tests.support.stores import fresh_store

SUITES = ROOT / "configs" / "paper" / "suites"
CHILDREN = {
    "flame_table3_fmnist.yaml": 135,  # 9 partitions x 3 methods x 5 seeds
    "flame_robustness_fmnist.yaml": 260,  # 4 methods x (clean + 4 attacks x 3 fractions) x 5 seeds
    **{f"flame_table3_{d}.yaml": 135 for d in ("mnist", "mmnist", "cifar10")},  # as fmnist
    "flame_table3_femnist.yaml": 15,  # feature skew x 3 methods x 5 seeds
    **{f"flame_robustness_fmnist_{p}.yaml": 260 for p in ("q2", "quality", "dir_quantity")},  # as hybrid skew
    "flame_robustness_fmnist_dir_label.yaml": 200,  # 4 methods x (clean + 3 attacks x 3 fractions) x 5 seeds
    # issue 48: the robustness grids on every Table III dataset, each as Fashion-MNIST's (FEMNIST: feature skew only)
    **{f"flame_robustness_{d}{p}.yaml": 260 for d in ("mnist", "mmnist", "cifar10") for p in ("", "_q2", "_quality")},
    **{f"flame_robustness_{d}_dir_quantity.yaml": 260 for d in ("mnist", "mmnist", "cifar10")},
    **{f"flame_robustness_{d}_dir_label.yaml": 200 for d in ("mnist", "mmnist", "cifar10")},  # no Gaussian attack
    "flame_robustness_femnist.yaml": 260,  # feature skew x 4 methods x (clean + 4 attacks x 3 fractions) x 5 seeds
    **{f"flame_sensitivity_{d}.yaml": 60 for d in ("mnist", "fmnist", "mmnist", "cifar10")},  # 4 studies x 3 x 5 seeds
    "fedslr_vs_fedavg_cifar10.yaml": 6,
    "fedapm_comparison_cifar10.yaml": 25,
    **{f"augfl_{d}_table2.yaml": 45 for d in ("fmnist", "cifar10", "cifar100", "emnist", "tiny_imagenet")},  # 9 x 5
    # issue 48: AugFL's figure studies (augfl.md 6), AugFL alone, 5 seeds each
    **{f"augfl_{d}_fig3.yaml": 20 for d in ("fmnist", "cifar10", "emnist")},  # M in 5, 10, 15, 20
    "augfl_cifar100_fig3.yaml": 25,  # M in 10, 20, 30, 40, 50
    **{f"augfl_{d}_fig6.yaml": 20 for d in ("emnist", "cifar10")},  # 10, 20, 40, 80 training clients
    "augfl_fmnist_fig4.yaml": 20,  # rho in 0.35, 0.7, 1.0, 1.5
    "augfl_fmnist_fig8.yaml": 25,  # lambda in 0 (no teacher), 1, 5, 10, 20
    "augfl_cifar10_fig9.yaml": 30,  # 3 teacher architectures, 3 more pretraining-pool sizes
    "fedapm_authors_fmnist.yaml": 8,  # 4 methods x 2 seeds
    **{f"fedapm_table3_{d}.yaml": 25 for d in ("cifar10", "crisismmd", "kuhar", "cremad")},  # 5 methods x 5 seeds
    **{f"fedapm_table4_{d}.yaml": 35 for d in ("cifar10", "crisismmd", "kuhar", "cremad")},  # 7 methods x 5 seeds
    # issue 48: Table 4's ResNet-18 columns (Table 3's 5 methods + 7, 5 seeds) and FedAPM's figure studies (5 seeds)
    **{f"fedapm_table4_{d}.yaml": 60 for d in ("cifar100", "tiny_imagenet")},
    **{f"fedapm_{s}_{d}.yaml": n for s, n in (("rho", 25), ("fraction", 20), ("lr", 20)) for d in FEDAPM_DATA},
    # FedSLR Table 1's 12 rows in 11 runs (FedSLR's run gives GKR and mixed) and the GPGD/LPGD ablations, one seed
    **{f"fedslr_table1_{d}_{s}.yaml": 13 for d in ("cifar10", "cifar100", "tiny_imagenet") for s in ("iid", "noniid")},
    # issue 47's field benchmark: 51 methods x 2 splits x 3 seeds (benchmarks/field_benchmark.py)
    **{f"field_benchmark_{d}.yaml": 306 for d in ("fmnist", "cifar10")},
    # FedSLR's sensitivity studies (fedslr.md 8): Tables 3-7, one seed
    **{
        f"fedslr_sensitivity_{study}_cifar100.yaml": n
        for study, n in (("lambda", 5), ("mu", 5), ("eta_g", 4), ("phase1_epochs", 4), ("pure_personal", 3))
    },
}


def test_every_paper_suite_is_listed_here():
    assert sorted(p.name for p in SUITES.glob("*.yaml")) == sorted(CHILDREN)


@pytest.mark.parametrize("name", sorted(CHILDREN))
def test_every_child_of_a_paper_suite_validates(name):
    children = load_suite(SUITES / name).experiments()
    assert len(children) == CHILDREN[name]
    assert len({c.tracking.run_name for _, c in children}) == len(children)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flame_table3_fmnist.yaml", "flame_robustness_fmnist.yaml"])
def test_the_flame_suites_partitions_and_attackers_can_all_be_made(name):
    """Every distinct (partition, seed) of the suite dealt from the real Fashion-MNIST, as before a real run."""
    children = load_suite(SUITES / name).experiments()
    check_partitions([(c.tracking.run_name, c) for _, c in children])


@pytest.mark.slow
def test_a_slice_of_flames_table3_suite_runs_and_tabulates(tmp_path, ray_local):
    """FLAME, pFedMe and Ditto on #label = 2 with every authors'-code switch, seed 1, one round (the best of steps 0
    and 1 tabulated): the shipped file's own base and members, run by `raysim run` and summarized by `raysim table
    PARENT --at best`."""
    shipped = yaml.safe_load((SUITES / "flame_table3_fmnist.yaml").read_text())
    uri = fresh_store(tmp_path / "mlflow.db")
    shipped["runs"] = [r for r in shipped["runs"] if r["name"].endswith("/q2")]
    shipped["seeds"] = [1]
    shipped["base"] |= {"rounds": 1}
    shipped["base"]["runtime"] |= {"reuse_actors": True}  # CI time: each child on the actors of the one before
    shipped["base"]["tracking"] |= {"uri": uri, "figures": []}
    path = tmp_path / "slice.yaml"
    path.write_text(yaml.safe_dump(shipped))
    assert main(["run", str(path), "--quiet"]) == 0
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("paper-flame-table3-fmnist").experiment_id
    (parent,) = [r.info.run_id for r in client.search_runs([experiment]) if r.data.tags.get("suite")]
    table = make_table(uri, parent, at="best")
    assert [row[0] for row in table.rows] == ["flame/q2", "pfedme/q2", "ditto/q2"]
    for _setting, seeds, cells in table.rows:
        assert seeds == [1] and all(0.0 < cells[m].mean <= 1.0 for m in ("pm/acc", "gm/acc", "hm/acc"))
    params = {r.info.run_name.removesuffix("/seed1"): r.data.params for r in client.search_runs([experiment])}
    assert params["ditto/q2"]["algorithm.global_steps"] == "one_batch"
    assert params["ditto/q2"]["clients.batches"] == "authors" and params["flame/q2"]["clients.batches"] == "authors"
    assert params["flame/q2"]["partition.draw"] == "authors" and params["flame/q2"]["model.init"] == "authors"
    assert params["pfedme/q2"]["tracking.gm_scored"] == "before_aggregation"


def test_augfls_table2_rows_have_the_papers_clients_and_models():
    """augfl.md 4.1-4.2: 50 clients for Fashion-MNIST, CIFAR-10 and Tiny-ImageNet, 100 for CIFAR-100 and EMNIST
    (letters), 20% of them held-out targets; ResNet8x4 clients, a ResNet32x4 teacher wherever there is one."""
    counts = {"fmnist": 50, "cifar10": 50, "tiny_imagenet": 50, "cifar100": 100, "emnist": 100}
    for data, count in counts.items():
        for _name, config in load_suite(SUITES / f"augfl_{data}_table2.yaml").experiments():
            assert (config.clients.count, config.clients.heldout, config.model.name) == (count, 0.2, "resnet8x4")
            assert getattr(config.algorithm, "teacher_model", None) in (None, "resnet32x4")
            assert config.partition.shots == 20 and config.partition.test_fraction == 0.5
    assert load_suite(SUITES / "augfl_emnist_table2.yaml").experiments()[0][1].dataset.split == "letters"


STUDIED = {
    "fig3": {"partition.shots"},
    "fig6": {"clients.count"},
    "fig4": {"algorithm.rho"},
    "fig8": {"algorithm.lambda", "algorithm.regularizer"},
    "fig9": {"algorithm.teacher_model", "partition.reserved"},
}
"""What each of AugFL's figure studies varies (augfl.md 6): M, the client count, rho, lambda (0: no teacher), the
teacher's architecture and its pretraining pool."""
RUN_LABELS = {"seed", "tracking.experiment", "tracking.run_name", "tracking.color", "tracking.group"}


def test_augfls_figure_studies_vary_one_setting_of_their_table2_row():
    """Each study suite is its dataset's Table II AugFL run (`augfl_with_teacher`) with only the figure's setting
    changed, every run a different value of it."""
    for path in AUGFL_STUDIES:
        data, figure = path.stem.removeprefix("augfl_").rsplit("_", 1)
        table2 = load_suite(SUITES / f"augfl_{data}_table2.yaml").experiments()
        (row,) = [c for name, c in table2 if name == "augfl_with_teacher" and c.seed == 1]
        reference = flatten(row.model_dump(mode="json", by_alias=True))
        values = set()
        for name, config in load_suite(path).experiments():
            flat = flatten(config.model_dump(mode="json", by_alias=True))
            changed = {key for key, value in flat.items() if reference.get(key) != value} - RUN_LABELS
            assert changed <= STUDIED[figure], (path.name, name, changed)
            values.add(tuple(str(flat[key]) for key in sorted(STUDIED[figure])))
        assert len(values) == len(load_suite(path).runs), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", AUGFL_STUDIES, ids=lambda path: path.stem)
def test_the_first_setting_of_each_augfl_study_trains_a_round_in_process(path, tmp_path, fmnist_tenth, monkeypatch):
    """One round of each study's first setting at its first seed in this process, with the paper's ResNet8x4 clients
    and its teacher pretrained for one epoch, on its Table II row's fixture (FEW_SHOT_FIXTURE: three clients, one a
    held-out target; Fig. 3 keeps its M), the target adapted and scored."""
    monkeypatch.setenv("RAYSIM_CACHE", str(tmp_path / "cache"))  # the pretrained teachers
    root = tmp_path / "data"
    root.mkdir()
    name, config = load_suite(path).experiments()[0]
    if config.dataset.name == "fashion_mnist":
        data = [f"dataset.root={fmnist_tenth}", *FEW_SHOT_FIXTURE]
    else:
        data = [f"dataset.root={root}", *SUITE_DATA[path.name](root)]
    if path.stem.endswith("_fig3"):
        data = [o for o in data if not o.startswith("partition.shots=")]
    tree = config.model_dump(mode="json", by_alias=True)
    apply_overrides(tree, ["rounds=1", "algorithm.teacher_epochs=1", *data])
    sim = InProcess(validate_config(tree))
    metrics = sim.round(0)
    evaluated = sim.host.evaluate(sim.coordinator.global_model(), sim.coordinator.evaluation_context())
    assert metrics and all(np.isfinite(v) for v in metrics.values()), name
    target = evaluated.column("pm_test_acc")[2].as_py()  # the held-out client, adapted from the global model
    assert evaluated.column("client_id").to_pylist() == [0, 1, 2] and 0.0 <= target <= 1.0, name


def sensitivity_settings() -> list[tuple[str, ExperimentConfig]]:
    """Every setting of FedSLR's sensitivity suites (fedslr.md 8); the centre setting (lambda 1e-4, mu 1e-3,
    eta_g 10, 2 Phase I epochs) that the first four share, once. (Their first settings, FedSLR on Table 1's CIFAR-100
    Non-IID cell with one value changed, do not run through Ray again: tests/system/test_paper_configs.py LEFT_OUT.)"""
    found: dict[str, tuple[str, ExperimentConfig]] = {}
    for path in sorted(SUITES.glob("fedslr_sensitivity_*.yaml")):
        for _name, config in load_suite(path).experiments():
            found.setdefault(config.algorithm.model_dump_json(), (path.name, config))
    return list(found.values())


def test_every_setting_of_fedslrs_sensitivity_suites_runs_one_round(tmp_path):
    """One round of each of the 18 distinct settings through the real client host and coordinator in this process
    (tests/support/inprocess.py; Ray and MLflow are exercised by the first settings' runs), on the CIFAR-100
    fixture with the CIFAR CNN and two clients (tests/system/test_paper_configs.py SUITE_DATA)."""
    settings = sensitivity_settings()
    assert len(settings) == 18  # (5 + 5 + 4 + 4 + 3) - 3 repeats of the centre
    for index, (suite, config) in enumerate(settings):
        root = tmp_path / str(index)
        root.mkdir()
        tree = config.model_dump(mode="json", by_alias=True)
        apply_overrides(tree, [f"dataset.root={root}", *SUITE_DATA[suite](root)])
        run = InProcess(validate_config(tree))
        metrics = run.round(0, [0, 1])
        assert np.isfinite(run.server.w).all()
        if config.algorithm.lam >= 10:  # Table 7's pure personalization: the SVT at lambda eta_g = 100 wipes the GKR
            assert metrics["rank_fraction"] == 0, suite
        else:
            assert metrics["rank_fraction"] > 0, suite


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_the_first_setting_of_each_fedapm_study_trains_a_round_in_process(study):
    """FedAPM's figure studies (fedapm_{rho,fraction,lr}_*.yaml): each dataset's first value at its first seed, one
    round in this process on the small built-in data (BUILT_IN; CIFAR-10's digits as shipped), light training, with
    the studied value in the run."""
    key, values = STUDIES[study]
    for dataset in sorted(FEDAPM_DATA):
        suite = load_suite(SUITES / f"fedapm_{study}_{dataset}.yaml")
        _name, config = suite.experiments()[0]
        tree = config.model_dump(mode="json", by_alias=True)
        apply_overrides(tree, list(BUILT_IN[config.dataset.name]))
        tree["algorithm"] |= light_training(tree["algorithm"])
        run = InProcess(validate_config(tree))
        assert flatten(run.config.model_dump(mode="json", by_alias=True))[key] == values[0]
        metrics = run.round(0)
        assert metrics and all(np.isfinite(v) for v in metrics.values()), (study, dataset)
        assert np.isfinite(run.coordinator.broadcast()).all(), (study, dataset)
