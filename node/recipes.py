"""Recommended RL settings per skill domain for the embedded tiny base on CPU: what
`bench/bench_learning.py` runs and what a node or `skillswarm train --config` can start from.
Each recipe's comment records what it was measured to do (2 shared cores, one torch thread each).
"""

from __future__ import annotations

from node.loss import LossConfig
from node.pipeline import RLConfig


class NoRecipeError(KeyError):
    """Raised when no recipe is recorded for a domain."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# Measured on warm starts of the embedded base (supervised on all three domains, batch 16, AdamW
# 1.5e-3), greedy held-out success on 128 tasks before and after, 2 shared cores with a load
# average of 3-10 from other work. With AdamW the learning rate mattered most: 5e-4 and above
# collapsed math and code (greedy -4 to -21 points in 6 minutes, sampled success to about 0; 1e-3
# and 3e-3 within 10 steps), 2e-4 rose steadily. Math and code were measured with outcome-only
# advantages (turn_reward_weight 0), and keep them. Every base named below was built with the
# earlier tokenizer (Qwen2's pre-tokenizer, which glues the character before a word to it) unless
# it says otherwise.
#
# SGD (momentum 0.9, gradients clipped to norm 1) instead of AdamW, with the current tokenizer:
# AdamW moves every weight by about the learning rate whatever its gradient's size, and the tiny
# model's copying of names and numbers did not survive that on search. SGD at 0.01 raised math
# and search where AdamW gained less or lost; 0.02 (math) and 0.03 (search) collapsed within
# 40-100 steps, sampled training success falling to a few percent.
_SGD_LEARNING_RATE = 0.01
_OUTCOME_ONLY = LossConfig(turn_reward_weight=0.0)

DOMAIN_RECIPES: dict[str, RLConfig] = {
    # From a warm start at the onset of number copying (350 steps, 4.7% greedy): 10 minutes,
    # 305 steps under load, 4.7% -> 20.3% (+15.6 points); on idle cores 782 steps, 4.7% -> 27.3%
    # (+22.7), sampled training success 3.7% -> 22.7%. From a later warm start (400 steps, 25.8%)
    # 6 minutes gave only +3.1. From the base `skillswarm bootstrap` built with 2 threads (350
    # steps, 16.4% greedy but 2.9% sampled) 10 minutes lost 12.5 points: sampled success never
    # rose. Where the warm start leaves the model matters more than any setting tried here.
    # With rollouts reusing each conversation's KV cache (734-930 steps in 10 minutes), from that
    # bootstrap base: temperature 1.0 gave -15.6 and +11.7 points in two runs, 0.7 gave +12.5,
    # 0.5 gave -6.2; sampled training success rose in each (to 10-24%) while greedy moved either
    # way, so this recipe keeps 1.0 until a setting is shown to be reliably better. From an
    # 800-step base weighted to search (math 3.1% greedy, 1.6% sampled): 981 steps, -2.3
    # points; sampled training success stayed at 1-6%, too rare a success for groups of 4 to
    # learn from. From the default base with the current tokenizer (36.7% greedy, 20.3% sampled):
    # AdamW 2e-4, 586 steps, +5.5 points greedy, 34.4% sampled, training success 0.10 -> 0.38;
    # SGD 0.01, 560 steps, 36.7% -> 48.4% (+11.7), sampled 20.3% -> 45.3%, training success
    # 0.18 -> 0.46 and still rising; SGD 0.014, 648 steps, -3.1 (training success 0.18 -> 0.33).
    # SGD 0.01 at temperature 0.7: 795 steps, 36.7% -> 66.4% greedy (+29.7 points), sampled at
    # 0.7 25.8% -> 64.8%, training success 0.27 -> 0.60 (795 steps in the 10 minutes against 560
    # at 1.0); a second run of it (held-out sample of eval seed 1) collapsed at step 440, training
    # success 0.56 -> 0.00 within 20 steps and never back: 37.5% -> 0.0%. SGD 0.007 at 0.7, this
    # recipe, on that held-out sample: 963 steps, 37.5% -> 67.2% (+29.7), sampled 32.0% ->
    # 63.3%, training success 0.28 -> 0.61 without a collapse (one run).
    "math": RLConfig(
        tasks_per_step=8,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=0.007,
        temperature=0.7,
        max_staleness=1,
        loss=_OUTCOME_ONLY,
    ),
    # From a warm start at 43.8% greedy (200 steps): 10 minutes, 68 steps of 8 tasks x 8 samples,
    # 43.8% -> 53.1% (+9.4 points), sampled training success 31% -> 46%. From the 350-step
    # bootstrap base (73.4%): 138 steps, +0.8 points, sampled 54% -> 63%. Groups of 8 give the
    # all-or-nothing function families a success to learn from more often than groups of 4
    # (8 x 4 from 33.6%: +3.1 with turn rewards, -1.6 without, in 6 minutes). From an 800-step
    # base weighted to search (11.7% greedy, 3.1% sampled): 208 steps, -7.8 points, sampled
    # training success 2% -> 6%. From the 1,200-step default base (7.0%, 0% sampled): 172 steps,
    # -3.1 points, sampled held-out 0% -> 3.9%. From the default base with the current tokenizer
    # (3.9%): 100 steps, +4.7 points, sampled held-out 0% -> 6.2%; with SGD 0.01, 90 steps, -1.6
    # (sampled training success stayed at 0-0.3%: nothing to learn from). From a 1,200-step base
    # weighted math 1.9, code 1.0, search 12 (18.0% greedy, 11.7% sampled): 144 steps, +1.6
    # points, sampled held-out unchanged, training success 0.11 -> 0.21. From the default base
    # with SGD 0.01 at temperature 0.7 (what made math learn): 102 steps, +0.0 points greedy,
    # sampled held-out 0% -> 3.1%, training success 0.02 -> 0.11 and rising (load average 3.5-10
    # from the sandbox's subprocesses).
    "code": RLConfig(
        tasks_per_step=8,
        samples_per_task=8,
        learning_rate=2e-4,
        temperature=1.0,
        max_staleness=1,
        loss=_OUTCOME_ONLY,
    ),
    # SGD at 0.01 and temperature 0.7, from the current tokenizer's default-weights warm start at
    # step 1,000 (before its learning-rate decay; 35.9% greedy): 143 steps, 35.9% -> 45.3%
    # (+9.4 points), sampled at 0.7 15.6% -> 22.7%. The same at temperature 1.0: 124 steps, +3.9
    # (sampled training success about 9%, against 22-25% at 0.7). With 4 tasks a step instead of
    # 8: 264 steps, +4.7 (sampled 18.0% -> 25.8%). Everything below used AdamW.
    # Before one-hop questions were in the mix, up to 1,000 warm-start steps
    # left the base unable to copy the name in the question into its first search (0-3%), so
    # groups all scored 0 but for the per-search turn credit, which this recipe keeps. When
    # training and held-out questions shared one world, the base reached 41.4% greedy after 800
    # steps and 73.4% after 1,430, partly by recalling that world's facts, and RL for 10 minutes
    # lowered both (-9.4 and -3.9 points; at temperature 0.7 and lr 1e-4, +1.6). With training
    # questions on other worlds (so only copying carries over): from the 1,200-step default base
    # (35.9%), 272 steps, -12.5 points; with adam_eps 1e-5, 239 steps, -17.2; without turn credit,
    # 290 steps, -14.1. From an 800-step base at 14.1%, 288 steps, -5.5, and with
    # negative_advantage_weight 0, 282 steps, -4.7.
    # Sampled training success over 10-step windows follows the seeded task sequence (the same
    # ups and downs in every run), so held-out success is the measure. Groups of 4 rather than 8,
    # for more steps in the time.
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
