"""The judge rubric: verdict parsing, and judging end to end through the OpenAI-compatible server
under a real uvicorn on 127.0.0.1, with the tiny model and with backends giving a fixed reply."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from skillswarm.agent.chat_backends import ChatMessage, LocalModelChatBackend, OpenAIChatBackend
from skillswarm.agent.envs.base import Task
from skillswarm.agent.judge import JudgeRubric, JudgeStats, as_reward, parse_verdict
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.openai_server import create_app, running_server

CRITERIA = ["The answer names the capital city correctly.", "The answer is one short sentence."]
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
REFERENCE = "Paris"


class RecordingBackend:
    """Wraps a backend and keeps every conversation it was asked to answer."""

    def __init__(self, inner: LocalModelChatBackend | None = None, reply: str = "") -> None:
        self.inner = inner
        self.reply = reply
        self.received: list[list[ChatMessage]] = []
        self._lock = threading.Lock()

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        with self._lock:
            self.received.append(messages)
        if self.inner is None:
            return self.reply
        return self.inner.complete(messages, max_tokens=max_tokens, temperature=temperature)


def fixed_reply_backend(reply: str) -> RecordingBackend:
    """A judge model stand-in that always answers `reply` (served through the real server)."""
    return RecordingBackend(reply=reply)


@pytest.fixture(scope="module")
def tiny_local_backend() -> LocalModelChatBackend:
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    return LocalModelChatBackend(build_tiny_model(tokenizer, seed=1).eval(), tokenizer)


@pytest.fixture(scope="module")
def tiny_judge_server(
    tiny_local_backend: LocalModelChatBackend,
) -> Iterator[tuple[str, RecordingBackend]]:
    recording = RecordingBackend(tiny_local_backend)
    with running_server(create_app(recording, "tiny-judge")) as url:
        yield url, recording


# -- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is right.\nSCORE: 7/10", 0.7),
        ("Score: 7", 0.7),
        ("Overall I give it 7 out of 10.", 0.7),
        ("**Score:** 8/10", 0.8),
        ("Final score = 7.5 out of 10", 0.75),
        ("score: 4/5", 0.8),
        ("SCORE: 10/10", 1.0),
        ("SCORE: 0/10", 0.0),
        ("SCORE: 3/10\nOn reflection the reference agrees.\nSCORE: 9/10", 0.9),
        ("SCORE: 7/10\nScore breakdown: two criteria met", 0.7),
        ("It mixes 3/4 cup of flour. 6/10", 0.6),
        ("Score: 6. The candidate also wrote 9 out of 10 somewhere.", 0.6),
    ],
)
def test_parse_verdict_reads_common_forms(text: str, expected: float) -> None:
    assert parse_verdict(text, 10) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no verdict here",
        "SCORE: 11/10",
        "SCORE: -1/10",
        "Score: 12",
        "It mixes 3/4 cup of flour.",
        "SCORE: n/10",
        "SCORE: 3/0",
    ],
)
def test_parse_verdict_rejects_missing_or_out_of_range_scores(text: str) -> None:
    assert parse_verdict(text, 10) is None


def test_parse_verdict_uses_the_scale_for_bare_numbers() -> None:
    assert parse_verdict("SCORE: 3", scale=5) == pytest.approx(0.6)
    assert parse_verdict("3 out of 5", scale=5) == pytest.approx(0.6)
    assert parse_verdict("3 out of 5", scale=10) is None
    with pytest.raises(ValueError):
        parse_verdict("SCORE: 1/1", scale=0)


# -- judging through the real server --------------------------------------------------------------


def test_judge_with_the_tiny_model_end_to_end(
    tiny_judge_server: tuple[str, RecordingBackend],
) -> None:
    url, recording = tiny_judge_server
    rubric = JudgeRubric(OpenAIChatBackend(url, "tiny-judge"), CRITERIA, max_tokens=24)
    verdict = rubric.judge(QUESTION, ANSWER, reference=REFERENCE)

    prompt = "\n".join(message["content"] for message in recording.received[-1])
    for text in (*CRITERIA, QUESTION, ANSWER, REFERENCE, "SCORE: n/10"):
        assert text in prompt
    expected = parse_verdict(verdict.raw, 10)
    assert verdict.parsed == (expected is not None)
    assert verdict.score == (expected if expected is not None else 0.0)
    assert 0.0 <= verdict.score <= 1.0
    assert rubric.stats.judged == 1
    assert rubric.stats.parsed + rubric.stats.unparsed == 1


def test_fixed_verdict_is_parsed_through_the_real_stack() -> None:
    stand_in = fixed_reply_backend("The capital is named correctly and briefly.\nSCORE: 7/10")
    with running_server(create_app(stand_in, "fixed-judge", api_key="judge-key")) as url:
        backend = OpenAIChatBackend(url, "fixed-judge", api_key="judge-key")
        rubric = JudgeRubric(backend, CRITERIA)
        verdict = rubric.judge(QUESTION, ANSWER)
    assert verdict.parsed
    assert verdict.score == pytest.approx(0.7)
    assert verdict.raw.endswith("SCORE: 7/10")
    user_prompt = stand_in.received[0][-1]["content"]
    assert ANSWER in user_prompt and "<reference_answer>" not in user_prompt
    assert rubric.stats == JudgeStats(judged=1, parsed=1)


def test_unparseable_verdict_scores_zero_and_is_counted() -> None:
    stand_in = fixed_reply_backend("Looks fine to me, good job.")
    with running_server(create_app(stand_in, "vague-judge")) as url:
        rubric = JudgeRubric(OpenAIChatBackend(url, "vague-judge"), CRITERIA)
        verdicts = [rubric.judge(QUESTION, ANSWER) for _ in range(2)]
    assert all(v.score == 0.0 and not v.parsed for v in verdicts)
    assert verdicts[0].raw == "Looks fine to me, good job."
    assert "SCORE: n/10" in verdicts[0].reason
    assert rubric.stats == JudgeStats(judged=2, unparsed=2)


def test_backend_failure_scores_zero_without_raising() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = OpenAIChatBackend(f"http://127.0.0.1:{port}/v1", "gone", max_retries=0)
    rubric = JudgeRubric(unreachable, CRITERIA)
    verdict = rubric.judge(QUESTION, ANSWER)
    assert verdict.score == 0.0 and not verdict.parsed
    assert "ChatBackendUnavailableError" in verdict.reason
    assert rubric.stats == JudgeStats(judged=1, backend_errors=1)


def test_as_reward_scores_environment_tasks() -> None:
    stand_in = fixed_reply_backend("SCORE: 9/10")
    with running_server(create_app(stand_in, "reward-judge")) as url:
        rubric = JudgeRubric(OpenAIChatBackend(url, "reward-judge"), CRITERIA)
        reward = as_reward(rubric)
        task = Task(id="t1", prompt=QUESTION, answer=REFERENCE)
        assert reward(task, ANSWER) == pytest.approx(0.9)
        assert reward(task, None) == 0.0
        assert reward(task, "   ") == 0.0
    assert len(stand_in.received) == 1
    assert "<reference_answer>\nParis\n</reference_answer>" in stand_in.received[0][-1]["content"]
    assert rubric.stats == JudgeStats(judged=3, parsed=1, no_answer=2)


def test_long_answers_are_bounded_in_the_prompt() -> None:
    stand_in = fixed_reply_backend("SCORE: 1/10")
    rubric = JudgeRubric(stand_in, CRITERIA, max_field_chars=100)
    assert rubric.judge(QUESTION, "y" * 5000).score == pytest.approx(0.1)
    user_prompt = stand_in.received[0][-1]["content"]
    assert "y" * 101 not in user_prompt
    assert "4900 more characters not shown" in user_prompt


def test_rubric_refuses_empty_criteria() -> None:
    with pytest.raises(ValueError, match="criterion"):
        JudgeRubric(fixed_reply_backend(""), ["  "])
