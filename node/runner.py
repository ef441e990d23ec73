"""A standalone RL run on one domain, as `skillswarm train` runs it: held-out evaluation before,
the asynchronous pipeline with checkpoints and metrics, the trained model, evaluation after, and a
PNG of the reward curves. A run folder left by a killed run is resumed from its last checkpoint.

Run folder: `metrics.jsonl`, `checkpoints/`, `final/` (a Hugging Face folder), `curves.png`,
`summary.json` (the configuration, held-out scores before and after, wall time).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skillswarm.agent.envs import get_environment
from skillswarm.agent.evaluate import EvalResult, evaluate_checkpoint
from skillswarm.agent.model import load_policy, save_tokenizer, set_torch_threads
from skillswarm.node.metrics import ProgressReporter, plot_reward_curves, read_metrics
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.protocol.durable import write_bytes_atomically

logger = logging.getLogger(__name__)

BEFORE_FILE = "eval_before.json"
SUMMARY_FILE = "summary.json"


@dataclass
class TrainingOutcome:
    """Where a run's outputs are and what it measured."""

    out_dir: Path
    steps_done: int
    before: EvalResult | None
    after: EvalResult | None
    stopped_early: bool
    seconds: float


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_bytes_atomically(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def _evaluate(
    model_and_tokenizer: Any, domain: str, n_tasks: int, seed: int, tasks_file: Path | None
) -> EvalResult:
    return evaluate_checkpoint(
        model_and_tokenizer, domain, n_tasks=n_tasks, seed=seed, tasks_file=tasks_file
    )


def run_training(
    base: Path,
    domain: str,
    out_dir: Path,
    config: RLConfig,
    *,
    eval_tasks: int = 128,
    eval_seed: int = 0,
    torch_threads: int = 1,
    progress: bool = True,
    handle_signals: bool = True,
    tasks_file: Path | None = None,
) -> TrainingOutcome:
    """Train the model at `base` on `domain` into `out_dir` (resuming a run found there).
    SIGTERM or SIGINT finish the step in progress, write a checkpoint and return early
    (`stopped_early`), without the final evaluation. With `tasks_file`, RL plays the file's train
    split and the evaluations its held-out split."""
    started = time.perf_counter()
    set_torch_threads(torch_threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(base)
    env = get_environment(domain, tasks_file=tasks_file)
    before: EvalResult | None = None
    if eval_tasks:
        before_path = out_dir / BEFORE_FILE
        if before_path.is_file():
            before = EvalResult(**json.loads(before_path.read_text()))
        else:
            logger.info("evaluating the base on %d held-out %s tasks", eval_tasks, domain)
            before = _evaluate((model, tokenizer), domain, eval_tasks, eval_seed, tasks_file)
            _write_json(before_path, before.to_dict())
    reporter = ProgressReporter(config.steps, f"{domain} RL", enabled=progress)

    def on_step(metrics: dict[str, float]) -> None:
        reporter.update(int(metrics["step"]), metrics)
        logger.info(
            "step=%d reward=%.3f success=%.3f staleness=%d idle=%.2f",
            int(metrics["step"]) + 1,
            metrics.get("reward_mean", float("nan")),
            metrics.get("success_rate", float("nan")),
            int(metrics.get("staleness", 0)),
            metrics.get("trainer_idle_fraction", float("nan")),
        )

    run = AsyncRLRun(
        model,
        tokenizer,
        env,
        config,
        checkpoint_dir=out_dir / "checkpoints",
        metrics_path=out_dir / "metrics.jsonl",
        on_step=on_step,
    )
    previous_handlers: dict[int, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous_handlers[signum] = signal.signal(signum, lambda *_: run.request_stop())
    try:
        run.run()
    finally:
        reporter.close()
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
    records = read_metrics(out_dir / "metrics.jsonl")
    steps_done = int(records[-1]["step"]) + 1 if records else 0
    if records:
        plot_reward_curves(records, out_dir / "curves.png", title=f"{domain}: RL from the base")
    stopped_early = steps_done < config.steps
    after: EvalResult | None = None
    if not stopped_early:
        model.save_pretrained(out_dir / "final")
        save_tokenizer(tokenizer, out_dir / "final")
        if eval_tasks:
            after = _evaluate((model, tokenizer), domain, eval_tasks, eval_seed, tasks_file)
    seconds = time.perf_counter() - started
    _write_json(
        out_dir / SUMMARY_FILE,
        {
            "domain": domain,
            "base": str(base),
            "config": config.model_dump(mode="json"),
            "steps_done": steps_done,
            "stopped_early": stopped_early,
            "before": before.to_dict() if before else None,
            "after": after.to_dict() if after else None,
            "seconds_this_process": seconds,
        },
    )
    return TrainingOutcome(out_dir, steps_done, before, after, stopped_early, seconds)
