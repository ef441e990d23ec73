"""Loading a daemon's one TOML configuration file into its pydantic model, with clear errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

import tomli_w
from pydantic import BaseModel, ValidationError

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigFileError(ValueError):
    """A configuration file is missing, is not TOML, or does not validate."""


def load_toml_config(path: Path, model: type[ConfigT]) -> ConfigT:
    """Read `path` and validate it as `model`; every error names the file and the field."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigFileError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path} is not valid TOML: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigFileError(f"{path}: {problems}") from exc


def write_toml_config(config: BaseModel, path: Path) -> Path:
    """Write a config model as TOML (None fields left out), e.g. for `demo` or a template."""
    data = config.model_dump(mode="json", exclude_none=True, by_alias=True)
    Path(path).write_text(tomli_w.dumps(data))
    return Path(path)
