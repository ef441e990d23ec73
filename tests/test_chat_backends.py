"""Chat backends against the real thing: a tiny Qwen2 built from config, served by the
OpenAI-compatible app under a real uvicorn on 127.0.0.1, and stand-in servers that misbehave."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from skillswarm.agent.chat_backends import (
    ChatBackend,
    ChatBackendConfig,
    ChatBackendConfigError,
    ChatBackendHTTPError,
    ChatBackendResponseError,
    ChatBackendUnavailableError,
    ContextLengthExceededError,
    LocalModelChatBackend,
    OpenAIChatBackend,
    chat_backend_from_config,
)
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.openai_server import create_app, running_server

MODEL_NAME = "tiny-chat"
API_KEY = "test-secret-key"
MAX_TOKENS_LIMIT = 64

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "and now?"},
    ],
]


@pytest.fixture(scope="module")
def local_backend() -> LocalModelChatBackend:
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    model = build_tiny_model(tokenizer, seed=3).eval()
    return LocalModelChatBackend(model, tokenizer)


@pytest.fixture(scope="module")
def server_url(local_backend: LocalModelChatBackend) -> Iterator[str]:
    app = create_app(local_backend, MODEL_NAME, api_key=API_KEY, max_tokens_limit=MAX_TOKENS_LIMIT)
    with running_server(app) as url:
        yield url


@pytest.fixture()
def remote_backend(server_url: str) -> Iterator[OpenAIChatBackend]:
    with OpenAIChatBackend(server_url, MODEL_NAME, api_key=API_KEY, max_retries=0) as backend:
        yield backend


def post_json(url: str, body: object, *, token: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=30)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"


# -- the real model through the real server ------------------------------------------------------


def test_both_backends_satisfy_the_protocol(
    local_backend: LocalModelChatBackend, remote_backend: OpenAIChatBackend
) -> None:
    assert isinstance(local_backend, ChatBackend)
    assert isinstance(remote_backend, ChatBackend)


def test_remote_greedy_reply_equals_local_reply(
    local_backend: LocalModelChatBackend, remote_backend: OpenAIChatBackend
) -> None:
    local_replies = [local_backend.complete(m, max_tokens=24) for m in CONVERSATIONS]
    remote_replies = [remote_backend.complete(m, max_tokens=24) for m in CONVERSATIONS]
    assert remote_replies == local_replies
    assert any(local_replies), "the tiny model should say something for at least one prompt"
    assert all("<|im_end|>" not in reply and "<|im_start|>" not in reply for reply in local_replies)


def test_local_backend_serialises_concurrent_callers(
    local_backend: LocalModelChatBackend,
) -> None:
    expected = local_backend.complete(CONVERSATIONS[0], max_tokens=16)
    replies: list[str] = []
    workers = [
        threading.Thread(
            target=lambda: replies.append(local_backend.complete(CONVERSATIONS[0], max_tokens=16))
        )
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert replies == [expected] * 4


def test_sampling_follows_the_torch_seed(local_backend: LocalModelChatBackend) -> None:
    torch.manual_seed(7)
    first = local_backend.complete(CONVERSATIONS[1], max_tokens=12, temperature=1.0)
    torch.manual_seed(7)
    second = local_backend.complete(CONVERSATIONS[1], max_tokens=12, temperature=1.0)
    assert first == second


def test_models_endpoint_lists_the_served_model(server_url: str) -> None:
    response = httpx.get(f"{server_url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    assert [card["id"] for card in response.json()["data"]] == [MODEL_NAME]


def test_response_has_the_openai_shape_and_usage(
    server_url: str, local_backend: LocalModelChatBackend
) -> None:
    response = post_json(
        server_url,
        {"model": MODEL_NAME, "messages": CONVERSATIONS[0], "max_tokens": 20, "temperature": 0},
    )
    assert response.status_code == 200
    body = response.json()
    expected = local_backend.complete_with_usage(CONVERSATIONS[0], max_tokens=20)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": expected.text},
            "finish_reason": expected.finish_reason,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": expected.prompt_tokens,
        "completion_tokens": expected.completion_tokens,
        "total_tokens": expected.prompt_tokens + expected.completion_tokens,
    }


def test_max_tokens_bounds_the_reply(server_url: str) -> None:
    response = post_json(
        server_url,
        {"model": MODEL_NAME, "messages": CONVERSATIONS[2], "max_tokens": 3, "temperature": 0},
    )
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert 1 <= usage["completion_tokens"] <= 3

    too_many = post_json(
        server_url,
        {"model": MODEL_NAME, "messages": CONVERSATIONS[0], "max_tokens": MAX_TOKENS_LIMIT + 1},
    )
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"


def test_stop_sequence_cuts_the_reply(
    server_url: str, local_backend: LocalModelChatBackend
) -> None:
    full = next(
        reply
        for reply in (local_backend.complete(m, max_tokens=24) for m in CONVERSATIONS)
        if len(reply) >= 4
    )
    stop = full[len(full) // 2]
    conversation = next(
        m for m in CONVERSATIONS if local_backend.complete(m, max_tokens=24) == full
    )
    response = post_json(
        server_url,
        {
            "model": MODEL_NAME,
            "messages": conversation,
            "max_tokens": 24,
            "temperature": 0,
            "stop": [stop],
        },
    )
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


def test_requests_without_the_token_get_401(server_url: str) -> None:
    body = {"model": MODEL_NAME, "messages": CONVERSATIONS[0], "max_tokens": 2}
    for token in (None, "wrong-key"):
        response = post_json(server_url, body, token=token)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server_url}/models").status_code == 401
    with OpenAIChatBackend(server_url, MODEL_NAME, max_retries=0) as keyless:
        with pytest.raises(ChatBackendHTTPError, match="API key") as raised:
            keyless.complete(CONVERSATIONS[0], max_tokens=2)
    assert raised.value.status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL_NAME}, 400, "messages"),
        ({"model": MODEL_NAME, "messages": []}, 400, "messages"),
        ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"model": MODEL_NAME, "messages": [{"role": "user"}]}, 400, None),
        ({"model": MODEL_NAME, "messages": CONVERSATIONS[0], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "messages": CONVERSATIONS[0], "temperature": 5}, 400, None),
        ({"model": MODEL_NAME, "messages": CONVERSATIONS[0], "stream": True}, 400, "stream"),
        ({"model": MODEL_NAME, "messages": CONVERSATIONS[0], "n": 2}, 400, "n"),
        ({"model": "other-model", "messages": CONVERSATIONS[0]}, 404, "model"),
        ([1, 2, 3], 400, None),
    ],
)
def test_bad_requests_get_openai_style_errors(
    server_url: str, body: object, status: int, param: str | None
) -> None:
    response = post_json(server_url, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_malformed_json_and_oversized_bodies_are_refused(server_url: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    malformed = httpx.post(f"{server_url}/chat/completions", content=b"{not json", headers=headers)
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "invalid_json"

    huge = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 2_000_000}]}
    oversized = httpx.post(
        f"{server_url}/chat/completions", content=json.dumps(huge).encode(), headers=headers
    )
    assert oversized.status_code == 413
    assert oversized.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(40):
            yield b" " * 50_000

    unsized = httpx.post(f"{server_url}/chat/completions", content=chunks(), headers=headers)
    assert unsized.status_code == 413


def test_prompt_longer_than_the_context_is_refused(
    local_backend: LocalModelChatBackend,
) -> None:
    short_context = LocalModelChatBackend(
        local_backend.model, local_backend.tokenizer, max_context_tokens=16
    )
    long_messages = [{"role": "user", "content": "a fairly long question " * 4}]
    with pytest.raises(ContextLengthExceededError, match="context window is 16"):
        short_context.complete(long_messages)
    app = create_app(short_context, MODEL_NAME)
    with running_server(app) as url:
        response = post_json(url, {"model": MODEL_NAME, "messages": long_messages}, token=None)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


# -- the OpenAI client against servers that fail ---------------------------------------------------


def failing_app(attempts: list[int]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def broken() -> Response:
        attempts.append(1)
        return PlainTextResponse("upstream exploded", status_code=500)

    @app.post("/bad-json/v1/chat/completions")
    async def bad_json() -> Response:
        return PlainTextResponse("<html>not an API</html>", status_code=200)

    @app.post("/no-choices/v1/chat/completions")
    async def no_choices() -> dict[str, object]:
        return {"choices": []}

    @app.post("/huge/v1/chat/completions")
    async def huge() -> Response:
        return PlainTextResponse("x" * 50_000, status_code=200)

    @app.post("/slow/v1/chat/completions")
    async def slow() -> dict[str, object]:
        await asyncio.sleep(1.5)
        return {"choices": [{"message": {"content": "late"}}]}

    return app


def test_openai_backend_retries_then_raises_on_500() -> None:
    attempts: list[int] = []
    with running_server(failing_app(attempts)) as url:
        backend = OpenAIChatBackend(url, MODEL_NAME, max_retries=1, retry_backoff_s=0.01)
        with pytest.raises(ChatBackendHTTPError, match="HTTP 500") as raised:
            backend.complete(CONVERSATIONS[0])
        assert raised.value.status_code == 500
        assert "upstream exploded" in str(raised.value)
        assert len(attempts) == 2


def test_openai_backend_raises_on_malformed_and_oversized_answers() -> None:
    with running_server(failing_app([])) as url:
        root = url.removesuffix("/v1")
        with pytest.raises(ChatBackendResponseError, match="invalid JSON"):
            OpenAIChatBackend(f"{root}/bad-json/v1", MODEL_NAME).complete(CONVERSATIONS[0])
        with pytest.raises(ChatBackendResponseError, match="choices"):
            OpenAIChatBackend(f"{root}/no-choices/v1", MODEL_NAME).complete(CONVERSATIONS[0])
        bounded = OpenAIChatBackend(f"{root}/huge/v1", MODEL_NAME, max_response_bytes=10_000)
        with pytest.raises(ChatBackendResponseError, match="exceeds 10000 bytes"):
            bounded.complete(CONVERSATIONS[0])
        impatient = OpenAIChatBackend(f"{root}/slow/v1", MODEL_NAME, timeout_s=0.3, max_retries=0)
        with pytest.raises(ChatBackendUnavailableError, match="within 0.3 s"):
            impatient.complete(CONVERSATIONS[0])


def test_openai_backend_raises_on_a_closed_port() -> None:
    backend = OpenAIChatBackend(closed_port_url(), MODEL_NAME, max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(ChatBackendUnavailableError, match="check the server is running"):
        backend.complete(CONVERSATIONS[0])


# -- configuration --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model_folder(
    tmp_path_factory: pytest.TempPathFactory, local_backend: LocalModelChatBackend
) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny"
    local_backend.model.save_pretrained(folder)
    local_backend.tokenizer.save_pretrained(folder)
    return folder


def test_local_backend_from_config_loads_a_saved_folder(
    saved_model_folder: Path, local_backend: LocalModelChatBackend
) -> None:
    folder = saved_model_folder
    loaded = chat_backend_from_config({"kind": "local", "model_path": str(folder)})
    assert isinstance(loaded, LocalModelChatBackend)
    for messages in CONVERSATIONS:
        assert loaded.complete(messages, max_tokens=16) == local_backend.complete(
            messages, max_tokens=16
        )


def test_openai_backend_from_config_reads_the_key_from_the_environment(
    server_url: str, local_backend: LocalModelChatBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ChatBackendConfig(
        kind="openai", base_url=server_url, model=MODEL_NAME, api_key_env="JUDGE_API_KEY"
    )
    assert API_KEY not in config.model_dump_json()
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    with pytest.raises(ChatBackendConfigError, match="JUDGE_API_KEY"):
        chat_backend_from_config(config)
    monkeypatch.setenv("JUDGE_API_KEY", API_KEY)
    backend = chat_backend_from_config(config.model_dump())
    assert isinstance(backend, OpenAIChatBackend)
    assert API_KEY not in repr(backend)
    assert backend.complete(CONVERSATIONS[1], max_tokens=10) == local_backend.complete(
        CONVERSATIONS[1], max_tokens=10
    )


@pytest.mark.parametrize(
    "config",
    [
        {"kind": "local"},
        {"kind": "openai", "base_url": "http://127.0.0.1:1/v1"},
        {"kind": "local", "model_path": "x", "base_url": "http://127.0.0.1:1/v1"},
        {"kind": "openai", "base_url": "http://h/v1", "model": "m", "api_key": "inline-secret"},
        {"kind": "remote", "base_url": "http://h/v1", "model": "m"},
    ],
)
def test_invalid_configs_are_refused(config: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        chat_backend_from_config(config)


def test_serve_runs_a_model_folder_as_an_endpoint(
    saved_model_folder: Path, local_backend: LocalModelChatBackend, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    script = (
        "import sys, torch; torch.set_num_threads(1); "
        "from skillswarm.agent.openai_server import serve; "
        "serve(sys.argv[1], port=int(sys.argv[2]), api_key='serve-key')"
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", script, str(saved_model_folder), str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                models = httpx.get(f"{url}/models", headers={"Authorization": "Bearer serve-key"})
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "serve did not start listening"
                time.sleep(0.2)
        assert [card["id"] for card in models.json()["data"]] == ["tiny"]
        with OpenAIChatBackend(url, "tiny", api_key="serve-key") as backend:
            assert backend.complete(CONVERSATIONS[0], max_tokens=12) == local_backend.complete(
                CONVERSATIONS[0], max_tokens=12
            )
    finally:
        process.terminate()
        process.wait(timeout=30)
