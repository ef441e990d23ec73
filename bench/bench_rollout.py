"""Rollout throughput: episodes per second with many episodes in flight against one at a time.

Plays the same held-out tasks with the embedded base model twice in one run: one episode after
another, then all of them together through the rollout engine (batched generation, concurrent tool
calls). Prints both rates and their ratio (the project's target is at least 4x at 32 episodes),
then each round's ratio, as the machine's other load moves single rounds a lot.
Run: `python bench/bench_rollout.py [--episodes 32] [--domain math] [--base PATH]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=32, help="episodes in flight")
    parser.add_argument("--domain", default="math")
    parser.add_argument("--base", type=Path, help="a model folder (default: build the base)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="repeat both modes, keep the best")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both modes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from skillswarm.agent.envs import get_environment
    from skillswarm.agent.inference import HFBackend
    from skillswarm.agent.model import load_policy
    from skillswarm.agent.rollout import RolloutEngine
    from skillswarm.node.bootstrap import create_base_checkpoint

    base = args.base
    if base is None:
        print("building the embedded base model (about a minute)…", flush=True)
        base = create_base_checkpoint(Path(tempfile.mkdtemp(prefix="bench-rollout-")) / "base")
    model, tokenizer = load_policy(base)
    env = get_environment(args.domain)
    engine = RolloutEngine(HFBackend(model, tokenizer), env, max_new_tokens=args.max_new_tokens)
    tasks = env.tasks("heldout", args.episodes, seed=0)

    def one_at_a_time() -> tuple[float, int, float]:
        started = time.perf_counter()
        episodes = [engine.play([task], seed=index)[0] for index, task in enumerate(tasks)]
        return time.perf_counter() - started, sum(e.num_turns for e in episodes), _mean(episodes)

    def all_together() -> tuple[float, int, float]:
        started = time.perf_counter()
        episodes = engine.play(tasks, seed=0)
        return time.perf_counter() - started, sum(e.num_turns for e in episodes), _mean(episodes)

    best: dict[str, tuple[float, int, float]] = {}
    ratios: list[float] = []
    for _ in range(args.rounds):
        round_seconds: dict[str, float] = {}
        for name, run in (("one at a time", one_at_a_time), ("concurrent", all_together)):
            result = run()
            round_seconds[name] = result[0]
            if name not in best or result[0] < best[name][0]:
                best[name] = result
        ratios.append(round_seconds["one at a time"] / round_seconds["concurrent"])
    print(f"{args.episodes} {args.domain} episodes, torch threads = {args.threads}")
    print(f"{'mode':>14} {'seconds':>8} {'episodes/s':>11} {'turns':>6} {'reward':>7}")
    for name, (seconds, turns, reward) in best.items():
        print(f"{name:>14} {seconds:8.2f} {args.episodes / seconds:11.2f} {turns:6d} {reward:7.3f}")
    ratio = best["one at a time"][0] / best["concurrent"][0]
    print(f"concurrent / one at a time: {ratio:.1f}x (target >= 4x)")
    rounds = " ".join(f"{value:.1f}x" for value in ratios)
    print(f"per round: {rounds} (median {statistics.median(ratios):.1f}x)")


def _mean(episodes: list) -> float:
    return sum(episode.reward for episode in episodes) / len(episodes)


if __name__ == "__main__":
    main()
