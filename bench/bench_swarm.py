"""The swarm against its baselines at equal compute, on the real code paths.

Every round, each domain's node trains k steps of its recipe from the swarm's current base (the
node's trainer, its optimizer state carried from its last round as a daemon's is), packs its
delta as a node does, and the coordinator's own functions merge the deltas (the own-domain gate,
the default merge plan and its validation choice, weights per domain among the candidates, the
outer optimizer, subsets of a held merge), score the candidate and apply the publication rule.
Beside it, with the same episodes per domain:

- experts: each domain's model trained alone, k steps more every round (its optimizer kept);
- mixed:   one model trained on all three domains, one step of each domain's recipe in turn
           (3 × k steps a round, one optimizer kept throughout; synchronous steps);
- base:    the starting checkpoint.

After every round it prints greedy held-out success per domain for every arm with 95% Wilson
intervals, and at the end each arm's paired difference with the base (bootstrap interval), the
swarm's retention (swarm − base) / (expert − base) and swarm − mixed. Writes `swarm.png` (success
per domain per round for every arm) and `results.json` into --out.

Run: `python bench/bench_swarm.py [--rounds 4] [--steps math=90,code=16,search=10]
[--eval-tasks 512] [--validation-tasks 128] [--seed 0] [--base DIR] [--out runs/bench-swarm]
[--outer-lr 1] [--outer-momentum 0] [--gate-alpha 0.05] [--no-keep-node-optimizer]
[--guidance math=0.25,…] [--kl math=0.1,…] [--anchor math=1,…] [--imitation search=N,…]
[--imitation-lr search=LR,…] [--imitation-optimizer sgd]
[--domain-weights 0.5,1|none]
[--domain-scale math=0.5,…|none] [--lambdas λ,…|none] [--keep-base-tensors PATTERN,…|none]`.
Without --base it uses the embedded base shipped in the package (`skillswarm bootstrap` rebuilds
one). `--help` prints the step budget of each arm. Exits 1 when, after the last round, the
published model does not beat the base by --min-gain points with the paired interval above zero
on every domain.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.evaluate import evaluate_checkpoint
from skillswarm.agent.model import load_policy, set_torch_threads
from skillswarm.agent.stats import paired_difference
from skillswarm.coordinator.candidates import gate_by_own_domain, merge_and_decide
from skillswarm.coordinator.config import CoordinatorConfig, EvalConfig, MergePlan
from skillswarm.coordinator.evaluation import Evaluator, ExpertInput, scores_row
from skillswarm.coordinator.publication import publication_rule
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.outer import OuterOptimizer, OuterOptimizerConfig
from skillswarm.merge.streaming import TaskVector
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.node.checkpointing import restore_optimizer_state, save_optimizer_state
from skillswarm.node.config import NodeConfig
from skillswarm.node.pipeline import AsyncRLRun
from skillswarm.node.recipes import recipe_for
from skillswarm.node.train import OPTIMIZERS
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader, pack_delta
from skillswarm.protocol.identity import load_or_create_identity, peer_id_of, public_key_bytes

DOMAINS = ("math", "code", "search")
# About 1.2 minutes of one node on 2 cores per domain per round (a math step is the cheapest, a
# search step the dearest): the recipes' steps a round, math's tripled and code's doubled.
DEFAULT_STEPS = {
    "math": 3 * recipe_for("math").steps,
    "code": 2 * recipe_for("code").steps,
    "search": recipe_for("search").steps,
}
ARMS = ("base", "swarm", "experts", "mixed")


def parse_keep_base(text: str) -> list[str]:
    """`*embed_tokens.weight,lm_head.weight` → the patterns; `none` → [] (merge every tensor)."""
    if text.strip().lower() == "none":
        return []
    patterns = [part.strip() for part in text.split(",")]
    try:
        MergePlan(keep_base_tensors=patterns)  # the coordinator's own bounds
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"--keep-base-tensors takes PATTERN,PATTERN,… or none; got {text!r}: {error}"
        ) from None
    return patterns


def add_keep_base_argument(parser: argparse.ArgumentParser) -> None:
    """`--keep-base-tensors PATTERN,…|none`, the coordinator's keep_base_tensors (this bench's
    and bench_merge_sweep's)."""
    parser.add_argument(
        "--keep-base-tensors",
        type=parse_keep_base,
        default=MergePlan().keep_base_tensors,
        metavar="PATTERN,…|none",
        help="tensors every merge leaves at the base's weights, DOMAIN:GLOB in that domain's "
        "deltas only (the coordinator's keep_base_tensors; 'none': merge every tensor; default "
        "%(default)s)",
    )


def parse_domain_weights(text: str) -> list[float]:
    """`0.5,1` → [0.5, 1.0]; `none` → [] (no weights per domain)."""
    if text.strip().lower() == "none":
        return []
    try:
        weights = [float(part) for part in text.split(",")]
        MergePlan(domain_weights=weights)  # the coordinator's own bounds
    except ValueError as error:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(
            f"--domain-weights takes W,W,… or none; got {text!r}: {error}"
        ) from None
    return weights


def parse_domain_scale(text: str) -> dict[str, float]:
    """`math=0.5` → {"math": 0.5}: the coordinator's domain_scale, within its bounds; `none` →
    {} (every delta whole)."""
    if text.strip().lower() == "none":
        return {}
    scale = parse_weights("--domain-scale")(text)
    try:
        MergePlan(domain_scale=scale)
    except ValueError as error:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(f"--domain-scale: {error}") from None
    return scale


def parse_lambdas(text: str) -> list[MergeSpec]:
    """`0.75,0.5` → task arithmetic at those λs, the candidates tried beside the plan's λ 1;
    `none` → [] (λ 1 alone)."""
    if text.strip().lower() == "none":
        return []
    try:
        weights = [float(part) for part in text.split(",")]
        specs = [MergeSpec(method="task_arithmetic", parameters={"weight": w}) for w in weights]
        if any(not 0 < w <= 2 for w in weights):
            raise ValueError("each λ must be above 0 and at most 2")
    except ValueError as error:  # pydantic's ValidationError is one
        raise argparse.ArgumentTypeError(f"--lambdas takes λ,λ,…; got {text!r}: {error}") from None
    return specs


def parse_steps(text: str) -> dict[str, int]:
    """`math=30,code=8,search=10` → steps per domain per round (every domain named, each ≥ 1)."""
    steps: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in DOMAINS or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"--steps takes DOMAIN=N for each of {', '.join(DOMAINS)}; got {part!r}"
            )
        steps[name.strip()] = int(value)
    if set(steps) != set(DOMAINS) or min(steps.values()) < 1:
        raise argparse.ArgumentTypeError(f"--steps needs N ≥ 1 for each of {', '.join(DOMAINS)}")
    return steps


def parse_weights(option: str) -> Callable[[str], dict[str, float]]:
    """The parser of `option`'s value: `math=0.25,code=0.25` → a weight per named domain (the
    others keep their recipe's); a bare `W` sets every domain's."""

    def parse(text: str) -> dict[str, float]:
        try:
            if "=" not in text:
                weights = dict.fromkeys(DOMAINS, float(text))
            else:
                weights = {}
                for part in text.split(","):
                    name, _, value = part.partition("=")
                    if name.strip() not in DOMAINS:
                        raise ValueError(name)
                    weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{option} takes W or DOMAIN=W,… for domains among {', '.join(DOMAINS)}; "
                f"got {text!r}"
            ) from None
        if not all(0 <= weight < float("inf") for weight in weights.values()):
            raise argparse.ArgumentTypeError(f"{option} weights must be 0 or more; got {text!r}")
        return weights

    return parse


def folder_id(folder: Path) -> str:
    """A checkpoint's id for the outer optimizer's state: the hash of its weights."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def train_steps(
    model: Any,
    tokenizer: Any,
    domain: str,
    steps: int,
    seed: int,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    synchronous: bool = False,
    carried: Path | None = None,
    round_number: int = 0,
    guidance: float | None = None,
    kl_coef: float | None = None,
    anchor: float | None = None,
    imitation: dict[str, Any] | None = None,
    reference: Any = None,
) -> tuple[list[dict[str, float]], torch.optim.Optimizer]:
    """`steps` RL steps of `domain`'s recipe on `model` (in place). With `optimizer`, training
    goes on with it (its momentum kept) at this recipe's learning rate; with `carried`, a fresh
    optimizer starts from the state an earlier round saved there when there is one, and its state
    is saved there at the end for round `round_number`, as a node's with keep_optimizer_state.
    `guidance` and `kl_coef`, when given, replace the recipe's; so does `anchor`, the weight of
    a KL anchor on the other domains' episodes (`node.anchor`, the other two of DOMAINS), and
    `imitation`, fields of the supervised steps before RL (`node.imitation`: steps,
    learning_rate, optimizer). With
    a KL term, `reference` is the model it is measured against (default: a frozen copy of
    `model` as it starts, the round's base as a node keeps it). Returns the history and the
    optimizer."""
    recipe = recipe_for(domain)
    update: dict[str, Any] = {"steps": steps, "seed": seed}
    if guidance is not None:
        update["guidance"] = guidance
    if kl_coef is not None:
        update["loss"] = recipe.loss.model_copy(update={"kl_coef": kl_coef})
    if anchor is not None:
        update["anchor"] = recipe.anchor.model_copy(
            update={"coef": anchor, "domains": [d for d in DOMAINS if d != domain]}
        )
    if imitation:
        update["imitation"] = recipe.imitation.model_copy(update=imitation)
    if synchronous:
        update["max_staleness"] = 0
    recipe = recipe.model_copy(update=update)
    run = AsyncRLRun(model, tokenizer, get_environment(domain), recipe, reference_model=reference)
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate
        run.trainer.optimizer = optimizer
    elif carried is not None:
        restore_optimizer_state(carried, run.trainer.optimizer, domain=domain, round=round_number)
    history = run.run()
    if carried is not None:
        save_optimizer_state(carried, run.trainer.optimizer, domain=domain, round=round_number)
    model.eval()
    return history, run.trainer.optimizer


def imitation_of(args: argparse.Namespace, domain: str) -> dict[str, Any]:
    """`domain`'s imitation fields that --imitation, --imitation-lr and --imitation-optimizer
    set (the others stay the recipe's)."""
    fields: dict[str, Any] = {}
    if (steps := args.imitation.get(domain)) is not None:
        fields["steps"] = int(steps)
    if (rate := args.imitation_lr.get(domain)) is not None:
        fields["learning_rate"] = rate
    if args.imitation_optimizer is not None:
        fields["optimizer"] = args.imitation_optimizer
    return fields


def frozen_copy(model: Any) -> Any:
    """A copy of `model` in eval mode, the reference a KL term is measured against."""
    return copy.deepcopy(model).eval()


@dataclass
class Arm:
    """One arm's success rows per round: {round: {domain: scores row}}."""

    name: str
    rounds: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def last(self) -> dict[str, dict[str, Any]]:
        return self.rounds[max(self.rounds)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.config = CoordinatorConfig(
            work_dir=self.out / "coordinator",
            eval=EvalConfig(
                domains=list(DOMAINS),
                n_tasks=args.eval_tasks,
                validation_tasks=args.validation_tasks,
                seed=args.eval_seed,
                experts="own",
            ),
            outer=OuterOptimizerConfig(learning_rate=args.outer_lr, momentum=args.outer_momentum),
            merge=MergePlan(
                own_domain_gate=not args.no_gate,
                own_domain_gate_alpha=args.gate_alpha,
                own_domain_min_gain=args.gate_min_gain,
                subsets_on_hold=not args.no_subsets,
                choose_by=args.choose_by,
                domain_weights=args.domain_weights,
                candidates=args.lambdas,
                keep_base_tensors=args.keep_base_tensors,
                domain_scale=args.domain_scale,
            ),
        )
        self.evaluator = Evaluator(self.config.eval)
        self.outer = OuterOptimizer(self.out / "coordinator" / "outer", self.config.outer)
        self.key_pair = load_or_create_identity(self.out / "identity.key")
        self.arms = {name: Arm(name) for name in ARMS}
        self.decisions: list[dict[str, Any]] = []
        self.started = time.perf_counter()

    def log(self, message: str) -> None:
        minutes = (time.perf_counter() - self.started) / 60
        print(f"[{minutes:6.1f} min] {message}", flush=True)

    def score(self, policy: Any, domains: tuple[str, ...] = DOMAINS) -> dict[str, dict]:
        """Greedy held-out rows on the reported tasks, the same tasks for every arm."""
        level = self.config.eval.level
        return {
            d: scores_row(
                evaluate_checkpoint(
                    policy, d, n_tasks=self.args.eval_tasks, seed=self.args.eval_seed
                ),
                level,
            )
            for d in domains
        }

    def run(self) -> int:
        args = self.args
        base_dir = self.out / "round-0"
        shutil.copytree(args.base, base_dir)
        self.log(f"scoring the base on {args.eval_tasks} held-out tasks per domain")
        self.arms["base"].rounds[0] = self.evaluator.scores(
            base_dir, list(DOMAINS), args.eval_tasks, args.eval_seed, cache_as=folder_id(base_dir)
        )
        for arm in ("swarm", "experts", "mixed"):
            self.arms[arm].rounds[0] = self.arms["base"].rounds[0]
        self.print_round(0)
        experts = {d: load_policy(base_dir) for d in DOMAINS}
        expert_optimizers: dict[str, torch.optim.Optimizer | None] = dict.fromkeys(DOMAINS)
        mixed = load_policy(base_dir)
        mixed_optimizer: torch.optim.Optimizer | None = None
        swarm_dir = base_dir
        for number in range(1, args.rounds + 1):
            swarm_dir = self.swarm_round(number, swarm_dir)
            if args.swarm_only:
                self.print_round(number)
                self.write_results()
                continue
            for index, domain in enumerate(DOMAINS):
                self.log(f"round {number}: {domain} expert, {args.steps[domain]} steps")
                model, tokenizer = experts[domain]
                _, expert_optimizers[domain] = train_steps(
                    model,
                    tokenizer,
                    domain,
                    args.steps[domain],
                    self.seed(number, index),
                    expert_optimizers[domain],
                    guidance=args.guidance.get(domain),
                    kl_coef=args.kl.get(domain),
                    anchor=args.anchor.get(domain),
                    imitation=imitation_of(args, domain),
                )
            self.arms["experts"].rounds[number] = {
                d: self.score(experts[d], (d,))[d] for d in DOMAINS
            }
            self.log(f"round {number}: mixed, {sum(args.steps.values())} steps in turn")
            # As a node's, a KL term holds the mixed model near where the round started.
            mixed_reference = frozen_copy(mixed[0])
            for step in range(max(args.steps.values())):
                for index, domain in enumerate(DOMAINS):
                    if step < args.steps[domain]:
                        _, mixed_optimizer = train_steps(
                            *mixed,
                            domain,
                            1,
                            self.seed(number, index) + step,
                            mixed_optimizer,
                            synchronous=True,
                            guidance=args.guidance.get(domain),
                            kl_coef=args.kl.get(domain),
                            # A node's imitation steps, once a round, before its first RL step.
                            imitation=imitation_of(args, domain) if step == 0 else {"steps": 0},
                            reference=mixed_reference,
                        )
            self.arms["mixed"].rounds[number] = self.score(mixed)
            self.print_round(number)
            self.write_results()
        return self.summary()

    def seed(self, number: int, index: int) -> int:
        """The same task stream for a domain's node, its expert and the mixed model's turns."""
        return self.args.seed + 1000 * number + 100 * index

    def swarm_round(self, number: int, base_dir: Path) -> Path:
        """One round of the swarm: three nodes' deltas, the coordinator's merge, outer step,
        scoring and publication rule. Returns the base of the next round."""
        work = self.out / f"work-{number}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        blobs = BlobStore(work / "blobs")
        base_id = folder_id(base_dir)
        base_tensors = dict(iter_base_tensors(base_dir))
        inputs: list[ExpertInput] = []
        for index, domain in enumerate(DOMAINS):
            self.log(f"round {number}: {domain} node, {self.args.steps[domain]} steps")
            model, tokenizer = load_policy(base_dir)
            history, _ = train_steps(
                model,
                tokenizer,
                domain,
                self.args.steps[domain],
                self.seed(number, index),
                carried=(
                    self.out / f"node-{domain}-optimizer.pt"
                    if self.args.keep_node_optimizer
                    else None
                ),
                guidance=self.args.guidance.get(domain),
                kl_coef=self.args.kl.get(domain),
                anchor=self.args.anchor.get(domain),
                imitation=imitation_of(self.args, domain),
                round_number=number,
            )
            state = model.state_dict()
            manifest = pack_delta(
                base_tensors,
                {name: state[name] for name in base_tensors},
                blobs,
                peer_id=peer_id_of(self.key_pair),
                public_key=public_key_bytes(self.key_pair),
                domain=domain,
                base_id=base_id,
                round=number,
                steps=len(history),
            )
            inputs.append(ExpertInput(f"expert:{domain}", domain, DeltaReader(manifest, blobs)))
        merging, gate = gate_by_own_domain(
            self.config.merge, self.evaluator, base_id, base_dir, inputs, work
        )
        if left_out := [g["domain"] for g in gate if not g["kept"]]:
            self.log(
                f"round {number}: left out (below the base on its own domain, or short of "
                f"--gate-min-gain): {left_out}"
            )
        if not merging:
            self.log(f"round {number}: held: the gate left out every delta")
            self.decisions.append({"round": number, "publish": False, "gate": gate})
            self.arms["swarm"].rounds[number] = self.arms["swarm"].rounds[number - 1]
            shutil.rmtree(work, ignore_errors=True)
            return base_dir
        self.log(f"round {number}: merging")
        origin = self.out / "round-0"
        decide = publication_rule(
            self.evaluator.validation_scores(base_dir, cache_as=base_id),
            self.config.publish,
            self.config.eval.level,
            origin_scores=(
                None
                if base_dir == origin
                else self.evaluator.validation_scores(origin, cache_as=folder_id(origin))
            ),
        )
        verdict = merge_and_decide(
            self.config.merge,
            self.evaluator,
            self.outer,
            base_id,
            base_dir,
            merging,
            work,
            number,
            decide,
            lambda e: TaskVector(name=e.domain, expert=e.reader.expert),
            gate,
        )
        chosen, candidates = verdict.merged.spec, verdict.merged.records
        decision, candidate_dir = verdict.decision, verdict.candidate_dir
        for subset in verdict.subsets:
            self.log(
                f"round {number}: subset {[label.split(':')[-1] for label in subset['merged']]}: "
                f"{'passes' if subset['publish'] else 'held'} (validation mean reward "
                f"{subset['score']:.3f}"
                + (
                    f", largest shortfall {subset['shortfall']:.3f})"
                    if "shortfall" in subset
                    else ")"
                )
            )
        table = self.evaluator.evaluation_table(
            base_id,
            base_dir,
            inputs,
            candidate_dir,
            work,
            keep_base=self.config.merge.kept_for,
        )
        self.decisions.append(
            {
                "round": number,
                "chosen": chosen.model_dump(),
                "candidates": candidates,
                "merged": [e.domain for e in verdict.merging],
                "subsets": verdict.subsets,
                **decision.to_dict(),
                "gate": gate,
                "experts_own_domain": {
                    e.domain: table[e.label][e.domain]["success_rate"] for e in inputs
                },
                "candidate": {d: row["success_rate"] for d, row in table["merged"].items()},
            }
        )
        self.log(
            f"round {number}: {'published' if decision.publish else 'held'} "
            f"({chosen.method} {chosen.parameters} of {[e.domain for e in verdict.merging]}): "
            f"{decision.reason}"
        )
        if decision.publish:
            next_dir = self.out / f"round-{number}"
            shutil.rmtree(next_dir, ignore_errors=True)
            shutil.copytree(candidate_dir, next_dir)
            self.outer.commit(folder_id(next_dir))
            self.arms["swarm"].rounds[number] = table["merged"]
        else:
            self.outer.discard()
            next_dir = base_dir
            self.arms["swarm"].rounds[number] = self.arms["swarm"].rounds[number - 1]
        shutil.rmtree(work, ignore_errors=True)
        return next_dir

    def print_round(self, number: int) -> None:
        print(f"\nafter round {number}: greedy held-out success (95% Wilson interval)")
        print(f"{'arm':<8}" + "".join(f"{d:>22}" for d in DOMAINS))
        for name in self.arms_run():
            rows = self.arms[name].rounds.get(number) or self.arms[name].rounds.get(0)
            cells = [
                f"{100 * rows[d]['success_rate']:5.1f} "
                f"[{100 * rows[d]['success_low']:4.1f}, {100 * rows[d]['success_high']:4.1f}]"
                for d in DOMAINS
            ]
            print(f"{name:<8}" + "".join(f"{c:>22}" for c in cells))
        print(flush=True)

    def arms_run(self) -> tuple[str, ...]:
        """The arms this run trains and scores, with the base: --swarm-only leaves out the
        experts and mixed RL, whose rows would be the base's."""
        return ("base", "swarm") if self.args.swarm_only else ARMS

    def summary(self) -> int:
        base = self.arms["base"].rounds[0]
        final = {name: self.arms[name].last() for name in ARMS}
        print("paired differences on the same tasks after the last round (points, 95% interval)")
        ok = True
        lines: dict[str, Any] = {}
        for d in DOMAINS:
            cells: dict[str, Any] = {
                f"{name}-base": paired_difference(
                    base[d]["successes"], final[name][d]["successes"]
                ).to_dict()
                for name in self.arms_run()[1:]
            }
            sb = cells["swarm-base"]
            line = f"{d:<8} swarm−base {_points(sb)}"
            if not self.args.swarm_only:
                cells["swarm-mixed"] = paired_difference(
                    final["mixed"][d]["successes"], final["swarm"][d]["successes"]
                ).to_dict()
                gain_expert = cells["experts-base"]["mean"]
                retention = sb["mean"] / gain_expert if gain_expert > 0 else None
                cells["retention"] = retention
                line += (
                    f"  expert−base {_points(cells['experts-base'])}  "
                    f"mixed−base {_points(cells['mixed-base'])}  "
                    f"swarm−mixed {_points(cells['swarm-mixed'])}  retention "
                    + (
                        f"{100 * retention:.0f}%"
                        if retention is not None
                        else "n/a (no expert gain)"
                    )
                )
            lines[d] = cells
            print(line)
            if not (100 * sb["mean"] >= self.args.min_gain and sb["low"] > 0):
                ok = False
        self.write_results(lines)
        print(f"results: {self.out / 'results.json'}; plot: {self.out / 'swarm.png'}")
        return 0 if ok else 1

    def write_results(self, summary: dict[str, Any] | None = None) -> None:
        def compact(rows: dict[str, dict]) -> dict[str, dict]:
            keep = ("success_rate", "success_low", "success_high", "mean_reward", "n")
            return {d: {k: row[k] for k in keep} for d, row in rows.items()}

        results = {
            "settings": {
                "rounds": self.args.rounds,
                "steps": self.args.steps,
                "eval_tasks": self.args.eval_tasks,
                "validation_tasks": self.config.eval.validation_task_count(),
                "eval_seed": self.args.eval_seed,
                "seed": self.args.seed,
                "merge": self.config.merge.model_dump(),
                "outer": self.config.outer.model_dump(),
                "publish": self.config.publish.model_dump(),
                "recipes": {d: recipe_for(d).model_dump() for d in DOMAINS},
                "guidance": self.args.guidance,
                "kl": self.args.kl,
                "anchor": self.args.anchor,
                "imitation": self.args.imitation,
                "imitation_lr": self.args.imitation_lr,
            },
            "arms": {
                name: {str(r): compact(rows) for r, rows in arm.rounds.items()}
                for name, arm in self.arms.items()
            },
            "decisions": self.decisions,
            "summary": summary,
            "minutes": (time.perf_counter() - self.started) / 60,
        }
        (self.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        plot(self.arms, self.out / "swarm.png")


def _points(diff: dict[str, Any]) -> str:
    return f"{100 * diff['mean']:+5.1f} [{100 * diff['low']:+5.1f}, {100 * diff['high']:+5.1f}]"


def plot(arms: dict[str, Arm], path: Path) -> None:
    """Success per domain per round for every arm, with the intervals as bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(DOMAINS), figsize=(4.2 * len(DOMAINS), 3.6), sharey=True)
    last = max(max(arm.rounds) for arm in arms.values())
    for axis, domain in zip(axes, DOMAINS, strict=True):
        base = arms["base"].rounds[0][domain]
        axis.axhline(100 * base["success_rate"], color="grey", linestyle="--", label="base")
        axis.axhspan(
            100 * base["success_low"], 100 * base["success_high"], color="grey", alpha=0.08
        )
        for name in ARMS[1:]:
            rounds = sorted(arms[name].rounds)
            if rounds == [0]:
                continue  # not trained in this run (--swarm-only)
            rows = [arms[name].rounds[r][domain] for r in rounds]
            rate = [100 * row["success_rate"] for row in rows]
            axis.plot(rounds, rate, marker="o", label=name)
            axis.fill_between(
                rounds,
                [100 * row["success_low"] for row in rows],
                [100 * row["success_high"] for row in rows],
                alpha=0.12,
            )
        axis.set_title(domain)
        axis.set_xlabel("round")
        axis.set_xticks(range(last + 1))
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success (%)")
    axes[-1].legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="swarm rounds (default 4)")
    parser.add_argument(
        "--steps",
        type=parse_steps,
        default=dict(DEFAULT_STEPS),
        help="RL steps per node per round, per domain (default "
        + ",".join(f"{d}={n}" for d, n in DEFAULT_STEPS.items())
        + "): "
        "each round the swarm trains these on three nodes, each expert trains its own, and "
        "the mixed model trains all of them in turn; so every arm but the base spends "
        "rounds × (sum of these) steps in all",
    )
    parser.add_argument(
        "--eval-tasks",
        type=int,
        default=512,
        help="held-out tasks per domain every arm is reported on (default %(default)s: a paired "
        "difference's 95%% interval of about ±4 points)",
    )
    parser.add_argument(
        "--validation-tasks",
        type=int,
        default=128,
        help="validation tasks per domain, which choose the merge and decide publication, as "
        "the coordinator's [eval] validation_tasks (default %(default)s)",
    )
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out tasks")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training tasks")
    parser.add_argument("--min-gain", type=float, default=15.0, help="points the swarm must gain")
    parser.add_argument("--base", type=Path, help="base model folder (default: the shipped one)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-swarm"))
    parser.add_argument(
        "--swarm-only",
        action="store_true",
        help="run the swarm arm alone, the other arms left at the base (to compare the "
        "coordinator's settings between runs)",
    )
    parser.add_argument(
        "--no-gate",
        action="store_true",
        help="merge every delta, without the coordinator's own-domain gate (which leaves out a "
        "delta that scores below the base on its own domain's validation tasks)",
    )
    parser.add_argument(
        "--gate-alpha",
        type=float,
        default=MergePlan().own_domain_gate_alpha,
        help="the own-domain gate leaves a delta out only when it is below the base on its own "
        "domain beyond noise, by the one-sided paired test at this level; 0: on any shortfall "
        "(the coordinator's own_domain_gate_alpha; default %(default)s)",
    )
    parser.add_argument(
        "--gate-min-gain",
        type=float,
        default=MergePlan().own_domain_min_gain,
        help="the own-domain gate also leaves out a delta whose own domain's mean validation "
        "reward gains less than this over the base (the coordinator's own_domain_min_gain; "
        "default %(default)s: off)",
    )
    parser.add_argument(
        "--keep-node-optimizer",
        action=argparse.BooleanOptionalAction,
        default=NodeConfig().keep_optimizer_state,
        help="each node's optimizer state (SGD momentum) carries over to its next round, as the "
        "experts' does, instead of starting fresh after the rebase (the node's "
        "keep_optimizer_state; default %(default)s)",
    )
    for option, metavar, what, recipe_value in (
        ("--guidance", "W", "off-policy guidance weight", lambda r: r.guidance),
        ("--kl", "K", "the KL term's weight to the round's base", lambda r: r.loss.kl_coef),
        (
            "--anchor",
            "A",
            "the weight of a KL anchor to the round's base on the other domains' episodes "
            "(node.anchor; the mixed model, which trains on all of them, has none)",
            lambda r: r.anchor.coef,
        ),
        (
            "--imitation",
            "N",
            "supervised steps on the domain's solutions before each round's RL "
            "(node.imitation; nodes and experts every round, the mixed model before its first "
            "step of each domain in a round)",
            lambda r: r.imitation.steps,
        ),
    ):
        parser.add_argument(
            option,
            type=parse_weights(option),
            default={},
            metavar=f"{metavar}|DOMAIN={metavar},…",
            help=f"{what} (0: off) of every domain, or of the domains named; the others keep "
            "their recipe's ("
            + ", ".join(f"{d} {recipe_value(recipe_for(d)):g}" for d in DOMAINS)
            + ")",
        )
    parser.add_argument(
        "--imitation-lr",
        type=parse_weights("--imitation-lr"),
        default={},
        metavar="LR|DOMAIN=LR,…",
        help="the imitation steps' learning rate (recipes: "
        + ", ".join(f"{d} {recipe_for(d).imitation.learning_rate:g}" for d in DOMAINS)
        + ")",
    )
    parser.add_argument(
        "--imitation-optimizer",
        choices=OPTIMIZERS,
        help="the imitation steps' optimizer, every domain's (recipes: "
        + ", ".join(f"{d} {recipe_for(d).imitation.optimizer}" for d in DOMAINS)
        + ")",
    )
    parser.add_argument(
        "--domain-weights",
        type=parse_domain_weights,
        default=MergePlan().domain_weights,
        metavar="W,W,…|none",
        help="task arithmetic with a weight per domain tried beside the plain λ candidates, "
        "each of these weights for each domain ('none': off; the coordinator's domain_weights; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--lambdas",
        type=parse_lambdas,
        default=MergePlan().candidates,
        metavar="λ,λ,…|none",
        help="task arithmetic weights tried beside the plan's λ 1 on the validation tasks (the "
        "coordinator's [merge] candidates; 'none': λ 1 alone; default "
        + (",".join(f"{spec.parameters['weight']:g}" for spec in MergePlan().candidates) or "none")
        + ")",
    )
    parser.add_argument(
        "--domain-scale",
        type=parse_domain_scale,
        default=MergePlan().domain_scale,
        metavar="DOMAIN=S,…|none",
        help="a fixed factor on the named domains' deltas before every merge, the others "
        "whole (the coordinator's [merge] domain_scale; 'none': every delta whole; default "
        + (",".join(f"{d}={s:g}" for d, s in MergePlan().domain_scale.items()) or "none")
        + ")",
    )
    add_keep_base_argument(parser)
    parser.add_argument(
        "--no-subsets",
        action="store_true",
        help="hold a round whose merge the publication rule refuses, without trying the merge "
        "again with a delta left out (the coordinator's subsets_on_hold)",
    )
    parser.add_argument(
        "--choose-by",
        choices=["mean", "shortfall"],
        default=MergePlan().choose_by,
        help="what the round publishes: 'shortfall' also tries the merge without each delta "
        "and takes the passing one whose worst domain falls least short of its own delta "
        "alone (the coordinator's choose_by; default %(default)s)",
    )
    parser.add_argument(
        "--outer-lr", type=float, default=1.0, help="the outer optimizer's learning rate"
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=0.0,
        help="the outer optimizer's Nesterov momentum (default 0 with lr 1: the coordinator's "
        "default, the merge published as it is)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.eval_tasks < 1 or (args.validation_tasks or 1) < 1:
        parser.error("--rounds, --eval-tasks and --validation-tasks must be at least 1")
    if any(n != int(n) for n in args.imitation.values()) or 0 in args.imitation_lr.values():
        parser.error("--imitation takes whole steps and --imitation-lr rates above 0")
    if args.base is None:
        from skillswarm.node.bootstrap import embedded_base

        args.base = embedded_base()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    set_torch_threads(1)
    budget = args.rounds * sum(args.steps.values())
    imitation = {
        d: steps
        for d in DOMAINS
        if (steps := int(args.imitation.get(d, recipe_for(d).imitation.steps)))
    }
    supervised = args.rounds * sum(imitation.values())
    print(
        f"{args.rounds} rounds; steps per round {args.steps}; every trained arm spends {budget} "
        f"RL steps"
        + (f" and {supervised} imitation steps ({imitation} a round)" if supervised else "")
        + f"; {args.eval_tasks} held-out tasks per domain; base {args.base}",
        flush=True,
    )
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
