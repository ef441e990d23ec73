"""Every registered domain end to end: its solver's turns played through the rollout engine (the
real parser, the real tools run concurrently, the real reward) solve held-out tasks."""

from __future__ import annotations

import pytest
from skillswarm.agent.envs import get_environment, list_environments
from skillswarm.agent.inference import SolverBackend
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.rollout import RolloutEngine, summarize_episodes
from skillswarm.agent.tools import TOOL_ERROR_PREFIX

HELDOUT_TASKS = 200


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def test_the_three_skill_domains_are_registered() -> None:
    assert {"math", "code", "search"} <= set(list_environments())


@pytest.mark.parametrize("domain", list_environments())
def test_solver_trajectories_through_the_engine_score_one_on_heldout_tasks(
    domain: str, tokenizer
) -> None:
    env = get_environment(domain)
    tasks = env.tasks("heldout", HELDOUT_TASKS, seed=7)
    assert len({task.id for task in tasks}) == HELDOUT_TASKS
    engine = RolloutEngine(SolverBackend(env, tokenizer), env, max_new_tokens=2048)
    episodes = engine.play(tasks, seed=0)
    solved = sum(episode.reward == 1.0 for episode in episodes)
    assert solved >= 0.99 * HELDOUT_TASKS, f"{domain}: {solved}/{HELDOUT_TASKS} solved"
    summary = summarize_episodes(episodes)
    tool_errors = [
        message["content"]
        for episode in episodes
        for message in episode.messages
        if message["role"] == "tool" and message["content"].startswith(TOOL_ERROR_PREFIX)
    ]
    assert summary["tool_errors_mean"] == 0.0, tool_errors[:3]
    assert summary["tool_calls_mean"] >= 1.0
    assert all(episode.finish_reason == "answer" for episode in episodes)
    assert all(episode.num_tool_timeouts == 0 for episode in episodes)
