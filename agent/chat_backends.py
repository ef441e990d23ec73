"""Chat backends: anything that turns a list of chat messages into the assistant's reply text.

Sub-agent tools (the search domain's `ask`) and the judge rubric talk to a model through this
interface, so the same code runs on the local model or on any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ChatMessage = dict[str, Any]


@runtime_checkable
class ChatBackend(Protocol):
    """A model that answers a conversation with one assistant message."""

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        """The assistant's reply to `messages` (greedy when `temperature` is 0)."""
        ...


# -- errors --------------------------------------------------------------------------------------


class ChatBackendError(RuntimeError):
    """A chat backend could not produce a reply (the message says why and what to check)."""


class ChatPromptError(ChatBackendError):
    """The messages cannot be turned into a prompt for this model (bad roles, template failure)."""


class ContextLengthExceededError(ChatPromptError):
    """The rendered prompt leaves no room for a reply within the model's context window."""


class ChatBackendUnavailableError(ChatBackendError):
    """The endpoint could not be reached or did not answer in time."""


class ChatBackendHTTPError(ChatBackendError):
    """The endpoint answered with an HTTP error status."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class ChatBackendResponseError(ChatBackendError):
    """The endpoint answered, but not with a well-formed chat completion of bounded size."""


class ChatBackendConfigError(ValueError):
    """A chat backend configuration cannot be turned into a backend."""


# -- completions with usage ----------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class ChatCompletion:
    """One reply with what an OpenAI-style response reports beside the text."""

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@runtime_checkable
class UsageReportingChatBackend(Protocol):
    """A backend that also reports token counts and why generation stopped."""

    def complete_with_usage(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> ChatCompletion:
        """The reply to `messages` with its finish reason and token counts."""
        ...


def _check_sampling_arguments(max_tokens: int, temperature: float) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


# -- a model in this process ---------------------------------------------------------------------


class LocalModelChatBackend:
    """A Hugging Face causal LM in this process: chat template in, decoded reply out.

    Temperature 0 is greedy decoding; above 0 it samples from the temperature-scaled distribution
    with no top-k/top-p truncation and no repetition penalty (the model's own generation defaults
    for those are overridden, so the reply depends only on the arguments given). One generation
    runs at a time: concurrent callers wait on a lock.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_context_tokens: int | None = None,
    ) -> None:
        model_limit = getattr(model.config, "max_position_embeddings", None)
        limit = max_context_tokens if max_context_tokens is not None else model_limit
        if limit is None:
            raise ValueError(
                "the model config has no max_position_embeddings; pass max_context_tokens"
            )
        if limit < 2:
            raise ValueError(f"max_context_tokens must be at least 2, got {limit}")
        if tokenizer.chat_template is None:
            raise ChatPromptError("the tokenizer has no chat template; cannot render messages")
        self.model = model
        self.tokenizer = tokenizer
        self.max_context_tokens = int(limit)
        self._stop_token_ids = self._collect_stop_token_ids(model, tokenizer)
        if not self._stop_token_ids:
            raise ValueError("neither the tokenizer nor the model names an end-of-turn token")
        self._pad_token_id = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else self._stop_token_ids[0]
        )
        self._lock = threading.Lock()

    @classmethod
    def from_path(
        cls, path: str | Path, *, max_context_tokens: int | None = None
    ) -> LocalModelChatBackend:
        """Load a Hugging Face model folder (raises CheckpointLoadError if it is not one)."""
        from skillswarm.agent.model import load_policy

        model, tokenizer = load_policy(Path(path))
        return cls(model, tokenizer, max_context_tokens=max_context_tokens)

    @staticmethod
    def _collect_stop_token_ids(
        model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> list[int]:
        stop_ids: list[int] = []
        configured = getattr(model.generation_config, "eos_token_id", None)
        candidates = [tokenizer.eos_token_id]
        candidates += configured if isinstance(configured, list) else [configured]
        for token_id in candidates:
            if token_id is not None and token_id not in stop_ids:
                stop_ids.append(int(token_id))
        return stop_ids

    def render_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of `messages` rendered by the chat template, ending with the reply header."""
        if not messages:
            raise ChatPromptError("no messages to answer; send at least one message")
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # jinja raises many types for malformed messages
            raise ChatPromptError(
                f"the chat template cannot render these messages ({type(error).__name__}: "
                f"{error}); check each message has a known role and string content"
            ) from error
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def complete_with_usage(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> ChatCompletion:
        """The reply to `messages`, at most `max_tokens` tokens and within the context window."""
        import torch

        _check_sampling_arguments(max_tokens, temperature)
        prompt_ids = self.render_prompt_ids(messages)
        room = self.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_ids)} tokens and the context window is "
                f"{self.max_context_tokens}; shorten the conversation"
            )
        max_new_tokens = min(max_tokens, room)
        sampling: dict[str, Any] = {"do_sample": temperature > 0.0}
        if temperature > 0.0:
            sampling.update(temperature=temperature, top_k=0, top_p=1.0)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        with self._lock, torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=self._stop_token_ids,
                pad_token_id=self._pad_token_id,
                repetition_penalty=1.0,
                **sampling,
            )
        new_ids = output[0, len(prompt_ids) :].tolist()
        stopped = bool(new_ids) and new_ids[-1] in self._stop_token_ids
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        return ChatCompletion(
            text=text,
            finish_reason="stop" if stopped else "length",
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(new_ids),
        )

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        """The assistant's reply to `messages` (greedy when `temperature` is 0)."""
        return self.complete_with_usage(
            messages, max_tokens=max_tokens, temperature=temperature
        ).text


# -- an OpenAI-compatible endpoint ---------------------------------------------------------------

DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
_RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_ERROR_EXCERPT_CHARS = 300


class OpenAIChatBackend:
    """Any OpenAI-compatible `/chat/completions` endpoint (vLLM, the node's own server, a hosted
    API). `base_url` ends in the API version, e.g. `http://127.0.0.1:8001/v1`.

    Connection failures, timeouts and 408/429/5xx answers are retried `max_retries` times with
    exponential backoff; other errors raise at once. `timeout_s` bounds each attempt as a whole.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_response_bytes = max_response_bytes
        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s))

    def __repr__(self) -> str:
        return f"OpenAIChatBackend(url={self.url!r}, model={self.model!r})"

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAIChatBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        """The assistant's reply to `messages` (greedy when `temperature` is 0)."""
        _check_sampling_arguments(max_tokens, temperature)
        payload = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        for attempt in range(self.max_retries + 1):
            is_last_attempt = attempt == self.max_retries
            try:
                status, body = self._post_once(payload)
            except ChatBackendUnavailableError as error:
                if is_last_attempt:
                    raise
                self._wait_before_retry(attempt, str(error))
                continue
            if status in _RETRYABLE_STATUSES and not is_last_attempt:
                self._wait_before_retry(attempt, f"HTTP {status}")
                continue
            break
        if status != 200:
            raise ChatBackendHTTPError(
                f"{self.url} answered HTTP {status}: {_error_excerpt(body)}{_status_hint(status)}",
                status,
            )
        return self._reply_text(body)

    def _wait_before_retry(self, attempt: int, failure: str) -> None:
        logger.warning(
            "chat request to %s failed (%s); retry %d of %d",
            self.url,
            failure,
            attempt + 1,
            self.max_retries,
        )
        time.sleep(self.retry_backoff_s * 2**attempt)

    def _post_once(self, payload: dict[str, Any]) -> tuple[int, bytes]:
        """One POST; the status and at most `max_response_bytes` of body."""
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._client.stream("POST", self.url, json=payload) as response:
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit():
                    self._check_size(int(declared))
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    self._check_size(len(body))
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("response body still arriving")
                return response.status_code, bytes(body)
        except httpx.TimeoutException as error:
            raise ChatBackendUnavailableError(
                f"no complete answer from {self.url} within {self.timeout_s:g} s ({error}); "
                "raise timeout_s or ask for fewer max_tokens"
            ) from error
        except httpx.TransportError as error:
            raise ChatBackendUnavailableError(
                f"cannot reach {self.url} ({type(error).__name__}: {error}); "
                "check the server is running and base_url is right"
            ) from error

    def _check_size(self, size: int) -> None:
        if size > self.max_response_bytes:
            raise ChatBackendResponseError(
                f"the response from {self.url} exceeds {self.max_response_bytes} bytes; "
                "ask for fewer max_tokens or raise max_response_bytes"
            )

    def _reply_text(self, body: bytes) -> str:
        try:
            document = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ChatBackendResponseError(
                f"{self.url} answered with invalid JSON ({error}): {_error_excerpt(body)}; "
                "is base_url an OpenAI-compatible API root ending in /v1?"
            ) from error
        try:
            content = document["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as error:
            raise ChatBackendResponseError(
                f"{self.url} answered without choices[0].message.content: {_error_excerpt(body)}"
            ) from error
        if content is None:
            return ""
        if not isinstance(content, str):
            raise ChatBackendResponseError(
                f"{self.url} answered with non-text content of type {type(content).__name__}"
            )
        return content


def _error_excerpt(body: bytes) -> str:
    """The endpoint's error message if it sent an OpenAI-style error, else the body's start."""
    try:
        document = json.loads(body)
        message = document["error"]["message"]
        if isinstance(message, str):
            return message[:_ERROR_EXCERPT_CHARS]
    except (ValueError, KeyError, TypeError):
        pass
    text = body[:_ERROR_EXCERPT_CHARS].decode("utf-8", errors="replace")
    return repr(text) if text else "(empty body)"


def _status_hint(status: int) -> str:
    if status in (401, 403):
        return " (check the API key: api_key_env must name a variable holding it)"
    if status == 404:
        return " (check base_url ends in /v1 and the model name is one the server serves)"
    if status == 429:
        return " (rate limited; lower the request rate or raise max_retries)"
    return ""


# -- configuration -------------------------------------------------------------------------------


class ChatBackendConfig(BaseModel):
    """Where a sub-agent or judge model lives: a local folder or an OpenAI-compatible endpoint.

    An API key is never part of the config: `api_key_env` names the environment variable to read
    it from.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "openai"]
    model_path: Path | None = Field(default=None, description="local: a Hugging Face folder")
    max_context_tokens: int | None = Field(default=None, ge=2, description="local only")
    base_url: str | None = Field(default=None, description="openai: e.g. http://host:8001/v1")
    model: str | None = Field(default=None, description="openai: the served model's name")
    api_key_env: str | None = Field(default=None, description="openai: variable with the key")
    timeout_s: float = Field(default=30.0, gt=0)
    max_retries: int = Field(default=2, ge=0)

    @model_validator(mode="after")
    def _fields_match_kind(self) -> ChatBackendConfig:
        if self.kind == "local":
            if self.model_path is None:
                raise ValueError("kind 'local' needs model_path (a Hugging Face model folder)")
            stray = [name for name in ("base_url", "model", "api_key_env") if getattr(self, name)]
            if stray:
                raise ValueError(f"kind 'local' does not use {', '.join(stray)}")
        else:
            if not self.base_url or not self.model:
                raise ValueError("kind 'openai' needs base_url (ending in /v1) and model")
            if self.model_path is not None or self.max_context_tokens is not None:
                raise ValueError("kind 'openai' does not use model_path or max_context_tokens")
        return self


def chat_backend_from_config(config: ChatBackendConfig | dict[str, Any]) -> ChatBackend:
    """Build the backend a config describes (a dict is validated as a ChatBackendConfig)."""
    if not isinstance(config, ChatBackendConfig):
        config = ChatBackendConfig.model_validate(config)
    if config.kind == "local":
        assert config.model_path is not None
        return LocalModelChatBackend.from_path(
            config.model_path, max_context_tokens=config.max_context_tokens
        )
    api_key: str | None = None
    if config.api_key_env:
        api_key = os.environ.get(config.api_key_env)
        if not api_key:
            raise ChatBackendConfigError(
                f"api_key_env names {config.api_key_env!r}, but that environment variable is "
                "unset or empty; export it or drop api_key_env"
            )
    assert config.base_url is not None and config.model is not None
    return OpenAIChatBackend(
        config.base_url,
        config.model,
        api_key=api_key,
        timeout_s=config.timeout_s,
        max_retries=config.max_retries,
    )
