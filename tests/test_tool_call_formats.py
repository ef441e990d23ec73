"""Tool-call formats from the chat template: the same call written the Hermes way (the embedded
base), the Qwen3 way (Hermes tags after `<think>` reasoning), the Llama 3.1 way (JSON with
"parameters"), or read by the tokenizer's own response template, gives the rollout engine the same
calls and the same episode. The templates are minimal ones written here, no downloads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from skillswarm.agent.envs.base import Environment, Message, Split, Task, ToolFunction
from skillswarm.agent.inference import SolverBackend
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.rollout import RolloutEngine
from skillswarm.agent.toolcalls import (
    HERMES,
    LLAMA31,
    QWEN3,
    RESPONSE_TEMPLATE,
    contains_tool_call,
    parse_llama31_tool_calls,
    parse_qwen3_tool_calls,
    tool_call_format_of,
    tool_call_parser,
)
from skillswarm.agent.tools import ToolCall, parse_tool_calls
from tokenizers import AddedToken

# Qwen3's layout, cut down: tools in the system turn, reasoning in <think>, calls as JSON inside
# <tool_call> lines, results in <tool_response> inside a user turn.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system_text = messages[0].content %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system_text = '' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system_text }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
    "{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- for message in turns %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or turns[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or turns[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's layout, cut down: headers per turn, tools in the first user turn, a custom tool call
# as JSON with "parameters", results in an `ipython` turn.
LLAMA31_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set system_text = messages[0].content %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set system_text = '' %}"
    "{%- set turns = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- system_text + '<|eot_id|>' }}"
    "{%- for message in turns %}"
    "{%- if message.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with "
    'its proper arguments.\\n\\nRespond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    '{{- \'{"name": "\' + call.name + \'", "parameters": \' + (call.arguments | tojson) }}'
    "{{- '}' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}"
    "{{- '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# A transformers response template for the Qwen3 layout: reasoning, content, and tool calls.
QWEN3_RESPONSE_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {},
    },
}


def qwen3_tokenizer(response_template: dict[str, Any] | None = None):
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>",)])
    if response_template is not None:
        tokenizer.response_template = response_template
    return tokenizer


def llama31_tokenizer():
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    headers = ("<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eot_id|>")
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in headers], special_tokens=True
    )
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA31_TEMPLATE
    return tokenizer


TOKENIZERS = {
    HERMES: lambda: build_tokenizer(TEMPLATE_FIXED_STRINGS),
    QWEN3: qwen3_tokenizer,
    LLAMA31: llama31_tokenizer,
    RESPONSE_TEMPLATE: lambda: qwen3_tokenizer(QWEN3_RESPONSE_TEMPLATE),
}


def repeat(word: str, times: int) -> str:
    """Repeat a word.

    Args:
        word: The word.
        times: How many times.
    """
    return " ".join([word] * times)


def echo(text: str) -> str:
    """Return the text.

    Args:
        text: What to return.
    """
    return text


class ScriptedEnvironment(Environment):
    """Each task scripts its assistant turns in `metadata["turns"]` as chat messages."""

    name = "scripted"
    system_prompt = "Use the tools, then answer as <answer>TEXT</answer>."
    max_turns = 4

    @property
    def tools(self) -> list[ToolFunction]:
        return [repeat, echo]

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        raise AssertionError("tasks are built by each test")

    def reward(self, task: Task, final_answer: str | None) -> float:
        return 1.0 if final_answer == task.answer else 0.0

    def solve(self, task: Task) -> list[Message]:
        messages = self.initial_messages(task)
        for turn in task.metadata["turns"]:
            messages.append(turn)
            if turn is not task.metadata["turns"][-1]:
                messages.append({"role": "tool", "content": "(result)"})
        return messages


def _call_turn(name: str, arguments: dict[str, Any], reasoning: str | None = None) -> Message:
    message: Message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _calls(calls: Sequence[ToolCall]) -> list[tuple[str | None, dict[str, Any] | None]]:
    return [(call.name, call.arguments) for call in calls]


def _play(format_name: str, turns: list[Message]):
    tokenizer = TOKENIZERS[format_name]()
    env = ScriptedEnvironment()
    engine = RolloutEngine(SolverBackend(env, tokenizer), env, max_new_tokens=400)
    task = Task("t", "Repeat ab three times.", "ab ab ab", {"turns": turns})
    (episode,) = engine.play([task], seed=0)
    return engine, episode


def test_hermes_stays_the_default_for_the_embedded_base() -> None:
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    assert tool_call_format_of(tokenizer) == HERMES
    env = ScriptedEnvironment()
    engine = RolloutEngine(SolverBackend(env, tokenizer), env)
    assert engine.tool_call_parser.format == HERMES


@pytest.mark.parametrize("format_name", [HERMES, QWEN3, LLAMA31, RESPONSE_TEMPLATE])
def test_the_template_picks_its_format_and_the_engine_plays_the_same_episode(
    format_name: str,
) -> None:
    turns = [
        _call_turn("repeat", {"word": "ab", "times": 3}),
        {"role": "assistant", "content": "<answer>ab ab ab</answer>"},
    ]
    engine, episode = _play(format_name, turns)
    assert engine.tool_call_parser.format == format_name
    tool_results = [(m.get("name"), m["content"]) for m in episode.messages if m["role"] == "tool"]
    assert tool_results == [("repeat", "ab ab ab")]
    assert (episode.num_tool_calls, episode.num_tool_errors) == (1, 0)
    assert (episode.finish_reason, episode.reward) == ("answer", 1.0)


@pytest.mark.parametrize("format_name", [HERMES, QWEN3, LLAMA31, RESPONSE_TEMPLATE])
def test_the_same_calls_written_in_each_format_parse_the_same(format_name: str) -> None:
    """The text each template renders for one turn with two calls reads back as those calls."""
    tokenizer = TOKENIZERS[format_name]()
    env = ScriptedEnvironment()
    engine = RolloutEngine(SolverBackend(env, tokenizer), env)
    expected = [("repeat", {"word": "ab", "times": 3}), ("echo", {"text": 'say "hi"'})]
    turn: Message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in expected
        ],
    }
    prompt_messages = env.initial_messages(Task("t", "Go.", ""))
    tools = env.tool_schemas()
    prompt = tokenizer.apply_chat_template(
        prompt_messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    rendered = tokenizer.apply_chat_template([*prompt_messages, turn], tools=tools, tokenize=False)
    written = rendered[len(prompt) :].split(tokenizer.eos_token)[0]
    assert _calls(engine.tool_call_parser.parse(written, prompt)) == expected


def test_qwen3_reads_calls_after_the_reasoning_only() -> None:
    decoy = 'Maybe <tool_call>{"name": "echo", "arguments": {"text": "no"}}</tool_call>?'
    turns = [
        _call_turn("repeat", {"word": "ab", "times": 3}, reasoning=decoy),
        {"role": "assistant", "content": "<answer>ab ab ab</answer>"},
    ]
    for format_name in (QWEN3, RESPONSE_TEMPLATE):
        _, episode = _play(format_name, turns)
        tool_results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert tool_results == ["ab ab ab"], format_name
        assert episode.reward == 1.0
    # A prompt that opens the reasoning leaves the model only its close tag.
    text = 'still thinking <tool_call>{"name": "echo", "arguments": {}}</tool_call></think>\n\n'
    text += '<tool_call>{"name": "echo", "arguments": {"text": "yes"}}</tool_call>'
    assert _calls(parse_qwen3_tool_calls(text)) == [("echo", {"text": "yes"})]
    assert len(parse_tool_calls(text)) == 2  # Hermes reads every tag


def test_llama31_calls_after_the_python_tag_and_malformed_ones() -> None:
    text = '<|python_tag|>{"name": "repeat", "parameters": {"word": "ab", "times": 3}}; '
    text += '{"name": "echo", "arguments": {"text": "x"}}'
    assert _calls(parse_llama31_tool_calls(text)) == [
        ("repeat", {"word": "ab", "times": 3}),
        ("echo", {"text": "x"}),
    ]
    (broken,) = parse_llama31_tool_calls('{"name": "echo", "parameters": {"text": ')
    assert broken.parse_error is not None and broken.parse_error.startswith("tool call is not")
    (no_json,) = parse_llama31_tool_calls("<|python_tag|>echo('x')")
    assert no_json.parse_error is not None and "JSON call" in no_json.parse_error
    (bad_parameters,) = parse_llama31_tool_calls('{"name": "echo", "parameters": [1]}')
    assert bad_parameters.parse_error == '"parameters" must be a JSON object'
    assert parse_llama31_tool_calls("The answer is 4.") == []
    assert parse_llama31_tool_calls('Found {"name": "Bob", "age": 3}.') == []  # data, no call
    assert contains_tool_call(text) and not contains_tool_call("The answer is 4.")


def test_a_reply_the_response_template_cannot_parse_is_a_tool_error_for_the_model() -> None:
    tokenizer = qwen3_tokenizer(QWEN3_RESPONSE_TEMPLATE)
    parser = tool_call_parser(tokenizer)
    (call,) = parser.parse('<tool_call>{"name": "echo", </tool_call>', "")
    assert call.name is None and call.parse_error is not None
    assert call.parse_error.startswith("the reply could not be parsed")


def test_a_response_template_without_tool_calls_falls_back_to_the_template_text() -> None:
    reasoning_only = {
        "version": 1,
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {"reasoning_content": {"open": "<think>", "close": "</think>"}, "content": {}},
    }
    assert tool_call_format_of(qwen3_tokenizer(reasoning_only)) == QWEN3


def test_an_explicit_format_wins_and_an_unknown_one_is_refused() -> None:
    tokenizer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    assert tool_call_parser(tokenizer, format=LLAMA31).format == LLAMA31
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'; expected one of"):
        tool_call_parser(tokenizer, format="xml")
    with pytest.raises(ValueError, match="needs a tokenizer with a response_template"):
        tool_call_parser(tokenizer, format=RESPONSE_TEMPLATE)
