"""The episode loop: token records, loss masks, tool turns and behaviour logprobs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from skillswarm.agent.envs.base import Task
from skillswarm.agent.envs.math import MathEnvironment
from skillswarm.agent.evaluate import evaluate_checkpoint
from skillswarm.agent.inference import Generation, HFBackend
from skillswarm.agent.model import load_policy
from skillswarm.agent.rollout import (
    PROMPT_TURN,
    RolloutEngine,
    encode_text,
    play_episodes,
    render_conversation,
    summarize_episodes,
    tokenize_demonstration,
)
from skillswarm.node.train import token_logprobs
from transformers import GenerationConfig, Qwen2Config

TURN_START = "<|im_start|>assistant\n"


class ScriptedPolicy(torch.nn.Module):
    """A stand-in for a language model (test only): in each assistant turn it writes the next
    token of a fixed script with probability ~1, so episodes follow a known path through the real
    rollout loop. It reads its token history from the KV cache the rollout passes in."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[list[int]]]) -> None:
        super().__init__()
        self.config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=4096,
        )
        self.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.turn_start = encode_text(tokenizer, TURN_START)

    def _next_token(self, history: list[int]) -> int:
        text = self.tokenizer.decode(history)
        scripts = [turns for prompt, turns in self.scripts.items() if prompt in text]
        width = len(self.turn_start)
        starts = [i for i in range(len(history)) if history[i : i + width] == self.turn_start]
        if not scripts or not starts:  # a shared prefix run on its own: nothing to write yet
            return self.tokenizer.pad_token_id
        (script,) = scripts
        written = len(history) - (starts[-1] + width)
        turn = script[len(starts) - 1]
        return turn[written] if written < len(turn) else self.tokenizer.eos_token_id

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: Any,
        **_: Any,
    ) -> SimpleNamespace:
        as_states = input_ids.to(torch.float32)[:, None, :, None]
        history = cache.update(as_states, as_states, 0)[0][:, 0, :, 0].long()
        logits = torch.full((input_ids.shape[0], 1, self.config.vocab_size), -1e4)
        for row in range(input_ids.shape[0]):
            real = history[row][attention_mask[row].bool()].tolist()
            logits[row, 0, self._next_token(real)] = 0.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def env(math_env) -> MathEnvironment:
    return math_env


@pytest.fixture(scope="module")
def tokenizer(math_tokenizer):
    return math_tokenizer


@pytest.fixture(scope="module")
def warm_policy(tiny_base):
    """The base checkpoint after a short warm start: it writes tool calls, so episodes have
    several turns."""
    return load_policy(tiny_base)


def _encode(tokenizer, text: str) -> list[int]:
    return encode_text(tokenizer, text)


SHARE_TASK = Task(
    id="math-share-example",
    prompt="Kai has 4 shells and Eli has 41 shells. They share them equally among 9 kids. "
    "How many shells does each kid get?",
    answer="5",
    metadata={"template": "share", "steps": ["4+41", "{previous}/9"]},
)


def test_loss_mask_spans_of_a_two_tool_call_episode(tokenizer, env: MathEnvironment) -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}</tool_call>'
    turns = [
        call.replace("EXPR", "4+41") + "<|im_end|>",
        call.replace("EXPR", "45/9") + "<|im_end|>",
        "<answer>5</answer><|im_end|>",
    ]
    results = [
        "\n<|im_start|>user\n<tool_response>45</tool_response><|im_end|>\n" + TURN_START,
        "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n" + TURN_START,
    ]
    policy = ScriptedPolicy(tokenizer, {SHARE_TASK.prompt: [_encode(tokenizer, t) for t in turns]})
    (episode,) = play_episodes(policy, tokenizer, env, [SHARE_TASK], seed=0)

    prompt = _encode(
        tokenizer,
        render_conversation(tokenizer, env.initial_messages(SHARE_TASK), env.tool_schemas(), True),
    )
    segments = [
        (prompt, 0, PROMPT_TURN),
        (_encode(tokenizer, turns[0]), 1, 0),
        (_encode(tokenizer, results[0]), 0, 0),
        (_encode(tokenizer, turns[1]), 1, 1),
        (_encode(tokenizer, results[1]), 0, 1),
        (_encode(tokenizer, turns[2]), 1, 2),
    ]
    assert episode.token_ids == [t for ids, _, _ in segments for t in ids]
    assert episode.loss_mask == [mask for ids, mask, _ in segments for _ in ids]
    assert episode.turn_index == [turn for ids, _, turn in segments for _ in ids]
    assert all(
        lp == 0.0 for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if not m
    )
    assert all(lp > -1e-3 for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if m)
    assert episode.num_tool_calls == 2 and episode.num_tool_errors == 0
    assert episode.num_turns == 3
    assert episode.final_answer == "5" and episode.reward == 1.0
    assert episode.finish_reason == "answer"
    assert [m["role"] for m in episode.messages] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant",
    ]  # fmt: skip
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["45", "5"]


def test_replayed_demonstrations_equal_the_full_rendering_and_score_one(
    tokenizer, env: MathEnvironment
) -> None:
    tasks = env.tasks("heldout", 12)
    tools = env.tool_schemas()
    records = {
        task.prompt: tokenize_demonstration(tokenizer, env.solve(task), tools) for task in tasks
    }
    scripts: dict[str, list[list[int]]] = {}
    for prompt, record in records.items():
        turns: dict[int, list[int]] = {}
        for token, mask, turn in zip(
            record.token_ids, record.loss_mask, record.turn_index, strict=True
        ):
            if mask:
                turns.setdefault(turn, []).append(token)
        scripts[prompt] = [turns[i] for i in sorted(turns)]
    policy = ScriptedPolicy(tokenizer, scripts)
    episodes = play_episodes(policy, tokenizer, env, tasks, samples_per_task=2, seed=1)
    assert len(episodes) == 24
    assert all(episode.reward == 1.0 for episode in episodes)
    for episode in episodes:
        record = records[episode.task.prompt]
        full = _encode(tokenizer, render_conversation(tokenizer, episode.messages, tools, False))
        # The conversation's full rendering ends with template glue after the last end-of-turn.
        assert full[: len(episode.token_ids)] == episode.token_ids
        assert tokenizer.decode(full[len(episode.token_ids) :]) == "\n"
        assert record.token_ids[: len(episode.token_ids)] == episode.token_ids
        assert record.loss_mask[: len(episode.token_ids)] == episode.loss_mask
        assert episode.num_tool_calls == len(episode.task.metadata["steps"])
    summary = summarize_episodes(episodes)
    assert summary["success_rate"] == 1.0 and summary["tool_errors_mean"] == 0.0


def test_a_policy_that_follows_the_solver_scores_one_in_evaluation(
    tokenizer, env: MathEnvironment
) -> None:
    tasks = env.tasks("heldout", 8, seed=4)
    scripts = {}
    for task in tasks:
        record = tokenize_demonstration(tokenizer, env.solve(task), env.tool_schemas())
        turns: dict[int, list[int]] = {}
        for token, mask, turn in zip(
            record.token_ids, record.loss_mask, record.turn_index, strict=True
        ):
            if mask:
                turns.setdefault(turn, []).append(token)
        scripts[task.prompt] = [turns[i] for i in sorted(turns)]
    result = evaluate_checkpoint((ScriptedPolicy(tokenizer, scripts), tokenizer), "math", 8, seed=4)
    assert (result.n, result.success_rate, result.mean_reward) == (8, 1.0, 1.0)
    assert result.tool_errors_mean == 0.0 and result.answered_rate == 1.0


def test_bad_tool_calls_no_tool_call_and_turn_limit(tokenizer) -> None:
    env = MathEnvironment(max_turns=2)
    bad_then_answer = Task("a", "Ann has 1 pen. Question A?", "7", {"steps": ["7"]})
    no_call = Task("b", "Ben has 2 pens. Question B?", "2", {"steps": ["2"]})
    too_many = Task("c", "Cara has 3 pens. Question C?", "3", {"steps": ["3"]})
    call = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
        "<|im_end|>"
    )
    scripts = {
        bad_then_answer.prompt: [
            _encode(tokenizer, "<tool_call>{oops}</tool_call><|im_end|>"),
            _encode(tokenizer, "<answer>7</answer><|im_end|>"),
        ],
        no_call.prompt: [_encode(tokenizer, "I think it is 2.<|im_end|>")],
        too_many.prompt: [_encode(tokenizer, call)] * 3,
    }
    policy = ScriptedPolicy(tokenizer, scripts)
    bad, silent, limited = play_episodes(
        policy, tokenizer, env, [bad_then_answer, no_call, too_many]
    )
    assert (bad.finish_reason, bad.num_tool_calls, bad.num_tool_errors, bad.reward) == (
        "answer", 1, 1, 1.0,
    )  # fmt: skip
    assert bad.messages[3]["content"].startswith("Error: tool call is not valid JSON")
    assert (silent.finish_reason, silent.num_tool_calls, silent.reward) == ("no_tool_call", 0, 0.0)
    assert silent.final_answer is None
    assert (limited.finish_reason, limited.num_turns, limited.num_tool_calls) == ("max_turns", 2, 1)
    assert limited.token_ids[-1] == tokenizer.eos_token_id


def test_rollout_logprobs_match_a_fresh_forward_pass(env: MathEnvironment, warm_policy) -> None:
    warm_model, tokenizer = warm_policy
    tasks = env.tasks("heldout", 6)
    episodes = play_episodes(
        warm_model,
        tokenizer,
        env,
        tasks,
        samples_per_task=3,
        temperature=1.0,
        seed=3,
        max_new_tokens=48,
    )
    assert len({len(e.token_ids) for e in episodes}) > 1  # left padding in play
    assert any(e.num_turns >= 2 for e in episodes)  # tokens after a tool result are covered
    checked = 0
    for episode in episodes:
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            fresh = token_logprobs(warm_model, ids, torch.ones_like(ids), 1.0)[0]
        sampled = torch.tensor(episode.loss_mask, dtype=torch.bool)
        behaviour = torch.tensor(episode.logprobs)
        assert torch.allclose(fresh[sampled], behaviour[sampled], atol=1e-4)
        assert torch.all(behaviour[~sampled] == 0)
        checked += int(sampled.sum())
    assert checked > 100


class _CacheCountingBackend(HFBackend):
    """An HF backend that notes, for every generation call, which requests brought their
    conversation's cache from the previous turn (test only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.with_cache: list[list[bool]] = []

    def generate(self, requests: Any, **options: Any) -> list[Generation]:
        self.with_cache.append([request.kv is not None for request in requests])
        return super().generate(requests, **options)


def test_later_turns_continue_from_their_conversation_cache(
    env: MathEnvironment, warm_policy
) -> None:
    warm_model, tokenizer = warm_policy
    backend = _CacheCountingBackend(warm_model, tokenizer)
    engine = RolloutEngine(backend, env, max_new_tokens=48, schedule="waves")
    episodes = engine.play(env.tasks("heldout", 6), samples_per_task=2, seed=3)
    assert any(episode.num_turns >= 2 for episode in episodes)
    first, *later = backend.with_cache
    assert not any(first) and later and all(all(call) for call in later)
    for episode in episodes:
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            fresh = token_logprobs(warm_model, ids, torch.ones_like(ids), 1.0)[0]
        sampled = torch.tensor(episode.loss_mask, dtype=torch.bool)
        assert torch.allclose(fresh[sampled], torch.tensor(episode.logprobs)[sampled], atol=1e-4)


def test_tempered_sampling_logprobs_use_the_scaled_distribution(
    env: MathEnvironment, warm_policy
) -> None:
    warm_model, tokenizer = warm_policy
    episodes = play_episodes(
        warm_model,
        tokenizer,
        env,
        env.tasks("heldout", 3),
        temperature=0.7,
        seed=5,
        max_new_tokens=24,
    )
    for episode in episodes:
        assert episode.temperature == 0.7
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            fresh = token_logprobs(warm_model, ids, torch.ones_like(ids), 0.7)[0]
        sampled = torch.tensor(episode.loss_mask, dtype=torch.bool)
        assert torch.allclose(fresh[sampled], torch.tensor(episode.logprobs)[sampled], atol=1e-4)


def test_seeded_rollouts_repeat_and_limits_hold(env: MathEnvironment, warm_policy) -> None:
    warm_model, tokenizer = warm_policy
    tasks = env.tasks("train", 4)
    first = play_episodes(warm_model, tokenizer, env, tasks, samples_per_task=2, seed=11)
    again = play_episodes(warm_model, tokenizer, env, tasks, samples_per_task=2, seed=11)
    assert [e.token_ids for e in first] == [e.token_ids for e in again]
    assert [e.task.id for e in first] == [t.id for t in tasks for _ in range(2)]
    greedy = play_episodes(warm_model, tokenizer, env, tasks, greedy=True)
    assert [e.token_ids for e in greedy] == [
        e.token_ids for e in play_episodes(warm_model, tokenizer, env, tasks, greedy=True, seed=9)
    ]
    short = play_episodes(warm_model, tokenizer, env, tasks, max_new_tokens=3, seed=0)
    assert all(e.num_sampled_tokens <= 3 for e in short)
    assert all(e.finish_reason in ("length", "answer", "no_tool_call") for e in short)
    prompt_length = min(e.loss_mask.index(1) for e in first)
    capped = play_episodes(
        warm_model, tokenizer, env, tasks, seed=0, max_total_tokens=prompt_length + 30
    )
    assert all(len(e.token_ids) <= prompt_length + 30 for e in capped)
    assert all(e.done for e in capped)
    assert any(e.finish_reason in ("length", "context") for e in capped)
    with pytest.raises(ValueError, match="temperature"):
        play_episodes(warm_model, tokenizer, env, tasks, temperature=0.0)


def test_rollout_restores_training_mode(env: MathEnvironment, warm_policy) -> None:
    warm_model, tokenizer = warm_policy
    warm_model.train()
    play_episodes(warm_model, tokenizer, env, env.tasks("train", 1), max_new_tokens=2, seed=0)
    assert warm_model.training
    warm_model.eval()
    play_episodes(warm_model, tokenizer, env, env.tasks("train", 1), max_new_tokens=2, seed=0)
    assert not warm_model.training
