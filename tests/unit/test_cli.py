"""The `raysim` command end to end: a real run read back from MLflow, and clear one-line errors on bad input."""

from __future__ import annotations

import pytest
import yaml

from tests.support.paths import ROOT


@pytest.mark.parametrize("shipped", ["configs/compare.yaml", "configs/sweep_flame.yaml"])
def test_config_of_a_suite_or_sweep_shows_every_child(shipped):
    """What `raysim config` shows of a shipped suite or sweep: the first child in full and each other child's
    differences, from which every child's config is rebuilt exactly; `--child` shows one child in full."""
    from raysim.config import flatten, set_value, validate_config
    from raysim.studies.family import family_children, family_yaml

    children = family_children(ROOT / shipped, [])
    shown = yaml.safe_load(family_yaml(shipped, children))
    assert shown["children"] == len(children) > 1 and shown["first"] == children[0][0]
    assert list(shown["differences"]) == [name for name, _ in children[1:]]
    for name, config in children:
        differences = shown["differences"].get(name, {})
        tree: dict = {}
        for key, value in (flatten(shown["config"]) | differences).items():
            if key != "dropped" and key not in differences.get("dropped", []):
                set_value(tree, key, value)
        assert validate_config(tree) == config, name
    name, config = children[-1]
    assert validate_config(yaml.safe_load(family_yaml(shipped, children, name))) == config


def test_config_command_on_a_sweep(capsys, monkeypatch):
    from raysim.cli import main
    from raysim.studies.family import family_children, family_yaml

    monkeypatch.chdir(ROOT)
    shipped = "configs/sweep_flame.yaml"
    assert main(["config", shipped]) == 0
    assert capsys.readouterr().out == family_yaml(shipped, family_children(shipped, []))
    assert main(["config", shipped, "--child", "nope"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --child:") and "seed=2" in error


def test_switching_a_scheme_or_algorithm_with_set_drops_the_old_settings(tmp_path):
    """The quickstart's `q: 2` belongs to q_label: switching to iid or dirichlet drops it, as switching FLAME to
    FedAvg drops lambda and rho, and switching an image folder to CIFAR-10 drops its size and channels; a setting the
    new choice lacks is refused only when it is set explicitly."""
    from raysim.config import ConfigError, load_config

    quickstart = ROOT / "configs" / "quickstart.yaml"
    assert load_config(quickstart, ["partition.scheme=iid"]).partition.scheme == "iid"
    dirichlet = load_config(quickstart, ["partition.scheme=dirichlet", "partition.beta=0.3"]).partition
    assert (dirichlet.scheme, dirichlet.beta) == ("dirichlet", 0.3)
    fedavg = load_config(quickstart, ["algorithm.name=fedavg"]).algorithm
    assert fedavg.name == "fedavg" and fedavg.lr == 0.01 and not hasattr(fedavg, "rho")
    assert load_config(quickstart, ["partition.q=3"]).partition.q == 3  # same scheme: nothing dropped
    with pytest.raises(ConfigError, match=r"partition\.q: unknown key"):
        load_config(quickstart, ["partition.scheme=iid", "partition.q=3"])
    mmnist = quickstart.parent / "paper" / "flame_mmnist.yaml"  # dataset: {name: image_folder, size: 64, channels: 3}
    cifar = load_config(mmnist, ["dataset.name=cifar10", "dataset.root=/data"]).dataset
    assert (cifar.name, cifar.root, cifar.download) == ("cifar10", "/data", True) and not hasattr(cifar, "size")
    assert load_config(mmnist, ["dataset.name=medmnist", "dataset.subset=pathmnist"]).dataset.size == 64  # it has one
    unknown = r"^dataset\.channels: unknown key \(allowed: name, .*, root, download, normalization\)$"
    with pytest.raises(ConfigError, match=unknown):
        load_config(mmnist, ["dataset.name=cifar10", "dataset.channels=1"])


POINTS = '''
from typing import ClassVar, Literal

import numpy as np

from raysim.data import DATASETS, Dataset, DatasetSettings


@DATASETS.register()
class PointsSettings(DatasetSettings):
    """Points a plugin makes itself: no files to find."""

    name: Literal["my_points"] = "my_points"
    layout: ClassVar[str] = "made in memory"
    get: ClassVar[str] = "nothing to get"

    def load(self, seed: int) -> Dataset:
        raise NotImplementedError
'''


def test_raysim_datasets_lists_a_plugins_source_without_files_as_a_plugins_not_as_built_in(tmp_path, capsys):
    """`raysim datasets --plugin FILE`: raysim's sources that need no files (scikit-learn's digits) are "built in", a
    plugin's is "needs no files" with the module it comes from."""
    from raysim.cli import main

    plugin = tmp_path / "my_points.py"
    plugin.write_text(POINTS)
    assert main(["datasets", "--plugin", str(plugin)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line and line[0] != " "}
    assert "built in:" in lines["digits"]
    assert "needs no files (plugin my_points):" in lines["my_points"] and "built in" not in lines["my_points"]


def test_raysim_sweep_takes_the_tracking_uri_and_experiment_as_raysim_run_does(tmp_path):
    """`raysim sweep SWEEP --tracking-uri URI --experiment NAME`: the sweep's base (its parent run's store and
    experiment) and every trial log there, as with `--set tracking.uri=... --set tracking.experiment=...`."""
    from raysim.cli import _tracking_overrides, parser
    from raysim.config import validate_config
    from raysim.studies.sweep import load_sweep
    from tests.support.experiments import tiny_config

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": tiny_config(), "grid": {"algorithm.rho": [0.1, 0.2]}}))
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    args = parser().parse_args(["sweep", str(path), "--tracking-uri", uri, "--experiment", "tryout"])
    overrides = [*args.set, *_tracking_overrides(args)]
    assert overrides == [f"tracking.uri={uri}", "tracking.experiment=tryout"]
    sweep = load_sweep(path, overrides)
    base = validate_config(sweep.base_tree())
    assert (base.tracking.uri, base.tracking.experiment) == (uri, "tryout")
    trials = sweep.trials(uri)
    assert len(trials) == 2 and all(t.config.tracking.experiment == "tryout" for t in trials)
