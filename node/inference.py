"""Inference backends for rollouts: token prompts in, sampled continuations out, each sampled token
with its behaviour logprob. `HFBackend` runs a transformers model (the CPU default: batched, one KV
cache per call, weights replaceable in place); `SolverBackend` writes an environment's
demonstration turns (for checks and the terminal viewer); the vLLM backend lives in
`node.inference_vllm` and is imported only when asked for.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from node.envs.base import Environment, Message, Task

DEFAULT_MAX_BATCH_SIZE = 256


@dataclass(frozen=True)
class GenerationRequest:
    """One continuation to write: the full token prompt and the most tokens it may add. `task`
    and `turn` say which episode turn it is (a solver backend needs them; models ignore them)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    task: Task | None = None
    turn: int = 0


@dataclass
class Generation:
    """A written continuation: its tokens, each token's logprob under the sampling distribution,
    and the stop token it ended on (None when it ran out of budget)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_token: int | None = None


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
        distribution (softmax(logits / temperature)); greedy decoding reports temperature 1."""
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
) -> list[Generation]:
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
    samples = [Generation() for _ in prompts]
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
    Generation and weight updates hold one lock, so new weights never land mid-batch."""

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
                )
            return generations
        finally:
            self.model.train(was_training)

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
