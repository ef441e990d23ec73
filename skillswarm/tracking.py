"""Experiment tracking: a node's training steps and the coordinator's rounds sent to trackio,
Weights & Biases or TensorBoard, as an optional `[tracking]` table of their configs sets up.
Logging never raises: a backend's failure is a warning, and training or merging goes on."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "BACKEND_PACKAGES",
    "Tracker",
    "TrackingBackendMissing",
    "TrackingConfig",
    "TrackingError",
    "markdown_table",
    "open_tracker",
    "require_backend",
]

log = logging.getLogger(__name__)

Backend = Literal["trackio", "wandb", "tensorboard"]
# backend -> (the module it imports, the extra of this package that installs it)
BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "trackio": ("trackio", "tracking"),
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboardX", "tensorboard"),
}


class TrackingError(RuntimeError):
    """A tracking run could not start."""


class TrackingBackendMissing(TrackingError):
    """The configured backend's package is not installed."""


def require_backend(backend: str) -> None:
    """Raise TrackingBackendMissing, naming what to install, when `backend`'s package is absent."""
    module, extra = BACKEND_PACKAGES[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one
        found = False
    if not found:
        raise TrackingBackendMissing(
            f"tracking backend {backend!r} needs the {module} package: "
            f"pip install 'skillswarm[{extra}]' (or pip install {module})"
        )


class TrackingConfig(BaseModel):
    """The `[tracking]` table of a node's or the coordinator's config; tracking is off without
    it. trackio (the default) keeps a local SQLite database, W&B runs offline unless `mode` is
    "online", TensorBoard writes event files; all of them under `dir`."""

    model_config = ConfigDict(extra="forbid")

    backend: Backend = "trackio"
    project: str = Field(default="skillswarm", min_length=1)
    run_name: str | None = Field(
        default=None,
        description="default: {domain}-node-{the peer id's last 8 characters} on a node, "
        "coordinator on the coordinator",
    )
    dir: Path | None = Field(
        default=None, description="where the backend writes; default: work_dir/tracking"
    )
    mode: Literal["offline", "online"] = Field(
        default="offline",
        description="W&B: offline (sync later with `wandb sync`) or online; trackio and "
        "TensorBoard always write locally",
    )
    table_every: int = Field(
        default=1, ge=0, description="node: a table of sample episodes every N steps; 0: none"
    )
    table_rows: int = Field(default=4, ge=1, description="node: episodes in each table")
    max_chars: int = Field(
        default=1000, ge=16, description="node: a table cell's text is cut to this many characters"
    )

    @model_validator(mode="after")
    def _backend_installed(self) -> TrackingConfig:
        try:
            require_backend(self.backend)
        except TrackingBackendMissing as exc:
            raise ValueError(str(exc)) from None
        return self


class _Run(Protocol):
    """One run of one backend."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(
        self, name: str, columns: list[str], rows: list[list[Any]], step: int
    ) -> None: ...

    def close(self) -> None: ...


class Tracker:
    """One tracking run. `log`, `log_table` and `close` never raise: a backend's first failure
    is logged as a warning, later ones are counted in `failures`. Thread-safe."""

    def __init__(self, run: _Run, backend: str, name: str) -> None:
        self.backend = backend
        self.name = name
        self.failures = 0
        self._run: _Run | None = run
        self._lock = threading.Lock()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the numeric entries of `metrics` (booleans as 0/1; non-finite ones left out)."""
        numbers = {
            str(key): float(value)
            for key, value in metrics.items()
            if isinstance(value, int | float) and math.isfinite(value)
        }
        if numbers:
            self._call("log", lambda run: run.log(numbers, int(step)))

    def log_table(
        self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int
    ) -> None:
        """Log a table (e.g. sample episodes) under `name` at `step`."""
        table = [list(row) for row in rows]
        self._call("log_table", lambda run: run.log_table(name, list(columns), table, int(step)))

    def close(self) -> None:
        """Finish the run (flushing what it holds); later calls do nothing."""
        self._call("close", lambda run: run.close())
        with self._lock:
            self._run = None

    def _call(self, what: str, action: Any) -> None:
        with self._lock:
            if self._run is None:
                return
            try:
                action(self._run)
            except Exception as exc:  # tracking is never worth a failed step or round
                self.failures += 1
                if self.failures == 1:
                    log.warning(
                        "%s tracking of %s failed in %s (%s: %s); training goes on, and later "
                        "tracking failures are counted, not logged",
                        self.backend,
                        self.name,
                        what,
                        type(exc).__name__,
                        exc,
                    )

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def open_tracker(
    config: TrackingConfig,
    *,
    run_name: str,
    default_dir: Path,
    run_config: Mapping[str, Any] | None = None,
) -> Tracker:
    """Start a run as `config` says: named `config.run_name` or else `run_name`, written under
    `config.dir` or else `default_dir`, with `run_config` recorded as its settings.
    TrackingBackendMissing when the backend's package is absent, TrackingError when it fails."""
    require_backend(config.backend)
    name = config.run_name or run_name
    folder = Path(config.dir or default_dir)
    settings = dict(run_config or {})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        opener = {"trackio": _TrackioRun, "wandb": _WandbRun, "tensorboard": _TensorBoardRun}
        run = opener[config.backend](config, name, folder, settings)
    except Exception as exc:
        raise TrackingError(
            f"could not start the {config.backend} run {name!r} in {folder}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    log.info("tracking %s with %s in %s", name, config.backend, folder)
    return Tracker(run, config.backend, name)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; `|` in cells escaped and line breaks written as <br>."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = [
        "| " + " | ".join(cell(c) for c in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
    ]
    return "\n".join(lines)


class _TrackioRun:
    """trackio: a local SQLite database, `dir`/{project}.db (`trackio show` opens it). trackio
    reads its folder (TRACKIO_DIR) once per process, and keeps one current run per process;
    tables are trackio.Table values, shown in its dashboard."""

    def __init__(self, config: TrackingConfig, name: str, folder: Path, settings: dict) -> None:
        os.environ["TRACKIO_DIR"] = str(folder)
        import trackio

        in_use = Path(getattr(getattr(trackio, "utils", None), "TRACKIO_DIR", folder))
        if in_use.resolve() != folder.resolve():
            log.warning("trackio already writes to %s in this process; %s goes there", in_use, name)
        self._trackio = trackio
        self._run = trackio.init(
            project=config.project,
            name=name,
            config=settings,
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self._run.log({name: self._trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        current = getattr(getattr(self._trackio, "context_vars", None), "current_run", None)
        if current is not None and current.get() is self._run:
            self._trackio.finish()  # also forgets it as the process's current run
        else:
            self._run.finish()


class _WandbRun:
    """Weights & Biases: `dir`/wandb/offline-run-… (mode offline; `wandb sync` uploads it) or a
    run on the W&B server (mode online). Tables are wandb.Table values."""

    def __init__(self, config: TrackingConfig, name: str, folder: Path, settings: dict) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=config.project,
            name=name,
            dir=str(folder),
            mode=config.mode,
            config=settings,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self._run.log({name: self._wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self._run.finish()


class _TensorBoardRun:
    """TensorBoard (through tensorboardX): event files in `dir`/{run name}, so that
    `tensorboard --logdir dir` shows each run; a table is a Markdown text summary."""

    def __init__(self, config: TrackingConfig, name: str, folder: Path, settings: dict) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(folder / name))
        if settings:
            text = json.dumps(settings, indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", "\n".join("    " + line for line in text.split("\n")))
            self._writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        self._writer.add_text(name, markdown_table(columns, rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
