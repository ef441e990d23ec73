"""Multi-turn episodes: the policy writes assistant turns, tool calls run, tool results come back as
`tool` messages rendered by the chat template, until a final answer or a limit. Generation is
batched across live episodes with a KV cache; every sampled token keeps its behaviour logprob.

Token invariant: an episode's `token_ids` are exactly what the model saw and sampled. The prompt and
every environment segment are the tokenization of what the chat template adds to its previous
rendering, appended after the sampled end-of-turn token (a special token, so tokenization restarts
there). Decoding `token_ids` gives the rendering of `messages` up to the last end-of-turn token
(assistant messages keep the raw generated text as `content`). When the sampled tokens are the
tokenizer's own encoding of their text, as in forced or demonstration turns, `token_ids` equal the
tokenization of that rendering (tested).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from node.envs.base import Environment, Message, Task
from node.tools import execute_tool_calls, extract_final_answer, parse_tool_calls, tool_messages

PROMPT_TURN = -1
DEFAULT_MAX_NEW_TOKENS = 96
DEFAULT_MAX_TOTAL_TOKENS = 2048
DEFAULT_MAX_BATCH_SIZE = 256
SUCCESS_REWARD = 1.0


class TemplatePrefixError(RuntimeError):
    """The chat template re-rendered earlier turns differently, so tokens cannot be appended."""


@dataclass
class ConversationTokens:
    """Token-level record of a conversation: ids, behaviour logprobs, loss mask, turn of each."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)

    def add_context(self, ids: Sequence[int], turn: int) -> None:
        """Append tokens the policy did not sample (prompt, tool results, template glue)."""
        self.token_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.turn_index.extend([turn] * len(ids))

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float], turn: int) -> None:
        """Append tokens written by the policy (loss-bearing) with their behaviour logprobs."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(ids)
        self.logprobs.extend(float(value) for value in logprobs)
        self.loss_mask.extend([1] * len(ids))
        self.turn_index.extend([turn] * len(ids))


@dataclass
class Episode:
    """One played episode: the conversation, its outcome and its token-level training record.

    `turn_index` is -1 on the prompt and k on assistant turn k's sampled tokens and on the tool
    results that follow it. `finish_reason` is one of: answer, no_tool_call, max_turns (the turn
    limit came with tool calls still pending; they are not run), length (the turn hit
    max_new_tokens), context (the token budget is spent), stop_token (a stop token other than the
    end-of-turn token). `rendered_text` is the text `token_ids` stand for, kept to append later
    turns exactly.
    """

    task: Task
    sample_index: int
    messages: list[Message]
    temperature: float
    tokens: ConversationTokens = field(default_factory=ConversationTokens)
    final_answer: str | None = None
    reward: float = 0.0
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    finish_reason: str = "running"
    rendered_text: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.tokens.logprobs

    @property
    def loss_mask(self) -> list[int]:
        return self.tokens.loss_mask

    @property
    def turn_index(self) -> list[int]:
        return self.tokens.turn_index

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.tokens.loss_mask)

    @property
    def done(self) -> bool:
        return self.finish_reason != "running"

    @property
    def success(self) -> bool:
        return self.reward >= SUCCESS_REWARD


def render_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    """The chat template's text for `messages` with the tools' schemas."""
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` exactly as rendered (no BOS/EOS added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def rendered_suffix(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
    seen_text: str,
    add_generation_prompt: bool = True,
) -> str:
    """What the template adds after `seen_text` when rendering `messages`."""
    text = render_conversation(tokenizer, messages, tools, add_generation_prompt)
    if not text.startswith(seen_text):
        raise TemplatePrefixError(
            "the chat template renders earlier turns differently once later turns are added; "
            "multi-turn token records need a template whose renderings extend each other"
        )
    return text[len(seen_text) :]


def tokenize_demonstration(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None,
) -> ConversationTokens:
    """Token record of a finished conversation as if the policy had written its assistant turns:
    each assistant turn up to and including its end-of-turn token is loss-bearing, all else not."""
    end_of_turn = tokenizer.eos_token
    if end_of_turn is None:
        raise ValueError("the tokenizer needs an eos_token marking the end of an assistant turn")
    record = ConversationTokens()
    seen_text = ""
    turn = PROMPT_TURN
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = rendered_suffix(tokenizer, messages[:position], tools, seen_text)
        record.add_context(encode_text(tokenizer, context), turn)
        seen_text += context
        turn += 1
        written = rendered_suffix(tokenizer, messages[: position + 1], tools, seen_text, False)
        cut = written.rfind(end_of_turn)
        if cut < 0:
            raise TemplatePrefixError(f"assistant turn rendered without {end_of_turn!r}")
        sampled = written[: cut + len(end_of_turn)]
        sampled_ids = encode_text(tokenizer, sampled)
        record.add_sampled(sampled_ids, [0.0] * len(sampled_ids), turn)
        seen_text += sampled
    tail = rendered_suffix(tokenizer, messages, tools, seen_text, False)
    record.add_context(encode_text(tokenizer, tail), turn)
    return record


@dataclass
class _TurnSample:
    token_ids: list[int]
    logprobs: list[float]
    stop_token: int | None


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
) -> list[_TurnSample]:
    """Sample one continuation per prompt with one batched KV cache. Each token's logprob is under
    the sampling distribution (softmax of logits / temperature; greedy: temperature 1). A row stops
    at a stop token or after its own `max_new_tokens`.

    The prompts' common leading tokens (the system prompt, typically) are run once and shared;
    each row's remaining tokens follow, left-padded, with position ids that skip the padding."""
    batch = len(prompts)
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    cache_keyword = cache_keyword_for(model)
    shared = common_prefix_length(prompts) if batch > 1 else 0
    if shared < 2:
        shared = 0
    else:
        model(
            input_ids=torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device),
            attention_mask=torch.ones((1, shared), dtype=torch.long, device=device),
            position_ids=torch.arange(shared, device=device).unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword: cache},
        )
        cache.batch_repeat_interleave(batch)
    rests = [prompt[shared:] for prompt in prompts]
    width = max(len(rest) for rest in rests)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    rest_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, rest in enumerate(rests):
        input_ids[row, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
        rest_mask[row, width - len(rest) :] = 1
    input_ids, rest_mask = input_ids.to(device), rest_mask.to(device)
    position_ids = (shared + rest_mask.cumsum(-1) - 1).clamp(min=0)
    attention_mask = torch.cat(
        [torch.ones((batch, shared), dtype=torch.long, device=device), rest_mask], dim=-1
    )
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **{cache_keyword: cache},
    ).logits[:, -1, :]
    next_position = position_ids[:, -1] + 1
    samples = [_TurnSample([], [], None) for _ in prompts]
    rows = list(range(batch))  # original row of each batch position still in the cache
    finished_in_batch = 0
    limits = list(max_new_tokens)
    live = [limit > 0 for limit in limits]
    while any(live[row] for row in rows):
        scores = logits.float() if greedy else logits.float() / temperature
        log_probs = torch.log_softmax(scores, dim=-1)
        if greedy:
            tokens = log_probs.argmax(dim=-1)
        else:
            tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
        token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        for position, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            if not live[row]:
                continue
            samples[row].token_ids.append(token)
            samples[row].logprobs.append(token_log_probs[position])
            if token in stop_token_ids:
                samples[row].stop_token = token
            if token in stop_token_ids or len(samples[row].token_ids) >= limits[row]:
                live[row] = False
                finished_in_batch += 1
        if not any(live[row] for row in rows):
            break
        if finished_in_batch * 4 >= len(rows):
            keep = [position for position, row in enumerate(rows) if live[row]]
            keep_index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(keep_index)
            rows = [rows[position] for position in keep]
            tokens = tokens[keep_index]
            attention_mask = attention_mask[keep_index]
            next_position = next_position[keep_index]
            finished_in_batch = 0
        attention_mask = torch.cat(
            [attention_mask, torch.ones((len(rows), 1), dtype=attention_mask.dtype, device=device)],
            dim=-1,
        )
        logits = model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=attention_mask,
            position_ids=next_position.unsqueeze(-1),
            use_cache=True,
            **{cache_keyword: cache},
        ).logits[:, -1, :]
        next_position = next_position + 1
    return samples


def _stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    stop = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        stop.add(configured)
    elif configured:
        stop.update(configured)
    return {token for token in stop if token is not None}


def _start_episode(
    tokenizer: PreTrainedTokenizerBase,
    env: Environment,
    task: Task,
    sample_index: int,
    temperature: float,
    tools: list[dict[str, Any]],
) -> Episode:
    messages = env.initial_messages(task)
    episode = Episode(
        task=task, sample_index=sample_index, messages=messages, temperature=temperature
    )
    prompt_text = render_conversation(tokenizer, messages, tools, add_generation_prompt=True)
    episode.tokens.add_context(encode_text(tokenizer, prompt_text), PROMPT_TURN)
    episode.rendered_text = prompt_text
    return episode


def _finish_turn(
    episode: Episode,
    sample: _TurnSample,
    env: Environment,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]],
    max_total_tokens: int,
) -> None:
    """Record one sampled assistant turn, run its tool calls and append their results, or end."""
    turn = episode.num_turns
    episode.num_turns += 1
    episode.tokens.add_sampled(sample.token_ids, sample.logprobs, turn)
    content_ids = sample.token_ids[:-1] if sample.stop_token is not None else sample.token_ids
    content = tokenizer.decode(content_ids, skip_special_tokens=False)
    episode.messages.append({"role": "assistant", "content": content})
    episode.rendered_text += tokenizer.decode(sample.token_ids, skip_special_tokens=False)
    if sample.stop_token is None:
        episode.finish_reason = "length"
        return
    if sample.stop_token != tokenizer.eos_token_id:
        episode.finish_reason = "stop_token"
        return
    answer = extract_final_answer(content)
    if answer is not None:
        episode.final_answer = answer
        episode.finish_reason = "answer"
        return
    calls = parse_tool_calls(content)
    if not calls:
        episode.finish_reason = "no_tool_call"
        return
    if episode.num_turns >= env.max_turns:
        episode.finish_reason = "max_turns"
        return
    results = execute_tool_calls(calls, env.tools_by_name())
    episode.num_tool_calls += len(results)
    episode.num_tool_errors += sum(result.is_error for result in results)
    results_messages = tool_messages(results)
    suffix = rendered_suffix(
        tokenizer, episode.messages + results_messages, tools, episode.rendered_text
    )
    suffix_ids = encode_text(tokenizer, suffix)
    if len(episode.token_ids) + len(suffix_ids) >= max_total_tokens:
        episode.finish_reason = "context"
        return
    episode.messages.extend(results_messages)
    episode.tokens.add_context(suffix_ids, turn)
    episode.rendered_text += suffix


def play_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: Environment,
    tasks: Sequence[Task],
    *,
    samples_per_task: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    greedy: bool = False,
    seed: int | None = None,
    max_total_tokens: int | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> list[Episode]:
    """Play `samples_per_task` episodes of every task, generating each round of assistant turns
    for all live episodes in batches, and score them with the environment's reward."""
    if not greedy and temperature <= 0:
        raise ValueError("temperature must be positive when sampling; pass greedy=True instead")
    if samples_per_task < 1 or max_new_tokens < 1 or max_batch_size < 1:
        raise ValueError("samples_per_task, max_new_tokens and max_batch_size must be positive")
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs eos (end of turn) and pad tokens for rollouts")
    context_limit = getattr(model.config, "max_position_embeddings", DEFAULT_MAX_TOTAL_TOKENS)
    max_total_tokens = min(max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS, context_limit)
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    tools = env.tool_schemas()
    stop_token_ids = _stop_token_ids(model, tokenizer)
    episodes = [
        _start_episode(tokenizer, env, task, sample_index, 1.0 if greedy else temperature, tools)
        for task in tasks
        for sample_index in range(samples_per_task)
    ]
    for episode in episodes:
        if len(episode.token_ids) >= max_total_tokens:
            episode.finish_reason = "context"
    was_training = model.training
    model.eval()
    try:
        while live := [episode for episode in episodes if not episode.done]:
            for start in range(0, len(live), max_batch_size):
                chunk = live[start : start + max_batch_size]
                budgets = [
                    min(max_new_tokens, max_total_tokens - len(episode.token_ids))
                    for episode in chunk
                ]
                samples = sample_continuations(
                    model,
                    [episode.token_ids for episode in chunk],
                    budgets,
                    stop_token_ids=stop_token_ids,
                    pad_token_id=tokenizer.pad_token_id,
                    temperature=temperature,
                    greedy=greedy,
                    generator=generator,
                )
                for episode, sample in zip(chunk, samples, strict=True):
                    _finish_turn(episode, sample, env, tokenizer, tools, max_total_tokens)
    finally:
        model.train(was_training)
    for episode in episodes:
        episode.reward = env.reward(episode.task, episode.final_answer)
    return episodes


def summarize_episodes(episodes: Sequence[Episode]) -> dict[str, float]:
    """Mean reward, success rate, tool calls and errors per episode, sampled tokens per episode."""
    count = len(episodes)
    if count == 0:
        return {"episodes": 0.0}
    return {
        "episodes": float(count),
        "reward_mean": sum(e.reward for e in episodes) / count,
        "success_rate": sum(e.success for e in episodes) / count,
        "tool_calls_mean": sum(e.num_tool_calls for e in episodes) / count,
        "tool_errors_mean": sum(e.num_tool_errors for e in episodes) / count,
        "answered_rate": sum(e.final_answer is not None for e in episodes) / count,
        "sampled_tokens_mean": sum(e.num_sampled_tokens for e in episodes) / count,
    }
