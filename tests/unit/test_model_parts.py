"""Settings that refer to parts of the model are checked against the model before Ray starts (issue 51, section 3):
`fedala` with `layer_idx: 1000` on a 6-tensor MLP was accepted (it mixed every tensor, as [-1000:] takes). Such a
setting carries a raysim.models.parts.ModelPart marker in its annotation; the pre-flight check walks the markers, so
the tests below are generated from the registry: every marked setting of every algorithm gets a value outside the
model and is refused in one line naming it, and a setting whose name says it refers to the model must carry one."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import BaseModel

from raysim.algorithms import ALGORITHMS
from raysim.errors import ConfigError
from raysim.models.flat import FlatModel
from raysim.models.parts import TensorCount, check_parts, marked_fields
from tests.support.experiments import tiny_config

MLP = FlatModel("mlp", (1, 28, 28), 10).spec
"""Three linear layers: six parameter tensors (weight and bias each)."""

MARKED = [
    (name, key, path, marker)
    for name, algorithm in ALGORITHMS.items()
    for key, path, marker in marked_fields(algorithm.Settings, "algorithm")
]

NOT_A_PART = {
    "head_epochs": "a number of epochs",
    "head_lr": "a learning rate",
    "head_mix": "a mixing weight",
    "hidden_layers": "the depth of the method's own hypernetwork, not of the clients' model",
    "layers": "a mode (module or tensor), valid for every model",
    "reset_personal": "a switch",
}
"""Settings whose names look like parts of the model and are not, each with the reason."""
LOOKS_LIKE_A_PART = re.compile(r"layer|rank|part|head|idx|index|preset|personal|module|tensor|block")


def _defaults(name: str) -> BaseModel:
    return ALGORITHMS.get(name).Settings.model_validate({"name": name})


def _with(settings: BaseModel, path: tuple[str, ...], value: Any) -> BaseModel:
    if len(path) == 1:
        return settings.model_copy(update={path[0]: value})
    inner = getattr(settings, path[0])
    return settings.model_copy(update={path[0]: _with(inner, path[1:], value)})


def test_the_markers_cover_the_layer_and_split_settings():
    keys = {(name, key) for name, key, _, _ in MARKED}
    assert ("fedala", "algorithm.layer_idx") in keys and ("lg_fedavg", "algorithm.global_layers") in keys
    assert {("fedrep", "algorithm.preset"), ("fedapm", "algorithm.personal")} <= keys


@pytest.mark.parametrize(("name", "key", "path", "marker"), MARKED, ids=[f"{n}-{k}" for n, k, _, _ in MARKED])
def test_every_marked_setting_is_refused_outside_the_model(name, key, path, marker):
    settings = _defaults(name)
    check_parts(settings, MLP)  # the defaults fit
    outside = marker.outside(MLP)
    with pytest.raises(ConfigError) as refused:
        check_parts(_with(settings, path, outside), MLP)
    message = str(refused.value)
    shown = list(outside) if isinstance(outside, tuple) else outside
    assert message.startswith(f"{key}={shown!r}: ") and "\n" not in message, message


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_setting_named_like_a_part_of_the_model_carries_a_marker(name):
    """The next method's knob gets the check by being marked: one named like a layer, rank, part, head or index
    must be, or be listed in NOT_A_PART with the reason."""
    marked = {key for key, _, _ in marked_fields(ALGORITHMS.get(name).Settings, "algorithm")}

    def names(model: type[BaseModel], prefix: str) -> list[str]:
        found = []
        for field, info in model.model_fields.items():
            found.append(prefix + (info.alias or field))
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                found += names(info.annotation, f"{prefix}{info.alias or field}.")
        return found

    unmarked = [
        key
        for key in names(ALGORITHMS.get(name).Settings, "algorithm.")
        if LOOKS_LIKE_A_PART.search(key.rsplit(".", 1)[-1]) and key not in marked
    ]
    assert [key for key in unmarked if key.rsplit(".", 1)[-1] not in NOT_A_PART] == []


def test_a_tensor_count_fits_from_none_to_all_of_them():
    count = len(MLP.names)
    assert count == 6
    for value in (0, 1, count):
        assert TensorCount().problem(value, MLP) is None
    assert TensorCount().problem(count + 1, MLP) == "model 'mlp' has 6 parameter tensors (allowed: 0 to 6)"


def test_one_unmatched_pattern_among_matching_ones_is_refused():
    settings = _defaults("fedper").model_copy(update={"personal": ("5.*", "fc.*")})
    with pytest.raises(ConfigError, match=r"^algorithm.personal=\['5.\*', 'fc.\*'\]: 'fc.\*' match no parameter"):
        check_parts(settings, MLP)


def test_raysim_run_refuses_fedala_with_a_layer_index_past_the_model_before_ray(tmp_path, monkeypatch, capsys):
    import ray
    import yaml

    from raysim.cli import main
    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)
    tree = tiny_config(
        algorithm={"name": "fedala", "layer_idx": 1000},
        model={"name": "mlp"},
        tracking={"experiment": "tests", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert main(["run", str(config), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "error: algorithm.layer_idx=1000: model 'mlp' has 6 parameter tensors (allowed: 0 to 6)"
    ]
    assert out == "" and not (tmp_path / "mlflow.db").exists()
