"""The one base class of every settings model read from a config file.

YAML gives `true` for a typo'd or mistaken value, and pydantic's lax mode turns it into 1 (or 1.0) for an
int or float field: `rounds: true` would run one round. Strict mode is no answer (YAML gives lists for
tuple fields and ints for float fields), so this base refuses a bool only where the field's type admits a
number and no bool, inside lists, tuples and dicts too; `.inf` and `.nan` are refused for every float.
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import AliasChoices, BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

_SEQUENCES = (list, tuple, set, frozenset)


def _arms(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a (possibly Annotated, Optional or union) type, Annotated metadata dropped; worked out
    once per type (every settings model validated runs this for each of its fields)."""
    try:
        return _cached_arms(annotation)
    except TypeError:  # an unhashable type argument
        return _work_out_arms(annotation)


def _work_out_arms(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) is Annotated:
        return _arms(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(arm for member in get_args(annotation) for arm in _arms(member))
    return (annotation,)


_cached_arms = functools.lru_cache(maxsize=4096)(_work_out_arms)


def _admits_bool(arms: tuple[Any, ...]) -> bool:
    return any(
        arm in (bool, Any, object) or (get_origin(arm) is Literal and any(isinstance(v, bool) for v in get_args(arm)))
        for arm in arms
    )


def _number_kind(arms: tuple[Any, ...]) -> str | None:
    """ "a number" / "an integer" when a bool would be coerced to one of the `arms`, else None."""
    if _admits_bool(arms):
        return None
    if float in arms:
        return "a number"
    if int in arms:
        return "an integer"
    return None


def _bool_for_number(annotation: Any, value: Any, where: str = "") -> tuple[str, str, str] | None:
    """(where inside the value, what was expected, the bool as YAML writes it) of the first bool that
    `annotation` would take as a number; None if there is none. Nested models validate their own fields."""
    if not isinstance(value, (bool, dict, *_SEQUENCES)):
        return None
    arms = _arms(annotation)
    if isinstance(value, bool):
        kind = _number_kind(arms)
        return (where, kind, str(value).lower()) if kind else None
    containers = [(get_origin(arm), get_args(arm)) for arm in arms]
    if isinstance(value, _SEQUENCES):
        for origin, args in containers:
            if origin not in _SEQUENCES or not args:
                continue
            homogeneous = origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)
            for index, item in enumerate(value):
                if not homogeneous and index >= len(args):
                    break
                found = _bool_for_number(args[0] if homogeneous else args[index], item, f"{where}.{index}")
                if found:
                    return found
    elif isinstance(value, dict):
        for origin, args in containers:
            if origin is not dict or len(args) != 2:
                continue
            for key, item in value.items():
                found = _bool_for_number(args[1], item, f"{where}.{key}")
                if found:
                    return found
    return None


def field_keys(name: str, field: FieldInfo) -> tuple[str, ...]:
    """The keys a config may give a field by: its key (its alias, else its name), its name, and old names it still
    answers to (a `validation_alias` of AliasChoices, e.g. AugFL's `pm_epochs` for `teacher_epochs`)."""
    alias = field.validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
    return tuple(dict.fromkeys([field.alias or name, name, *(c for c in choices if isinstance(c, str))]))


@functools.cache
def _keyed_fields(model: type[BaseModel]) -> tuple[tuple[tuple[str, ...], Any], ...]:
    """(field_keys, annotation) of each of a settings model's fields, worked out once per model."""
    return tuple((field_keys(name, field), field.annotation) for name, field in model.model_fields.items())


class Settings(BaseModel):
    """Unknown keys, bools taken for numbers and non-finite floats are refused; validated settings are
    immutable. Every settings model of a config subclasses this.

    The bool check is a model validator, not a field validator: pydantic allows no `before` field validator on
    the discriminator fields (`algorithm.name`, `partition.scheme`). Its error carries the key in `ctx["key"]`
    (raysim.config adds it to the error's location)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_key_given_twice(cls, data: Any) -> Any:
        """A setting given by two of its keys (`lambda` and `lam`, `teacher_lr` and its old name `pm_lr`): pydantic
        would take one and drop the other silently."""
        if isinstance(data, dict):
            for keys, _ in _keyed_fields(cls):
                given = [key for key in keys if key in data]
                if len(given) > 1:
                    context = {"key": given[0], "other": given[1]}
                    raise PydanticCustomError("key_given_twice", "given twice, also as {other}; keep one", context)
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_bool_for_number(cls, data: Any) -> Any:
        """A YAML `true` given for a number is a mistake, not 1."""
        if not isinstance(data, dict):
            return data
        for keys, annotation in _keyed_fields(cls):
            key = next((key for key in keys if key in data), None)
            if key is None:
                continue
            found = _bool_for_number(annotation, data[key])
            if found:
                where, kind, value = found
                raise PydanticCustomError(
                    "bool_for_number",
                    "{key}: must be {kind}, not a bool ({value})",
                    {"key": f"{key}{where}", "kind": kind, "value": value},
                )
        return data
