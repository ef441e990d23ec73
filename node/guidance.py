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

import json
import logging
from collections.abc import Sequence
from typing import Any

from skillswarm.agent.envs.base import Environment, Message, Task
from skillswarm.agent.envs.code import NoReferenceSolutionError
from skillswarm.agent.envs.search import SolverFailedError, SolverUnavailableError
from skillswarm.agent.rollout import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_TOTAL_TOKENS,
    Episode,
    tokenize_demonstration,
)
from skillswarm.agent.tools import ToolCall, ToolResult
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# What `solve` raises for a task without a known solution: such groups stay unguided quietly.
NO_SOLUTION_ERRORS = (SolverUnavailableError, SolverFailedError, NoReferenceSolutionError)
_warned: set[tuple[str, str]] = set()


def _warn_once(env: Environment, error: BaseException) -> None:
    key = (type(env).__name__, type(error).__name__)
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "guidance: %s gives no usable solution (%s: %s); such groups stay unguided",
            type(env).__name__,
            type(error).__name__,
            error,
        )


def replayed_turn_rewards(env: Environment, task: Task, messages: Sequence[Message]) -> list[float]:
    """The environment's turn credit for each assistant turn of a finished conversation, as the
    rollout engine credits a sampled one: each turn's tool calls with the tool messages that
    follow it, through `turn_reward` with one fresh episode memory."""
    memory = env.new_episode_memory(task)
    rewards: list[float] = []
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        replies = []
        for later in messages[position + 1 :]:
            if later["role"] != "tool":
                break
            replies.append(later)
        results = []
        for call, reply in zip(message.get("tool_calls") or [], replies, strict=False):
            function = call.get("function", call)
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            results.append(
                ToolResult(
                    ToolCall(raw="", name=function.get("name"), arguments=arguments),
                    str(reply.get("content") or ""),
                    is_error=False,
                )
            )
        rewards.append(float(env.turn_reward(task, results, memory)) if results else 0.0)
    return rewards


def solution_episode(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]],
    task: Task,
    *,
    sample_index: int,
    temperature: float,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
) -> Episode | None:
    """The environment's solution of `task` as a scored, guided episode: every assistant turn
    loss-bearing, each turn credited as the engine credits a sampled turn. None when the task
    has no solution, when a turn is longer than `max_new_tokens` or the whole longer than
    `max_total_tokens` (a policy under those budgets could not write it), or when the solution
    does not succeed under the environment's own reward."""
    try:
        messages = env.solve(task)
        turns = [message for message in messages if message["role"] == "assistant"]
        if not turns:
            return None
        tokens = tokenize_demonstration(tokenizer, messages, list(tools))
        final_answer = env.final_answer(str(turns[-1].get("content") or ""))
        turn_rewards = replayed_turn_rewards(env, task, messages)
        reward = float(env.reward(task, final_answer))
    except NO_SOLUTION_ERRORS as error:
        logger.debug("no guidance for %s: %s", task.id, error)
        return None
    except Exception as error:  # a solver or reward of another package: never stop the run
        _warn_once(env, error)
        return None
    written = [0] * len(turns)
    for turn, loss in zip(tokens.turn_index, tokens.loss_mask, strict=True):
        if loss:
            written[turn] += 1
    if max(written) > max_new_tokens or len(tokens.token_ids) > max_total_tokens:
        return None
    episode = Episode(
        task=task,
        sample_index=sample_index,
        messages=list(messages),
        temperature=temperature,
        samples=[tokens],
        final_answer=final_answer,
        reward=reward,
        turn_rewards=turn_rewards,
        num_turns=len(turns),
        num_tool_calls=sum(len(message.get("tool_calls") or []) for message in turns),
        finish_reason="answer" if final_answer is not None else "no_tool_call",
        guided=True,
    )
    return episode if episode.success else None


def guide_unsolved_groups(
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]],
    episodes: Sequence[Episode],
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
) -> list[Episode]:
    """One solution episode for each task whose sampled episodes in `episodes` all failed (in
    task order); tasks without a usable solution are left out."""
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
            max_new_tokens=max_new_tokens,
            max_total_tokens=max_total_tokens,
        )
        if guide is not None:
            guides.append(guide)
    return guides
