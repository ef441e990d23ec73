"""Tool-call formats: how a policy's chat template has it write tool calls, and the parser the
rollout engine reads them with. The tokenizer's own `response_template` comes first; otherwise the
chat template's text picks Hermes (the default), Qwen3-style (Hermes after reasoning) or Llama 3.1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skillswarm.agent.envs.base import strip_reasoning
from skillswarm.agent.tools import ToolCall, parse_tool_calls, tool_call_from_payload
from transformers import PreTrainedTokenizerBase

HERMES = "hermes"
QWEN3 = "qwen3"
LLAMA31 = "llama3.1"
# The tokenizer's declarative response template (transformers' `parse_response`).
RESPONSE_TEMPLATE = "response_template"

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PYTHON_TAG = "<|python_tag|>"
_JSON_CALL_START = re.compile(r'\{\s*"name"\s*:')
_JSON_DECODER = json.JSONDecoder()
MAX_ERROR_CHARS = 200


def _after_reasoning(text: str) -> str:
    """`text` without its reasoning: closed `<think>…</think>` spans, and everything up to a
    `</think>` whose `<think>` the prompt wrote (templates that open the block for the model)."""
    visible = strip_reasoning(text)
    if THINK_CLOSE in visible:
        visible = visible.rsplit(THINK_CLOSE, 1)[1]
    return visible


def parse_qwen3_tool_calls(text: str) -> list[ToolCall]:
    """Qwen3-style: Hermes `<tool_call>{json}</tool_call>` blocks after the reasoning; a call
    written inside `<think>…</think>` is thought, not called."""
    return parse_tool_calls(_after_reasoning(text))


def parse_llama31_tool_calls(text: str) -> list[ToolCall]:
    """Llama 3.1-style: JSON objects `{"name": …, "parameters": {…}}` (or `"arguments"`), after a
    `<|python_tag|>` when there is one; several calls may follow each other (separated by `;` or
    whitespace). An object without parameters is not a call; text after the tag that holds no
    JSON call is a malformed call."""
    body = _after_reasoning(text)
    tagged = PYTHON_TAG in body
    if tagged:
        body = body.split(PYTHON_TAG, 1)[1]
    calls: list[ToolCall] = []
    position = 0
    while (match := _JSON_CALL_START.search(body, position)) is not None:
        start = match.start()
        try:
            payload, end = _JSON_DECODER.raw_decode(body, start)
        except json.JSONDecodeError as error:
            message = f"tool call is not valid JSON ({error.msg})"
            calls.append(ToolCall(raw=body[start:].strip(), parse_error=message))
            break
        position = end
        keys = [key for key in ("parameters", "arguments") if key in payload]
        if keys:  # an object with a name but no arguments is data, not a call
            calls.append(tool_call_from_payload(payload, body[start:end], keys[0]))
    if tagged and not calls:
        message = f'after {PYTHON_TAG} write a JSON call {{"name": …, "parameters": {{…}}}}'
        calls.append(ToolCall(raw=body.strip(), parse_error=message))
    return calls


# Formats read from the generated text alone, by name.
TEXT_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {
    HERMES: parse_tool_calls,
    QWEN3: parse_qwen3_tool_calls,
    LLAMA31: parse_llama31_tool_calls,
}
TOOL_CALL_FORMATS: tuple[str, ...] = (*TEXT_FORMATS, RESPONSE_TEMPLATE)


def contains_tool_call(text: str) -> bool:
    """Whether `text` holds a tool call, well-formed or not, in any of the text formats."""
    return any(parse(text) for parse in TEXT_FORMATS.values())


def chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text of the tokenizer's chat template ('' when it has none); of a set of named
    templates, the `tool_use` one when there is one, else all of them."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") or "\n".join(str(text) for text in template.values())
    return template if isinstance(template, str) else ""


def format_of_template(template: str) -> str:
    """The tool-call format a chat template's text teaches: Hermes tags (Qwen3-style when the
    template also knows `<think>` reasoning), Llama 3.1 (`<|python_tag|>`, or JSON calls with
    `"parameters"`), else Hermes."""
    if "<tool_call>" in template:
        return QWEN3 if THINK_OPEN in template or "reasoning_content" in template else HERMES
    if PYTHON_TAG in template or '"parameters"' in template:
        return LLAMA31
    return HERMES


def _response_template_has_tool_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = getattr(tokenizer, "response_template", None)
    return isinstance(template, dict) and "tool_calls" in (template.get("fields") or {})


def tool_call_format_of(tokenizer: PreTrainedTokenizerBase) -> str:
    """The format to read this tokenizer's tool calls in: its response template when that
    defines `tool_calls`, else the one its chat template's text names."""
    if _response_template_has_tool_calls(tokenizer):
        return RESPONSE_TEMPLATE
    return format_of_template(chat_template_text(tokenizer))


def _call_of_message_entry(entry: Any) -> ToolCall:
    """One entry of a parsed message's `tool_calls` (OpenAI `{"function": {…}}` or bare)."""
    function = entry.get("function", entry) if isinstance(entry, dict) else entry
    raw = json.dumps(function, ensure_ascii=False, default=str)
    return tool_call_from_payload(function, raw)


@dataclass(frozen=True)
class ToolCallParser:
    """Reads the tool calls of one generated assistant turn in one format. `tokenizer` and
    `tools` (the schemas the prompt showed) serve the response-template format, which also needs
    the prompt that came before the turn."""

    format: str
    tokenizer: PreTrainedTokenizerBase | None = None
    tools: tuple[dict[str, Any], ...] = ()

    def parse(self, text: str, prompt: str = "") -> list[ToolCall]:
        """All tool calls in `text`, in order; malformed ones carry a `parse_error`."""
        if self.format != RESPONSE_TEMPLATE:
            return TEXT_FORMATS[self.format](text)
        assert self.tokenizer is not None
        try:
            message = self.tokenizer.parse_response(
                text, prefix=prompt, tools=list(self.tools) or None
            )
        except (ValueError, KeyError, TypeError) as error:
            reason = str(error).splitlines()[0][:MAX_ERROR_CHARS] if str(error) else ""
            return [ToolCall(raw=text, parse_error=f"the reply could not be parsed ({reason})")]
        return [_call_of_message_entry(entry) for entry in message.get("tool_calls") or []]


def tool_call_parser(
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]] | None = None,
    format: str | None = None,
) -> ToolCallParser:
    """The parser for this tokenizer's tool calls: `format` when given (one of
    TOOL_CALL_FORMATS), else the one `tool_call_format_of` picks."""
    chosen = format or tool_call_format_of(tokenizer)
    if chosen not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"unknown tool-call format {chosen!r}; expected one of {', '.join(TOOL_CALL_FORMATS)}"
        )
    if chosen == RESPONSE_TEMPLATE and getattr(tokenizer, "response_template", None) is None:
        raise ValueError(
            "the response_template tool-call format needs a tokenizer with a response_template; "
            f"choose one of {', '.join(TEXT_FORMATS)}"
        )
    return ToolCallParser(chosen, tokenizer, tuple(tools or ()))
