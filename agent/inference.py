"""Inference backends for rollouts: token prompts in, sampled continuations out, each sampled token
with its behaviour logprob. `HFBackend` runs a transformers model (the CPU default: batched, one KV
cache per call, weights replaceable in place, each conversation's cache handed back for its next
turn); `SolverBackend` writes an environment's demonstration turns (for checks and the terminal
viewer); the vLLM backend (`inference_vllm`) is imported only when asked for.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from skillswarm.agent.envs.base import Environment, Message, Task
from transformers import AttentionInterface, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DEFAULT_MAX_BATCH_SIZE = 256
GROWTH_TOKENS = 32  # room a generation cache gains at a time
SHARED_PREFIX_ATTENTION = "skillswarm_shared_prefix"

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values
KVSegment = tuple[LayerKV, ...]  # every layer's keys and values of a run of tokens


@dataclass(frozen=True)
class ConversationKV:
    """The keys and values a backend computed for a conversation's tokens, handed back with its
    turn so the next turn prefills only what was added since (the tool results, the next
    assistant header). `segments` cover `token_ids` in order, each layer's keys and values shaped
    (1, kv_heads, tokens, head_dim); the first may be a prefix shared with other conversations.
    `weights` names the weights that computed them, so a cache outlives no weight update."""

    token_ids: tuple[int, ...]
    segments: tuple[KVSegment, ...]
    weights: object


@dataclass(frozen=True)
class GenerationRequest:
    """One continuation to write: the full token prompt and the most tokens it may add. `task`
    and `turn` say which episode turn it is (a solver backend needs them; models ignore them).
    `kv` is the conversation's cache from its previous turn, when the backend returned one."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    task: Task | None = None
    turn: int = 0
    kv: ConversationKV | None = None


@dataclass
class Generation:
    """A written continuation: its tokens, each token's logprob under the sampling distribution,
    and the stop token it ended on (None when it ran out of budget). `kv` is the cache of the
    prompt and the written tokens (all but the last, which the model never read), for a backend
    that can continue from it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_token: int | None = None
    kv: ConversationKV | None = None


class InferenceBackend(Protocol):
    """What the rollout engine needs from an inference engine."""

    tokenizer: PreTrainedTokenizerBase
    policy_version: int

    @property
    def max_context_tokens(self) -> int:
        """The longest sequence (prompt plus continuation) the model accepts."""
        ...

    def stop_token_ids(self) -> set[int]:
        """Token ids that end an assistant turn."""
        ...

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        """One continuation per request, in order. Sampled logprobs are those of the tempered
        distribution (softmax(logits / temperature)); greedy decoding reports temperature 1. A
        generation's `kv`, when set, goes back in the request for the conversation's next turn."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load new policy weights in place and record their version."""
        ...


def cache_keyword_for(model: PreTrainedModel) -> str:
    """The keyword this transformers version's forward takes a KV cache under."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Leading tokens all sequences share, leaving every sequence at least one token of its own."""
    first = sequences[0]
    limit = min(len(sequence) for sequence in sequences) - 1
    length = 0
    while length < limit and all(sequence[length] == first[length] for sequence in sequences):
        length += 1
    return length


def full_attention_layer_count(model: PreTrainedModel) -> int:
    """How many layers keep keys and values. Rollouts cache every layer's whole history, which is
    right only for models whose layers all attend to all earlier tokens."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * int(
        config.num_hidden_layers
    )
    other = sorted({kind for kind in layer_types if kind != "full_attention"})
    if other:
        raise ValueError(f"rollouts need full-attention layers only; this model has {other}")
    return len(layer_types)


def segment_length(segment: KVSegment) -> int:
    """How many tokens a segment covers."""
    return segment[0][0].shape[-2]


def kv_span(segments: Sequence[KVSegment], start: int, stop: int) -> list[KVSegment]:
    """Views of tokens [start, stop) of consecutive segments: one piece per segment touched."""
    pieces: list[KVSegment] = []
    offset = 0
    for segment in segments:
        length = segment_length(segment)
        low, high = max(start - offset, 0), min(stop - offset, length)
        if low < high:
            pieces.append(
                tuple((keys[:, :, low:high], values[:, :, low:high]) for keys, values in segment)
            )
        offset += length
    return pieces


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix: KVSegment | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a prefix every row shares, held once per layer as (1, kv_heads, prefix,
    head_dim), then over each row's own keys (`key`, `value`, masked by `attention_mask`). Every
    query comes after the prefix, so it sees all of it. One product per key head reads the prefix
    for the whole batch: decoding 32 rows, the system prompt was most of each row's cache, and
    reading it once per row made attention the largest cost of a step (it is memory-bound). The
    two parts share one softmax, normalised in place, without joining them into one tensor.
    Without a prefix this is plain SDPA."""
    if shared_prefix is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    prefix_keys, prefix_values = shared_prefix[module.layer_idx]
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    rows = heads // kv_heads * queries  # the queries one key head serves in one row
    scale = scaling if scaling is not None else dim**-0.5
    grouped = (query * scale).reshape(batch, kv_heads, rows, dim)
    stacked = grouped.transpose(0, 1).reshape(1, kv_heads, batch * rows, dim)
    prefix_scores = torch.matmul(stacked, prefix_keys.transpose(-1, -2)).float()
    own_scores = torch.matmul(grouped, key.transpose(-1, -2)).float()
    if attention_mask is not None:
        own_mask = attention_mask.repeat(1, 1, heads // kv_heads, 1)
        own_scores.masked_fill_(~own_mask, float("-inf"))
    by_row = prefix_scores.view(kv_heads, batch, rows, -1).transpose(0, 1)
    top = torch.maximum(by_row.amax(-1, keepdim=True), own_scores.amax(-1, keepdim=True))
    by_row.sub_(top).exp_()
    own_scores.sub_(top).exp_()
    total = by_row.sum(-1, keepdim=True) + own_scores.sum(-1, keepdim=True)
    prefix_output = torch.matmul(prefix_scores.to(value.dtype), prefix_values)
    output = prefix_output.view(kv_heads, batch, rows, dim).transpose(0, 1) + torch.matmul(
        own_scores.to(value.dtype), value
    )
    output = output.div_(total.to(output.dtype)).reshape(batch, heads, queries, dim)
    return output.transpose(1, 2).contiguous(), None


def _always_built_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's boolean mask, never left to `is_causal`: the shared-prefix attention needs it."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


AttentionInterface.register(SHARED_PREFIX_ATTENTION, shared_prefix_attention)
AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, _always_built_sdpa_mask)


@contextmanager
def shared_prefix_attention_in(model: PreTrainedModel) -> Iterator[None]:
    """Run `model`'s attention through `shared_prefix_attention` for a while. Calls that pass no
    prefix (another thread's, say) still get plain SDPA."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = SHARED_PREFIX_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


class BufferedLayer(CacheLayerMixin):
    """One layer's keys and values in buffers written in place, with room for `GROWTH_TOKENS`
    more tokens at a time. `DynamicCache` concatenates on every token, copying the whole cache
    each step; at 32 rows that copy was the largest single cost of a decode step. The room stays
    small because first touches of fresh memory cost several times a copy into used memory."""

    is_sliding = False

    def __init__(self, batch: int, capacity: int) -> None:
        super().__init__()
        self.batch = batch
        self.capacity = capacity
        self.length = 0
        self.key_buffer = torch.empty(0)
        self.value_buffer = torch.empty(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Uninitialised buffers shaped like the given states; `clear_before` zeroes padding."""
        self.device = key_states.device
        self.key_buffer = key_states.new_empty(
            (self.batch, key_states.shape[1], self.capacity, key_states.shape[-1])
        )
        self.value_buffer = value_states.new_empty(
            (self.batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> LayerKV:
        """Write the new tokens' keys and values after the cached ones; return all of them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end + GROWTH_TOKENS)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        """Move into new, larger buffers (views handed out by `row` keep the old ones)."""
        shape = (*self.key_buffer.shape[:2], capacity, self.key_buffer.shape[-1])
        keys = self.key_buffer.new_empty(shape)
        values = self.value_buffer.new_empty((*shape[:-1], self.value_buffer.shape[-1]))
        keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
        values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer, self.capacity = keys, values, capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def place(self, row: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy keys and values computed earlier, (1, heads, tokens, head_dim), into one row from
        column `start` on."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        end = start + keys.shape[-2]
        self.key_buffer[row, :, start:end] = keys[0]
        self.value_buffer[row, :, start:end] = values[0]

    def clear_before(self, row: int, column: int) -> None:
        """Zero a row's padding columns. Attention masks them out but still multiplies their
        values by a zero weight, and 0 * NaN (left over in an uninitialised buffer) is NaN."""
        self.key_buffer[row, :, :column] = 0.0
        self.value_buffer[row, :, :column] = 0.0

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Move the rows in `keep` (ascending) to the front, in place, and drop the others. Views
        of dropped rows handed out by `row` must be copied first: their columns get overwritten.
        (Copying into new buffers instead touches fresh memory, which costs several times more.)"""
        used = slice(0, self.length)
        for target, source in enumerate(keep):
            if target != source:
                self.key_buffer[target, :, used] = self.key_buffer[source, :, used]
                self.value_buffer[target, :, used] = self.value_buffer[source, :, used]
        self.batch = len(keep)
        self.key_buffer = self.key_buffer[: self.batch]
        self.value_buffer = self.value_buffer[: self.batch]
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def row(self, row: int, start: int) -> LayerKV:
        """One row's keys and values from column `start` to the end, as views (no copy)."""
        return (
            self.key_buffer[row : row + 1, :, start : self.length],
            self.value_buffer[row : row + 1, :, start : self.length],
        )


class BufferedCache(Cache):
    """The KV cache of one generation call: a `BufferedLayer` per model layer."""

    layers: list[BufferedLayer]

    def __init__(self, layer_count: int, batch: int, capacity: int) -> None:
        super().__init__(layers=[BufferedLayer(batch, capacity) for _ in range(layer_count)])

    def start_at(self, length: int) -> None:
        """Count the first `length` columns, filled by `place`, as already cached."""
        for layer in self.layers:
            layer.length = length

    def keep_rows(self, keep: Sequence[int]) -> None:
        for layer in self.layers:
            layer.keep_rows(keep)

    def row(self, row: int, start: int) -> KVSegment:
        return tuple(layer.row(row, start) for layer in self.layers)


def _joined(pieces: Sequence[KVSegment]) -> KVSegment:
    """One segment from consecutive pieces (copied only when there are several)."""
    if len(pieces) == 1:
        return pieces[0]
    return tuple(
        (
            torch.cat([piece[layer][0] for piece in pieces], dim=-2),
            torch.cat([piece[layer][1] for piece in pieces], dim=-2),
        )
        for layer in range(len(pieces[0]))
    )


def _shared_prefix(
    model: PreTrainedModel,
    tokens: Sequence[int],
    cached: Sequence[ConversationKV | None],
    layer_count: int,
) -> KVSegment:
    """Keys and values of the prefix every prompt starts with: cut from a row's cache that covers
    it (later turns), else run once through the model (first turns)."""
    for kv in cached:
        if kv is not None and len(kv.token_ids) >= len(tokens):
            return _joined(kv_span(kv.segments, 0, len(tokens)))
    device = next(model.parameters()).device
    cache = BufferedCache(layer_count, 1, len(tokens))
    model(
        input_ids=torch.tensor([list(tokens)], dtype=torch.long, device=device),
        attention_mask=torch.ones((1, len(tokens)), dtype=torch.long, device=device),
        position_ids=torch.arange(len(tokens), device=device).unsqueeze(0),
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword_for(model): cache},
    )
    return cache.row(0, 0)


def _aligned_cache(
    prompts: Sequence[Sequence[int]],
    sources: Sequence[tuple[int, tuple[KVSegment, ...]]],
    split: int,
    starts: Sequence[int],
    layer_count: int,
    room: int,
) -> tuple[BufferedCache, int]:
    """A cache of every row's tokens from `split` on (those before are the shared prefix, held
    apart), row i right-aligned from column `starts[i]`, and how many trailing columns the model
    still has to run: the most tokens any row lacks keys for. `sources[i]` says how many leading
    tokens of prompt i have keys, and where they are; the columns before the run are copied from
    them (a row runs some known tokens again rather than leave a gap)."""
    run = max(len(prompt) - count for prompt, (count, _) in zip(prompts, sources, strict=True))
    width = starts[0] + len(prompts[0]) - split
    copied = width - run
    cache = BufferedCache(layer_count, len(prompts), width + room)
    for row, (prompt, (_, segments)) in enumerate(zip(prompts, sources, strict=True)):
        column = starts[row]
        for piece in kv_span(segments, split, len(prompt) - run):
            for layer, (keys, values) in zip(cache.layers, piece, strict=True):
                layer.place(row, column, keys, values)
            column += segment_length(piece)
    for row, start in enumerate(starts):
        if 0 < start and 0 < copied:  # left padding among the copied columns
            for layer in cache.layers:
                layer.clear_before(row, min(start, copied))
    cache.start_at(copied)
    return cache, run


def _pick_tokens(
    logits: torch.Tensor, temperature: float, greedy: bool, generator: torch.Generator | None
) -> tuple[torch.Tensor, list[float]]:
    """The next token of every row and its logprob under the sampling distribution."""
    scores = logits.float() if greedy else logits.float() / temperature
    log_probs = torch.log_softmax(scores, dim=-1)
    if greedy:
        tokens = log_probs.argmax(dim=-1)
    else:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()


def _row_sources(
    cached: Sequence[ConversationKV | None], shared: KVSegment | None, shared_length: int
) -> list[tuple[int, tuple[KVSegment, ...]]]:
    """How many leading tokens of each prompt already have keys, and where they are: the row's
    own cache when it covers the shared prefix, else the shared prefix, else nowhere."""
    sources: list[tuple[int, tuple[KVSegment, ...]]] = []
    for kv in cached:
        if kv is not None and len(kv.token_ids) >= shared_length:
            sources.append((len(kv.token_ids), kv.segments))
        elif shared is not None:
            sources.append((shared_length, (shared,)))
        else:
            sources.append((0, ()))
    return sources


def _prefill_inputs(
    prompts: Sequence[Sequence[int]], split: int, run: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions of the last `run` columns: each prompt's last tokens (none before
    `split`), left-padded. Padding gets position 0; the attention mask hides it."""
    input_ids = torch.full((len(prompts), run), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tail = list(prompt[max(split, len(prompt) - run) :])
        input_ids[row, run - len(tail) :] = torch.tensor(tail, dtype=torch.long)
    lengths = torch.tensor([len(prompt) for prompt in prompts], dtype=torch.long)
    position_ids = (lengths.unsqueeze(-1) - run + torch.arange(run)).clamp(min=0)
    return input_ids, position_ids


def _own_copies(segment: KVSegment) -> KVSegment:
    """A segment in memory of its own, for a row whose cache columns are about to be reused."""
    return tuple((keys.clone(), values.clone()) for keys, values in segment)


@torch.inference_mode()
def sample_continuations(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    stop_token_ids: set[int],
    pad_token_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    cached: Sequence[ConversationKV | None] | None = None,
    weights: object = None,
) -> list[Generation]:
    """Sample one continuation per prompt with one batched KV cache. Each token's logprob is under
    the sampling distribution (softmax of logits / temperature; greedy: temperature 1). A row stops
    at a stop token or after its own `max_new_tokens`.

    `cached[i]`, when given, holds keys and values of prompt i's first tokens (the caller checked
    that they match), so only the rest is run. The prefix all prompts share is computed (or cut
    from a cache) once; with SDPA attention it also stays out of the rows' caches and is read once
    per step for the whole batch (`shared_prefix_attention`). Each generation's `kv` covers its
    prompt and its written tokens but the last, tagged `weights`."""
    batch = len(prompts)
    device = next(model.parameters()).device
    layer_count = full_attention_layer_count(model)
    cached = list(cached or [None] * batch)
    shared_length = common_prefix_length(prompts) if batch > 1 else 0
    shared = None
    if shared_length >= 2:
        shared = _shared_prefix(model, prompts[0][:shared_length], cached, layer_count)
    apart = shared is not None and model.config._attn_implementation == "sdpa"
    split = shared_length if apart else 0
    prefix_kwargs = {"shared_prefix": shared} if apart else {}
    room = min(max(max_new_tokens), GROWTH_TOKENS)
    sources = _row_sources(cached, shared, shared_length)
    width = max(len(prompt) for prompt in prompts) - split
    starts = [width - (len(prompt) - split) for prompt in prompts]  # each row's first column
    cache, run = _aligned_cache(prompts, sources, split, starts, layer_count, room)
    input_ids, position_ids = _prefill_inputs(prompts, split, run, pad_token_id)
    columns = torch.arange(width + max(max_new_tokens), device=device)
    attention_mask = (columns >= torch.tensor(starts, device=device).unsqueeze(-1)).long()
    cache_keyword = cache_keyword_for(model)
    samples = [Generation() for _ in prompts]
    row_kv: list[KVSegment | None] = [None] * batch
    with shared_prefix_attention_in(model) if apart else nullcontext():
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask[:, :width],
            position_ids=position_ids.to(device),
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword: cache},
            **prefix_kwargs,
        ).logits[:, -1, :]
        seen = width
        next_position = position_ids[:, -1].to(device) + 1
        rows = list(range(batch))  # original row of each batch position still in the cache
        finished_in_batch = 0
        limits = list(max_new_tokens)
        live = [limit > 0 for limit in limits]
        while any(live[row] for row in rows):
            tokens, token_log_probs = _pick_tokens(logits, temperature, greedy, generator)
            for position, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                if not live[row]:
                    continue
                sample = samples[row]
                sample.token_ids.append(token)
                sample.logprobs.append(token_log_probs[position])
                if token in stop_token_ids:
                    sample.stop_token = token
                if token in stop_token_ids or len(sample.token_ids) >= limits[row]:
                    live[row] = False
                    finished_in_batch += 1
                    row_kv[row] = cache.row(position, starts[row])
            if not any(live[row] for row in rows):
                break
            if finished_in_batch * 4 >= len(rows):
                for row in rows:
                    own = row_kv[row]
                    if own is not None and not live[row]:
                        row_kv[row] = _own_copies(own)
                keep = [position for position, row in enumerate(rows) if live[row]]
                keep_index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.keep_rows(keep)
                rows = [rows[position] for position in keep]
                tokens = tokens[keep_index]
                attention_mask = attention_mask[keep_index]
                next_position = next_position[keep_index]
                finished_in_batch = 0
            seen += 1
            logits = model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=attention_mask[:, :seen],
                position_ids=next_position.unsqueeze(-1),
                use_cache=True,
                **{cache_keyword: cache},
                **prefix_kwargs,
            ).logits[:, -1, :]
            next_position = next_position + 1
    head = (shared,) if shared is not None and apart else ()
    for prompt, sample, own in zip(prompts, samples, row_kv, strict=True):
        if own is not None:
            read = (*prompt, *sample.token_ids)[: split + segment_length(own)]
            sample.kv = ConversationKV(tuple(read), (*head, own), weights)
    return samples


def model_stop_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokenizer's end-of-turn token plus the model's configured end-of-sequence tokens."""
    stop = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        stop.add(configured)
    elif configured:
        stop.update(configured)
    return {token for token in stop if token is not None}


class HFBackend:
    """A transformers causal LM as the behaviour policy. The trainer may share `model` with it, in
    which case new weights are already in place and `update_weights` only records the version.
    Generation and weight updates hold one lock, so new weights never land mid-batch.

    Each generation carries its conversation's KV cache; a request that hands it back (the next
    turn of the same conversation) prefills only its new tokens. A cache is used only if its
    tokens begin the new prompt and no `update_weights` came in between, so a rewritten history
    or new weights fall back to a full prefill (a trainer sharing `model` must therefore still
    call `update_weights` after each change)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be positive")
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs eos (end of turn) and pad tokens for rollouts")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self._stop_token_ids = model_stop_token_ids(model, tokenizer)
        self._lock = threading.Lock()
        self._weights = object()  # replaced on every weight update, invalidating older caches

    @property
    def max_context_tokens(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def stop_token_ids(self) -> set[int]:
        return set(self._stop_token_ids)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        if not requests:
            return []
        with self._lock:
            return self._generate(requests, temperature=temperature, greedy=greedy, seed=seed)

    def _generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        generator = torch.Generator()
        generator.manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            generations: list[Generation] = []
            for start in range(0, len(requests), self.max_batch_size):
                chunk = requests[start : start + self.max_batch_size]
                generations += sample_continuations(
                    self.model,
                    [request.prompt_ids for request in chunk],
                    [request.max_new_tokens for request in chunk],
                    stop_token_ids=self._stop_token_ids,
                    pad_token_id=self.tokenizer.pad_token_id,
                    temperature=temperature,
                    greedy=greedy,
                    generator=generator,
                    cached=[self._reusable_kv(request) for request in chunk],
                    weights=self._weights,
                )
            return generations
        finally:
            self.model.train(was_training)

    def _reusable_kv(self, request: GenerationRequest) -> ConversationKV | None:
        """The request's cache when the current weights computed it and its tokens begin the
        prompt, leaving at least one prompt token to run (its logits start the turn)."""
        kv = request.kv
        if kv is None or kv.weights is not self._weights:
            return None
        count = len(kv.token_ids)
        if count >= len(request.prompt_ids) or tuple(request.prompt_ids[:count]) != kv.token_ids:
            return None
        return kv

    @torch.no_grad()
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        with self._lock:
            self._update_weights(named_tensors, version)

    def _update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        updates = list(named_tensors)
        for name, tensor in updates:  # check everything before changing anything
            target = targets.get(name)
            if target is None:
                raise KeyError(f"the model has no parameter named {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{name}: new weights have shape {tuple(tensor.shape)}, "
                    f"the model's is {tuple(target.shape)}"
                )
        for name, tensor in updates:
            target = targets[name]
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor)
        self.policy_version = version
        self._weights = object()


class SolverBackend:
    """Writes each episode's turns from its environment's solver demonstration, token for token
    as the chat template renders them (logprob 0). Tool results still come from the real tools,
    so playing it through the engine checks the parser, the executor and the reward end to end."""

    def __init__(
        self, env: Environment, tokenizer: PreTrainedTokenizerBase, max_context_tokens: int = 4096
    ) -> None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "the tokenizer needs an eos_token marking the end of an assistant turn"
            )
        self.env = env
        self.tokenizer = tokenizer
        self.policy_version = 0
        self._max_context_tokens = max_context_tokens
        self._schemas = env.tool_schemas() or None
        self._turns: dict[str, list[list[int]]] = {}

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    def stop_token_ids(self) -> set[int]:
        return {self.tokenizer.eos_token_id}

    def _demonstration_turns(self, task: Task) -> list[list[int]]:
        turns = self._turns.get(task.id)
        if turns is None:
            turns = [
                self._assistant_turn_tokens(messages, position)
                for messages in [self.env.solve(task)]
                for position, message in enumerate(messages)
                if message["role"] == "assistant"
            ]
            self._turns[task.id] = turns
        return turns

    def _assistant_turn_tokens(self, messages: list[Message], position: int) -> list[int]:
        before = self.tokenizer.apply_chat_template(
            messages[:position], tools=self._schemas, add_generation_prompt=True, tokenize=False
        )
        through = self.tokenizer.apply_chat_template(
            messages[: position + 1], tools=self._schemas, tokenize=False
        )
        written = through[len(before) :]
        end = written.find(self.tokenizer.eos_token)
        if not through.startswith(before) or end < 0:
            raise ValueError("the chat template does not render assistant turns incrementally")
        text = written[: end + len(self.tokenizer.eos_token)]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        generations: list[Generation] = []
        for request in requests:
            if request.task is None:
                raise ValueError("SolverBackend needs the task of every request")
            turns = self._demonstration_turns(request.task)
            if request.turn >= len(turns):
                raise ValueError(
                    f"the demonstration of {request.task.id} has {len(turns)} assistant turns; "
                    f"turn {request.turn} was asked for"
                )
            tokens = turns[request.turn][: request.max_new_tokens]
            stop = tokens[-1] if tokens and tokens[-1] == self.tokenizer.eos_token_id else None
            generations.append(Generation(list(tokens), [0.0] * len(tokens), stop))
        return generations

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        raise TypeError("SolverBackend has no weights to update")
