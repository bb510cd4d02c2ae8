"""Plugins: a researcher's own algorithms, models, dataset sources, partition schemes, attack kinds and robust rules,
in modules of their own that register with raysim's registries (raysim.registry) exactly as the built-ins do.

A plugin is found three ways, and always imported before a config is validated:

- `plugins:` in an experiment, suite or sweep file: module names or `.py` files (relative to that file);
- `--plugin MODULE_OR_FILE` on the command line (a file relative to the current directory);
- an installed package's entry point in the group `raysim.plugins` (imported once, at the first registry lookup).

A file is imported as the module named after it (`fedavgm.py` -> `fedavgm`), so that what it defines pickles by
reference. Ray's workers import the same plugins before they unpickle anything of the run (`carry`); `raysim
submit` ships plugin files with the job, where they are modules by that name (raysim.jobs).

A plugin's import is one guarded step: whatever ends it but success (an exception, `sys.exit`, a
KeyboardInterrupt the plugin raises) is one PluginError line naming the plugin and what ended it, before any Ray
work.

A checkpoint runs no code it names: resuming one imports no plugin its saved config lists, only those the user
gives (`raysim resume --plugin`) or that this process imported already (a resumed study's file names them);
`for_checkpoint` refuses, in one line naming it, a plugin the checkpoint needs that was not given.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pickle
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from raysim.errors import ConfigError

ENTRY_POINT_GROUP = "raysim.plugins"

_loaded: dict[str, ModuleType] = {}
"""The plugins imported through `load` in this process, by spec (a file's absolute path, or a module name)."""
_installed: dict[str, str] = {}
"""The entry points imported by `load_installed` (empty until then): name -> module."""
_installed_done = False


class PluginError(ConfigError):
    """A plugin could not be found or imported; the message names it and what went wrong."""


def is_file(spec: str) -> bool:
    """Whether a plugin spec names a `.py` file (else it is a module name)."""
    return spec.endswith(".py")


def module_name(spec: str) -> str:
    """The module a plugin is imported as: a module name as it is, a file by its stem (`a/fedavgm.py` -> `fedavgm`)."""
    return Path(spec).stem if is_file(spec) else spec


def resolve(specs: object, base: Path | None, where: str) -> list[str]:
    """Plugin specs as stored: module names as given, files as absolute paths (relative ones against `base`, else the
    current directory); a ConfigError starting with `where` for anything that is neither."""
    if specs is None:
        return []
    if not isinstance(specs, list | tuple) or not all(isinstance(spec, str) and spec for spec in specs):
        raise ConfigError(f"{where}: must be a list of module names or .py files (got {specs!r})")
    resolved = []
    for spec in specs:
        if is_file(spec):
            path = Path(spec).expanduser()
            spec = str(path if path.is_absolute() else (base or Path.cwd()) / path)
        elif not all(part.isidentifier() for part in spec.split(".")):
            raise ConfigError(f"{where}: {spec!r} is neither a module name nor a .py file")
        if spec not in resolved:
            resolved.append(spec)
    return resolved


def load_all(specs: Iterable[str]) -> None:
    """Import every plugin of `specs` (see `load`), in order."""
    for spec in specs:
        load(spec)


def load(spec: str) -> ModuleType:
    """Import one plugin (a module name, or a `.py` file's path), once per process; a PluginError naming it and its
    exception if it cannot be imported."""
    if spec in _loaded:
        return _loaded[spec]
    module = _load_file(Path(spec)) if is_file(spec) else _load_module(spec)
    _loaded[spec] = module
    return module


def _failure(error: BaseException) -> str:
    """What ended a plugin's import, as one line: the exception's type and its message's first line; `sys.exit`
    says so with its code (a plugin must not end the command, least of all with exit 0)."""
    if isinstance(error, SystemExit):
        return f"it called sys.exit({error.code!r}) while being imported"
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0]}" if message else type(error).__name__


def _load_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except BaseException as error:  # noqa: BLE001 - sys.exit and KeyboardInterrupt in a plugin are its failures too
        sys.modules.pop(name, None)
        raise PluginError(f"plugin {name}: {_failure(error)}") from None


def _load_file(path: Path) -> ModuleType:
    """Import a `.py` file as the module named after it, refusing a name that another module already has."""
    path = path.resolve()
    name = path.stem
    if not path.is_file():
        raise PluginError(f"plugin {path}: no such file")
    if not name.isidentifier():
        raise PluginError(f"plugin {path}: {name!r} is not a module name; rename the file (letters, digits and _)")
    existing = sys.modules.get(name)
    if existing is not None:
        existing_file = getattr(existing, "__file__", None)
        if existing_file and Path(existing_file).resolve() == path:
            return existing
        where = existing_file or "a built-in module"
        raise PluginError(f"plugin {path}: module name {name!r} is taken by {where}; rename the file")
    found = importlib.util.find_spec(name)
    if found is not None and found.origin and Path(found.origin).resolve() != path:
        raise PluginError(f"plugin {path}: module name {name!r} is taken by {found.origin}; rename the file")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # noqa: BLE001 - sys.exit and KeyboardInterrupt in a plugin are its failures too
        del sys.modules[name]
        raise PluginError(f"plugin {path}: {_failure(error)}") from None
    return module


def load_installed() -> list[str]:
    """Import the plugins of installed packages (entry points of the group `raysim.plugins`), once per process;
    returns their names. A PluginError naming the entry point if one cannot be imported."""
    global _installed_done
    if not _installed_done:
        _installed_done = True  # first: a plugin that looks a name up while it is imported does not come back here
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry.load()
            except BaseException as error:  # noqa: BLE001 - whatever ends a plugin's import is reported as one line
                raise PluginError(
                    f"plugin {entry.name} (entry point {entry.value} of {ENTRY_POINT_GROUP}): {_failure(error)}"
                ) from None
            _installed[entry.name] = entry.module
    return list(_installed)


def for_checkpoint(specs: object, where: str) -> list[str]:
    """The plugins a checkpoint's saved config lists (`specs`), each matched by module name to one imported in this
    process (given with `--plugin`, named by the study being resumed, or an installed entry point), as that import's
    spec: resuming imports nothing the checkpoint names. A PluginError starting with `where` names the first one
    that was not given."""
    available = {module_name(spec): spec for spec in loaded()}
    load_installed()  # what any registry lookup imports: the user installed them
    installed = set(_installed.values())
    matched = []
    for spec in resolve(specs, None, f"{where}: plugins"):
        name = module_name(spec)
        if name in available:
            matched.append(available[name])
        elif name in installed:
            matched.append(name)
        else:
            raise PluginError(
                f"{where}: the checkpoint needs plugin {spec}, which was not given; a resume imports only the "
                f"plugins named on its command line: add --plugin {spec} if you trust that file"
            )
    return list(dict.fromkeys(matched))


def is_plugin_module(name: str) -> bool:
    """Whether module `name` is a plugin imported in this process (through `load` or an entry point), or inside
    one: its dataclasses are state classes that checkpoints may rebuild (raysim.runtime.checkpoint)."""
    roots = {module.__name__ for module in _loaded.values()} | set(_installed.values())
    return any(name == root or name.startswith(f"{root}.") for root in roots)


def loaded() -> list[str]:
    """The plugins `load` imported in this process (what `carry` takes to Ray's workers), in order."""
    return list(_loaded)


def carry(value: Any) -> Any:
    """`value` as an argument for a Ray actor or task: unpickled there only after the worker imported this process's
    plugins (a file plugin from its path, which the worker's node must have), so that their classes are found and
    their entries registered. Without plugins, `value` itself."""
    specs = loaded()
    return _Carried(value, specs) if specs else value


class _Carried:
    def __init__(self, value: Any, specs: list[str]):
        self.value = value
        self.specs = specs

    def __reduce__(self) -> tuple[Any, tuple[list[str], bytes]]:
        return _arrive, (self.specs, pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL))


def _arrive(specs: list[str], payload: bytes) -> Any:
    load_all(specs)
    return pickle.loads(payload)


def import_in_worker(specs: list[str]) -> str | None:
    """Run in a Ray worker (raysim.runtime.session.check_plugins_in_workers): import `specs` there; the PluginError's
    line if one cannot be imported, returned rather than raised, since Ray prints an exception raised in a worker
    with its traceback on the driver's console."""
    try:
        load_all(specs)
    except PluginError as error:
        return str(error)
    return None


def failed_in_worker(error: BaseException) -> str | None:
    """The PluginError line of a Ray error whose actor or task could not import a plugin in its worker (`_arrive`
    raised it while Ray read the arguments), else None. Ray hands the driver such an error as text (its message
    holds the worker's traceback), so the line is found by the error's qualified name."""
    if not type(error).__module__.startswith("ray."):
        return None
    prefix = f"{PluginError.__module__}.{PluginError.__qualname__}: "
    lines = [line[len(prefix) :] for line in str(error).splitlines() if line.startswith(prefix)]
    return lines[-1] if lines else None
