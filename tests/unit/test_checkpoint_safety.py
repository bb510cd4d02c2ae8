"""A checkpoint file runs no code it names: only raysim's state dataclasses (and registered plugin classes)
are rebuilt; anything else a crafted file names is refused before it is imported or called."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.runtime import checkpoint
from raysim.runtime.checkpoint import CheckpointError
from tests.support.checkpoints import crafted_npz
from tests.support.experiments import tiny_config
from tests.support.inprocess import InProcess


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("subprocess:Popen", {"args": ["touch", "{marker}"]}),
        ("os:system", {"command": "touch {marker}"}),
        ("builtins:eval", {"source": "open('{marker}', 'w')"}),
        ("raysim.cli:main", {"argv": ["run", "{marker}"]}),
        ("raysim.runtime.checkpoint:Path.touch", {"self": "{marker}"}),
        ("raysim.runtime.checkpoint:os.system", {"command": "touch {marker}"}),
        ("raysim.errors:RaysimError", {"args": "{marker}"}),
        ("raysim.nonexistent_module:Thing", {}),
    ],
)
def test_a_crafted_checkpoint_cannot_construct_anything_but_state(tmp_path, name, fields):
    marker = tmp_path / "pwned"
    fields = json.loads(json.dumps(fields).replace("{marker}", str(marker)))
    path = tmp_path / "host-0.npz"
    crafted_npz(path, {"__dict__": [["state", {"__dataclass__": name, "fields": fields}]]})
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_tree(path)
    assert str(path) in str(error.value) and name in str(error.value)
    assert not marker.exists()


def test_unknown_sequence_kinds_and_fields_are_refused(tmp_path):
    path = tmp_path / "seq.npz"
    crafted_npz(path, {"__seq__": "__import__", "items": ["os"]})
    with pytest.raises(CheckpointError, match="unknown sequence kind '__import__'"):
        checkpoint.load_tree(path)
    crafted_npz(path, {"__dataclass__": "raysim.algorithms.requests:SGDResult", "fields": {"params": 1, "evil": 2}})
    with pytest.raises(CheckpointError, match=r"fields it does not have: \['evil'\]"):
        checkpoint.load_tree(path)


@dataclass
class _PluginState:
    theta: np.ndarray


def test_a_state_class_outside_raysim_must_be_registered(tmp_path):
    path = tmp_path / "plugin.npz"
    with pytest.raises(TypeError, match="register_state_class"):
        checkpoint.save_tree(path, _PluginState(np.ones(3)))
    assert not path.exists()
    checkpoint.register_state_class(_PluginState)
    checkpoint.save_tree(path, _PluginState(np.ones(3)))
    assert checkpoint.load_tree(path).theta.tolist() == [1, 1, 1]
    with pytest.raises(TypeError, match="not a dataclass"):
        checkpoint.register_state_class(dict)


@pytest.mark.parametrize(
    "algorithm",
    [
        *({"name": name} for name in ("flame", "fedslr", "fedapm", "ditto", "fedavg", "pfedme")),
        *({"name": name, "diagnostics": True} for name in ("flame", "fedadmm")),
    ],
    ids=lambda algorithm: "-".join(str(v) if v is not True else k for k, v in algorithm.items()),
)
def test_real_algorithm_states_round_trip(tmp_path, algorithm):
    """Every state a real run checkpoints is a raysim class the allowlist accepts, rebuilt equal (with the ADMM
    diagnostics too: their totals at the server, each client's last reported term)."""
    sim = InProcess(validate_config(tiny_config(algorithm=algorithm, model={"name": "mlp"})))
    sim.round(0)
    tree = {"clients": sim.states, "server": sim.server}
    checkpoint.save_tree(tmp_path / "s.npz", tree)
    back = checkpoint.load_tree(tmp_path / "s.npz")
    assert type(back["server"]) is type(sim.server)
    for a, b in zip(_leaves(sim.server), _leaves(back["server"]), strict=True):
        assert np.array_equal(a, b)
    for i, state in sim.states.items():
        assert type(back["clients"][i]) is type(state)
        for a, b in zip(_leaves(state), _leaves(back["clients"][i]), strict=True):
            assert np.array_equal(a, b, equal_nan=True)  # NaN: a diagnostic not reported yet


def _leaves(state) -> list:
    from dataclasses import fields, is_dataclass

    if is_dataclass(state):
        return [leaf for f in fields(state) for leaf in _leaves(getattr(state, f.name))]
    return [np.asarray(state)] if state is not None else []
