"""Registry of training environments by domain name.

Adding an environment is one module that decorates its class with `@register_environment` and one
line in `_BUILTIN_MODULES` below. Installed packages add theirs through the entry-point group
`skillswarm.environments`: each entry point is named after its environment and names either the
Environment subclass or a module that registers it; each is loaded when first needed, once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from skillswarm.agent.envs.base import Environment

logger = logging.getLogger(__name__)

_BUILTIN_MODULES: tuple[str, ...] = (
    "skillswarm.agent.envs.math",
    "skillswarm.agent.envs.code",
    "skillswarm.agent.envs.search",
)

ENTRY_POINT_GROUP = "skillswarm.environments"

_REGISTRY: dict[str, type[Environment]] = {}
_builtins_loaded = False
# Entry points seen so far, by name, and why each one that failed to load failed.
_DECLARED: dict[str, importlib.metadata.EntryPoint] = {}
_LOADED: set[str] = set()
_ENTRY_POINT_ERRORS: dict[str, str] = {}

EnvironmentClass = TypeVar("EnvironmentClass", bound=type[Environment])


class DuplicateEnvironmentError(ValueError):
    """Raised when a second environment registers under a name that is already taken."""


class UnknownEnvironmentError(KeyError):
    """Raised when no environment is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class EnvironmentEntryPointError(UnknownEnvironmentError):
    """Raised when the installed entry point that declares an environment fails to load."""


class TasksFileNotSupportedError(ValueError):
    """Raised when a task file is given for an environment that reads none."""


def register_environment(environment_class: EnvironmentClass) -> EnvironmentClass:
    """Class decorator: register an Environment subclass under its `name` attribute."""
    name = getattr(environment_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{environment_class.__qualname__} needs a non-empty string `name`")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not environment_class:
        raise DuplicateEnvironmentError(
            f"environment name {name!r} is already registered by "
            f"{existing.__module__}.{existing.__qualname__}; choose another name"
        )
    _REGISTRY[name] = environment_class
    return environment_class


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        for module_name in _BUILTIN_MODULES:
            importlib.import_module(module_name)
        _builtins_loaded = True


def _discover_entry_points() -> None:
    """Note the entry points of the group that are installed now (they are not imported)."""
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _DECLARED.setdefault(entry_point.name, entry_point)


def _register_entry_point(entry_point: importlib.metadata.EntryPoint) -> None:
    """Import what `entry_point` names and make sure it registered the environment of its name."""
    loaded = entry_point.load()
    if isinstance(loaded, type) and issubclass(loaded, Environment):
        if getattr(loaded, "name", None) != entry_point.name:
            raise ValueError(
                f"it names {loaded.__module__}.{loaded.__qualname__}, whose name is "
                f"{getattr(loaded, 'name', None)!r}; name the entry point after its environment"
            )
        register_environment(loaded)
    elif not isinstance(loaded, ModuleType):
        raise TypeError(
            f"it names {loaded!r}; an entry point names an Environment subclass or a module "
            "that registers one"
        )
    if entry_point.name not in _REGISTRY:
        raise ValueError(f"its module registers no environment named {entry_point.name!r}")


def _load_entry_point(name: str) -> None:
    """Load the entry point `name` unless it was tried already; a failure is kept and logged."""
    if name in _LOADED:
        return
    _LOADED.add(name)
    entry_point = _DECLARED[name]
    try:
        _register_entry_point(entry_point)
    except Exception as error:  # a broken package must not take the other environments down
        message = (
            f"environment entry point {name!r} ({entry_point.value}, group "
            f"{ENTRY_POINT_GROUP}) failed to load: {type(error).__name__}: {error}; fix or "
            "uninstall the package that declares it"
        )
        _ENTRY_POINT_ERRORS[name] = message
        logger.warning("%s", message)


def _load_all_entry_points() -> None:
    _discover_entry_points()
    for name in list(_DECLARED):
        _load_entry_point(name)


def entry_point_errors() -> dict[str, str]:
    """Why each installed environment entry point that failed to load failed, by its name."""
    _load_all_entry_points()
    return dict(_ENTRY_POINT_ERRORS)


def list_environments() -> list[str]:
    """Names of all registered environments (built-in and from installed packages), sorted;
    entry points that fail to load are left out (see `entry_point_errors`)."""
    _load_builtins()
    _load_all_entry_points()
    return sorted(_REGISTRY)


def environment_class(name: str) -> type[Environment]:
    """The class registered as `name`, without building an environment. An installed entry
    point of that name is loaded first; other entry points only when the name is not found."""
    _load_builtins()
    found = _REGISTRY.get(name)
    if found is None:
        _discover_entry_points()
        if name in _DECLARED:
            _load_entry_point(name)
        else:
            _load_all_entry_points()
        found = _REGISTRY.get(name)
    if found is None:
        if name in _ENTRY_POINT_ERRORS:
            raise EnvironmentEntryPointError(_ENTRY_POINT_ERRORS[name])
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnknownEnvironmentError(f"no environment named {name!r}; registered: {known}")
    return found


def takes_tasks_file(name: str) -> bool:
    """Whether the environment registered as `name` can read its tasks from a file."""
    return "tasks_file" in inspect.signature(environment_class(name)).parameters


def get_environment(
    name: str, *, tasks_file: str | Path | None = None, **kwargs: Any
) -> Environment:
    """Instantiate the environment registered as `name` with `kwargs`; `tasks_file`, when given,
    goes to an environment that takes one and is refused by one that does not."""
    found = environment_class(name)
    if tasks_file is None:
        return found(**kwargs)
    if not takes_tasks_file(name):
        readers = [other for other in list_environments() if takes_tasks_file(other)]
        raise TasksFileNotSupportedError(
            f"the {name} environment reads no task file ({tasks_file}); environments that do: "
            f"{', '.join(readers) or 'none'}"
        )
    return found(tasks_file=tasks_file, **kwargs)


__all__ = [
    "ENTRY_POINT_GROUP",
    "DuplicateEnvironmentError",
    "Environment",
    "EnvironmentEntryPointError",
    "TasksFileNotSupportedError",
    "UnknownEnvironmentError",
    "entry_point_errors",
    "environment_class",
    "get_environment",
    "list_environments",
    "register_environment",
    "takes_tasks_file",
]
