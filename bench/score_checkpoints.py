"""Score model folders against a base on the same held-out tasks of every domain.

Prints greedy held-out success per domain for the base and for each folder (a published round's
checkpoint, a node's expert…), with each folder's paired difference from the base and its
bootstrap 95% interval. The tasks are the evaluation's (`skillswarm.agent.evaluate`): the same
--eval-tasks drawn with --eval-seed for every model, so the differences are paired task by task.

Run: `python bench/score_checkpoints.py FOLDER… [--base DIR] [--eval-tasks 512] [--eval-seed 0]`.
Without --base the base is the embedded one shipped in the package.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from skillswarm.agent.evaluate import evaluate_checkpoint
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.agent.stats import paired_difference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swarm import DOMAINS  # noqa: E402 (the bench folder is no package)


def scores(policy: Any, n_tasks: int, seed: int) -> dict[str, list[float]]:
    """Greedy success (1/0) per held-out task on every domain, in task order."""
    return {
        d: list(evaluate_checkpoint(policy, d, n_tasks=n_tasks, seed=seed).successes)
        for d in DOMAINS
    }


def row(label: str, base: dict[str, list[float]], now: dict[str, list[float]]) -> str:
    """One line: success per domain, and the paired difference from `base` with its interval."""
    cells = []
    for d in DOMAINS:
        difference = paired_difference(base[d], now[d])
        cells.append(
            f"{d} {100 * sum(now[d]) / len(now[d]):5.1f}% "
            f"({100 * difference.mean:+5.1f} [{100 * difference.low:+5.1f}, "
            f"{100 * difference.high:+5.1f}])"
        )
    return f"{label:<10} " + "  ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", type=Path, nargs="+", help="model folders to score")
    parser.add_argument("--base", type=Path, help="base model folder (default: the shipped one)")
    parser.add_argument("--eval-tasks", type=int, default=512, help="held-out tasks per domain")
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out tasks")
    args = parser.parse_args()
    if args.eval_tasks < 1:
        parser.error("--eval-tasks must be at least 1")
    if args.base is None:
        from skillswarm.node.bootstrap import embedded_base

        args.base = embedded_base()
    set_torch_threads(2)
    base = scores(load_policy(args.base), args.eval_tasks, args.eval_seed)
    print(
        f"greedy on {args.eval_tasks} held-out tasks per domain (seed {args.eval_seed}); points "
        f"against the base {args.base} with the paired 95% interval",
        flush=True,
    )
    print(row("base", base, base), flush=True)
    for folder in args.folders:
        print(f"{folder}:", flush=True)
        print(row("", base, scores(load_policy(folder), args.eval_tasks, args.eval_seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
