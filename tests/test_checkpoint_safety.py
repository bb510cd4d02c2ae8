"""A checkpoint file runs no code it names: only raysim's state dataclasses (and registered plugin classes)
are rebuilt; anything else a crafted file names is refused before it is imported or called."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import numpy as np
import pytest

from raysim.config import validate_config
from raysim.runtime import checkpoint
from raysim.runtime.checkpoint import CheckpointError
from tests.conftest import tiny_config
from tests.inprocess import InProcess


def _crafted(path, structure) -> None:
    """An .npz laid out as save_tree writes it, whose JSON structure is whatever an attacker chose."""
    with zipfile.ZipFile(path, "w") as archive, archive.open("__structure__.npy", "w") as member:
        np.lib.format.write_array(member, np.frombuffer(json.dumps(structure).encode(), dtype=np.uint8))


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
    _crafted(path, {"__dict__": [["state", {"__dataclass__": name, "fields": fields}]]})
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_tree(path)
    assert str(path) in str(error.value) and name in str(error.value)
    assert not marker.exists()


def test_a_crafted_checkpoint_imports_no_module_outside_raysim(tmp_path):
    """The refusal comes before any import: a module that is not loaded stays unloaded."""
    path = tmp_path / "x.npz"
    _crafted(path, {"__dataclass__": "smtplib:SMTP", "fields": {}})
    code = (
        "import sys; from raysim.runtime import checkpoint\n"
        f"try: checkpoint.load_tree({str(path)!r})\n"
        "except checkpoint.CheckpointError as e: print('refused', e)\n"
        "print('smtplib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused") and out.strip().endswith("False")


def test_unknown_sequence_kinds_and_fields_are_refused(tmp_path):
    path = tmp_path / "seq.npz"
    _crafted(path, {"__seq__": "__import__", "items": ["os"]})
    with pytest.raises(CheckpointError, match="unknown sequence kind '__import__'"):
        checkpoint.load_tree(path)
    _crafted(path, {"__dataclass__": "raysim.algorithms.base:SGDResult", "fields": {"params": 1, "evil": 2}})
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


@pytest.mark.parametrize("algorithm", ["flame", "fedslr", "fedapm", "ditto", "fedavg", "pfedme"])
def test_real_algorithm_states_round_trip(tmp_path, algorithm):
    """Every state a real run checkpoints is a raysim class the allowlist accepts, rebuilt equal."""
    sim = InProcess(validate_config(tiny_config(algorithm={"name": algorithm}, model={"name": "mlp"})))
    sim.round(0)
    tree = {"clients": sim.states, "server": sim.server}
    checkpoint.save_tree(tmp_path / "s.npz", tree)
    back = checkpoint.load_tree(tmp_path / "s.npz")
    assert type(back["server"]) is type(sim.server)
    for i, state in sim.states.items():
        assert type(back["clients"][i]) is type(state)
        for a, b in zip(_leaves(state), _leaves(back["clients"][i]), strict=True):
            assert np.array_equal(a, b)


def _leaves(state) -> list:
    from dataclasses import fields, is_dataclass

    if is_dataclass(state):
        return [leaf for f in fields(state) for leaf in _leaves(getattr(state, f.name))]
    return [np.asarray(state)] if state is not None else []
