"""Registries: the one door through which algorithms, models, dataset sources, partition schemes, attack kinds and
robust rules come in, raysim's own exactly as a user's plugin (raysim.plugins).

A registry maps the names a config writes (`algorithm.name: flame`) to entries. Each kind has one, at the bottom of
its own layer (ALGORITHMS in raysim.algorithms.interface, MODELS in raysim.models.spec, DATASETS in raysim.data.dataset,
PARTITIONS in raysim.data.scheme, ATTACKS in raysim.threats.attacks, ROBUST_RULES in raysim.threats.robust); every
entry registers itself with the registry's decorator in its own module, and the packages import their built-in
modules so that they register. Names are looked up when a config is validated, not when raysim.config is imported,
so a plugin imported at any time joins; an unknown name is one line naming the key, a close match and the names
allowed. The first lookup also imports the installed plugins (raysim.plugins.load_installed).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar, cast

from pydantic import BaseModel, GetCoreSchemaHandler, SerializeAsAny, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError, core_schema

from raysim.errors import ConfigError
from raysim.plugins import load_installed
from raysim.settings import Settings

T = TypeVar("T")
D = TypeVar("D")

UNKNOWN = "unknown_choice"
"""The pydantic error type of a name no registry entry has (raysim.config prints its message as it is)."""


def defined_by(entry: object) -> object:
    """The class or function an entry is: a typed entry (a model's, raysim.models.spec.ModelEntry) names the
    definition it describes as its `definition`."""
    return getattr(entry, "definition", entry)


def _origin(entry: object) -> str:
    """Where an entry was defined (module.qualname), to tell a module imported twice from two entries that clash."""
    entry = defined_by(entry)
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', type(entry).__qualname__)}"


class Registry(Generic[T]):
    """Names -> entries of one kind of extension, answering one config key (e.g. `algorithm.name`)."""

    def __init__(
        self,
        kind: str,
        key: str,
        settings: Callable[[T], type[Settings]] | None = None,
        check: Callable[[str, T], None] | None = None,
        entry: Callable[..., T] | None = None,
    ):
        """`kind` names an entry in messages ("algorithm"); `key` is the config key the names are written in;
        `settings(entry)` is an entry's settings model when the key chooses a whole section (`choice`);
        `check(name, entry)` refuses an entry that does not fit (raises TypeError); `entry(definition, **details)`
        makes the typed entry stored for a decorated definition and the details `register` was given."""
        self.kind = kind
        self.key = key
        self._settings = settings
        self._check = check
        self._entry = entry
        self._entries: dict[str, T] = {}

    @property
    def field(self) -> str:
        """The key's last part: the field or class attribute an entry states its own name in (`name`, `scheme`)."""
        return self.key.rsplit(".", 1)[-1]

    def register(self, name: str | None = None, **details: Any) -> Callable[[D], D]:
        """Decorator: register the decorated class or function as `name` (default: the name it states itself, see
        `name_of`), with the `details` its kind's typed entry takes (a model's `personalization`, `example`);
        returns it unchanged."""
        if details and self._entry is None:
            raise TypeError(f"a {self.kind} registers with a name only, not {', '.join(details)}")

        def decorate(definition: D) -> D:
            # without a typed entry, the definition is the entry (an Algorithm subclass, a rule function)
            entry = cast(T, definition) if self._entry is None else self._entry(definition, **details)
            self.add(self.name_of(definition) if name is None else name, entry)
            return definition

        return decorate

    def name_of(self, entry: object) -> str:
        """The name an entry states for itself: the default of its settings' `field` (a settings class), else its
        `field` attribute (`Algorithm.name`)."""
        fields = getattr(entry, "model_fields", None)
        stated = fields[self.field].default if fields and self.field in fields else getattr(entry, self.field, None)
        if not isinstance(stated, str):
            raise TypeError(f"{_origin(entry)} states no {self.field}; give the {self.kind} a name: register('name')")
        return stated

    def add(self, name: str, entry: T) -> T:
        """Register `entry` as `name`. The same definition registered again (its module imported a second time)
        replaces itself; another entry under a taken name is a ConfigError naming both."""
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"{self.key}: {name!r} is not a usable {self.kind} name (letters, digits and _)")
        existing = self._entries.get(name)
        if existing is not None and existing is not entry and _origin(existing) != _origin(entry):
            raise ConfigError(
                f"{self.key}: {self.kind} {name!r} is registered twice, by {_origin(existing)} and {_origin(entry)}"
            )
        if self._check is not None:
            self._check(name, entry)
        self._entries[name] = entry
        return entry

    def _all(self) -> dict[str, T]:
        load_installed()
        return self._entries

    def get(self, name: object) -> T:
        """The entry registered as `name`; a ConfigError naming the key, a close match and the allowed names."""
        entries = self._all()
        if isinstance(name, str) and name in entries:
            return entries[name]
        raise ConfigError(f"{self.key}: {self.unknown(name)}")

    def unknown(self, name: object, also: tuple[str, ...] = ()) -> str:
        """What to say about a name no entry has: "unknown algorithm 'fedavgmm'; did you mean 'fedavgm'? (allowed:
        ...)" (or "missing" for None); `also`: the field's other allowed values (OneOf.also)."""
        names = (*also, *self.names())
        allowed = f"(allowed: {', '.join(names)})"
        if name is None:
            return f"missing {allowed}"
        hint = difflib.get_close_matches(name, names, n=1) if isinstance(name, str) else []
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        plugin = f"; if {name!r} is a plugin's, load it (--plugin FILE.py or MODULE, or the config's plugins:)"
        return f"unknown {self.kind} {name!r}{suggestion} {allowed}{'' if hint else plugin}"

    def names(self) -> tuple[str, ...]:
        return tuple(self._all())

    def items(self) -> list[tuple[str, T]]:
        return list(self._all().items())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._all()

    def __len__(self) -> int:
        return len(self._all())

    def settings_of(self, name: str) -> type[Settings]:
        """The settings model of the entry `name` (a registry of whole sections, see `choice`)."""
        if self._settings is None:
            raise TypeError(f"the {self.kind} registry holds no settings models")
        return self._settings(self.get(name))

    def choice(self, base: type[BaseModel], default: str | None = None) -> Any:
        """The type of a config section chosen by this registry's key: validated, when the config is, by the
        settings model of the entry its `field` names (`default` when it names none; required without one), and
        dumped with that model's fields."""
        validator = WrapValidator(_ChoiceValidator(self, base, default))
        return Annotated[SerializeAsAny[base], validator]  # type: ignore[misc, valid-type]  # a type made at run time


@dataclass(frozen=True)
class _ChoiceValidator:
    registry: Registry
    base: type[BaseModel]
    default: str | None

    def __call__(self, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, self.base) and type(value) is not self.base:
            return value
        if not isinstance(value, dict):
            raise PydanticCustomError(
                "choice_type",
                "must be a mapping with a {field} (got {value})",
                {"field": self.registry.field, "value": repr(value)},
            )
        name = value.get(self.registry.field, self.default)
        if not isinstance(name, str) or name not in self.registry:
            raise PydanticCustomError(UNKNOWN, self.registry.unknown(name), {"config_key": self.registry.key})
        return self.registry.settings_of(name).model_validate(value)


@dataclass(frozen=True)
class OneOf:
    """Field metadata: the value is one of `registry`'s names (or of `also`, values that name no entry, such as
    `auto`), checked at validation (`Annotated[str, OneOf(MODELS)]`); the configuration reference lists the names
    from it."""

    registry: Registry
    also: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return (*self.also, *self.registry.names())

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: str) -> str:
        if value not in self.registry and value not in self.also:
            message = self.registry.unknown(value, self.also)
            raise PydanticCustomError(UNKNOWN, message, {"config_key": ""})
        return value
