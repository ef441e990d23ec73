"""Per-task outcomes of a held-out evaluation: in task order, consistent with the summary, and
paired across evaluations of the same tasks."""

from __future__ import annotations

import json

import pytest
from skillswarm.agent.envs import get_environment
from skillswarm.agent.evaluate import EvalResult, evaluate_checkpoint
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.rollout import encode_text
from skillswarm.agent.stats import paired_difference, wilson_interval
from test_rollout import ScriptedPolicy

N_TASKS = 6
SEED = 3


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def _policy_answering(tokenizer, correct: set[int]) -> ScriptedPolicy:
    """A scripted policy that answers the held-out tasks at the indices in `correct` right and
    the others wrong, each in one turn."""
    tasks = get_environment("math").tasks("heldout", N_TASKS, seed=SEED)
    scripts = {
        task.prompt: [
            encode_text(
                tokenizer,
                f"<answer>{task.answer if i in correct else '-1'}</answer><|im_end|>",
            )
        ]
        for i, task in enumerate(tasks)
    }
    return ScriptedPolicy(tokenizer, scripts)


def test_outcomes_follow_the_tasks_and_agree_with_the_summary(tokenizer) -> None:
    policy = _policy_answering(tokenizer, {0, 2, 3})
    result = evaluate_checkpoint((policy, tokenizer), "math", N_TASKS, seed=SEED)
    tasks = get_environment("math").tasks("heldout", N_TASKS, seed=SEED)
    assert result.task_ids == tuple(task.id for task in tasks)
    assert result.successes == (1, 0, 1, 1, 0, 0)
    assert result.rewards == (1.0, 0.0, 1.0, 1.0, 0.0, 0.0)
    assert len(result.rewards) == len(result.successes) == len(result.task_ids) == result.n
    assert result.success_rate == sum(result.successes) / result.n
    assert result.mean_reward == sum(result.rewards) / result.n
    assert result.success_interval() == wilson_interval(3, N_TASKS)
    assert result.success_interval(0.8) == wilson_interval(3, N_TASKS, 0.8)


def test_the_same_checkpoint_evaluated_twice_pairs_task_by_task(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=1, hidden=32, layers=2, heads=4, intermediate=64)
    first, second = (
        evaluate_checkpoint(
            (model, tokenizer), "math", N_TASKS, seed=SEED, greedy=False, max_new_tokens=8
        )
        for _ in range(2)
    )
    assert len(set(first.task_ids)) == N_TASKS
    assert first.task_ids == second.task_ids
    assert (first.rewards, first.successes) == (second.rewards, second.successes)


def test_two_checkpoints_on_the_same_tasks_compare_pairwise(tokenizer) -> None:
    better = evaluate_checkpoint(
        (_policy_answering(tokenizer, {0, 1, 2, 3, 4}), tokenizer), "math", N_TASKS, seed=SEED
    )
    worse = evaluate_checkpoint(
        (_policy_answering(tokenizer, {0}), tokenizer), "math", N_TASKS, seed=SEED
    )
    assert better.task_ids == worse.task_ids
    difference = paired_difference(better.successes, worse.successes)
    assert difference.mean == pytest.approx(-4 / N_TASKS)
    assert difference.p_worse == pytest.approx(0.5**4)


def test_a_result_survives_its_json_round_trip(tokenizer) -> None:
    policy = _policy_answering(tokenizer, {1})
    result = evaluate_checkpoint((policy, tokenizer), "math", N_TASKS, seed=SEED)
    stored = json.loads(json.dumps(result.to_dict()))
    assert stored["successes"] == [0, 1, 0, 0, 0, 0]
    assert EvalResult(**stored) == result
    without_outcomes = {
        key: value
        for key, value in stored.items()
        if key not in ("rewards", "successes", "task_ids")
    }
    assert EvalResult(**without_outcomes).rewards == ()
