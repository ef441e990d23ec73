"""RL settings per skill domain, measured for the embedded tiny base on CPU: a node's default
[train] settings (NodeConfig lays the fields its TOML sets over them), and where `skillswarm
train` without --config and bench/bench_learning.py start. Results and reasons: docs/training.md.
"""

from __future__ import annotations

from skillswarm.node.imitation import ImitationConfig
from skillswarm.node.loss import LossConfig
from skillswarm.node.pipeline import RLConfig


class NoRecipeError(KeyError):
    """Raised when no recipe is recorded for a domain."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# SGD with momentum, not AdamW: AdamW's uniform step sizes erase the tiny model's copying.
_SGD_LEARNING_RATE = 0.01
# A KL term to the round's base at 0.1 in every domain: without it a math round's delta (90
# steps) cost code 9 to 29 points held-out while math gained 12 to 17; with it code moved −6
# to +2 and math gained 11 to 17 (docs/training.md, "The KL term to the round's base").
_KL_TO_BASE = 0.1
_OUTCOME_ONLY = LossConfig(turn_reward_weight=0.0, kl_coef=_KL_TO_BASE)
# Off-policy guidance (`node.guidance`) at 0.25 for math and code: the solution joins a group
# that failed; code's `repeat` family, which the base never solves, becomes learnable. Not for
# search, whose learning it slowed (docs/training.md, "Off-policy guidance").
_GUIDANCE = 0.25

DOMAIN_RECIPES: dict[str, RLConfig] = {
    # Outcome-only advantages at 0.007: 0.01 once collapsed the policy mid-run.
    # Steps per round: about a minute of a node's time on 2 cores for each domain.
    "math": RLConfig(
        steps=30,
        tasks_per_step=8,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=0.007,
        temperature=0.7,
        max_staleness=1,
        guidance=_GUIDANCE,
        loss=_OUTCOME_ONLY,
    ),
    # Groups of 8 at temperature 0.5: all-or-nothing families need a success in the group.
    "code": RLConfig(
        steps=8,
        tasks_per_step=8,
        samples_per_task=8,
        optimizer="sgd",
        learning_rate=0.007,
        temperature=0.5,
        max_staleness=1,
        guidance=_GUIDANCE,
        loss=_OUTCOME_ONLY,
    ),
    # 16 tasks a step in groups of 4, per-turn credit kept for searches and reads. From the
    # whole-word base, 60 steps of 8 tasks gained 2.3 points held-out (120 steps: 0.8) and of 16
    # tasks 10.2, with failed episodes pushed down or not; a larger learning rate (0.03) lost 18.
    # 50 imitation steps at 1e-4 first: RL alone gained about 4 points in 40 steps; two rounds
    # of these steps alone gained 11.7 and raised math and code too (at 3e-4 they cost code 9).
    "search": RLConfig(
        imitation=ImitationConfig(steps=50, learning_rate=1e-4),
        steps=10,
        tasks_per_step=16,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=_SGD_LEARNING_RATE,
        temperature=0.7,
        max_staleness=1,
        loss=LossConfig(kl_coef=_KL_TO_BASE),
    ),
}


def recipe_for(domain: str) -> RLConfig:
    """A fresh copy of `domain`'s recommended settings (change it freely)."""
    recipe = DOMAIN_RECIPES.get(domain)
    if recipe is None:
        known = ", ".join(sorted(DOMAIN_RECIPES))
        raise NoRecipeError(f"no RL recipe for domain {domain!r}; recipes exist for {known}")
    return recipe.model_copy(deep=True)
