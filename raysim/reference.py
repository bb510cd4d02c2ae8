"""The configuration reference, generated from the pydantic models that validate a config and the registries their
choices come from (the docs site's `reference.md` is built from it at every `make docs`, so it cannot drift from what
`raysim run` accepts; with plugins imported first, it documents theirs too)."""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal, TypeGuard

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from raysim.algorithms import ALGORITHMS
from raysim.config import SWITCHES, ExperimentConfig, choice_models
from raysim.data import DatasetSettings
from raysim.registry import OneOf
from raysim.settings import field_keys


def type_text(annotation: Any) -> str:
    """A field's type as a reader wants it: allowed values for a Literal, `int | None`, `list[str]`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(arg) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return type_text(typing.get_args(annotation)[0])
    if origin is not None:
        inner = ", ".join(type_text(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def field_type(field: FieldInfo) -> str:
    """type_text of a field; a registered name lists the registry's names (those of plugins imported too)."""
    metadata = [*field.metadata, *_annotated_metadata(field.annotation)]
    choice = next((item for item in metadata if isinstance(item, OneOf)), None)
    registry = next((item.registry for item in metadata if hasattr(item, "registry")), None)
    if registry is not None:
        names = " \\| ".join(f"`{name}`" for name in (choice.names() if choice else registry.names()))
        return f"{names} \\| null" if type(None) in typing.get_args(field.annotation) else names
    return type_text(field.annotation)


def _annotated_metadata(annotation: Any) -> list[Any]:
    """The metadata of the Annotated members of an optional annotation (`Annotated[str, OneOf(...)] | None`)."""
    return [
        item
        for arg in typing.get_args(annotation)
        if typing.get_origin(arg) is typing.Annotated
        for item in arg.__metadata__
    ]


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.get_default(call_default_factory=True)
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{'null' if value is None else value}`"


def bounds_text(field: FieldInfo) -> str:
    """The numeric bounds pydantic enforces (`>= 1`, `> 0`, `< 1`)."""
    parts = []
    for item in field.metadata:
        for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def field_rows(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key in skip:
            continue
        about = (field.description or "").replace("|", "\\|").replace("\n", " ")
        bounds = bounds_text(field)
        about = f"{about} ({bounds})" if bounds and about else about or (f"({bounds})" if bounds else "")
        old = [f"`{k}`" for k in field_keys(name, field) if k not in (key, name)]
        about = f"{about} (old key {', '.join(old)}, still accepted)".strip() if old else about
        rows.append(f"| `{prefix}{key}` | {field_type(field)} | {default_text(field)} | {about} |")
    return rows


TABLE_HEAD = ["| key | type / allowed values | default | what |", "|---|---|---|---|"]


def config_reference() -> str:
    """Every key of an experiment config, section by section, as Markdown."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models that validate a config (`raysim/config.py` and the algorithm, dataset "
        "and partition settings its registries hold), so it lists exactly what `raysim run` accepts. `raysim config "
        "FILE` prints a file's resolved config with every default filled in.",
        "",
        "## Top level",
        "",
        *TABLE_HEAD,
        *[row for row in field_rows(ExperimentConfig, "") if "see below" not in row and "required" not in row],
    ]
    for section, field in ExperimentConfig.model_fields.items():
        if section in SWITCHES:
            choice, models = SWITCHES[section], choice_models(section)
            common = shared_fields(list(models.values()), skip=(choice,))
            out += ["", f"## `{section}`", "", f"`{section}.{choice}` chooses the settings below."]
            if common:
                first = next(iter(models.values()))
                only = tuple(set(first.model_fields) - set(common))
                out += [
                    "",
                    f"Every `{section}.{choice}` takes:",
                    "",
                    *TABLE_HEAD,
                    *field_rows(first, f"{section}.", skip=only),
                ]
            for value, model in models.items():
                out += [
                    "",
                    f"### `{section}.{choice}: {value}`",
                    "",
                    summary(model),
                    "",
                    *TABLE_HEAD,
                    *field_rows(model, f"{section}.", skip=(choice, *common)),
                ]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            doc = (field.annotation.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
            out += ["", f"## `{section}`", "", doc, "", *TABLE_HEAD, *field_rows(field.annotation, f"{section}.")]
    return "\n".join(out) + "\n"


def shared_fields(models: list[type[BaseModel]], skip: tuple[str, ...]) -> tuple[str, ...]:
    """The fields every model has alike (same type, default and description), shown once for a choice section."""

    def same(name: str) -> bool:
        fields = [model.model_fields.get(name) for model in models]
        first = fields[0]
        return first is not None and all(
            f is not None
            and (f.annotation, f.default, f.description) == (first.annotation, first.default, first.description)
            for f in fields
        )

    return tuple(name for name in models[0].model_fields if name not in skip and same(name)) if models else ()


def summary(model: type[BaseModel]) -> str:
    """A dataset source's summary, else a settings model's first paragraph, else (an algorithm's settings say
    nothing) its module's docstring's."""
    text = model.summary() if issubclass(model, DatasetSettings) else model.__dict__.get("__doc__")
    if not text:
        owner = next((cls for _, cls in ALGORITHMS.items() if cls.Settings is model), None)
        text = sys.modules[owner.__module__].__doc__ if owner is not None else ""
    return " ".join((text or "").strip().split("\n\n")[0].split())


def config_keys() -> set[str]:
    """Every dotted key the reference documents (tests check it against the models)."""
    keys = {name for name, f in ExperimentConfig.model_fields.items() if not _is_model(f.annotation)}
    for section, field in ExperimentConfig.model_fields.items():
        if section in SWITCHES:
            for model in choice_models(section).values():
                keys |= {f"{section}.{f.alias or n}" for n, f in model.model_fields.items()}
        elif _is_model(field.annotation):
            keys |= {f"{section}.{f.alias or n}" for n, f in field.annotation.model_fields.items()}
    return keys


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)
