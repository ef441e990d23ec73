"""Asynchronous against synchronous RL: the same number of episodes at max_staleness 0, 1 and 2,
with every tool call made 50 ms slower (as a real tool would be), from the same base weights.

Prints, per setting: wall time, the trainer's idle fraction (time waiting for rollouts), mean
reward over the last steps, and held-out success after training; then the speed-up over the
synchronous run. Run: `python bench/bench_async.py [--steps 12] [--latency 0.05] [--base PATH]`.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def with_latency(env: Any, seconds: float) -> Any:
    """`env` whose bound tools each wait `seconds` before running (same names and signatures)."""
    original = env.bind_tools

    def bind_tools(task: Any) -> dict[str, Callable[..., str]]:
        tools = original(task)

        def slowed(function: Callable[..., str]) -> Callable[..., str]:
            @functools.wraps(function)
            def call(*args: Any, **kwargs: Any) -> str:
                time.sleep(seconds)
                return function(*args, **kwargs)

            return call

        return {name: slowed(function) for name, function in tools.items()}

    env.bind_tools = bind_tools
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--samples-per-task", type=int, default=4)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds added per tool call")
    parser.add_argument("--domain", default="math")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--base", type=Path, help="a model folder (default: build the base)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from skillswarm.agent.envs import get_environment
    from skillswarm.agent.evaluate import evaluate_checkpoint
    from skillswarm.agent.model import load_policy
    from skillswarm.node.bootstrap import create_base_checkpoint
    from skillswarm.node.pipeline import AsyncRLRun, RLConfig

    base = args.base
    if base is None:
        print("building the embedded base model (about a minute)…", flush=True)
        base = create_base_checkpoint(Path(tempfile.mkdtemp(prefix="bench-async-")) / "base")
    episodes = args.steps * args.tasks_per_step * args.samples_per_task
    print(
        f"{args.domain}: {args.steps} steps x {args.tasks_per_step} tasks x "
        f"{args.samples_per_task} samples = {episodes} episodes per setting, "
        f"+{args.latency * 1000:.0f} ms per tool call"
    )
    rows = []
    for staleness in args.staleness:
        model, tokenizer = load_policy(base)
        env = with_latency(get_environment(args.domain), args.latency)
        config = RLConfig(
            steps=args.steps,
            tasks_per_step=args.tasks_per_step,
            samples_per_task=args.samples_per_task,
            max_staleness=staleness,
            seed=1,
        )
        started = time.perf_counter()
        history = AsyncRLRun(model, tokenizer, env, config).run()
        wall = time.perf_counter() - started
        tail = history[-3:]
        reward = sum(m["reward_mean"] for m in tail) / len(tail)
        idle = history[-1]["trainer_idle_fraction"]
        heldout = evaluate_checkpoint((model, tokenizer), args.domain, n_tasks=args.eval_tasks)
        rows.append((staleness, wall, idle, reward, heldout.success_rate))
        print(
            f"max_staleness={staleness}: {wall:6.1f} s  idle {idle:5.1%}  "
            f"reward(last 3) {reward:.3f}  held-out {heldout.success_rate:.1%}",
            flush=True,
        )
    header = ("staleness", "wall s", "idle", "reward", "held-out", "speed-up")
    print("\n" + " ".join(f"{name:>9}" for name in header))
    sync_wall = rows[0][1]
    for staleness, wall, idle, reward, heldout in rows:
        print(
            f"{staleness:>9} {wall:9.1f} {idle:9.1%} {reward:9.3f} {heldout:9.1%} "
            f"{sync_wall / wall:8.2f}x"
        )


if __name__ == "__main__":
    main()
