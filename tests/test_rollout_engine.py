"""The rollout engine: concurrent tool calls with timeouts, tool errors that never end a run,
truncated tool output, turn-level rewards, the reasoning-dropping context policy, policy versions,
the solver backend, and the lazily imported vLLM backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from skillswarm.agent.envs.base import Environment, Message, Split, Task, ToolFunction
from skillswarm.agent.inference import GenerationRequest, HFBackend, SolverBackend
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.rollout import (
    PROMPT_TURN,
    RolloutEngine,
    context_messages,
    encode_text,
    render_conversation,
)
from skillswarm.agent.tools import TRUNCATION_MARKER, ToolResult


class _Concurrency:
    """Counts how many tool calls run at the same moment."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


def _call(name: str, **arguments: Any) -> Message:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


class ProbeEnvironment(Environment):
    """A test environment whose tasks script their assistant turns in `metadata["turns"]`
    (a message, or raw assistant text), so episodes take known paths through the engine."""

    name = "probe"
    system_prompt = "Use the tools, then answer as <answer>TEXT</answer>."
    max_turns = 6
    tool_timeout_s = 0.5
    max_tool_output_chars = 40

    def __init__(self) -> None:
        self.concurrency = _Concurrency()
        self.release = threading.Event()

    @property
    def tools(self) -> list[ToolFunction]:
        def echo(text: str) -> str:
            """Return the text.

            Args:
                text: What to return.
            """
            return text

        def pause(seconds: float) -> str:
            """Wait, then say so.

            Args:
                seconds: How long to wait.
            """
            self.concurrency.enter()
            try:
                if seconds > 5:  # a tool that hangs until the test lets it go
                    self.release.wait(30)
                else:
                    time.sleep(seconds)
            finally:
                self.concurrency.leave()
            return f"waited {seconds:g}"

        def repeat(word: str, times: int) -> str:
            """Repeat a word.

            Args:
                word: The word.
                times: How many times.
            """
            return " ".join([word] * times)

        return [echo, pause, repeat]

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        raise AssertionError("the probe environment's tasks are built by each test")

    def reward(self, task: Task, final_answer: str | None) -> float:
        return 1.0 if final_answer == task.answer else 0.0

    def turn_reward(
        self, task: Task, results: Sequence[ToolResult], memory: dict[str, Any]
    ) -> float:
        hits = sum("hit" in result.content for result in results if not result.is_error)
        memory["hits"] = memory.get("hits", 0) + hits
        return 0.5 * hits

    def solve(self, task: Task) -> list[Message]:
        messages = self.initial_messages(task)
        for turn in task.metadata["turns"]:
            message = turn if isinstance(turn, dict) else {"role": "assistant", "content": turn}
            messages.append(message)
            if message is not task.metadata["turns"][-1]:
                messages.append({"role": "tool", "content": "(result)"})
        return messages


def _task(task_id: str, answer: str, *turns: Message | str) -> Task:
    return Task(task_id, f"Task {task_id}.", answer, {"turns": list(turns)})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def _solver_engine(env: Environment, tokenizer, **options: Any) -> RolloutEngine:
    return RolloutEngine(SolverBackend(env, tokenizer), env, max_new_tokens=400, **options)


def test_tool_calls_of_many_episodes_run_concurrently(tokenizer) -> None:
    env = ProbeEnvironment()
    tasks = [
        _task(f"t{i}", "done", _call("pause", seconds=0.2), "<answer>done</answer>")
        for i in range(8)
    ]
    episodes = _solver_engine(env, tokenizer).play(tasks, seed=0)
    assert [episode.reward for episode in episodes] == [1.0] * 8
    assert [m["content"] for m in episodes[0].messages if m["role"] == "tool"] == ["waited 0.2"]
    assert env.concurrency.peak > 1


def test_a_tool_call_past_its_timeout_becomes_an_error_and_the_episode_goes_on(tokenizer) -> None:
    env = ProbeEnvironment()
    hangs = _task("hang", "late", _call("pause", seconds=60), "<answer>late</answer>")
    quick = _task("quick", "ok", _call("echo", text="hi"), "<answer>ok</answer>")
    try:
        hung, fine = _solver_engine(env, tokenizer).play([hangs, quick], seed=0)
    finally:
        env.release.set()
    assert hung.num_tool_timeouts == 1 and hung.num_tool_errors == 1
    assert hung.messages[3]["content"] == "Error: pause timed out after 0.5 s"
    assert (hung.finish_reason, hung.reward) == ("answer", 1.0)
    assert (fine.num_tool_timeouts, fine.num_tool_errors, fine.reward) == (0, 0, 1.0)


def test_bad_calls_are_counted_errors_that_never_end_the_run(tokenizer) -> None:
    env = ProbeEnvironment()
    task = _task(
        "bad",
        "fine",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "repeat", "arguments": {"word": "a", "times": "x"}}</tool_call>',
        "<tool_call>{not json</tool_call>",
        "<answer>fine</answer>",
    )
    (episode,) = _solver_engine(env, tokenizer).play([task], seed=0)
    errors = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert errors[0].startswith("Error: unknown tool 'nope'; available tools: echo, pause, repeat")
    assert errors[1] == "Error: bad arguments for repeat: argument 'times' must be of type int"
    assert errors[2].startswith("Error: tool call is not valid JSON")
    assert (episode.num_tool_calls, episode.num_tool_errors) == (3, 3)
    assert (episode.finish_reason, episode.reward, episode.num_turns) == ("answer", 1.0, 4)


def test_long_tool_output_is_truncated_to_the_environment_budget(tokenizer) -> None:
    env = ProbeEnvironment()
    task = _task("long", "x", _call("repeat", word="abc", times=100), "<answer>x</answer>")
    (episode,) = _solver_engine(env, tokenizer).play([task], seed=0)
    result = episode.messages[3]["content"]
    assert result == ("abc " * 10)[:40] + TRUNCATION_MARKER
    assert result in tokenizer.decode(episode.token_ids)


def test_turn_rewards_are_credited_to_the_turn_that_earned_them(tokenizer) -> None:
    env = ProbeEnvironment()
    task = _task(
        "credit",
        "y",
        _call("echo", text="miss"),
        _call("echo", text="hit"),
        "<answer>y</answer>",
    )
    (episode,) = _solver_engine(env, tokenizer).play([task], seed=0)
    assert episode.turn_rewards == [0.0, 0.5, 0.0]
    assert episode.memory == {"hits": 1}


def test_dropping_reasoning_makes_each_rewritten_turn_its_own_exact_sample(tokenizer) -> None:
    env = ProbeEnvironment()
    first = _call("echo", text="one")
    first["content"] = "<think>I should echo one.</think>\n"
    second = _call("echo", text="two")
    second["content"] = "<think>Now two.</think>\n"
    task = _task("think", "two", first, second, "<think>Done.</think>\n<answer>two</answer>")

    (full,) = _solver_engine(env, tokenizer).play([task], seed=0)
    assert len(full.samples) == 1 and full.reward == 1.0

    (dropped,) = _solver_engine(env, tokenizer, context_policy="drop_reasoning").play(
        [task], seed=0
    )
    assert dropped.reward == 1.0 and len(dropped.samples) == 3
    assert dropped.messages == full.messages  # the conversation keeps its reasoning
    tools = env.tool_schemas()
    assistant_positions = [i for i, m in enumerate(full.messages) if m["role"] == "assistant"]
    for turn, (sample, position) in enumerate(
        zip(dropped.samples, assistant_positions, strict=True)
    ):
        visible = context_messages(full.messages[:position], "drop_reasoning")
        prompt = encode_text(tokenizer, render_conversation(tokenizer, visible, tools, True))
        assert sample.token_ids[: len(prompt)] == prompt
        assert sample.loss_mask[: len(prompt)] == [0] * len(prompt)
        assert set(sample.turn_index[: len(prompt)]) == {PROMPT_TURN}
        written = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert tokenizer.decode(written).startswith("<think>")
        assert set(sample.turn_index[len(prompt) :]) == {turn}
        # No earlier turn's reasoning is in this turn's context.
        assert tokenizer.decode(sample.token_ids[: len(prompt)]).count("<think>") == 0
    with pytest.raises(ValueError, match="training samples"):
        _ = dropped.token_ids


def test_sampled_tokens_carry_the_policy_version_of_the_weights_that_wrote_them(
    tokenizer,
) -> None:
    model = build_tiny_model(tokenizer, seed=3, hidden=32, layers=1, heads=2, intermediate=64)
    backend = HFBackend(model, tokenizer)
    env = ProbeEnvironment()
    task = _task("v", "z", "<answer>z</answer>")
    engine = RolloutEngine(backend, env, max_new_tokens=6)
    (before,) = engine.play([task], seed=1)
    assert {
        v for v, m in zip(before.tokens.policy_version, before.loss_mask, strict=True) if m
    } == {0}
    new_weights = [(name, p.detach() + 0.01) for name, p in model.named_parameters()]
    backend.update_weights(new_weights, version=7)
    current = dict(model.named_parameters())
    assert all(torch.equal(current[name], tensor) for name, tensor in new_weights)
    (after,) = engine.play([task], seed=1)
    sampled_versions = [
        v for v, m in zip(after.tokens.policy_version, after.loss_mask, strict=True) if m
    ]
    assert sampled_versions and set(sampled_versions) == {7}
    assert set(after.tokens.policy_version[: after.loss_mask.index(1)]) == {-1}
    with pytest.raises(ValueError, match="shape"):
        backend.update_weights([("lm_head.weight", torch.zeros(2, 2))], version=8)
    with pytest.raises(KeyError, match="no parameter"):
        backend.update_weights([("nope.weight", torch.zeros(2, 2))], version=8)


def test_solver_backend_writes_the_demonstration_turns(tokenizer) -> None:
    env = ProbeEnvironment()
    task = _task("s", "q", _call("echo", text="hi"), "<answer>q</answer>")
    backend = SolverBackend(env, tokenizer)
    (generation,) = backend.generate(
        [GenerationRequest([1, 2], 400, task=task, turn=1)], temperature=1.0, greedy=False, seed=0
    )
    assert tokenizer.decode(generation.token_ids) == "<answer>q</answer><|im_end|>"
    assert generation.stop_token == tokenizer.eos_token_id and set(generation.logprobs) == {0.0}
    with pytest.raises(ValueError, match="2 assistant turns"):
        backend.generate(
            [GenerationRequest([1], 400, task=task, turn=2)], temperature=1.0, greedy=True, seed=0
        )
    with pytest.raises(TypeError, match="no weights"):
        backend.update_weights([], version=1)


def test_engine_refuses_bad_settings(tokenizer) -> None:
    env = ProbeEnvironment()
    backend = SolverBackend(env, tokenizer)
    with pytest.raises(ValueError, match="context policy"):
        RolloutEngine(backend, env, context_policy="forget")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule"):
        RolloutEngine(backend, env, schedule="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        RolloutEngine(backend, env).play([_task("a", "b", "<answer>b</answer>")], temperature=0)


def test_vllm_backend_is_imported_lazily_and_refuses_clearly_without_vllm(tmp_path) -> None:
    import importlib.util
    import sys

    from skillswarm.agent.inference_vllm import VLLMBackend, VLLMUnavailableError

    assert "vllm" not in sys.modules or importlib.util.find_spec("vllm") is not None
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(VLLMUnavailableError, match="gpu"):
            VLLMBackend(tmp_path)


@pytest.mark.gpu
def test_vllm_backend_logprobs_match_the_trainer_and_weights_update(tmp_path, tokenizer) -> None:
    from skillswarm.agent.inference_vllm import VLLMBackend
    from skillswarm.node.train import token_logprobs

    model = build_tiny_model(tokenizer, seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = VLLMBackend(tmp_path, gpu_memory_utilization=0.2, max_model_len=512, dtype="float32")
    prompt = encode_text(tokenizer, "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    (generation,) = backend.generate(
        [GenerationRequest(prompt, 16)], temperature=0.8, greedy=False, seed=1
    )
    ids = torch.tensor([prompt + generation.token_ids])
    with torch.no_grad():
        fresh = token_logprobs(model, ids, torch.ones_like(ids), 0.8)[0, len(prompt) :]
    assert torch.allclose(fresh, torch.tensor(generation.logprobs), atol=2e-2)
    backend.update_weights([(n, p.detach() * 0) for n, p in model.named_parameters()], version=1)
    assert backend.policy_version == 1
