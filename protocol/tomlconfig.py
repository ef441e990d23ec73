"""Loading a daemon's configuration into its pydantic model: the model's defaults, then one TOML
file, then `SKILLSWARM_…` environment variables, then `--set KEY=VALUE` overrides, each over the
one before; every error names the file, variable or override it comes from."""

from __future__ import annotations

import copy
import logging
import os
import tomllib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ValidationError

ConfigT = TypeVar("ConfigT", bound=BaseModel)

ENV_PREFIX = "SKILLSWARM_"
ENV_NESTING = "__"
Keys = tuple[str, ...]

log = logging.getLogger(__name__)


class ConfigFileError(ValueError):
    """A configuration file is missing, is not TOML, or does not validate."""


class ConfigOverrideError(ConfigFileError):
    """A `--set` override or an environment variable names no field or holds no usable value."""


class _NoSuchField(ValueError):
    """A dotted key that names no field of the model."""


def read_toml_table(path: Path) -> dict[str, Any]:
    """The TOML file at `path` as a table; ConfigFileError when missing or not TOML."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigFileError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path} is not valid TOML: {exc}") from exc


def load_toml_config(path: Path, model: type[ConfigT]) -> ConfigT:
    """Read `path` and validate it as `model`; every error names the file and the field. The
    file alone: no environment variables, no overrides (`load_config` adds those)."""
    return resolve_config(model, read_toml_table(path), source=str(path), environ={})


def load_config(
    model: type[ConfigT],
    path: Path | None = None,
    *,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> ConfigT:
    """`model` from its defaults, the TOML file at `path` (when given), the environment's
    variables (`os.environ` unless `environ`) and `overrides`, each over the one before."""
    table = read_toml_table(path) if path is not None else {}
    return resolve_config(
        model,
        table,
        source=str(path) if path is not None else "configuration",
        overrides=overrides,
        environ=environ,
        env_prefix=env_prefix,
    )


def resolve_config(
    model: type[ConfigT],
    table: Mapping[str, Any],
    *,
    source: str = "configuration",
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
) -> ConfigT:
    """Validate `table` (what `source` holds) as `model` once the overrides are laid over it.

    A variable counts when its name is `env_prefix` followed by a field path with `__` between
    the levels, in any case (SKILLSWARM_TRAIN__LEARNING_RATE is train.learning_rate); other
    variables, and empty ones, are ignored. An override is `dotted.key=VALUE`, applied in order.
    Values are TOML values (`0.01`, `true`, `["math", "code"]`, `{steps = 3}`); text that is not
    one, or any value of a text field, is taken as text. A table merges into the table below it
    key by key, so the overridden fields count as fields the user set, like the file's."""
    data = copy.deepcopy(dict(table))
    sources: dict[Keys, str] = {}
    found = environment_overrides(model, os.environ if environ is None else environ, env_prefix)
    for name, keys, value in found:
        _assign(data, keys, value)
        sources[keys] = name
    for text in overrides:
        keys, value = parse_override(model, text)
        _assign(data, keys, value)
        sources[keys] = f"--set {text}"
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_problem(error, sources) for error in exc.errors())
        raise ConfigFileError(f"{source}: {problems}") from exc


def parse_override(model: type[BaseModel], text: str) -> tuple[Keys, Any]:
    """`"train.learning_rate=0.01"` -> (("train", "learning_rate"), 0.01), the key checked
    against `model`; ConfigOverrideError naming the override when it cannot be used."""
    key, equals, raw = text.partition("=")
    keys = tuple(part.strip() for part in key.strip().split("."))
    if not equals or not all(keys):
        raise ConfigOverrideError(f"--set {text}: expected KEY=VALUE, e.g. train.steps=3")
    try:
        leaf = _field_at(model, keys)
    except _NoSuchField as exc:
        raise ConfigOverrideError(f"--set {text}: {exc}") from exc
    try:
        return keys, _parse_value(raw.strip(), leaf)
    except ValueError as exc:
        raise ConfigOverrideError(f"--set {text}: {'.'.join(keys)} {exc}") from exc


def environment_overrides(
    model: type[BaseModel], environ: Mapping[str, str], prefix: str = ENV_PREFIX
) -> list[tuple[str, Keys, Any]]:
    """(variable, field path, value) of every non-empty variable in `environ` whose name is
    `prefix` and a field path of `model`, tables before the fields inside them."""
    found: list[tuple[str, Keys, Any]] = []
    for name, raw in environ.items():
        if not name.upper().startswith(prefix.upper()) or not raw.strip():
            continue
        keys = tuple(name[len(prefix) :].lower().split(ENV_NESTING))
        try:
            leaf = _field_at(model, keys)
        except _NoSuchField as exc:
            if len(keys) > 1 and keys[0] in model.model_fields:  # a near miss, likely a typo
                log.warning("ignoring environment variable %s: %s", name, exc)
            continue
        try:
            found.append((name, keys, _parse_value(raw.strip(), leaf)))
        except ValueError as exc:
            message = f"environment variable {name}: {'.'.join(keys)} {exc}"
            raise ConfigOverrideError(message) from exc
    return sorted(found, key=lambda item: (len(item[1]), item[0]))


def config_toml(config: BaseModel) -> str:
    """A config model as TOML text (None fields left out)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True, by_alias=True))


def write_toml_config(config: BaseModel, path: Path) -> Path:
    """Write a config model as TOML (None fields left out), e.g. for `demo` or a template."""
    Path(path).write_text(config_toml(config))
    return Path(path)


def _field_at(model: type[BaseModel], keys: Keys) -> Any:
    """The annotation of the field `keys` names in `model`: fields of nested models by name,
    then, inside a table-valued field (a dict), any key. Raises _NoSuchField."""
    current: Any = model
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth])
        if isinstance(current, type) and issubclass(current, BaseModel):
            if key not in current.model_fields:
                known = ", ".join(current.model_fields)
                owner = f"[{where}]" if where else "the configuration"
                raise _NoSuchField(f"{owner} has no field {key!r}; its fields: {known}")
            current = _table_type(current.model_fields[key].annotation)
        elif get_origin(current) is dict or current is dict:
            arguments = get_args(current)
            current = _table_type(arguments[1]) if arguments else Any
        else:
            raise _NoSuchField(f"{where} is a value, not a table: {key!r} cannot be under it")
    return current


def _table_type(annotation: Any) -> Any:
    """`annotation` without Annotated and None; a union's model or dict member when it has one
    (so that keys can go under it), else the annotation."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [_table_type(a) for a in get_args(annotation) if a is not type(None)]
        for member in members:
            is_model = isinstance(member, type) and issubclass(member, BaseModel)
            if is_model or get_origin(member) is dict or member is dict:
                return member
        return members[0] if len(members) == 1 else annotation
    return annotation


def _is_text(annotation: Any) -> bool:
    """Whether a field takes text: str, a Path, or a Literal of strings."""
    if annotation in (str, Path):
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(choice, str) for choice in get_args(annotation))
    return False


def _parse_value(raw: str, annotation: Any) -> Any:
    """`raw` as a TOML value; text as it is when the field takes text (unless quoted) or when
    `raw` is not TOML. ValueError for text that looks like TOML (brackets, quotes) but is not."""
    quoted = raw[:1] in ('"', "'")
    if _is_text(annotation) and not quoted:
        return raw
    try:
        parsed = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError as exc:
        if raw[:1] in ("[", "{") or quoted:
            raise ValueError(
                f"= {raw} is not a TOML value ({exc}); strings inside arrays and tables need "
                'quotes, e.g. ["math", "code"]'
            ) from exc
        return raw
    return parsed["value"] if list(parsed) == ["value"] else raw


def _assign(table: dict[str, Any], keys: Keys, value: Any) -> None:
    """Put `value` at `keys` in `table`, making the tables on the way; a table merges into the
    table already there key by key."""
    for key in keys[:-1]:
        below = table.get(key)
        if not isinstance(below, dict):
            below = table[key] = {}
        table = below
    last = keys[-1]
    if isinstance(value, dict) and isinstance(table.get(last), dict):
        for key, item in value.items():
            _assign(table[last], (key,), item)
    else:
        table[last] = value


def _problem(error: Any, sources: Mapping[Keys, str]) -> str:
    """One validation error as 'dotted.loc: message', with the overrides that touched it."""
    loc = tuple(str(part) for part in error["loc"])
    text = f"{'.'.join(loc)}: {error['msg']}"
    touched = [
        source
        for keys, source in sources.items()
        if keys[: len(loc)] == loc or loc[: len(keys)] == keys
    ]
    return f"{text} (from {', '.join(touched)})" if touched else text
