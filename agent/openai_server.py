"""A minimal OpenAI-compatible chat server around any ChatBackend, so a local Hugging Face model
(the tiny default or a real one) can serve as the sub-agent or judge endpoint of other nodes:
`GET /v1/models` and `POST /v1/chat/completions`, optional bearer token, bounded requests.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from skillswarm.agent.chat_backends import (
    ChatBackend,
    ChatCompletion,
    ChatMessage,
    ChatPromptError,
    ContextLengthExceededError,
    LocalModelChatBackend,
    UsageReportingChatBackend,
)
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
DEFAULT_MAX_TOKENS_LIMIT = 1024
DEFAULT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 4
SERVER_START_TIMEOUT_S = 10.0

ErrorType = Literal["invalid_request_error", "authentication_error", "server_error"]


def openai_error_body(
    message: str, error_type: ErrorType, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An error body in the OpenAI shape: `{"error": {message, type, param, code}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class OpenAIRequestError(Exception):
    """Raised inside the app to answer with an OpenAI-style error and an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: ErrorType = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = openai_error_body(message, error_type, code=code, param=param)


# -- request and response models ---------------------------------------------------------------


class TextContentPart(BaseModel):
    """One part of a multi-part message content; only text is served."""

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """A request message. Extra fields (tool_calls, name, tool_call_id) pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessageIn:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_chat_message(self) -> ChatMessage:
        """The plain dict a ChatBackend takes, with multi-part content joined into one string."""
        message: ChatMessage = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        else:
            message["content"] = self.content or ""
        return message


class ChatCompletionRequest(BaseModel):
    """The served subset of OpenAI's chat completion request; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, description="only 1 is served")
    stream: bool = Field(default=False, description="only false is served")

    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        sequences = [self.stop] if isinstance(self.stop, str) else self.stop
        return [sequence for sequence in sequences if sequence]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "skillswarm"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- the request gate: bearer token, then a bounded body ---------------------------------------


class RequestGateMiddleware:
    """Refuses requests without the bearer token (401) and bodies over `max_request_bytes`
    (413) before any route sees them; accepted bodies are buffered (bounded) and replayed."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected_authorization is not None and not hmac.compare_digest(
            headers.get(b"authorization", b""), self.expected_authorization
        ):
            await self._refuse(
                scope,
                receive,
                send,
                401,
                openai_error_body(
                    "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    code="invalid_api_key",
                ),
                {"WWW-Authenticate": "Bearer"},
            )
            return
        declared = headers.get(b"content-length")
        if declared is not None and (
            not declared.isdigit() or int(declared) > self.max_request_bytes
        ):
            await self._refuse_too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        received = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_request_bytes:
                await self._refuse_too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay_body, send)

    async def _refuse_too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = openai_error_body(
            f"request body exceeds {self.max_request_bytes} bytes; shorten the conversation",
            "invalid_request_error",
            code="request_too_large",
        )
        await self._refuse(scope, receive, send, 413, body, {})

    @staticmethod
    async def _refuse(
        scope: Scope,
        receive: Receive,
        send: Send,
        status_code: int,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        await JSONResponse(body, status_code=status_code, headers=headers)(scope, receive, send)


# -- the app ------------------------------------------------------------------------------------


def _validation_error_response(error: RequestValidationError) -> JSONResponse:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        body = openai_error_body(
            "the request body is not valid JSON", "invalid_request_error", code="invalid_json"
        )
        return JSONResponse(body, status_code=400)
    first = problems[0] if problems else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    summary = "; ".join(
        f"{'.'.join(str(p) for p in problem.get('loc', ()) if p != 'body') or 'body'}: "
        f"{problem.get('msg', 'invalid')}"
        for problem in problems[:5]
    )
    body = openai_error_body(
        f"invalid request: {summary}", "invalid_request_error", code="invalid_value", param=param
    )
    return JSONResponse(body, status_code=400)


def _cut_at_stop_sequences(text: str, stop_sequences: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop sequence, and whether one was found."""
    cut_at = min(
        (index for index in (text.find(s) for s in stop_sequences) if index >= 0), default=-1
    )
    return (text[:cut_at], True) if cut_at >= 0 else (text, False)


def create_app(
    backend: ChatBackend,
    model_name: str,
    *,
    api_key: str | None = None,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    default_max_tokens: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """An OpenAI-compatible app serving `backend` under the name `model_name`.

    Requests asking for more than `max_tokens_limit` tokens are refused (400); bodies over
    `max_request_bytes` get 413; with `api_key` set, requests without the bearer token get 401.
    A request without max_tokens gets `default_max_tokens` (256, or the limit if lower).
    Generation runs in a worker thread, never on the event loop.
    """
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be at least 1, got {max_tokens_limit}")
    if default_max_tokens is None:
        default_max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if not 1 <= default_max_tokens <= max_tokens_limit:
        raise ValueError(
            f"default_max_tokens ({default_max_tokens}) must be in 1..max_tokens_limit "
            f"({max_tokens_limit})"
        )
    created = int(time.time())
    app = FastAPI(title=f"OpenAI-compatible chat: {model_name}")
    app.add_middleware(RequestGateMiddleware, api_key=api_key, max_request_bytes=max_request_bytes)

    @app.exception_handler(OpenAIRequestError)
    async def _openai_error(request: Request, error: OpenAIRequestError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        server_side = error.status_code >= 500
        error_type: ErrorType = "server_error" if server_side else "invalid_request_error"
        body = openai_error_body(str(error.detail), error_type, code=str(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created)])

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(request: ChatCompletionRequest) -> ChatCompletionResponse:
        if request.model != model_name:
            raise OpenAIRequestError(
                404,
                f"model {request.model!r} is not served here; this server serves {model_name!r}",
                code="model_not_found",
                param="model",
            )
        if request.stream:
            raise OpenAIRequestError(
                400, "streaming is not supported; send stream: false", param="stream"
            )
        if request.n != 1:
            raise OpenAIRequestError(400, "only n = 1 is supported", param="n")
        max_tokens = request.max_completion_tokens or request.max_tokens or default_max_tokens
        if max_tokens > max_tokens_limit:
            raise OpenAIRequestError(
                400,
                f"max_tokens {max_tokens} exceeds this server's limit of {max_tokens_limit}",
                code="invalid_value",
                param="max_tokens",
            )
        stop_sequences = request.stop_sequences()
        if len(stop_sequences) > MAX_STOP_SEQUENCES:
            raise OpenAIRequestError(
                400, f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop"
            )
        messages = [message.as_chat_message() for message in request.messages]
        completion = await run_in_threadpool(
            _generate, backend, messages, max_tokens, request.temperature
        )
        text, stopped_early = _cut_at_stop_sequences(completion.text, stop_sequences)
        usage = None
        if completion.prompt_tokens >= 0:
            usage = Usage(
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                total_tokens=completion.prompt_tokens + completion.completion_tokens,
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model_name,
            choices=[
                Choice(
                    index=0,
                    message=ResponseMessage(content=text),
                    finish_reason="stop" if stopped_early else completion.finish_reason,
                )
            ],
            usage=usage,
        )

    return app


def _generate(
    backend: ChatBackend, messages: list[ChatMessage], max_tokens: int, temperature: float
) -> ChatCompletion:
    """Run the backend (in a worker thread); usage is -1 when the backend does not report it."""
    try:
        if isinstance(backend, UsageReportingChatBackend):
            return backend.complete_with_usage(
                messages, max_tokens=max_tokens, temperature=temperature
            )
        text = backend.complete(messages, max_tokens=max_tokens, temperature=temperature)
    except ContextLengthExceededError as error:
        raise OpenAIRequestError(
            400, str(error), code="context_length_exceeded", param="messages"
        ) from error
    except ChatPromptError as error:
        raise OpenAIRequestError(400, str(error), param="messages") from error
    except Exception as error:
        logger.exception("chat backend failed")
        raise OpenAIRequestError(
            500,
            f"the model failed to generate a reply ({type(error).__name__}); see the server log",
            error_type="server_error",
        ) from error
    return ChatCompletion(text=text, finish_reason="stop", prompt_tokens=-1, completion_tokens=-1)


# -- running it ---------------------------------------------------------------------------------


@contextmanager
def running_server(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` with uvicorn in a background thread for the duration of the block; yields the
    API base URL (`http://host:port/v1`). Port 0 picks a free port. Shuts down on exit."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    bound_port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="openai-server", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {host}:{bound_port}")
            time.sleep(0.01)
        yield f"http://{host}:{bound_port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_TIMEOUT_S)
        listener.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8001,
    api_key: str | None = None,
    *,
    model_name: str | None = None,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
) -> None:
    """Load the Hugging Face folder at `model_path` and serve it until interrupted. The model's
    name on the API defaults to the folder's name."""
    backend = LocalModelChatBackend.from_path(model_path)
    name = model_name or Path(model_path).resolve().name
    if api_key is None and not _is_loopback(host):
        logger.warning(
            "serving %s on %s without an API key: anyone who can reach it may use it", name, host
        )
    app = create_app(backend, name, api_key=api_key, max_tokens_limit=max_tokens_limit)
    logger.info("serving model %r at http://%s:%d/v1", name, host, port)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
