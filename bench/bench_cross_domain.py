"""What one node's round does to the other domains: its own gain against what it costs the rest.

From one base, a domain's node trains one round (the swarm bench's steps a round, its recipe with
the KL weight and guidance given here) for each setting and training seed, and the result is
scored greedily on the same held-out tasks of every domain. Prints, per run, success per domain
and each domain's paired difference with the base (bootstrap interval): a delta that lowers
another domain beyond noise is one the merge has to trade against. Writes `cross_domain.json`
into --out.

Run: `python bench/bench_cross_domain.py [--domain math] [--kl 0,0.1] [--guidance 0.25]
[--anchor 0,0.1] [--seeds 1000,2000] [--steps 90] [--eval-tasks 128] [--base DIR]
[--out runs/bench-cross-domain]`.
About 1.5 minutes per run for math on 2 cores (90 steps and the scoring).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from skillswarm.agent.evaluate import evaluate_checkpoint
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.agent.stats import paired_difference
from skillswarm.coordinator.evaluation import scores_row
from skillswarm.node.recipes import recipe_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swarm import DEFAULT_STEPS, DOMAINS, train_steps  # noqa: E402 (no package)


def floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def score(policy: Any, n_tasks: int, seed: int) -> dict[str, dict[str, Any]]:
    return {
        d: scores_row(evaluate_checkpoint(policy, d, n_tasks=n_tasks, seed=seed)) for d in DOMAINS
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--domain", choices=DOMAINS, default="math", help="the node's domain")
    parser.add_argument("--kl", type=floats, help="KL weights to the base to try (the recipe's)")
    parser.add_argument("--guidance", type=floats, help="guidance weights to try (the recipe's)")
    parser.add_argument(
        "--anchor",
        type=floats,
        help="weights of the KL anchor on the other domains' episodes to try (the recipe's)",
    )
    parser.add_argument("--seeds", type=ints, default=[1000], help="training seeds")
    parser.add_argument("--steps", type=int, help="steps (the swarm bench's a round)")
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--base", type=Path, help="base model folder (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-cross-domain"))
    args = parser.parse_args()
    if args.base is None:
        from skillswarm.node.bootstrap import embedded_base

        args.base = embedded_base()
    recipe = recipe_for(args.domain)
    steps = args.steps or DEFAULT_STEPS[args.domain]
    kls = args.kl if args.kl is not None else [recipe.loss.kl_coef]
    guidances = args.guidance if args.guidance is not None else [recipe.guidance]
    anchors = args.anchor if args.anchor is not None else [recipe.anchor.coef]
    set_torch_threads(1)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    base = score(load_policy(args.base), args.eval_tasks, args.eval_seed)
    print(
        f"{args.domain} node, {steps} steps from {args.base}; greedy held-out success on "
        f"{args.eval_tasks} tasks per domain, paired difference with the base (95% bootstrap)"
    )
    print(f"{'kl':>5} {'guid':>5} {'anch':>5} {'seed':>5}" + "".join(f"{d:>26}" for d in DOMAINS))
    print(
        f"{'base':>23}" + "".join(f"{100 * base[d]['success_rate']:>26.1f}" for d in DOMAINS),
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    settings = [(kl, g, a) for kl in kls for g in guidances for a in anchors]
    for kl, guidance, anchor in settings:
        for seed in args.seeds:
            model, tokenizer = load_policy(args.base)
            train_steps(
                model,
                tokenizer,
                args.domain,
                steps,
                seed,
                guidance=guidance,
                kl_coef=kl,
                anchor=anchor,
            )
            rows = score((model, tokenizer), args.eval_tasks, args.eval_seed)
            differences = {
                d: paired_difference(base[d]["successes"], rows[d]["successes"]).to_dict()
                for d in DOMAINS
            }
            cells = [
                f"{100 * rows[d]['success_rate']:5.1f} {100 * differences[d]['mean']:+5.1f} "
                f"[{100 * differences[d]['low']:+5.1f},{100 * differences[d]['high']:+5.1f}]"
                for d in DOMAINS
            ]
            print(
                f"{kl:>5g} {guidance:>5g} {anchor:>5g} {seed:>5}"
                + "".join(f"{c:>26}" for c in cells)
            )
            sys.stdout.flush()
            runs.append(
                {
                    "kl": kl,
                    "guidance": guidance,
                    "anchor": anchor,
                    "seed": seed,
                    "success": {d: rows[d]["success_rate"] for d in DOMAINS},
                    "difference": differences,
                }
            )
            (args.out / "cross_domain.json").write_text(
                json.dumps(
                    {
                        "domain": args.domain,
                        "steps": steps,
                        "eval_tasks": args.eval_tasks,
                        "eval_seed": args.eval_seed,
                        "base": {d: base[d]["success_rate"] for d in DOMAINS},
                        "runs": runs,
                    },
                    indent=1,
                )
            )
    print(f"{(time.perf_counter() - started) / 60:.1f} minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
