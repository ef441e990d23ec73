"""Registry of training environments by domain name.

Adding an environment is one module that decorates its class with `@register_environment` and one
line in `_BUILTIN_MODULES` below.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, TypeVar

from skillswarm.agent.envs.base import Environment

_BUILTIN_MODULES: tuple[str, ...] = (
    "skillswarm.agent.envs.math",
    "skillswarm.agent.envs.code",
    "skillswarm.agent.envs.search",
)

_REGISTRY: dict[str, type[Environment]] = {}
_builtins_loaded = False

EnvironmentClass = TypeVar("EnvironmentClass", bound=type[Environment])


class DuplicateEnvironmentError(ValueError):
    """Raised when a second environment registers under a name that is already taken."""


class UnknownEnvironmentError(KeyError):
    """Raised when no environment is registered under the requested name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


def list_environments() -> list[str]:
    """Names of all registered environments, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def environment_class(name: str) -> type[Environment]:
    """The class registered as `name`, without building an environment."""
    _load_builtins()
    found = _REGISTRY.get(name)
    if found is None:
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
    "DuplicateEnvironmentError",
    "Environment",
    "TasksFileNotSupportedError",
    "UnknownEnvironmentError",
    "environment_class",
    "get_environment",
    "list_environments",
    "register_environment",
    "takes_tasks_file",
]
