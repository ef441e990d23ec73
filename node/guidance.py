"""Off-policy guidance: a group of sampled episodes with no success teaches nothing (every
advantage is zero), so a task the policy never solves stays unsolved however long RL runs. With
guidance on (`RLConfig.guidance`), such a group gets one more episode: the environment's own
solution (`Environment.solve`), tokenized as if the policy had written it and scored by the same
reward. Group-relative advantages then push it up, as LUFFY (Yan et al., arXiv:2504.14945) mixes
off-policy demonstrations into groups that fail. Its tokens carry no behaviour logprobs (no
policy sampled them); the trainer takes the current policy's own, so their importance ratio is 1
and the update is the advantage-weighted log-likelihood of the demonstration.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from skillswarm.agent.envs.base import Environment
from skillswarm.agent.envs.code import NoReferenceSolutionError
from skillswarm.agent.envs.search import SolverFailedError, SolverUnavailableError
from skillswarm.agent.rollout import Episode, TemplatePrefixError, tokenize_demonstration
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# What `solve` raises for a task without a known solution: such groups stay unguided.
NO_SOLUTION_ERRORS = (SolverUnavailableError, SolverFailedError, NoReferenceSolutionError)


def solution_episode(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]],
    task: Any,
    *,
    sample_index: int,
    temperature: float,
) -> Episode | None:
    """The environment's solution of `task` as a scored, guided episode (every assistant turn
    loss-bearing, zero turn rewards); None when the task has no solution or the solution does
    not succeed under the environment's own reward."""
    try:
        messages = env.solve(task)
    except NO_SOLUTION_ERRORS as error:
        logger.debug("no guidance for %s: %s", task.id, error)
        return None
    turns = [message for message in messages if message["role"] == "assistant"]
    if not turns:
        return None
    try:
        tokens = tokenize_demonstration(tokenizer, messages, list(tools))
    except TemplatePrefixError:
        return None
    final_answer = env.final_answer(str(turns[-1].get("content") or ""))
    episode = Episode(
        task=task,
        sample_index=sample_index,
        messages=list(messages),
        temperature=temperature,
        samples=[tokens],
        final_answer=final_answer,
        turn_rewards=[0.0] * len(turns),
        num_turns=len(turns),
        num_tool_calls=sum(1 for message in turns if message.get("tool_calls")),
        finish_reason="answer" if final_answer is not None else "no_tool_call",
        guided=True,
    )
    episode.reward = float(env.reward(task, final_answer))
    return episode if episode.success else None


def guide_unsolved_groups(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]],
    episodes: Sequence[Episode],
) -> list[Episode]:
    """One solution episode for each task whose sampled episodes in `episodes` all failed (in
    task order); tasks without a solution are left out."""
    groups: dict[str, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(episode.task.id, []).append(episode)
    guides: list[Episode] = []
    for group in groups.values():
        if any(episode.success for episode in group):
            continue
        guide = solution_episode(
            env,
            tokenizer,
            tools,
            group[0].task,
            sample_index=len(group),
            temperature=group[0].temperature,
        )
        if guide is not None:
            guides.append(guide)
    return guides
