"""FedAPM's paper suites (configs/paper/suites/fedapm_table3_*.yaml, fedapm_table4_*.yaml) and the qualitative
findings of fedapm.md 7.3 on the offline substitutes.

Issue 31's "done when": the Table 3 suites run end to end on a fresh clone on the substitutes (every dataset,
every method, one seed, shortened), and on the substitutes FedAPM's findings hold at a fixed seed, each checked
by real runs compared with each other (no number is written down here). The baselines run as Table 3's suites run
them, the authors' code at FedAPM's step (`loss_scale: 1/m` at FedAPM's lr): FedAvg `shared_only` (the shared
part trained, the server mean over all m), FedAlt and FedSim `average_over: all` (the same server).

fedapm.md 7.3's four findings are checked here. With the authors' FedAlt server (the mean of all m latest shared
parts, stale ones included) FedAPM's PM training loss is below FedAlt's and FedSim's at every round from the third
on, at seeds 1-4 alike (round 8, seed 3: FedAPM 1.980, FedAlt 2.008, FedSim 2.008, FedAvg 2.057; seeds 1, 2, 4:
FedAPM 1.995 / 1.977 / 2.000, FedAlt 2.015 / 2.005 / 2.023); in the first two rounds they are within 1e-3, either
one lower. Raysim's default FedAlt, which averages the selected clients only, is the lower one for the first ~23
rounds (round 8, seed 3: 1.956) and FedAPM's drops below it only from round 24 on: the stale models in the
authors' mean damp their FedAlt as they damp FedAPM's own server, so the paper's ordering holds here against the
authors' FedAlt, not against Pillutla et al.'s in these rounds (fedapm.md 1.5)."""

from __future__ import annotations

import math

import pytest

from raysim.studies.suite import load_suite, run_suite
from tests.support.experiments import NO_FIGURES
from tests.support.fedapm import SUITES, TABLE3
from tests.support.paper_data import BUILT_IN
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("integration-fedapm_findings")
"""One worker runs this module's tests: its findings fixture runs the four FedAPM runs once."""

NO_ARTIFACTS = ["tracking.figures=[]", "tracking.save_models=none"]
"""The runs here are read for their metrics: no figures, no saved models (tests/support/experiments.py NO_FIGURES;
the shipped configs' runs in tests/system/test_paper_configs.py draw and save them)."""


@pytest.mark.slow
@pytest.mark.parametrize("dataset", sorted(TABLE3))
def test_the_table3_suite_runs_end_to_end_on_the_substitute(dataset, tmp_path, monkeypatch):
    """Every method of the suite at its first seed, 2 rounds, small substitutes (BUILT_IN), one epoch, the hosts
    in this process: all finish, every round's PM accuracy is a share and the methods, FedAvg and FedProx
    included, report the deviation of the shared part. A suite whose children all run their hosts in process
    starts no Ray and joins none (RAY_ADDRESS points at nothing here: a Ray start cost most of this test)."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    substitute, methods = TABLE3[dataset]
    uri = fresh_store(tmp_path / "mlflow.db")
    sets = [
        *BUILT_IN[substitute],
        "algorithm.epochs=1",
        "rounds=2",
        "runtime.num_hosts=1",
        "runtime.actors=in_process",
        f"tracking.uri={uri}",
        *NO_ARTIFACTS,
    ]
    suite = load_suite(SUITES / f"fedapm_table3_{dataset}.yaml", sets)
    suite = suite.model_copy(update={"seeds": suite.seeds[:1]})
    result = run_suite(suite, show_progress=False)
    assert not result.failed, [(c.name, c.outcome.error) for c in result.failed]
    assert {c.name for c in result.children} == methods and len(result.children) == len(methods)
    for child in result.children:
        assert child.config.dataset.name == substitute and child.config.seed == suite.seeds[0]
        history = child.outcome.history
        assert all(0.0 <= history[step]["pm/acc"] <= 1.0 for step in (0, 1, 2)), child.name
        assert all(math.isfinite(history[step]["update/deviation"]) for step in (1, 2)), child.name


FINDINGS_DATA = {
    "name": "crisismmd_synthetic",
    "samples": 800,
    "image_dim": 24,
    "text_dim": 8,
    "tokens": 6,
    "image_signal": 1.0,
    "text_signal": 0.5,
    "test_ratio": 0.0,
}
"""The CrisisMMD substitute, small (the models read their sizes from it) and informative enough that 20 clients
learn within a few rounds; every sample dealt (`test_ratio: 0`, no official test set: these runs split each client
80/20)."""


FINDINGS_ROUNDS = 8


PRESET = "input"
"""The suite's split (fedapm.md 2: image projection + text GRU personal), the same for every method."""


LR = 2.0
"""FedAPM's lr on the alpha_i-weighted objective (step lr/m = 0.1); the baselines take it with `loss_scale: 1/m`."""


def _findings_run(algorithm: dict, tracking_uri: str, fraction: float = 0.3) -> dict[int, dict[str, float]]:
    """One seeded run of the findings' setting (fedapm_table3_crisismmd.yaml's, scaled down: 20 clients,
    Dirichlet(1.0), 2 epochs per phase, batch 50, FINDINGS_ROUNDS rounds); its history by round."""
    from raysim.config import validate_config
    from raysim.runtime.driver import run_experiment

    config = {
        "algorithm": {**algorithm, "epochs": 2, "batch_size": 50},
        "dataset": FINDINGS_DATA,
        "partition": {"scheme": "dirichlet", "beta": 1.0},
        "model": {"name": "image_text_classifier"},
        "clients": {"count": 20, "fraction": fraction},
        "rounds": FINDINGS_ROUNDS,
        "seed": 3,
        "runtime": {"num_hosts": 1, "actors": "in_process"},
        "tracking": {"uri": tracking_uri, "experiment": "fedapm-findings", **NO_FIGURES},
    }
    return run_experiment(validate_config(config), show_progress=False).history


def _fedapm(rho: float = 0.01) -> dict:
    """FedAPM as the authors' multimodal code runs it (v-step on the received u, u-step started from it)."""
    return {
        "name": "fedapm",
        "lr": LR,
        "rho": rho,
        "sigma": 0.01,
        "preset": PRESET,
        "v_anchor": "broadcast",
        "u_start": "broadcast",
    }


def _rounds_to_reach(history: dict[int, dict[str, float]], target: float) -> float:
    """The first round whose mean PM training loss is at most `target` (inf if none): fedapm.md 4.4's
    communication efficiency, rounds to reach a given training loss."""
    return next((step for step in sorted(history) if history[step]["pm/train_loss"] <= target), math.inf)


def _faster(fast: dict[int, dict[str, float]], slow: dict[int, dict[str, float]]) -> bool:
    """`fast` reaches the PM training loss that `slow` ends with in fewer rounds than `slow` takes."""
    target = slow[max(slow)]["pm/train_loss"]
    return _rounds_to_reach(fast, target) < _rounds_to_reach(slow, target)


def _mean_deviation(history: dict[int, dict[str, float]]) -> float:
    """The mean over the rounds of the selected clients' mean deviation of their shared part, sum_k ||u_i[k] -
    u[k]||_F (fedapm.md 1.5; the paper's bars average the first rounds of the curve, 5.3)."""
    values = [history[step]["update/deviation"] for step in sorted(history) if step > 0]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict[str, dict[int, dict[str, float]]]:
    """The runs the findings compare, at one seed, on one Ray with the actors kept between them."""
    uri = fresh_store(tmp_path_factory.mktemp("findings") / "mlflow.db")
    baseline = {"lr": LR, "loss_scale": "1/m", "preset": PRESET}
    return {
        "fedapm": _findings_run(_fedapm(), uri),
        "fedavg": _findings_run({"name": "fedavg", "shared_only": True, **baseline}, uri),
        "fedapm_rho0.1": _findings_run(_fedapm(rho=0.1), uri),
        "fedalt": _findings_run({"name": "fedalt", "average_over": "all", **baseline}, uri),
        "fedsim": _findings_run({"name": "fedsim", "average_over": "all", **baseline}, uri),
        "fedapm_frac0.1": _findings_run(_fedapm(), uri, fraction=0.1),
        "fedapm_frac0.5": _findings_run(_fedapm(), uri, fraction=0.5),
    }


@pytest.mark.slow
def test_fedapm_keeps_the_shared_part_closer_to_the_global_one(findings):
    """fedapm.md 5.3 (Fig. 5): FedAPM's local shared part deviates less from u than FedAlt's, FedSim's and
    FedAvg's, on average over the rounds. Against FedAvg the gap is small (0.5% at this seed, 1-2% at seeds 1, 2
    and 4; FedAvg is the lower one in some rounds): rho = 0.01 against the loss weight 1/m is a weak pull."""
    fedapm = _mean_deviation(findings["fedapm"])
    for other in ("fedalt", "fedsim", "fedavg"):
        assert fedapm < _mean_deviation(findings[other]), other


@pytest.mark.slow
@pytest.mark.parametrize(("other", "from_round"), [("fedavg", 1), ("fedalt", 3), ("fedsim", 3)])
def test_fedapm_trains_to_a_lower_loss(findings, other, from_round):
    """fedapm.md 7.3 "FedAPM's loss curve is lower", against the baselines as the authors' code trains them
    (FedAvg's personal part frozen at the initial model; FedAlt and FedSim averaged over all m): FedAPM's mean PM
    training loss is the lower one at every round from `from_round` on. In the first two rounds the partial
    methods are within 1e-3 of FedAPM (each starts with E epochs on the personal part, and FedAPM's rho = 0.01
    pull is weak against the loss weight 1/m), either one lower at seeds 1-4."""
    fedapm, baseline = findings["fedapm"], findings[other]
    rounds = [step for step in sorted(fedapm) if step >= from_round]
    assert all(fedapm[step]["pm/train_loss"] < baseline[step]["pm/train_loss"] for step in rounds)


@pytest.mark.slow
def test_a_larger_rho_converges_more_slowly(findings):
    """fedapm.md 6 (Fig. 6/9): rho = 0.1 is slower than rho = 0.01."""
    assert _faster(findings["fedapm"], findings["fedapm_rho0.1"])
    assert not _faster(findings["fedapm_rho0.1"], findings["fedapm"])


@pytest.mark.slow
def test_more_participation_converges_faster(findings):
    """fedapm.md 6 (Fig. 7/10): 50% of the clients per round is faster than 30%, which is faster than 10%."""
    assert _faster(findings["fedapm_frac0.5"], findings["fedapm"])
    assert _faster(findings["fedapm"], findings["fedapm_frac0.1"])
