"""Held-out scoring of checkpoints on every domain: the score cache of published checkpoints, and
the evaluation table of a round (base, each expert alone, the merged candidate).
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skillswarm.agent.stats import not_worse, wilson_interval
from skillswarm.coordinator.config import EvalConfig
from skillswarm.coordinator.gates import write_expert_checkpoint
from skillswarm.coordinator.publication import check_same_tasks, outcomes_of
from skillswarm.coordinator.store import DeltaRecord
from skillswarm.protocol.delta import DeltaReader

if TYPE_CHECKING:
    from skillswarm.agent.evaluate import EvalResult

__all__ = [
    "DomainScores",
    "Evaluator",
    "ExpertInput",
    "expert_folder",
    "expert_label",
    "gate_verdict",
    "mean_reward",
    "scores_row",
]

log = logging.getLogger(__name__)

DomainScores = dict[str, dict[str, Any]]
"""{domain: row} of one checkpoint; a row holds "mean_reward", "success_rate", "n", the success
rate's interval "success_low"/"success_high", and the per-task "rewards", "successes" and
"task_ids" in task order (so that two checkpoints scored on the same tasks compare pairwise)."""


@dataclass(frozen=True)
class ExpertInput:
    """One delta of a round, scored applied alone to the base: its table label and domain."""

    label: str
    domain: str
    reader: DeltaReader


class Evaluator:
    """Scores checkpoints through the rollout engine; thread-safe.

    `_cache_lock` guards only the score cache: two scorings may run at once (intake's evaluation
    gate and a merge), each loading its own policy.
    """

    def __init__(self, eval_config: EvalConfig) -> None:
        self.eval_config = eval_config
        self._cache_lock = threading.Lock()
        self._score_cache: dict[tuple[str, str, int, int], dict[str, Any]] = {}

    def scores(
        self,
        folder: Path,
        domains: Sequence[str],
        n_tasks: int,
        seed: int,
        cache_as: str | None = None,
    ) -> DomainScores:
        """{domain: {mean_reward, success_rate, n}} of one checkpoint, loaded once; results of a
        published checkpoint (`cache_as` its id) are kept for the next asks."""
        from skillswarm.agent.evaluate import evaluate_checkpoint
        from skillswarm.agent.model import load_policy

        scores: DomainScores = {}
        policy = None
        for domain in domains:
            key = (cache_as or "", domain, n_tasks, seed)
            if cache_as is not None:
                with self._cache_lock:
                    cached = self._score_cache.get(key)
                if cached is not None:
                    scores[domain] = cached
                    continue
            if policy is None:
                policy = load_policy(folder)
            result = evaluate_checkpoint(
                policy,
                domain,
                n_tasks=n_tasks,
                seed=seed,
                tasks_file=self.eval_config.tasks_files.get(domain),
            )
            scores[domain] = scores_row(result, self.eval_config.level)
            if cache_as is not None:
                with self._cache_lock:
                    self._score_cache[key] = scores[domain]
        return scores

    def validation_scores(self, folder: Path, cache_as: str | None = None) -> DomainScores:
        """Scores on the validation tasks (not the reported ones) over every configured domain:
        what chooses among merge candidates and what the publication rule compares."""
        config = self.eval_config
        return self.scores(
            folder,
            config.domains,
            config.validation_task_count(),
            config.validation_tasks_seed(),
            cache_as,
        )

    def own_domain_gate(
        self,
        base_id: str,
        base_dir: Path,
        experts: Sequence[ExpertInput],
        work: Path,
        alpha: float = 0.0,
        keep_base: KeepBase | None = None,
        min_gain: float = 0.0,
    ) -> list[dict[str, Any]]:
        """For each expert (its delta applied alone, the tensors `keep_base(its domain)` names
        left at the base as the merge leaves them), its own domain's mean reward on the
        validation tasks beside the base's, and whether it is kept (`gate_verdict` at `alpha`
        and `min_gain`). An expert of a domain that is not evaluated is kept unscored."""
        config = self.eval_config
        seed, n_tasks = config.validation_tasks_seed(), config.validation_task_count()
        gate: list[dict[str, Any]] = []
        for expert in experts:
            entry: dict[str, Any] = {"label": expert.label, "domain": expert.domain}
            if expert.domain not in config.domains:
                gate.append(entry | {"kept": True, "base": None, "expert": None})
                continue
            base = self.scores(base_dir, [expert.domain], n_tasks, seed, cache_as=base_id)
            folder = expert_folder(base_dir, expert, work, kept(keep_base, expert))
            alone = self.scores(folder, [expert.domain], n_tasks, seed)
            base_reward = mean_reward(base[expert.domain])
            expert_reward = mean_reward(alone[expert.domain])
            entry |= {"base": base_reward, "expert": expert_reward}
            verdict = gate_verdict(base[expert.domain], alone[expert.domain], alpha, min_gain)
            gate.append(entry | verdict)
        return gate

    def evaluate(self, checkpoints: Mapping[str, Path]) -> dict[str, DomainScores]:
        """Held-out scores of each named checkpoint on every configured domain."""
        config = self.eval_config
        return {
            label: self.scores(folder, config.domains, config.n_tasks, config.seed)
            for label, folder in checkpoints.items()
        }

    def evaluation_table(
        self,
        base_id: str,
        base_dir: Path,
        experts: Sequence[ExpertInput],
        merged_dir: Path,
        work: Path,
        keep_base: KeepBase | None = None,
    ) -> dict[str, Any]:
        """Held-out scores of the base, each expert (its delta applied alone, the tensors
        `keep_base(its domain)` names left at the base as the merge leaves them; on every
        domain, its own or none, as eval.experts says) and the merged candidate, all on the same
        tasks through the same rollout engine."""
        config = self.eval_config
        domains, n_tasks, seed = config.domains, config.n_tasks, config.seed
        table: dict[str, Any] = {
            "base": self.scores(base_dir, domains, n_tasks, seed, cache_as=base_id)
        }
        for expert in experts if config.experts != "none" else ():
            scored = domains if config.experts == "all" else [expert.domain]
            scored = [d for d in scored if d in domains]
            if not scored:
                continue
            folder = expert_folder(base_dir, expert, work, kept(keep_base, expert))
            table[expert.label] = self.scores(folder, scored, n_tasks, seed)
        table["merged"] = self.scores(merged_dir, domains, n_tasks, seed)
        return table


# The glob patterns of the tensors a domain's deltas leave at the base (MergePlan.kept_for).
KeepBase = Callable[[str], Sequence[str]]


def kept(keep_base: KeepBase | None, expert: ExpertInput) -> Sequence[str]:
    """The patterns `keep_base` names for `expert`'s domain; none without it."""
    return () if keep_base is None else keep_base(expert.domain)


def expert_folder(
    base_dir: Path, expert: ExpertInput, work: Path, keep_base: Sequence[str] = ()
) -> Path:
    """base + `expert`'s delta (but the tensors `keep_base` names) as a checkpoint folder under
    `work`, written on the first ask and reused after it (the own-domain gate and the evaluation
    table score the same expert); the round's work folder is removed when the round ends. A
    folder appears whole or not at all."""
    key = "\n".join([str(base_dir.resolve()), expert.label, *keep_base])
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = work / "experts" / name
    if folder.is_dir():
        return folder
    partial = work / "experts" / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    write_expert_checkpoint(base_dir, expert.reader, partial, keep_base)
    partial.rename(folder)
    return folder


def gate_verdict(
    base: Mapping[str, Any], expert: Mapping[str, Any], alpha: float, min_gain: float = 0.0
) -> dict[str, Any]:
    """The own-domain gate on one delta, from the base's and the delta's rows on the same
    validation tasks: `kept` unless, with `alpha` > 0, the one-sided paired test on the per-task
    rewards says the delta is below the base at that level (`p_worse` given), or, with 0, its
    mean reward is below the base's; and, with `min_gain` > 0, unless its mean reward gains at
    least `min_gain` over the base's (`short_of_min_gain` set when that alone leaves it out)."""
    check_same_tasks(base, expert)
    if alpha == 0:
        verdict: dict[str, Any] = {"kept": mean_reward(expert) >= mean_reward(base)}
    else:
        kept, difference = not_worse(
            outcomes_of(base, "reward"), outcomes_of(expert, "reward"), alpha=alpha
        )
        verdict = {"kept": kept, "p_worse": difference.p_worse}
    # Rewards are means over the same tasks: a gain of exactly min_gain is not lost to rounding.
    gain = mean_reward(expert) - mean_reward(base)
    if min_gain > 0 and verdict["kept"] and gain < min_gain - 1e-9:
        verdict |= {"kept": False, "short_of_min_gain": True}
    return verdict


def scores_row(result: EvalResult, level: float = 0.95) -> dict[str, Any]:
    """One checkpoint's row on one domain (see DomainScores) from its evaluation."""
    low, high = wilson_interval(sum(result.successes), result.n, level)
    return {
        "mean_reward": _finite(result.mean_reward),
        "success_rate": _finite(result.success_rate),
        "n": result.n,
        "success_low": low,
        "success_high": high,
        "rewards": [float(r) for r in result.rewards],
        "successes": [int(v) for v in result.successes],
        "task_ids": list(result.task_ids),
    }


def expert_label(record: DeltaRecord) -> str:
    """The evaluation table's label of one delta applied alone to the base."""
    return f"expert:{record.domain}:{record.id[:12]}"


def mean_reward(row: Mapping[str, Any]) -> float:
    """A domain's mean reward from a scores row, an unscored (non-finite) one counting as 0."""
    value = row.get("mean_reward")
    return 0.0 if value is None else float(value)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
