"""Plugins: a researcher's own algorithm, model and dataset, kept outside the package (in a temporary folder), come in
through the same registries as raysim's own.

docs/extending.md runs as written: its files are saved into a folder, its math test passes there and its commands
(`raysim ... --plugin FILE`) run there. The same three plugins also run listed in a config (`plugins:`) and installed
as a real package with an entry point (`raysim submit` on a local cluster: tests/system/test_cluster.py). A plugin that
cannot be imported is one error line before Ray starts; a misspelled name of every kind gets a "did you mean".
Whatever imports a plugin runs in a subprocess, so this test process's registries stay as raysim ships them.
"""

from __future__ import annotations

import pytest

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.registry import Registry
from tests.support.experiments import tiny_config


@pytest.mark.parametrize(
    ("section", "wrong", "key", "right"),
    [
        ("algorithm", {"name": "flam"}, "algorithm.name", "flame"),
        ("model", {"name": "cnnn"}, "model.name", "cnn"),
        ("dataset", {"name": "fashion_mnst"}, "dataset.name", "fashion_mnist"),
        ("partition", {"scheme": "dirichelt"}, "partition.scheme", "dirichlet"),
        ("attack", {"kind": "sign_flp", "fraction": 0.2}, "attack.kind", "sign_flip"),
        ("aggregation", {"rule": "mediam"}, "aggregation.rule", "median"),
    ],
)
def test_every_kind_of_name_gets_a_did_you_mean_and_the_allowed_names(section, wrong, key, right):
    with pytest.raises(ConfigError) as refused:
        validate_config(tiny_config(**{section: wrong}))
    message = str(refused.value)
    assert message.startswith(f"{key}: unknown ") and f"; did you mean '{right}'? (allowed: " in message, message
    assert "\n" not in message


def test_a_registry_refuses_a_clash_and_names_both_entries():
    registry: Registry[object] = Registry("widget", "widget.name")

    @registry.register("spinner")
    def spinner() -> None:
        """A widget."""

    def other() -> None:
        """Another."""

    registry.register("spinner")(spinner)  # the same definition again (its module imported twice): no clash
    with pytest.raises(ConfigError, match=r"^widget.name: widget 'spinner' is registered twice, by .*spinner and "):
        registry.add("spinner", other)
    with pytest.raises(TypeError, match="not a usable widget name"):
        registry.add("no spaces please", other)
    assert registry.names() == ("spinner",) and "spinner" in registry
    assert registry.unknown("spiner") == "unknown widget 'spiner'; did you mean 'spinner'? (allowed: spinner)"
    assert registry.unknown(None) == "missing (allowed: spinner)"
    assert registry.unknown("my_gadget") == (  # no close name: maybe a plugin's that was not loaded
        "unknown widget 'my_gadget' (allowed: spinner); if 'my_gadget' is a plugin's, load it (--plugin FILE.py or "
        "MODULE, or the config's plugins:)"
    )
