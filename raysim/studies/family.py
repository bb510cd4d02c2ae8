"""What `raysim config` shows of a suite or sweep: every child validated as `raysim run` would before starting,
the first child in full and every other child by the settings in which it differs from the first, so that a
72-child suite reads in one screen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from raysim.config import ExperimentConfig, flatten, is_suite_file, is_sweep_file, validate_config
from raysim.errors import ConfigError


def family_children(
    path: str | Path, overrides: list[str], plugins: list[str] | tuple[str, ...] = ()
) -> list[tuple[str, ExperimentConfig]] | None:
    """(run name, validated config) of every child of a suite or sweep file, in run order; None for one
    experiment."""
    if is_suite_file(path):
        from raysim.studies.suite import load_suite

        suite = load_suite(path, overrides, plugins)
        return [(config.tracking.run_name or name, config) for name, config in suite.experiments()]
    if is_sweep_file(path):
        from raysim.studies.sweep import absolute_tracking_uri, load_sweep

        sweep = load_sweep(path, overrides, plugins)
        uri = absolute_tracking_uri(validate_config(sweep.base_tree()).tracking.uri)
        return [(trial.config.tracking.run_name or trial.label, trial.config) for trial in sweep.trials(uri)]
    return None


def family_yaml(path: str | Path, children: list[tuple[str, ExperimentConfig]], child: str | None = None) -> str:
    """One YAML document: the first child in full (`config`) and, under `differences`, every other child's
    dotted keys whose values differ from the first's (`dropped`: the first's keys it does not have). With `child`,
    that child's config alone."""
    names = [name for name, _ in children]
    if child is not None:
        if child not in names:
            raise ConfigError(f"--child: {path} has no child {child!r}; its children: {', '.join(names)}")
        return children[names.index(child)][1].to_yaml()
    first_name, first = children[0]
    reference = flatten(first.shown())
    differences: dict[str, dict[str, Any]] = {}
    for name, config in children[1:]:
        flat = flatten(config.shown())
        changed: dict[str, Any] = {key: value for key, value in flat.items() if reference.get(key, flat) != value}
        dropped = [key for key in reference if key not in flat]
        differences[name] = changed | ({"dropped": dropped} if dropped else {})
    header = (
        f"# {path}: {len(children)} children, all valid. `config` is the first ({first_name}) in full; "
        f"`differences` lists each other child's settings that differ from it. `--child NAME` shows one in full.\n"
    )
    document = {"children": len(children), "first": first_name, "config": first.shown(), "differences": differences}
    return header + yaml.safe_dump(document, sort_keys=False)
