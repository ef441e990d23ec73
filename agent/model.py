"""The embedded default policy's parts: a locally built byte-level tokenizer with a
Qwen2.5/Hermes-style chat template and a tiny Qwen2 model; also loads any Hugging Face causal-LM
folder as a policy (the base checkpoint is built in `skillswarm.node.bootstrap`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PAD_TOKEN = "<|endoftext|>"
TURN_START_TOKEN = "<|im_start|>"
TURN_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, TURN_START_TOKEN, TURN_END_TOKEN)
TOOL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
# An upper bound: BPE stops earlier when no pair occurs twice (about 670 on the math corpus).
DEFAULT_VOCAB_SIZE = 1024
DEFAULT_MAX_POSITIONS = 2048
# Wider than Qwen2's 0.02: at hidden size 128 this model learns to copy numbers from the prompt
# into tool calls in roughly half the supervised steps.
DEFAULT_INITIALIZER_RANGE = 0.08


TOOLS_HEADER = (
    "# Tools\n\nYou may call functions to help with the task. "
    "Their JSON schemas are inside <tools></tools>:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nTo call a function, write its name and arguments as a JSON object inside "
    '<tool_call></tool_call> tags:\n<tool_call>{"name": <function-name>, "arguments": '
    "<args-json-object>}</tool_call>"
)

# Qwen2.5/Hermes layout: tool schemas in the system turn, tool calls as JSON inside <tool_call>,
# tool results wrapped in <tool_response> inside a user turn.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system_text = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system_text = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if system_text %}{{- system_text + '\\n\\n' }}{%- endif %}"
    "{{- " + json.dumps(TOOLS_HEADER) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + json.dumps(TOOLS_FOOTER) + " + '<|im_end|>\\n' }}"
    "{%- elif system_text %}"
    "{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or turns[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>' + message.content + '</tool_response>' }}"
    "{%- if loop.last or turns[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer pattern without its leading "any one non-letter" before a word (and the
# optional space before punctuation): words, single digits, punctuation runs and whitespace runs
# are each their own pieces.
PRE_TOKENIZER_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Literal pieces of the template, added to every tokenizer corpus.
TEMPLATE_FIXED_STRINGS: tuple[str, ...] = (
    "<|im_start|>system\n",
    "<|im_start|>user\n",
    "<|im_start|>assistant\n",
    "<|im_end|>\n",
    TOOLS_HEADER,
    TOOLS_FOOTER,
    '<tool_call>{"name": "',
    '", "arguments": {"',
    "\n<tool_response>",
    "</tool_response><|im_end|>\n",
)

_ADDED_TOKEN_PATTERN = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))


class CheckpointLoadError(RuntimeError):
    """Raised when a folder is not a loadable Hugging Face causal-LM checkpoint."""


def set_torch_threads(num_threads: int) -> None:
    """Set torch's intra-op threads for this process (one per process is the safe default on
    shared CPUs: more threads than free cores slows generation by an order of magnitude)."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    torch.set_num_threads(num_threads)


def build_threads() -> int:
    """Torch threads for building a base when nothing else runs: the machine's cores, up to 4
    (the tiny model gains little beyond that)."""
    return max(1, min(4, os.cpu_count() or 1))


def _strip_added_tokens(corpus: Iterable[str]) -> Iterable[str]:
    """Corpus pieces between special and tool tokens: those tokens are never merged by BPE."""
    for text in corpus:
        for piece in _ADDED_TOKEN_PATTERN.split(text):
            if piece:
                yield piece


def build_tokenizer(
    corpus: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus` (deterministic; any text encodes): Qwen2's
    normalizer (NFC), a pre-tokenizer that keeps words, spaces and punctuation apart (every digit
    its own token), the chat special tokens, the tool-call tokens and the chat template. It is
    saved as a plain `tokenizer.json`, which stock `AutoTokenizer` loads as it is, so it
    tokenizes identically.

    Qwen2's own pre-tokenizer glues the character before a word to it, so a name is different
    tokens after a space (in a question), after a quote (in a tool call's JSON) or after a bracket
    (a search result's "[f73]"). Here a word is the same tokens wherever it stands, which is what
    copying it from the prompt into a tool call needs."""
    backend = Tokenizer(BPE())
    backend.normalizer = normalizers.NFC()  # Qwen2's normalizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_strip_added_tokens(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=TURN_END_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(
        [AddedToken(TURN_START_TOKEN, special=True, normalized=False)], special_tokens=True
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


# Transformers 5 names a tokenizer built from a `tokenizers` object "TokenizersBackend" in
# tokenizer_config.json, a class transformers 4 does not have, so its AutoTokenizer refuses the
# folder. Both versions load a tokenizer.json unchanged under this name.
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_TRANSFORMERS5_ONLY_TOKENIZER_CLASS = "TokenizersBackend"


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> None:
    """`save_pretrained`, naming a class in tokenizer_config.json that transformers 4 and 5
    both load (PORTABLE_TOKENIZER_CLASS) where transformers 5 would name one only it knows."""
    tokenizer.save_pretrained(folder)
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == _TRANSFORMERS5_ONLY_TOKENIZER_CLASS:
        config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
        config_path.write_text(
            json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
            encoding="utf-8",
        )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 512,
    *,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
) -> Qwen2ForCausalLM:
    """A freshly initialised float32 Qwen2 with tied embeddings sized to `tokenizer`."""
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=DEFAULT_MAX_POSITIONS,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model.to(torch.float32)


def load_policy(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a Hugging Face folder, in float32, eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointLoadError(
            f"{path} has no config.json; expected a Hugging Face model folder"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise CheckpointLoadError(f"cannot load a causal LM from {path}: {error}") from error
    if tokenizer.chat_template is None:
        raise CheckpointLoadError(f"the tokenizer in {path} has no chat template")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer
