"""Tool calls: parse the Hermes format `<tool_call>{json}</tool_call>` from generated text (other
formats are in `toolcalls`), run the calls with an environment's tool functions, turn results into
`tool` messages, and read the final `<answer>…</answer>`. Every failure becomes an error string that
goes back to the model.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A tool reports failure by returning a string with this prefix; the executor uses it too.
TOOL_ERROR_PREFIX = "Error: "
MAX_TOOL_RESULT_CHARS = 2000
TRUNCATION_MARKER = " …[truncated]"

_TOOL_CALL_PATTERN = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL
)
_ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SCALAR_TYPES: tuple[type, ...] = (str, int, float, bool)


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block: the parsed name and arguments, or why it could not be parsed."""

    raw: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    parse_error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a call returned (or its error message) and whether it counts as a tool error."""

    call: ToolCall
    content: str
    is_error: bool


def parse_tool_calls(text: str) -> list[ToolCall]:
    """All tool calls in `text`, in order; malformed ones carry a `parse_error`."""
    calls: list[ToolCall] = []
    for match in _TOOL_CALL_PATTERN.finditer(text):
        body, closing = match.group(1), match.group(2)
        if not closing:
            calls.append(ToolCall(raw=body, parse_error=f"{TOOL_CALL_OPEN} is never closed"))
            continue
        calls.append(_parse_tool_call_body(body))
    return calls


def _parse_tool_call_body(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(raw=body, parse_error=f"tool call is not valid JSON ({error.msg})")
    return tool_call_from_payload(payload, body)


def tool_call_from_payload(payload: object, raw: str, arguments_key: str = "arguments") -> ToolCall:
    """The call a decoded JSON object `{"name": …, "arguments": {…}}` stands for (arguments may
    also be a JSON string of an object), or why it is not one; `raw` is the text it came from
    and `arguments_key` the key that holds the arguments in this format."""
    if not isinstance(payload, dict):
        return ToolCall(raw=raw, parse_error="tool call must be a JSON object")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(raw=raw, parse_error='tool call needs a string "name"')
    arguments = payload.get(arguments_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            message = f'"{arguments_key}" is not a JSON object'
            return ToolCall(raw=raw, name=name, parse_error=message)
    if not isinstance(arguments, dict):
        message = f'"{arguments_key}" must be a JSON object'
        return ToolCall(raw=raw, name=name, parse_error=message)
    return ToolCall(raw=raw, name=name, arguments=arguments)


def _argument_error(function: Callable[..., Any], arguments: dict[str, Any]) -> str | None:
    """Why `arguments` do not fit `function`'s signature and scalar type hints, or None."""
    signature = inspect.signature(function)
    try:
        signature.bind(**arguments)
    except TypeError as error:
        return str(error)
    hints = typing.get_type_hints(function)
    for parameter_name, value in arguments.items():
        expected = hints.get(parameter_name)
        if expected not in _SCALAR_TYPES:
            continue
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            return f"argument {parameter_name!r} must be of type {expected.__name__}"
    return None


def execute_tool_call(
    call: ToolCall,
    tools: Mapping[str, Callable[..., Any]],
    *,
    max_chars: int = MAX_TOOL_RESULT_CHARS,
) -> ToolResult:
    """Run one call; parse errors, unknown tools, bad arguments and exceptions become errors.
    Output longer than `max_chars` is cut there and marked as truncated."""
    if call.parse_error is not None:
        return ToolResult(call, TOOL_ERROR_PREFIX + call.parse_error, is_error=True)
    assert call.name is not None and call.arguments is not None
    function = tools.get(call.name)
    if function is None:
        available = ", ".join(sorted(tools)) or "none"
        message = f"unknown tool {call.name!r}; available tools: {available}"
        return ToolResult(call, TOOL_ERROR_PREFIX + message, is_error=True)
    argument_error = _argument_error(function, call.arguments)
    if argument_error is not None:
        message = f"bad arguments for {call.name}: {argument_error}"
        return ToolResult(call, TOOL_ERROR_PREFIX + message, is_error=True)
    try:
        output = function(**call.arguments)
    except Exception as error:  # a tool's failure is reported to the model, never raised
        message = f"{call.name} raised {type(error).__name__}: {error}"
        return ToolResult(call, TOOL_ERROR_PREFIX + message, is_error=True)
    content = output if isinstance(output, str) else json.dumps(output, default=str)
    if len(content) > max_chars:
        content = content[:max_chars] + TRUNCATION_MARKER
    return ToolResult(call, content, is_error=content.startswith(TOOL_ERROR_PREFIX))


def tool_messages(results: list[ToolResult]) -> list[dict[str, Any]]:
    """Chat messages (role `tool`) carrying the results back to the model."""
    messages: list[dict[str, Any]] = []
    for result in results:
        message: dict[str, Any] = {"role": "tool", "content": result.content}
        if result.call.name is not None:
            message["name"] = result.call.name
        messages.append(message)
    return messages


def extract_final_answer(text: str) -> str | None:
    """The text inside the last `<answer>…</answer>`, stripped; None when there is none."""
    matches = _ANSWER_PATTERN.findall(text)
    return matches[-1].strip() if matches else None


def execute_tool_calls(
    calls: list[ToolCall],
    tools: Mapping[str, Callable[..., Any]],
    *,
    max_chars: int = MAX_TOOL_RESULT_CHARS,
) -> list[ToolResult]:
    """Run calls one after another (the rollout engine runs them concurrently instead)."""
    return [execute_tool_call(call, tools, max_chars=max_chars) for call in calls]
