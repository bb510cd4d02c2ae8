"""Settings that refer to parts of the model (a count of parameter tensors, parameter-name patterns, a split preset)
carry a `ModelPart` marker in their annotation (`Annotated[int, TensorCount()]`); `check_parts` walks a settings
model's fields, nested ones included, and checks every marked value against the model the run builds, before Ray
starts (raysim.algorithms.build_algorithm). A new method's knob gets the check by its annotation alone, and the test
generated from the registry (tests/unit/test_model_parts.py) gives it an out-of-range value.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from raysim.errors import ConfigError
from raysim.models.spec import ParamSpec


class ModelPart:
    """Marks a setting whose value names a part of the model: `problem` says what is wrong with a value for this
    model (None when it fits), `outside` gives a value that cannot fit (for the tests)."""

    def problem(self, value: Any, params: ParamSpec) -> str | None:
        raise NotImplementedError

    def outside(self, params: ParamSpec) -> Any:
        raise NotImplementedError


def _model(params: ParamSpec) -> str:
    return f"model {params.model!r}" if params.model else "this model"


@dataclass(frozen=True)
class TensorCount(ModelPart):
    """A number of parameter tensors, counted from the top (the last ones) or the bottom: 0 to the model's count."""

    def problem(self, value: Any, params: ParamSpec) -> str | None:
        count = len(params.names)
        if isinstance(value, int) and 0 <= value <= count:
            return None
        return f"{_model(params)} has {count} parameter tensors (allowed: 0 to {count})"

    def outside(self, params: ParamSpec) -> Any:
        return len(params.names) + 1


@dataclass(frozen=True)
class ParameterPatterns(ModelPart):
    """fnmatch patterns over parameter names (None: not given): each must match at least one of the model's."""

    def problem(self, value: Any, params: ParamSpec) -> str | None:
        if value is None:
            return None
        unmatched = [pattern for pattern in value if not any(fnmatch.fnmatchcase(n, pattern) for n in params.names)]
        if not unmatched:
            return None
        return f"{', '.join(map(repr, unmatched))} match no parameter of {_model(params)} ({', '.join(params.names)})"

    def outside(self, params: ParamSpec) -> Any:
        return ("no_such_layer.*",)


def marked_fields(settings: type[BaseModel], prefix: str) -> list[tuple[str, tuple[str, ...], ModelPart]]:
    """(the key as a config names it, the field path to its value, its marker) for every marked field of a settings
    class, nested settings included."""
    found: list[tuple[str, tuple[str, ...], ModelPart]] = []
    for name, field in settings.model_fields.items():
        key = f"{prefix}.{field.alias or name}"
        for marker in field.metadata:
            if isinstance(marker, ModelPart):
                found.append((key, (name,), marker))
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += [(k, (name, *path), m) for k, path, m in marked_fields(annotation, key)]
    return found


def check_parts(settings: BaseModel, params: ParamSpec, prefix: str = "algorithm") -> None:
    """A ConfigError naming the first marked setting (`prefix.key=value`) whose value does not fit the model."""
    for key, path, marker in marked_fields(type(settings), prefix):
        section: Any = settings
        for name in path[:-1]:
            section = getattr(section, name)
        if section is None:
            continue  # a nested section left out
        value = getattr(section, path[-1])
        problem = marker.problem(value, params)
        if problem is not None:
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(f"{key}={shown!r}: {problem}")
