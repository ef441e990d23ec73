"""Run metrics of the RL trainer: an append-only JSONL log that survives kill -9, a histogram of
sample staleness, reward-curve plots (PNG), a terminal progress bar, and the step metrics and
sample episodes sent to an experiment tracker (skillswarm.tracking).
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from skillswarm.protocol.durable import write_bytes_atomically

from skillswarm.tracking import Tracker, TrackingConfig, open_tracker

if TYPE_CHECKING:
    from skillswarm.agent.rollout import Episode

MetricRecord = dict[str, Any]
RunRecords = Sequence[MetricRecord] | str | os.PathLike[str]


class MetricsFileError(ValueError):
    """A metrics log has a damaged line that is not the (possibly torn) last one."""


def _json_safe(value: Any) -> Any:
    """`value` as plain JSON: non-finite floats become None, numpy and torch scalars become
    Python numbers, mappings and sequences are converted element by element."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        return _json_safe(item())
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-able")


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a kill left without its newline, so appends start on a fresh line."""
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return
        position = size
        chunk_size = 65536
        while position > 0:
            start = max(0, position - chunk_size)
            handle.seek(start)
            chunk = handle.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                handle.truncate(start + newline + 1)
                return
            position = start
        handle.truncate(0)


class MetricsLogger:
    """Appends one JSON object per line (`step`, `time`, then the metrics) to `path`, flushing
    each line and fsyncing every `fsync_every` lines (0: never). Opening an existing log resumes
    it: a line torn by a kill is dropped and new lines follow the last whole one."""

    def __init__(self, path: Path, *, fsync_every: int = 0) -> None:
        if fsync_every < 0:
            raise ValueError(f"fsync_every must be non-negative, got {fsync_every}")
        self.path = Path(path)
        self.fsync_every = fsync_every
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_torn_tail(self.path)
        self._handle: io.TextIOWrapper | None = open(self.path, "a", encoding="utf-8")
        self._unsynced = 0

    def log(self, step: int, metrics: Mapping[str, Any] | None = None, **more: Any) -> MetricRecord:
        """Write one line for `step` with `metrics` and keyword metrics; return the record."""
        if self._handle is None:
            raise ValueError(f"metrics log {self.path} is closed")
        record: MetricRecord = {"step": int(step), "time": time.time()}
        for key, value in {**(metrics or {}), **more}.items():
            if key in ("step", "time"):
                continue
            record[str(key)] = _json_safe(value)
        self._handle.write(json.dumps(record, allow_nan=False) + "\n")
        self._handle.flush()
        self._unsynced += 1
        if self.fsync_every and self._unsynced >= self.fsync_every:
            os.fsync(self._handle.fileno())
            self._unsynced = 0
        return record

    def close(self) -> None:
        """Flush, fsync and close; later calls do nothing."""
        if self._handle is None:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: Path) -> list[MetricRecord]:
    """Every record of a metrics log, in order. A damaged last line (a kill mid-write) is
    ignored; a damaged line before it raises `MetricsFileError` naming the line."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records: list[MetricRecord] = []
    written = [index for index, line in enumerate(lines) if line.strip()]
    last_index = written[-1] if written else -1
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as error:
            if index == last_index:
                break
            raise MetricsFileError(f"{path}:{index + 1}: damaged metrics line ({error})") from error
        records.append(record)
    return records


class StalenessHistogram:
    """How many samples were trained on at each staleness (policy versions behind the trainer)."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()

    def add(self, staleness: int, count: int = 1) -> None:
        if staleness < 0 or count < 0:
            raise ValueError(f"staleness and count must be non-negative, got {staleness}, {count}")
        if count:
            self._counts[int(staleness)] += int(count)

    def update(self, stalenesses: Iterable[int]) -> None:
        for staleness in stalenesses:
            self.add(staleness)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def mean(self) -> float:
        """Mean staleness; NaN when empty."""
        total = self.total
        if total == 0:
            return float("nan")
        return sum(staleness * count for staleness, count in self._counts.items()) / total

    def as_dict(self) -> dict[str, int]:
        """Counts keyed by staleness as a string (JSON object keys), smallest first."""
        return {str(staleness): self._counts[staleness] for staleness in sorted(self._counts)}

    def clear(self) -> None:
        self._counts.clear()


def _ema(values: Sequence[float], smoothing: float) -> list[float]:
    """Exponential moving average with bias correction (the first point is not pulled to 0)."""
    smoothed: list[float] = []
    average = 0.0
    for count, value in enumerate(values, start=1):
        average = smoothing * average + (1 - smoothing) * value
        smoothed.append(average / (1 - smoothing**count))
    return smoothed


def _as_records(source: RunRecords) -> list[MetricRecord]:
    if isinstance(source, str | os.PathLike):
        return read_metrics(Path(source))
    return list(source)


def plot_reward_curves(
    records: RunRecords | Mapping[str, RunRecords],
    out_png: Path,
    *,
    keys: Sequence[str] = ("reward_mean", "success_rate"),
    title: str = "Training reward",
    smoothing: float = 0.8,
) -> Path:
    """Plot each metric of `keys` that any run has, one panel per key, against `step`: raw points
    and an exponentially smoothed line. `records` is one run (records or a log path) or a mapping
    of run name to run, overlaid (e.g. one run per domain). Writes the PNG atomically."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    if isinstance(records, Mapping):
        runs = {str(name): _as_records(source) for name, source in records.items()}
    else:
        runs = {"": _as_records(records)}
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for key in keys:
        for name, run in runs.items():
            points = [
                (float(record["step"]), float(record[key]))
                for record in run
                if isinstance(record.get("step"), int | float)
                and isinstance(record.get(key), int | float)
                and not isinstance(record.get(key), bool)
                and math.isfinite(record[key])
            ]
            if points:
                points.sort()
                series.setdefault(key, {})[name] = ([p[0] for p in points], [p[1] for p in points])
    if not series:
        raise ValueError(f"no run has any of the metrics {list(keys)} to plot")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.2 * len(series)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(series), 1, squeeze=False)[:, 0]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    color_of = dict(zip(runs, colors, strict=True))
    for axis, (key, by_run) in zip(axes, series.items(), strict=True):
        for name, (steps, values) in by_run.items():
            color = color_of[name]
            axis.scatter(steps, values, s=8, alpha=0.3, color=color, linewidths=0)
            axis.plot(steps, _ema(values, smoothing), color=color, label=name or None)
        axis.set_ylabel(key)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if len(runs) > 1:
            axis.legend(loc="best", fontsize="small")
    figure.suptitle(title)
    return write_figure_png(figure, out_png)


def write_figure_png(figure: Any, out_png: Path) -> Path:
    """Write a matplotlib figure to `out_png` atomically (its folder made if need be)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(out_png, buffer.getvalue())
    return out_png


class ProgressReporter:
    """A progress bar on stderr: step/total, reward and success rate of the last step, tokens/s.
    Does nothing when disabled or when the console is not a terminal (logs, pipes, CI)."""

    def __init__(
        self,
        total_steps: int,
        description: str = "training",
        *,
        enabled: bool = True,
        console: Console | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.description = description
        self.console = console or Console(stderr=True)
        self.active = enabled and self.console.is_terminal
        self.last_reward: float | None = None
        self.last_success_rate: float | None = None
        self.last_tokens_per_second: float | None = None
        self._last_update = time.perf_counter()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.active:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("step"),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"),
                TextColumn("success {task.fields[success]}"),
                TextColumn("{task.fields[speed]} tok/s"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                description, total=total_steps, reward="-", success="-", speed="-"
            )
            self._progress.start()

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Show `step` (0-based, so step+1 are done) and its metrics: `reward_mean`,
        `success_rate`, and tokens from `tokens` or `episodes` × `sampled_tokens_mean`, over
        `step_seconds` or the time since the previous update."""
        metrics = metrics or {}
        now = time.perf_counter()
        seconds = float(metrics.get("step_seconds", now - self._last_update))
        self._last_update = now
        self.last_reward = _finite_or_none(metrics.get("reward_mean"))
        self.last_success_rate = _finite_or_none(metrics.get("success_rate"))
        tokens = metrics.get("tokens")
        if tokens is None and "episodes" in metrics and "sampled_tokens_mean" in metrics:
            tokens = metrics["episodes"] * metrics["sampled_tokens_mean"]
        tokens = _finite_or_none(tokens)
        self.last_tokens_per_second = (
            tokens / seconds if tokens is not None and seconds > 0 else None
        )
        if self._progress is None or self._task is None:
            return
        self._progress.update(
            self._task,
            completed=min(step + 1, self.total_steps),
            reward=_shown(self.last_reward, "{:.3f}"),
            success=_shown(self.last_success_rate, "{:.1%}"),
            speed=_shown(self.last_tokens_per_second, "{:,.0f}"),
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _finite_or_none(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _shown(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


EPISODE_COLUMNS = (
    "task",
    "prompt",
    "completion",
    "reward",
    "success",
    "turns",
    "tool_calls",
    "finish_reason",
)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def episode_rows(episodes: Sequence[Episode], limit: int, max_chars: int = 1000) -> list[list[Any]]:
    """The first `limit` episodes as rows of EPISODE_COLUMNS: the task's prompt and what followed
    it (each message as `[role] content`), each cut to `max_chars`."""
    rows: list[list[Any]] = []
    for episode in episodes[:limit]:
        first = next(
            (i for i, m in enumerate(episode.messages) if m.get("role") == "assistant"),
            len(episode.messages),
        )
        completion = "\n".join(
            f"[{message.get('role', '?')}] {message.get('content') or ''}"
            for message in episode.messages[first:]
        )
        rows.append(
            [
                episode.task.id,
                _cut(episode.task.prompt, max_chars),
                _cut(completion, max_chars),
                float(episode.reward),
                bool(episode.success),
                episode.num_turns,
                episode.num_tool_calls,
                episode.finish_reason,
            ]
        )
    return rows


@dataclass(frozen=True)
class StepTracker:
    """A node's training steps in its tracking run: each step's metrics, and every `table_every`
    steps a table ("episodes") of the step's first `table_rows` episodes. Steps count on across
    rounds: round r's step s is logged at (r - 1) × steps_per_round + s, with `round` among the
    metrics."""

    tracker: Tracker
    table_every: int = 1
    table_rows: int = 4
    max_chars: int = 1000
    round_number: int = 0
    steps_per_round: int = 0

    def for_round(self, number: int, steps_per_round: int) -> StepTracker:
        """This tracker, logging round `number`'s steps."""
        return replace(self, round_number=number, steps_per_round=steps_per_round)

    def tracker_step(self, step: int) -> int:
        return max(self.round_number - 1, 0) * self.steps_per_round + step

    def record(self, step: int, metrics: Mapping[str, Any], episodes: Sequence[Episode]) -> None:
        """Send step `step` (0-based, within the round) of the run; never raises for a backend."""
        at = self.tracker_step(step)
        extra = {"round": self.round_number} if self.round_number else {}
        self.tracker.log({**metrics, **extra}, at)
        if self.table_every and step % self.table_every == 0 and episodes:
            rows = episode_rows(episodes, self.table_rows, self.max_chars)
            self.tracker.log_table("episodes", EPISODE_COLUMNS, rows, at)

    def close(self) -> None:
        self.tracker.close()


def open_node_tracker(
    config: TrackingConfig | None,
    *,
    domain: str,
    peer_id: str,
    work_dir: Path,
    run_config: Mapping[str, Any],
) -> StepTracker | None:
    """A node's tracking run as its [tracking] table says (None without one): named
    {domain}-node-{the peer id's last 8 characters} unless `run_name` is set, written under
    work_dir/tracking unless `dir` is, with the node's settings `run_config`."""
    if config is None:
        return None
    tracker = open_tracker(
        config,
        run_name=f"{domain}-node-{peer_id[-8:]}",
        default_dir=Path(work_dir) / "tracking",
        run_config=run_config,
    )
    return StepTracker(tracker, config.table_every, config.table_rows, config.max_chars)
