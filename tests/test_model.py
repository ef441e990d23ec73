"""The embedded default model: tokenizer and chat template, tiny Qwen2, base checkpoint folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import (
    PORTABLE_TOKENIZER_CLASS,
    SPECIAL_TOKENS,
    TEMPLATE_FIXED_STRINGS,
    TOOL_TOKENS,
    CheckpointLoadError,
    build_tiny_model,
    build_tokenizer,
    load_policy,
    save_tokenizer,
)
from skillswarm.node.bootstrap import create_base_checkpoint, render_demonstrations
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM


@pytest.fixture(scope="module")
def tokenizer():
    env = get_environment("math")
    renderer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    corpus = list(TEMPLATE_FIXED_STRINGS) + render_demonstrations(renderer, [env], 300, seed=0)
    return build_tokenizer(corpus)


def test_tokenizer_is_byte_level_with_single_digit_tokens(tokenizer) -> None:
    assert 300 <= len(tokenizer) <= 1100
    for text in ["Ann has 12 apples.", "ünïcödé ☃ \t\n\n  tabs", "1234567890", '{"a": [1.5]}']:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    digits = tokenizer.convert_ids_to_tokens(
        tokenizer("x 90817 y", add_special_tokens=False)["input_ids"]
    )
    assert [t for t in digits if any(c.isdigit() for c in t)] == ["9", "0", "8", "1", "7"]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert tokenizer.convert_tokens_to_ids(token) in ids
    kept = tokenizer.decode(
        tokenizer("<|im_start|>x<tool_call>y</tool_call><|im_end|>")["input_ids"],
        skip_special_tokens=True,
    )
    assert kept == "x<tool_call>y</tool_call>"


def test_a_word_is_the_same_tokens_wherever_it_stands_also_after_reloading(
    tokenizer, tmp_path: Path
) -> None:
    save_tokenizer(tokenizer, tmp_path)
    # A class name transformers 4 knows too ("TokenizersBackend" is transformers 5's); without a
    # config.json beside it, AutoTokenizer goes by that name.
    saved_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert saved_config["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for loaded in (tokenizer, reloaded):

        def pieces(text: str, loaded=loaded) -> list[str]:
            return loaded.convert_ids_to_tokens(loaded(text, add_special_tokens=False)["input_ids"])

        for word in ["Lodan", "apples", "f73"]:
            alone = pieces(word)
            contexts = [f"Ask {word} now", f'{{"query": "{word}"}}', f"[{word}] x", f"({word}."]
            for context in contexts:
                found = pieces(context)
                assert any(found[i : i + len(alone)] == alone for i in range(len(found))), (
                    word,
                    context,
                    found,
                )
    text = 'Where was Lodan Lalzar born? {"query": "Lodan Lalzar"} [f73] 12 * 3'
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_tokenizer_training_is_deterministic() -> None:
    corpus = ["Ann has 12 apples and buys 7 boxes of 3 apples."] * 20 + list(TEMPLATE_FIXED_STRINGS)
    first = build_tokenizer(corpus).backend_tokenizer.to_str()
    second = build_tokenizer(corpus).backend_tokenizer.to_str()
    assert hashlib.sha256(first.encode()).digest() == hashlib.sha256(second.encode()).digest()


def test_chat_template_renders_tools_tool_calls_and_tool_results(tokenizer) -> None:
    env = get_environment("math")
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
                }
            ],
        },
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=env.tool_schemas(), tokenize=False)
    schema_line = json.dumps(env.tool_schemas()[0], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nBe exact.\n\n# Tools\n")
    assert f"<tools>\n{schema_line}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>5</answer><|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        messages[:2], tools=env.tool_schemas(), tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith(prompt[: -len("<|im_start|>assistant\n")])
    plain = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert (
        plain
        == "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    )
    two_results = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "q"},
            {"role": "tool", "content": "1"},
            {"role": "tool", "content": "2"},
        ],
        tokenize=False,
    )
    assert two_results.endswith(
        "<|im_start|>user\n<tool_response>1</tool_response>\n<tool_response>2</tool_response><|im_end|>\n"
    )


def test_tiny_model_shape_and_seeded_init(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=3)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    same = build_tiny_model(tokenizer, seed=3)
    other = build_tiny_model(tokenizer, seed=4)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), same.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_base_checkpoint_is_a_loadable_hugging_face_folder(tiny_base: Path) -> None:
    base_checkpoint = tiny_base
    for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]:
        assert (base_checkpoint / name).is_file(), name
    tokenizer_config = json.loads((base_checkpoint / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    tokenizer = AutoTokenizer.from_pretrained(base_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(base_checkpoint)
    policy, policy_tokenizer = load_policy(base_checkpoint)
    env = get_environment("math")
    task = env.tasks("heldout", 1)[0]
    text = tokenizer.apply_chat_template(env.solve(task), tools=env.tool_schemas(), tokenize=False)
    assert "<tool_call>" in text and "# Tools" in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == policy_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    batch = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(batch).logits, policy(batch).logits)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert policy_tokenizer.padding_side == "left"


def test_base_checkpoint_is_deterministic(tmp_path: Path) -> None:
    first = create_base_checkpoint(tmp_path / "first", warm_start_steps=2)
    again = create_base_checkpoint(tmp_path / "again", warm_start_steps=2)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    other_seed = create_base_checkpoint(tmp_path / "other", seed=1, warm_start_steps=2)
    assert (other_seed / "model.safetensors").read_bytes() != (
        first / "model.safetensors"
    ).read_bytes()


def test_base_checkpoint_refuses_bad_domain_weights_before_building(tmp_path: Path) -> None:
    for weights, message in [
        ({"search": 2.0}, "not being trained: search"),
        ({"math": 0.0, "code": 0.0}, "not all 0"),
        ({"math": -1.0}, "not negative"),
    ]:
        with pytest.raises(ValueError, match=message):
            create_base_checkpoint(
                tmp_path / "base", domains=("math", "code"), domain_weights=weights
            )
        assert not (tmp_path / "base").exists()
    for size, message in [({"hidden_size": 130}, "multiple of 4"), ({"layers": 0}, "layers")]:
        with pytest.raises(ValueError, match=message):
            create_base_checkpoint(tmp_path / "base", **size)
        assert not (tmp_path / "base").exists()


def test_saved_model_round_trips_weights(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_policy(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_load_policy_refuses_a_folder_without_a_model(tmp_path: Path) -> None:
    with pytest.raises(CheckpointLoadError, match="config.json"):
        load_policy(tmp_path)


def test_evaluate_checkpoint_scores_heldout_tasks(tiny_base: Path) -> None:
    from skillswarm.agent.evaluate import EvalResult, evaluate_checkpoint

    from_path = evaluate_checkpoint(tiny_base, "math", n_tasks=6, seed=0)
    assert isinstance(from_path, EvalResult)
    assert from_path.n == 6 and from_path.greedy and from_path.domain == "math"
    assert 0.0 <= from_path.success_rate <= 1.0 and 0.0 <= from_path.mean_reward <= 1.0
    from_policy = evaluate_checkpoint(load_policy(tiny_base), "math", n_tasks=6, seed=0)
    assert from_policy == from_path
    sampled = evaluate_checkpoint(tiny_base, "math", n_tasks=6, seed=0, greedy=False)
    assert sampled.n == 6 and not sampled.greedy
    with pytest.raises(ValueError):
        evaluate_checkpoint(tiny_base, "math", n_tasks=0)
