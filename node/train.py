"""Training the policy: a supervised warm start on solver demonstrations, and a GRPO-style
policy-gradient trainer (group-relative advantages, clipped importance ratios π_θ/μ, token-mean
loss over sampled tokens), with the synchronous play-then-update loop the node runs.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from node.envs.base import Environment
from node.model import set_torch_threads
from node.rollout import (
    DEFAULT_MAX_NEW_TOKENS,
    ConversationTokens,
    Episode,
    cache_keyword_for,
    common_prefix_length,
    play_episodes,
    summarize_episodes,
    tokenize_demonstration,
)

StepCallback = Callable[[dict[str, float]], None]


def _right_padded(
    sequences: Sequence[Sequence[int]], pad_token_id: int, *extra: Sequence[Sequence[float]]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token ids (B, L), attention mask (B, L), and each `extra` per-token list padded with 0."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    padded_extra = [torch.zeros((len(sequences), width), dtype=torch.float32) for _ in extra]
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
        for values, target in zip(extra, padded_extra, strict=True):
            target[row, : len(sequence)] = torch.tensor(values[row], dtype=torch.float32)
    return input_ids, attention_mask, padded_extra


def shared_prefix_length(
    sequences: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[float]]
) -> int:
    """Length of the leading tokens every row has in common and none trains on (typically the
    system prompt): `token_logprobs` runs them once for the whole batch."""
    first_trained = min(
        next((i for i, value in enumerate(mask) if value), len(mask)) for mask in loss_masks
    )
    return min(common_prefix_length(sequences), first_trained)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    shared_prefix: int = 0,
) -> torch.Tensor:
    """log π(token_t | tokens_<t) for a right-padded batch, shape (B, L); `temperature` (a float
    or a (B,) tensor) scales logits as the sampler did. With `shared_prefix` = P ≥ 2 (the first P
    tokens identical in every row), the prefix runs once and positions below P get 0."""
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    batch, width = input_ids.shape
    if shared_prefix >= 2:
        cache = DynamicCache(config=model.config)
        cache_keyword = cache_keyword_for(model)
        prefix_logits = model(
            input_ids=input_ids[:1, :shared_prefix],
            attention_mask=attention_mask[:1, :shared_prefix],
            position_ids=torch.arange(shared_prefix, device=device).unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword: cache},
        ).logits
        cache.batch_repeat_interleave(batch)
        suffix_logits = model(
            input_ids=input_ids[:, shared_prefix:],
            attention_mask=attention_mask,
            position_ids=torch.arange(shared_prefix, width, device=device).expand(batch, -1),
            use_cache=True,
            **{cache_keyword: cache},
        ).logits[:, :-1, :]
        logits = torch.cat([prefix_logits.expand(batch, -1, -1), suffix_logits], dim=1)
        start = shared_prefix
    else:
        position_ids = torch.arange(width, device=device).expand_as(input_ids)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).logits[:, :-1, :]
        start = 1
    if isinstance(temperature, torch.Tensor):
        logits = logits.float() / temperature.to(device).view(-1, 1, 1)
    else:
        logits = logits.float() / temperature
    targets = input_ids[:, start:, None]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
    return torch.nn.functional.pad(picked, (start, 0))


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    envs: Sequence[Environment],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    *,
    warmup_steps: int | None = None,
    max_grad_norm: float = 1.0,
) -> list[float]:
    """Cross-entropy on the assistant tokens of solver demonstrations (training tasks only),
    with AdamW and a warm-up / stable / decay schedule (linear warm-up, constant `lr`, then a
    linear decay to a tenth of it over the last fifth). Returns the loss per step."""
    if not envs:
        raise ValueError("supervised_warm_start needs at least one environment")
    if steps <= 0:
        return []
    warmup = max(1, min(10, steps // 10)) if warmup_steps is None else warmup_steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    decay_start = int(steps * 0.8)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        return 1.0 - 0.9 * (step - decay_start + 1) / max(1, steps - decay_start)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    schemas = {id(env): env.tool_schemas() for env in envs}
    rng = random.Random(seed)
    losses: list[float] = []
    was_training = model.training
    model.train()
    try:
        for _ in range(steps):
            records: list[ConversationTokens] = []
            for slot in range(batch_size):
                env = envs[slot % len(envs)]
                (task,) = env.tasks("train", 1, seed=rng.randrange(2**62))
                records.append(tokenize_demonstration(tokenizer, env.solve(task), schemas[id(env)]))
            sequences = [record.token_ids for record in records]
            masks = [record.loss_mask for record in records]
            input_ids, attention_mask, (loss_mask,) = _right_padded(
                sequences, tokenizer.pad_token_id, masks
            )
            prefix = shared_prefix_length(sequences, masks)
            logprobs = token_logprobs(model, input_ids, attention_mask, shared_prefix=prefix)
            loss = -(logprobs * loss_mask).sum() / loss_mask.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    finally:
        model.train(was_training)
    return losses


def group_advantages(episodes: Sequence[Episode], epsilon: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its task group's mean, over the group's std; groups
    whose rewards are all equal carry no signal and get 0."""
    groups: dict[str, list[int]] = defaultdict(list)
    for position, episode in enumerate(episodes):
        groups[episode.task.id].append(position)
    advantages = [0.0] * len(episodes)
    for members in groups.values():
        rewards = torch.tensor([episodes[i].reward for i in members], dtype=torch.float64)
        std = float(rewards.std(unbiased=False))
        if std < epsilon:
            continue
        mean = float(rewards.mean())
        for i in members:
            advantages[i] = (episodes[i].reward - mean) / (std + epsilon)
    return advantages


class PolicyGradientTrainer:
    """GRPO-style updates on episodes from a behaviour policy μ (which may lag the trainer).

    Per sampled token: ratio r = π_θ/μ, loss -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A), averaged
    over all loss-bearing tokens of the update (token-mean). Episodes with zero advantage (their
    group's rewards all equal) carry no gradient and are left out of the update and the mean.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        lr: float = 2e-4,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 32,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not (0 < clip_low < 1 and clip_high > 0):
            raise ValueError("need 0 < clip_low < 1 and clip_high > 0")
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be positive")
        self.model = model
        self.tokenizer = tokenizer
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.updates = 0

    def step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """One optimizer update from `episodes` (several per task); returns its metrics.
        When no group has reward variance, nothing is updated and `skipped` is 1."""
        advantages = group_advantages(episodes)
        chosen = [
            (episode, advantage)
            for episode, advantage in zip(episodes, advantages, strict=True)
            if advantage != 0.0 and episode.num_sampled_tokens > 0
        ]
        metrics: dict[str, float] = {
            "loss": 0.0,
            "trained_episodes": float(len(chosen)),
            "trained_tokens": 0.0,
            "clip_fraction": 0.0,
            "ratio_mean": 1.0,
            "approx_kl": 0.0,
            "grad_norm": 0.0,
            "skipped": 1.0,
        }
        if not chosen:
            return metrics
        total_tokens = sum(episode.num_sampled_tokens for episode, _ in chosen)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped = ratio_sum = kl_sum = 0.0
        for start in range(0, len(chosen), self.micro_batch_size):
            part = chosen[start : start + self.micro_batch_size]
            sequences = [episode.token_ids for episode, _ in part]
            masks = [episode.loss_mask for episode, _ in part]
            input_ids, attention_mask, (old_logprobs, loss_mask) = _right_padded(
                sequences,
                self.tokenizer.pad_token_id,
                [episode.logprobs for episode, _ in part],
                masks,
            )
            temperatures = torch.tensor([episode.temperature for episode, _ in part])
            advantage = torch.tensor([a for _, a in part], dtype=torch.float32).view(-1, 1)
            new_logprobs = token_logprobs(
                self.model,
                input_ids,
                attention_mask,
                temperatures,
                shared_prefix=shared_prefix_length(sequences, masks),
            )
            device = new_logprobs.device
            old_logprobs, loss_mask, advantage = (
                old_logprobs.to(device),
                loss_mask.to(device),
                advantage.to(device),
            )
            log_ratio = (new_logprobs - old_logprobs) * loss_mask
            ratio = log_ratio.exp()
            clipped_ratio = ratio.clamp(1 - self.clip_low, 1 + self.clip_high)
            per_token = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
            loss = (per_token * loss_mask).sum() / total_tokens
            loss.backward()
            with torch.no_grad():
                loss_sum += float(loss)
                clip_active = (clipped_ratio * advantage < ratio * advantage).float()
                clipped += float((clip_active * loss_mask).sum())
                ratio_sum += float((ratio * loss_mask).sum())
                kl_sum += float((-log_ratio * loss_mask).sum())
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        )
        metrics.update(
            loss=loss_sum,
            trained_tokens=float(total_tokens),
            clip_fraction=clipped / total_tokens,
            ratio_mean=ratio_sum / total_tokens,
            approx_kl=kl_sum / total_tokens,
            grad_norm=grad_norm,
        )
        if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            metrics["nonfinite"] = 1.0
            return metrics
        self.optimizer.step()
        self.updates += 1
        metrics["skipped"] = 0.0
        return metrics


def train_rl(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: Environment,
    steps: int,
    tasks_per_step: int = 16,
    samples_per_task: int = 8,
    seed: int = 0,
    on_step: StepCallback | None = None,
    *,
    lr: float = 2e-4,
    temperature: float = 1.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    trainer: PolicyGradientTrainer | None = None,
    num_threads: int | None = None,
    **trainer_options: Any,
) -> list[dict[str, float]]:
    """Play a fresh batch of training tasks with the current policy, update on it, repeat.
    Each step's metrics (reward mean, success rate, tool calls, update statistics, seconds) are
    passed to `on_step` and returned. `num_threads`, when given, sets torch's threads first."""
    if num_threads is not None:
        set_torch_threads(num_threads)
    trainer = trainer or PolicyGradientTrainer(model, tokenizer, lr=lr, **trainer_options)
    history: list[dict[str, float]] = []
    for step in range(steps):
        step_seed = seed * 1_000_003 + step
        started = time.perf_counter()
        tasks = env.tasks("train", tasks_per_step, seed=step_seed)
        episodes = play_episodes(
            model,
            tokenizer,
            env,
            tasks,
            samples_per_task=samples_per_task,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            seed=step_seed,
        )
        rollout_seconds = time.perf_counter() - started
        metrics = {"step": float(step), **summarize_episodes(episodes), **trainer.step(episodes)}
        metrics["rollout_seconds"] = rollout_seconds
        metrics["step_seconds"] = time.perf_counter() - started
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
    return history
