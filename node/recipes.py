"""Recommended RL settings per skill domain for the embedded tiny base on CPU: what
`bench/bench_learning.py` runs and what a node or `skillswarm train --config` can start from.
Each recipe's comment records what it was measured to do (2 shared cores, one torch thread each).
"""

from __future__ import annotations

from skillswarm.node.loss import LossConfig
from skillswarm.node.pipeline import RLConfig


class NoRecipeError(KeyError):
    """Raised when no recipe is recorded for a domain."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# Measured from the default base (`skillswarm bootstrap`: copy pretraining, then 300 warm-start
# steps; greedy held-out math 53.9%, code 33.6%, search 60.2%) with `python bench/bench_learning.py
# --base runs/base --domains D`: 10 minutes of RL per domain on 2 idle cores, greedy held-out
# success on the same 128 tasks before and after. Earlier bases, warm-started from demonstrations
# alone (no copy stage), are named as such.
#
# SGD (momentum 0.9, gradients clipped to norm 1) rather than AdamW: AdamW moves every weight by
# about the learning rate whatever its gradient's size, and the tiny model's copying of names and
# numbers did not survive that on search (AdamW lowered search held-out success from every earlier
# base and setting tried; on a prototype of the default base, AdamW 1e-4: -2.3 in 125 steps).
# With AdamW, 5e-4 and above collapsed math and code within 10-60 steps; 2e-4 rose slowly. SGD at
# 0.02 collapsed math and search within 40-125 steps (sampled training success down to a few
# percent; search from the prototype base -10.9). Math and code use outcome-only advantages
# (turn_reward_weight 0); search keeps its per-turn credit.
_SGD_LEARNING_RATE = 0.01
_OUTCOME_ONLY = LossConfig(turn_reward_weight=0.0)

DOMAIN_RECIPES: dict[str, RLConfig] = {
    # From the default base (53.9% greedy, 51.6% sampled at 0.7): 385 steps in 10 minutes,
    # 53.9% -> 84.4% greedy (+30.5 points), sampled 51.6% -> 78.1%, training success 0.46 ->
    # 0.77. From a prototype of that base (50.8%): 522 steps, +15.6. From the earlier 1,200-step
    # base without a copy stage (36.7%): SGD 0.007 at 0.7, 963 steps, 37.5% -> 67.2% (+29.7, on
    # eval seed 1); SGD 0.01 at 0.7 once +29.7 (795 steps) and once a collapse at step 440
    # (training success 0.56 -> 0.00 within 20 steps, 37.5% -> 0.0%), hence 0.007; at
    # temperature 1.0, SGD 0.01 +11.7 and 0.014 -3.1; AdamW 2e-4, +5.5. From bases that had
    # barely begun copying numbers into the calculator (sampled success 2-6%), runs ended
    # anywhere from -15.6 to +22.7 points: where the warm start leaves the model matters more
    # than any setting tried here.
    "math": RLConfig(
        tasks_per_step=8,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=0.007,
        temperature=0.7,
        max_staleness=1,
        loss=_OUTCOME_ONLY,
    ),
    # From the default base (copy pretraining, then 300 warm-start steps; 33.6% greedy, 21.1%
    # sampled at 0.5): 77 steps in 10 minutes, 33.6% -> 61.7% greedy (+28.1 points), sampled
    # 21.1% -> 42.2%, training success 0.37 -> 0.45. From a prototype of that base (18.8%):
    # 78 steps, 18.8% -> 28.9% (+10.2), sampled 10.2% -> 23.4%. A step of 8 tasks x 8 samples
    # takes about 7.7 s, much of it in the sandbox (two fresh Python processes per test run,
    # visible and hidden tests in one run, identical answers checked once). Groups of 8 give the
    # all-or-nothing function families a success to learn from more often than groups of 4.
    # Earlier bases, from demonstrations alone: AdamW 2e-4 at temperature 1.0 gained at most
    # +9.4 points (from 43.8%, 68 steps) and lost up to 7.8 where sampled success was rare
    # (2-6%); SGD 0.01 at 0.7 from a 3.9% base, +0.0 in 102 steps: nothing succeeded to learn
    # from. Temperature 0.5 because on the prototype base sampled success at 0.7 was 3.9%
    # (10.2% at 0.5, 18.8% greedy): too few successes in a group to learn from.
    "code": RLConfig(
        tasks_per_step=8,
        samples_per_task=8,
        optimizer="sgd",
        learning_rate=0.007,
        temperature=0.5,
        max_staleness=1,
        loss=_OUTCOME_ONLY,
    ),
    # From the default base (60.2% greedy, 52.3% sampled at 0.7): 110 steps in 10 minutes, 60.2% ->
    # 81.2% greedy (+21.1 points), sampled 52.3% -> 78.9%, training success 0.55 -> 0.74; on another
    # held-out sample (eval seed 1), 112 steps, 60.2% -> 78.1% (+18.0), sampled 48.4% -> 70.3%. A
    # step (8 tasks x 4 samples of multi-turn episodes with long tool results) takes about 5.4 s.
    # From a prototype of that base (61.7%): 144 steps, +1.6; with the reader's credit for each fact
    # on the question's path (`fact_credit`, now the default), 117 steps, +0.0: that base's failures
    # were questions with the wrong relation, which its samples rarely got right either. Earlier
    # bases, from demonstrations alone, where copying the question's name into the first search came
    # late or never: from a snapshot at 35.9%, +9.4 (143 steps), +3.9 at temperature 1.0, +4.7 with
    # 4 tasks a step; with AdamW from the 1,200-step base, -12.5 to -17.2. Sampled training success
    # over 10-step windows follows the seeded task sequence (the same ups and downs in every run),
    # so held-out success is the measure. Groups of 4 rather than 8, for more steps in the time.
    "search": RLConfig(
        tasks_per_step=8,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=_SGD_LEARNING_RATE,
        temperature=0.7,
        max_staleness=1,
    ),
}


def recipe_for(domain: str) -> RLConfig:
    """A fresh copy of `domain`'s recommended settings (change it freely)."""
    recipe = DOMAIN_RECIPES.get(domain)
    if recipe is None:
        known = ", ".join(sorted(DOMAIN_RECIPES))
        raise NoRecipeError(f"no RL recipe for domain {domain!r}; recipes exist for {known}")
    return recipe.model_copy(deep=True)
