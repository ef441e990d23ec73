"""The search domain's `ask` sub-agent on a real model behind a real OpenAI-compatible server: the
reader sees the whole document, the main conversation only ever sees the reader's answer."""

from __future__ import annotations

import threading

import pytest
from skillswarm.agent.chat_backends import ChatMessage, LocalModelChatBackend, OpenAIChatBackend
from skillswarm.agent.envs.search import ChatReader, SearchEnvironment
from skillswarm.agent.inference import SolverBackend
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.openai_server import create_app, running_server
from skillswarm.agent.rollout import RolloutEngine
from skillswarm.agent.tools import parse_tool_calls


class RecordingReaderModel:
    """The tiny local model as a chat backend, keeping each conversation and its reply."""

    def __init__(self, inner: LocalModelChatBackend) -> None:
        self.inner = inner
        self.calls: list[tuple[list[ChatMessage], str]] = []
        self._lock = threading.Lock()

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        reply = self.inner.complete(messages, max_tokens=max_tokens, temperature=temperature)
        with self._lock:
            self.calls.append((messages, reply))
        return reply


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def test_ask_runs_a_served_model_on_one_document_and_returns_only_its_answer(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=1, hidden=32, layers=1, heads=2, intermediate=64)
    served = RecordingReaderModel(LocalModelChatBackend(model, tokenizer))
    with running_server(create_app(served, "reader")) as base_url:
        client = OpenAIChatBackend(base_url, "reader", timeout_s=60)
        env = SearchEnvironment(reader=ChatReader(client, max_tokens=12), hops=2)
        tasks = env.tasks("heldout", 2, seed=5)
        engine = RolloutEngine(SolverBackend(env, tokenizer), env, max_new_tokens=1000)
        episodes = engine.play(tasks, seed=0)
        client.close()

    local_reader = ChatReader(LocalModelChatBackend(model, tokenizer), max_tokens=12)
    asked = 0
    for episode in episodes:
        context = tokenizer.decode(episode.token_ids)
        for position, message in enumerate(episode.messages):
            calls = parse_tool_calls(message["content"]) if message["role"] == "assistant" else []
            if not calls or calls[0].name != "ask":
                continue
            asked += 1
            arguments = calls[0].arguments or {}
            document = env.corpus.get(arguments["doc_id"])
            assert document is not None
            answer = episode.messages[position + 1]["content"]
            # What came back through the server equals the same reader run in process.
            assert answer == local_reader.answer(document, arguments["question"])
            # The reader saw the whole document; the policy's context holds only the answer.
            prompts = [messages[-1]["content"] for messages, _ in served.calls]
            assert any(document.text in prompt for prompt in prompts)
            later_sentences = document.text.split(". ")[1:]
            assert later_sentences
            for sentence in later_sentences:
                if sentence and sentence not in answer:
                    assert sentence not in context
    assert asked == 4 and len(served.calls) >= 4
