"""The HF backend's KV cache: buffers written in place, the shared-prefix attention, and each
conversation's cache handed back for its next turn. Whatever path a token takes, its keys, values
and logprobs must be what a fresh forward pass over the whole conversation gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from skillswarm.agent.inference import (
    GROWTH_TOKENS,
    ConversationKV,
    Generation,
    GenerationRequest,
    HFBackend,
    shared_prefix_attention,
)
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.node.train import token_logprobs
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tokenizer):
    """With SDPA the shared prefix is held apart from the rows' caches; with any other attention
    it is copied into every row."""
    built = build_tiny_model(tokenizer, seed=1, hidden=32, layers=2, heads=4, intermediate=64)
    built.set_attn_implementation(request.param)
    return built


def _prompts(prefix: list[int], tails: list[list[int]]) -> list[list[int]]:
    return [prefix + tail for tail in tails]


def _prefill_widths(model: Any) -> tuple[list[int], Any]:
    """Record how many tokens each forward pass runs."""
    widths: list[int] = []

    def record(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        widths.append(kwargs["input_ids"].shape[-1])

    return widths, model.model.register_forward_pre_hook(record, with_kwargs=True)


def _fresh_logprobs(model: Any, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    tensor = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model, tensor, torch.ones_like(tensor), temperature)[0]


def _whole(kv: ConversationKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values of the whole conversation, joined from its segments."""
    return [
        (
            torch.cat([segment[layer][0] for segment in kv.segments], dim=-2),
            torch.cat([segment[layer][1] for segment in kv.segments], dim=-2),
        )
        for layer in range(len(kv.segments[0]))
    ]


@pytest.mark.parametrize("queries", [1, 5])
def test_shared_prefix_attention_equals_sdpa_over_the_whole_history(queries: int) -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, prefix, own = 3, 4, 2, 8, 7, 9
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=heads // kv_heads)
    query = torch.randn(batch, heads, queries, dim)
    keys, values = torch.randn(batch, kv_heads, own, dim), torch.randn(batch, kv_heads, own, dim)
    prefix_keys, prefix_values = (
        torch.randn(1, kv_heads, prefix, dim),
        torch.randn(1, kv_heads, prefix, dim),
    )
    mask = torch.ones(batch, 1, queries, own, dtype=torch.bool).tril(diagonal=own - queries)
    mask[1, :, :, :3] = False  # left padding in one row
    output, _ = shared_prefix_attention(
        module,
        query,
        keys,
        values,
        mask,
        scaling=0.3,
        shared_prefix=((prefix_keys, prefix_values),),
    )
    whole_keys = torch.cat([prefix_keys.expand(batch, -1, -1, -1), keys], dim=2)
    whole_values = torch.cat([prefix_values.expand(batch, -1, -1, -1), values], dim=2)
    whole_mask = torch.cat([mask.new_ones(batch, 1, queries, prefix), mask], dim=-1)
    expected = F.scaled_dot_product_attention(
        query,
        whole_keys.repeat_interleave(heads // kv_heads, dim=1),
        whole_values.repeat_interleave(heads // kv_heads, dim=1),
        attn_mask=whole_mask,
        scale=0.3,
    ).transpose(1, 2)
    assert torch.allclose(output, expected, atol=1e-6)


def test_a_handed_back_cache_continues_as_a_fresh_prefill_would(model, tokenizer) -> None:
    backend = HFBackend(model, tokenizer)
    prefix = list(range(10, 40))
    first = _prompts(prefix, [[50, 51], [52, 53, 54, 55], [56]])
    turns = backend.generate(
        [GenerationRequest(prompt, 6) for prompt in first], temperature=1.0, greedy=True, seed=0
    )
    second = [
        prompt + turn.token_ids + extra
        for prompt, turn, extra in zip(first, turns, [[60, 61, 62], [63], [64, 65]], strict=True)
    ]
    widths, hook = _prefill_widths(model)
    try:
        reused = backend.generate(
            [
                GenerationRequest(ids, 8, kv=turn.kv)
                for ids, turn in zip(second, turns, strict=True)
            ],
            temperature=0.8,
            greedy=False,
            seed=1,
        )
    finally:
        hook.remove()
    fresh = backend.generate(
        [GenerationRequest(ids, 8) for ids in second], temperature=0.8, greedy=False, seed=1
    )
    assert widths[0] <= 4  # only the new tokens (and the sampled end of the last turn) ran
    assert [g.token_ids for g in reused] == [g.token_ids for g in fresh]
    for prompt, again, anew in zip(second, reused, fresh, strict=True):
        assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(anew.logprobs), atol=1e-5)
        behaviour = torch.tensor(again.logprobs)
        recomputed = _fresh_logprobs(model, prompt + again.token_ids, 0.8)[len(prompt) :]
        assert torch.allclose(recomputed, behaviour, atol=1e-4)


def test_caches_hold_exactly_the_keys_of_the_tokens_read(model, tokenizer) -> None:
    """Rows end at different steps (compaction copies the finished ones out) and run past the
    buffers' first room (they grow); every handed-back cache still equals a fresh forward's."""
    backend = HFBackend(model, tokenizer)
    prompts = _prompts(list(range(10, 30)), [[40 + row] * (row + 1) for row in range(6)])
    limits = [1, 3, 5, GROWTH_TOKENS + 8, 2, GROWTH_TOKENS + 3]
    generations = backend.generate(
        [GenerationRequest(prompt, limit) for prompt, limit in zip(prompts, limits, strict=True)],
        temperature=1.0,
        greedy=False,
        seed=3,
    )
    for prompt, generation in zip(prompts, generations, strict=True):
        assert generation.kv is not None
        assert len(generation.kv.segments) == (
            2 if model.config._attn_implementation == "sdpa" else 1
        )
        read = prompt + generation.token_ids[:-1]
        assert list(generation.kv.token_ids) == read
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([read]), use_cache=True, cache=cache)
        for (keys, values), layer in zip(_whole(generation.kv), cache.layers, strict=True):
            assert torch.allclose(keys, layer.keys, atol=1e-5)
            assert torch.allclose(values, layer.values, atol=1e-5)


def test_stale_or_unrelated_caches_are_not_used(model, tokenizer) -> None:
    backend = HFBackend(model, tokenizer)
    prompt = list(range(10, 30))
    (turn,) = backend.generate([GenerationRequest(prompt, 4)], temperature=1.0, greedy=True, seed=0)
    follow = prompt + turn.token_ids + [60, 61]
    rewritten = [11] + follow[1:]  # the history changed: the cache no longer starts the prompt
    widths, hook = _prefill_widths(model)
    try:
        backend.generate(
            [GenerationRequest(rewritten, 2, kv=turn.kv)], temperature=1.0, greedy=True, seed=0
        )
        assert widths[0] == len(rewritten)
        backend.update_weights(
            [(name, parameter.detach() * 1.01) for name, parameter in model.named_parameters()], 1
        )
        widths.clear()
        (after,) = backend.generate(
            [GenerationRequest(follow, 3, kv=turn.kv)], temperature=1.0, greedy=False, seed=2
        )
        assert widths[0] == len(follow)  # the cache was computed with the old weights
    finally:
        hook.remove()
    recomputed = _fresh_logprobs(model, follow + after.token_ids)[len(follow) :]
    assert torch.allclose(recomputed, torch.tensor(after.logprobs), atol=1e-4)


def test_grouped_query_models_share_the_prefix_exactly(tokenizer) -> None:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(2)
    grouped = Qwen2ForCausalLM(config).eval()
    assert grouped.config._attn_implementation == "sdpa"
    backend = HFBackend(grouped, tokenizer)
    prompts = _prompts(list(range(10, 25)), [[40], [41, 42, 43], [44, 45]])
    generations: list[Generation] = backend.generate(
        [GenerationRequest(prompt, 5) for prompt in prompts], temperature=1.0, greedy=False, seed=4
    )
    for prompt, generation in zip(prompts, generations, strict=True):
        assert generation.kv is not None and len(generation.kv.segments) == 2  # prefix, own
        recomputed = _fresh_logprobs(grouped, prompt + generation.token_ids)[len(prompt) :]
        assert torch.allclose(recomputed, torch.tensor(generation.logprobs), atol=1e-4)
