"""Does RL teach the embedded base each skill? From one base, per domain: greedy held-out success
before, RL with the domain's recipe (`node.recipes`) for a wall-clock budget, greedy held-out
success after on the same tasks, and the gain in points. Exits 1 when any gain is below the bar.

Run: `python bench/bench_learning.py [--minutes 10] [--steps N] [--domains math,code,search]
[--base PATH] [--eval-tasks 128] [--min-gain 15] [--json results.json]`, plus overrides of the
recipes' settings (`--help` lists them: temperature, learning rate, optimizer, tasks per step,
group size, guidance, training seed, loss fields…). Without --base it builds the default base as
`skillswarm bootstrap` does (copy pretraining, then math, code and search with
MULTI_DOMAIN_WARM_START_STEPS and DEFAULT_DOMAIN_WEIGHTS, the machine's cores) and times that too.
Domains run one after another from the same base, each with one torch thread per pipeline thread
(rollout producers and trainer), so a run uses the machine's two cores. Held-out success is also
reported sampled at the recipe's temperature (one episode per task), the policy RL trains. Beside
each wall time the table gives the process's CPU minutes and the load average before/after: other
work on the machine leaves a run fewer steps in the same budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skillswarm.agent.envs import Environment, get_environment, list_environments
from skillswarm.agent.evaluate import EvalResult, evaluate_checkpoint
from skillswarm.agent.model import build_threads, load_policy, set_torch_threads
from skillswarm.node.bootstrap import (
    DEFAULT_DOMAIN_WEIGHTS,
    MULTI_DOMAIN_COPY_STEPS,
    MULTI_DOMAIN_WARM_START_STEPS,
    create_base_checkpoint,
)
from skillswarm.node.loss import LossConfig
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.node.recipes import recipe_for
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Upper bound on the steps of a budgeted run; the wall-clock budget ends it long before.
MAX_BUDGETED_STEPS = 1_000_000


@dataclass
class DomainOutcome:
    """What one domain's budgeted RL run did."""

    domain: str
    steps: int
    minutes: float
    cpu_minutes: float
    before: float
    after: float
    sampled_before: float
    sampled_after: float
    train_success_first: float
    train_success_last: float
    load_before: float
    load_after: float

    @property
    def gain_points(self) -> float:
        return 100.0 * (self.after - self.before)


def load_average() -> float:
    """The machine's one-minute load average."""
    return os.getloadavg()[0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class WallClockBudget:
    """An `on_step` callback that asks `run` to stop before its next step would overrun the
    budget: once the time spent plus the mean step time reaches `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.perf_counter()
        self.run: AsyncRLRun | None = None
        self.history: list[dict[str, float]] = []

    def start(self, run: AsyncRLRun) -> None:
        self.run = run
        self.history.clear()
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, metrics: dict[str, float]) -> None:
        self.history.append(metrics)
        elapsed = self.elapsed()
        if elapsed + elapsed / len(self.history) >= self.seconds and self.run is not None:
            self.run.request_stop()


def evaluate(
    policy: tuple[PreTrainedModel, PreTrainedTokenizerBase],
    domain: str,
    n_tasks: int,
    seed: int,
    temperature: float | None = None,
) -> EvalResult:
    """Success on `n_tasks` held-out tasks drawn with `seed` (the same tasks each call): greedy,
    or one episode each sampled at `temperature`. Sampling is seeded, yet two runs of the same
    policy can differ by a few tasks (search at T 0.7 from one base: 32.0% and 34.4%)."""
    return evaluate_checkpoint(
        policy,
        domain,
        n_tasks=n_tasks,
        seed=seed,
        greedy=temperature is None,
        temperature=temperature or 1.0,
    )


def train_for(
    base: Path,
    domain: str,
    config: RLConfig,
    seconds: float,
    *,
    eval_tasks: int,
    eval_seed: int,
    max_steps: int | None = None,
    log_every: int = 10,
    environment: Environment | None = None,
) -> DomainOutcome:
    """RL from `base` on `domain` with `config` (its `steps` ignored) until `seconds` of wall
    time are spent or `max_steps` steps are taken, with held-out success measured on the same
    tasks before and after. `environment` plays the training episodes (default: the domain's
    with its defaults); held-out tasks always come from the environment's defaults."""
    model, tokenizer = load_policy(base)
    before = evaluate((model, tokenizer), domain, eval_tasks, eval_seed)
    sampled_before = evaluate((model, tokenizer), domain, eval_tasks, eval_seed, config.temperature)
    print(
        f"{domain}: held-out success before {before.success_rate:.1%} greedy, "
        f"{sampled_before.success_rate:.1%} sampled at T={config.temperature:g}",
        flush=True,
    )
    budget = WallClockBudget(seconds)

    def on_step(metrics: dict[str, float]) -> None:
        budget(metrics)
        done = len(budget.history)
        if done % log_every == 0:
            recent = budget.history[-log_every:]
            print(
                f"  {domain} step {done:4d}  {budget.elapsed() / 60:5.2f} min  "
                f"reward {_mean([m['reward_mean'] for m in recent]):.3f}  "
                f"success {_mean([m['success_rate'] for m in recent]):.3f}  "
                f"load {load_average():.1f}",
                flush=True,
            )

    budgeted = config.model_copy(update={"steps": max_steps or MAX_BUDGETED_STEPS})
    env = environment if environment is not None else get_environment(domain)
    run = AsyncRLRun(model, tokenizer, env, budgeted, on_step=on_step)
    load_before = load_average()
    cpu_started = time.process_time()
    budget.start(run)
    run.run()
    minutes = budget.elapsed() / 60
    cpu_minutes = (time.process_time() - cpu_started) / 60
    load_after = load_average()
    model.eval()
    after = evaluate((model, tokenizer), domain, eval_tasks, eval_seed)
    sampled_after = evaluate((model, tokenizer), domain, eval_tasks, eval_seed, config.temperature)
    successes = [m["success_rate"] for m in budget.history]
    window = max(1, len(successes) // 10)
    return DomainOutcome(
        domain=domain,
        steps=len(budget.history),
        minutes=minutes,
        cpu_minutes=cpu_minutes,
        before=before.success_rate,
        after=after.success_rate,
        sampled_before=sampled_before.success_rate,
        sampled_after=sampled_after.success_rate,
        train_success_first=_mean(successes[:window]),
        train_success_last=_mean(successes[-window:]),
        load_before=load_before,
        load_after=load_after,
    )


def print_table(outcomes: list[DomainOutcome], eval_tasks: int) -> None:
    print(
        f"\nheld-out success on {eval_tasks} tasks, the same before and after: greedy (the gain), "
        "and one episode each sampled at the recipe's temperature"
    )
    print(
        f"{'domain':<8} {'steps':>6} {'minutes':>8} {'cpu min':>8} {'before':>7} {'after':>7} "
        f"{'gain':>7}  {'sampled':>15}  {'train success':>15}  {'load':>9}"
    )
    for o in outcomes:
        print(
            f"{o.domain:<8} {o.steps:>6} {o.minutes:>8.2f} {o.cpu_minutes:>8.2f} "
            f"{o.before:>7.1%} {o.after:>7.1%} {o.gain_points:>+6.1f}p  "
            f"{o.sampled_before:>6.1%} -> {o.sampled_after:<6.1%}  "
            f"{o.train_success_first:>6.3f} -> {o.train_success_last:<5.3f}  "
            f"{o.load_before:>4.1f}/{o.load_after:<4.1f}"
        )


# What `skillswarm bootstrap` warm-starts the default base on, in its order (the order of the
# demonstrations in each batch and in the tokenizer's corpus shapes the base).
BOOTSTRAP_DOMAINS = ("math", "code", "search")


def _with_overrides(recipe: RLConfig, args: argparse.Namespace) -> RLConfig:
    """`recipe` with the settings given on the command line in place of its own, validated."""
    settings = recipe.model_dump()
    if args.temperature is not None:
        settings["temperature"] = args.temperature
    if args.learning_rate is not None:
        settings["learning_rate"] = args.learning_rate
    if args.kl_coef is not None:
        settings["loss"]["kl_coef"] = args.kl_coef
    if args.mean_over is not None:
        settings["loss"]["mean_over"] = args.mean_over
    if args.optimizer is not None:
        settings["optimizer"] = args.optimizer
    if args.adam_eps is not None:
        settings["adam_eps"] = args.adam_eps
    if args.tasks_per_step is not None:
        settings["tasks_per_step"] = args.tasks_per_step
    if args.samples_per_task is not None:
        settings["samples_per_task"] = args.samples_per_task
    if args.guidance is not None:
        settings["guidance"] = args.guidance
    if args.seed is not None:
        settings["seed"] = args.seed
    if args.imitation_steps is not None:
        settings["imitation"]["steps"] = args.imitation_steps
    for option in args.loss:
        name, separator, value = option.partition("=")
        if not separator or name.strip() not in LossConfig.model_fields:
            known = ", ".join(LossConfig.model_fields)
            raise ValueError(f"--loss takes NAME=VALUE with NAME one of {known}; got {option!r}")
        settings["loss"][name.strip()] = value.strip()  # pydantic converts and checks it
    return RLConfig.model_validate(settings)


def parse_train_env(options: list[str]) -> dict[str, Any]:
    """`--train-env NAME=VALUE` options → keyword arguments; a VALUE that parses as JSON is
    that value (`hops=[2]`, `top_k=5`), any other is the string."""
    kwargs: dict[str, Any] = {}
    for option in options:
        name, separator, value = option.partition("=")
        if not separator or not name.strip().isidentifier():
            raise ValueError(f"--train-env takes NAME=VALUE; got {option!r}")
        try:
            kwargs[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[name.strip()] = value
    return kwargs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, help="a model folder (default: build the base)")
    parser.add_argument("--minutes", type=float, default=10.0, help="RL wall time per domain")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="RL steps per domain: stop there if the wall time is not spent first (a run "
        "comparable across machines; give --minutes room)",
    )
    parser.add_argument("--domains", default=",".join(list_environments()))
    parser.add_argument("--eval-tasks", type=int, default=128)
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--min-gain", type=float, default=15.0, help="points each domain must gain")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--temperature", type=float, help="sampling temperature (all domains)")
    parser.add_argument("--learning-rate", type=float, help="RL learning rate (all domains)")
    parser.add_argument("--kl-coef", type=float, help="KL-to-base coefficient (all domains)")
    parser.add_argument(
        "--mean-over",
        choices=("informative", "all"),
        help="the loss mean's denominator: informative samples or all (all domains)",
    )
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), help="RL optimizer (all domains)")
    parser.add_argument("--adam-eps", type=float, help="AdamW's epsilon (all domains)")
    parser.add_argument("--tasks-per-step", type=int, help="tasks per RL step (all domains)")
    parser.add_argument(
        "--samples-per-task", type=int, help="episodes per task, the group size (all domains)"
    )
    parser.add_argument(
        "--guidance",
        type=float,
        help="weight of the solver's episode in a group that failed, 0 off (all domains)",
    )
    parser.add_argument(
        "--imitation-steps",
        type=int,
        help="supervised steps on the solutions before RL, 0 off (all domains; node.imitation)",
    )
    parser.add_argument("--seed", type=int, help="training seed (the recipe's, 0)")
    parser.add_argument(
        "--loss",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a LossConfig field in every domain's recipe (repeatable), e.g. "
        "--loss negative_advantage_weight=0 --loss aggregation=sequence_mean",
    )
    parser.add_argument(
        "--train-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword argument of the training environment (repeatable; VALUE as JSON where "
        "it parses), e.g. --train-env 'hops=[2]' to train search on two-hop questions only; "
        "held-out tasks keep the environment's defaults",
    )
    args = parser.parse_args()
    if args.eval_tasks < 1 or args.minutes <= 0 or (args.steps is not None and args.steps < 1):
        parser.error("--eval-tasks, --minutes and --steps must be positive")
    domains = [domain.strip() for domain in args.domains.split(",") if domain.strip()]
    try:
        recipes = {domain: _with_overrides(recipe_for(domain), args) for domain in domains}
        train_env = parse_train_env(args.train_env)
        # Built before any training, so that a wrong --train-env argument fails first.
        environments = {domain: get_environment(domain, **train_env) for domain in domains}
    except (ValueError, TypeError) as error:  # pydantic's ValidationError names the bad setting
        parser.error(str(error))
    set_torch_threads(1)

    base: Path = args.base
    base_timing: dict[str, float] | None = None
    if base is None:
        print(
            f"building the default base (copy pretraining, then {MULTI_DOMAIN_WARM_START_STEPS} "
            f"warm-start steps on {', '.join(BOOTSTRAP_DOMAINS)}; load {load_average():.1f})…",
            flush=True,
        )
        started, cpu_started = time.perf_counter(), time.process_time()
        folder = Path(tempfile.mkdtemp(prefix="bench-learning-")) / "base"
        base = create_base_checkpoint(
            folder,
            warm_start_steps=MULTI_DOMAIN_WARM_START_STEPS,
            domains=BOOTSTRAP_DOMAINS,
            num_threads=build_threads(),
            domain_weights=DEFAULT_DOMAIN_WEIGHTS,
            copy_steps=MULTI_DOMAIN_COPY_STEPS,
        )
        set_torch_threads(1)  # the RL runs take one thread per pipeline thread
        base_timing = {
            "minutes": (time.perf_counter() - started) / 60,
            "cpu_minutes": (time.process_time() - cpu_started) / 60,
            "load_after": load_average(),
        }
        print(
            f"base built in {base_timing['minutes']:.2f} min, {base_timing['cpu_minutes']:.2f} "
            f"CPU min (load {base_timing['load_after']:.1f}): {base}",
            flush=True,
        )

    outcomes: list[DomainOutcome] = []
    for domain in domains:
        print(f"{domain}: recipe {recipes[domain].model_dump_json()}", flush=True)
        outcomes.append(
            train_for(
                base,
                domain,
                recipes[domain],
                args.minutes * 60,
                eval_tasks=args.eval_tasks,
                eval_seed=args.eval_seed,
                max_steps=args.steps,
                environment=environments[domain],
            )
        )
    print_table(outcomes, args.eval_tasks)
    if base_timing is not None:
        print(
            f"base warm start: {base_timing['minutes']:.2f} min wall, "
            f"{base_timing['cpu_minutes']:.2f} CPU min"
        )
    if args.json is not None:
        report = {
            "base": str(base),
            "base_build": base_timing,
            "minutes_per_domain": args.minutes,
            "max_steps_per_domain": args.steps,
            "eval_tasks": args.eval_tasks,
            "eval_seed": args.eval_seed,
            "train_env": train_env,
            "min_gain_points": args.min_gain,
            "recipes": {
                domain: config.model_dump(mode="json") for domain, config in recipes.items()
            },
            "outcomes": [asdict(o) | {"gain_points": o.gain_points} for o in outcomes],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    failed = [o.domain for o in outcomes if o.gain_points < args.min_gain]
    if failed:
        print(f"FAIL: gain below {args.min_gain:g} points on {', '.join(failed)}")
        return 1
    print(f"PASS: every domain gained at least {args.min_gain:g} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
