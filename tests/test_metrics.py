"""Run metrics: the JSONL log (append, resume, torn last line, non-finite values), the staleness
histogram, reward-curve PNGs and the progress bar with and without a terminal."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.text import Text
from skillswarm.node.metrics import (
    MetricsFileError,
    MetricsLogger,
    ProgressReporter,
    StalenessHistogram,
    plot_reward_curves,
    read_metrics,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def fake_run(steps: int, slope: float) -> list[dict]:
    return [
        {"step": step, "reward_mean": slope * step / steps, "success_rate": 0.5 * step / steps}
        for step in range(steps)
    ]


def test_log_appends_one_json_object_per_line_and_resumes(tmp_path: Path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLogger(path) as log:
        written = log.log(0, {"reward_mean": 0.5}, success_rate=0.25)
        log.log(1, {"reward_mean": 0.75, "success_rate": 0.5})
    assert written["step"] == 0 and written["reward_mean"] == 0.5
    with MetricsLogger(path, fsync_every=1) as log:
        log.log(2, reward_mean=1.0, tag="after-restart")

    records = read_metrics(path)
    assert [record["step"] for record in records] == [0, 1, 2]
    assert [record["reward_mean"] for record in records] == [0.5, 0.75, 1.0]
    assert records[0]["success_rate"] == 0.25 and records[2]["tag"] == "after-restart"
    assert all(isinstance(record["time"], float) for record in records)
    assert len(path.read_text().splitlines()) == 3


def test_torn_last_line_is_ignored_and_cut_on_resume(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(path) as log:
        for step in range(3):
            log.log(step, reward_mean=step / 10)
    with open(path, "ab") as handle:  # what a kill -9 in the middle of a write leaves
        handle.write(b'{"step": 3, "time": 17.5, "rew')

    assert [record["step"] for record in read_metrics(path)] == [0, 1, 2]
    with MetricsLogger(path) as log:
        log.log(3, reward_mean=0.3)
    assert [record["step"] for record in read_metrics(path)] == [0, 1, 2, 3]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_a_damaged_line_before_the_last_is_an_error(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=r"metrics\.jsonl:2"):
        read_metrics(path)


def test_non_finite_and_array_scalars_are_written_as_plain_json(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    histogram = StalenessHistogram()
    histogram.update([0, 0, 1])
    with MetricsLogger(path) as log:
        log.log(
            np.int64(4),
            loss=float("nan"),
            grad_norm=float("inf"),
            kl=-math.inf,
            ratio=np.float32(1.5),
            tokens=torch.tensor(12),
            staleness=histogram.as_dict(),
            rewards=[1.0, float("nan")],
        )
        with pytest.raises(TypeError, match="not JSON-able"):
            log.log(5, weights=torch.ones(3))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    (record,) = read_metrics(path)
    assert record["step"] == 4
    assert record["loss"] is None and record["grad_norm"] is None and record["kl"] is None
    assert record["ratio"] == 1.5 and record["tokens"] == 12
    assert record["staleness"] == {"0": 2, "1": 1} and record["rewards"] == [1.0, None]


def test_a_closed_logger_refuses_to_write(tmp_path: Path):
    log = MetricsLogger(tmp_path / "metrics.jsonl")
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.log(0, reward_mean=1.0)


def test_staleness_histogram_counts_each_value():
    histogram = StalenessHistogram()
    assert histogram.total == 0 and math.isnan(histogram.mean())
    histogram.update([2, 0, 2, 1])
    histogram.add(3, count=4)
    histogram.add(1, count=0)
    assert histogram.as_dict() == {"0": 1, "1": 1, "2": 2, "3": 4}
    assert histogram.total == 8 and histogram.mean() == pytest.approx(17 / 8)
    with pytest.raises(ValueError):
        histogram.add(-1)
    histogram.clear()
    assert histogram.as_dict() == {} and histogram.total == 0


def test_plot_of_one_run_has_a_panel_per_present_key(tmp_path: Path):
    both = plot_reward_curves(fake_run(40, 1.0), tmp_path / "both.png", title="math")
    only_reward = [{"step": r["step"], "reward_mean": r["reward_mean"]} for r in fake_run(40, 1.0)]
    one = plot_reward_curves(only_reward, tmp_path / "plots" / "one.png")
    both_width, both_height = png_size(both)
    one_width, one_height = png_size(one)
    assert both_width == one_width and both_height == 2 * one_height
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["one.png"]


def test_plot_reads_a_log_and_overlays_several_runs(tmp_path: Path):
    log_path = tmp_path / "search.jsonl"
    with MetricsLogger(log_path) as log:
        for record in fake_run(25, 0.5):
            log.log(record["step"], record)
        log.log(25, reward_mean=float("nan"), success_rate=None)
    single = plot_reward_curves(log_path, tmp_path / "single.png")
    overlay = plot_reward_curves(
        {"math": fake_run(30, 1.0), "code": fake_run(10, 0.2), "search": log_path},
        tmp_path / "domains.png",
        title="per domain",
    )
    assert png_size(single) == png_size(overlay)
    assert overlay.stat().st_size > 0 and overlay.read_bytes() != single.read_bytes()


def test_plot_without_any_requested_metric_is_an_error(tmp_path: Path):
    with pytest.raises(ValueError, match="reward_mean"):
        plot_reward_curves([{"step": 0, "loss": 1.0}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_progress_reporter_is_silent_without_a_terminal():
    stream = io.StringIO()
    with ProgressReporter(3, "math", console=Console(file=stream)) as progress:
        assert not progress.active
        progress.update(
            0, {"reward_mean": 0.5, "success_rate": 0.25, "tokens": 400.0, "step_seconds": 2.0}
        )
    assert stream.getvalue() == ""
    assert progress.last_reward == 0.5 and progress.last_tokens_per_second == 200.0

    with ProgressReporter(3, "on stderr") as default_console:  # pytest's stderr is no terminal
        default_console.update(1, {"reward_mean": float("nan")})
    assert not default_console.active and default_console.last_reward is None


def test_progress_reporter_shows_step_reward_success_and_speed_on_a_terminal():
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=160)
    with ProgressReporter(5, "math", console=console) as progress:
        assert progress.active
        progress.update(
            2,
            {
                "reward_mean": 0.75,
                "success_rate": 0.5,
                "episodes": 16.0,
                "sampled_tokens_mean": 50.0,
                "step_seconds": 0.5,
            },
        )
    shown = Text.from_ansi(stream.getvalue()).plain
    assert "3/5" in shown and "0.750" in shown and "50.0%" in shown and "1,600 tok/s" in shown
    with ProgressReporter(5, "off", enabled=False, console=console) as disabled:
        disabled.update(0, {"reward_mean": 1.0})
    assert not disabled.active
