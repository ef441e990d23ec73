"""How far does imitating the environments' solutions take a base, and what does it cost the
other domains? From one base: supervised steps on solver demonstrations of training tasks of the
domains named (the warm start's loss, optimizer and schedule: `node.train.supervised_warm_start`),
with greedy held-out success on every domain scored at the base and at --checks points along the
run, each with its paired difference from the base (bootstrap interval) on the same tasks.

Run: `python bench/bench_imitation.py [--domains search] [--weights 1,…] [--steps 300]
[--checks 3] [--rounds 1] [--batch-size 16] [--learning-rate 0.0015] [--optimizer adamw]
[--eval-tasks 512] [--eval-seed 1] [--seed 7] [--base DIR] [--json FILE]`. Without --base it
starts from the embedded base shipped in the package. With --rounds R it runs R × --steps, each
run with a fresh optimizer and schedule, as a node's imitation before RL restarts every round
(`node.imitation`). It measures what the solutions alone teach, beside what RL from the same base
gains (bench_learning.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.node.bootstrap import DEFAULT_WARM_START_BATCH_SIZE, DEFAULT_WARM_START_LR
from skillswarm.node.train import OPTIMIZERS, supervised_warm_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from score_checkpoints import row, scores  # noqa: E402 (the bench folder is no package)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--domains", default="search", help="domains whose solutions are imitated (comma-separated)"
    )
    parser.add_argument(
        "--weights",
        help="each domain's share of the demonstrations, comma-separated (default equal)",
    )
    parser.add_argument("--steps", type=int, default=300, help="supervised steps")
    parser.add_argument("--checks", type=int, default=3, help="held-out scorings along the run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of --steps one after another, each with a fresh optimizer and schedule and "
        "its own demonstrations (--seed + round), as a node's imitation restarts every round; "
        "above 1, every domain is scored after each run instead of --checks times",
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULT_WARM_START_BATCH_SIZE)
    parser.add_argument("--learning-rate", type=float, default=DEFAULT_WARM_START_LR)
    parser.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="adamw", help="default %(default)s"
    )
    parser.add_argument("--eval-tasks", type=int, default=512, help="held-out tasks per domain")
    parser.add_argument("--eval-seed", type=int, default=1, help="seed of the held-out tasks")
    parser.add_argument("--seed", type=int, default=7, help="seed of the demonstrations")
    parser.add_argument("--base", type=Path, help="base model folder (default: the shipped one)")
    parser.add_argument("--json", type=Path, help="write the scores here")
    args = parser.parse_args()
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    weights = None if args.weights is None else [float(w) for w in args.weights.split(",")]
    if weights is not None and len(weights) != len(domains):
        parser.error(f"--weights gives {len(weights)} shares for {len(domains)} domains")
    if args.steps < 1 or not 1 <= args.checks <= args.steps or args.eval_tasks < 1:
        parser.error("--steps ≥ 1, 1 ≤ --checks ≤ --steps and --eval-tasks ≥ 1")
    if args.rounds < 1:
        parser.error("--rounds ≥ 1")
    if args.rounds > 1:
        args.checks = 1
    if args.base is None:
        from skillswarm.node.bootstrap import embedded_base

        args.base = embedded_base()
    set_torch_threads(2)
    model, tokenizer = load_policy(args.base)
    started = time.perf_counter()
    base = scores((model, tokenizer), args.eval_tasks, args.eval_seed)
    print(
        f"imitating {', '.join(domains)} from {args.base}: {args.rounds} × {args.steps} steps of "
        f"{args.batch_size} demonstrations, {args.optimizer} at lr {args.learning_rate:g}; "
        "greedy on "
        f"{args.eval_tasks} held-out tasks per domain (seed {args.eval_seed}), points against "
        "the base with the paired 95% interval",
        flush=True,
    )
    print(row("base", base, base), flush=True)
    every = args.steps // args.checks
    check_at = {every * (i + 1) for i in range(args.checks - 1)} | {args.steps}
    results: dict[str, Any] = {"args": {**vars(args), "base": str(args.base)}, "base": base}

    done = 0  # steps of the earlier rounds

    def on_step(step: int, loss: float) -> None:
        if step not in check_at:
            return
        model.eval()
        now = scores((model, tokenizer), args.eval_tasks, args.eval_seed)
        model.train()
        results[f"step-{done + step}"] = {"loss": loss, "scores": now}
        minutes = (time.perf_counter() - started) / 60
        label = f"step {done + step}"
        print(row(label, base, now) + f"  loss {loss:.3f}  {minutes:.1f} min", flush=True)

    for number in range(args.rounds):
        supervised_warm_start(
            model,
            tokenizer,
            [get_environment(d) for d in domains],
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.learning_rate,
            seed=args.seed + number,
            weights=weights,
            on_step=on_step,
            optimizer=args.optimizer,
        )
        done += args.steps
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
