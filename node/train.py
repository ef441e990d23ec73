"""Training the policy: a supervised warm start on solver demonstrations, and the policy-gradient
trainer (group-relative advantages with turn-level credit, importance-weighted loss from
`node.loss`). The loop that feeds it rollouts lives in `node.pipeline`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, get_args

import torch
from skillswarm.agent.envs.base import Environment, Message
from skillswarm.agent.inference import cache_keyword_for, common_prefix_length
from skillswarm.agent.rollout import ConversationTokens, Episode, tokenize_demonstration
from skillswarm.node.guidance import NO_SOLUTION_ERRORS
from skillswarm.node.loss import (
    LOSS_METRICS,
    LossConfig,
    combine_loss_metrics,
    episode_token_advantages,
    policy_loss,
)
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from skillswarm.node.anchor import AnchorBatches

StepCallback = Callable[[dict[str, float]], None]


def right_padded(
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


def length_sorted_micro_batches(
    lengths: Sequence[int], max_rows: int, max_tokens: int
) -> list[list[int]]:
    """Row indices in micro-batches of similar length: sorted by length, each micro-batch at most
    `max_rows` rows whose padded size (rows x its longest row) stays within `max_tokens` (a row
    longer than that goes alone). A short row padded to a long one's length costs as much compute
    as the long one, for nothing."""
    if max_rows < 1 or max_tokens < 1:
        raise ValueError("max_rows and max_tokens must be positive")
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda row: lengths[row]):
        current = batches[-1] if batches else None
        if (
            current is None
            or len(current) >= max_rows
            or (len(current) + 1) * lengths[index] > max_tokens
        ):
            batches.append([index])
        else:
            current.append(index)
    return batches


def anchor_kl(
    model: PreTrainedModel,
    reference: PreTrainedModel,
    samples: Sequence[ConversationTokens],
    pad_token_id: int,
    *,
    micro_batch_size: int = 32,
    micro_batch_tokens: int = 8192,
    scale: float = 1.0,
) -> float:
    """Backpropagate `scale` × the mean, over the sampled tokens of `samples`, of the
    full-vocabulary KL(reference ‖ model) of the next-token distribution that wrote each of them
    (the anchor of `node.anchor`); returns that mean (detached). Nothing is backpropagated when
    `scale` is 0."""
    total_tokens = sum(s.num_sampled_tokens for s in samples)
    if total_tokens == 0:
        return 0.0
    device = next(model.parameters()).device
    kl_sum = 0.0
    for indices in length_sorted_micro_batches(
        [len(s.token_ids) for s in samples], micro_batch_size, micro_batch_tokens
    ):
        part = [samples[i] for i in indices]
        input_ids, attention_mask, (loss_mask,) = right_padded(
            [s.token_ids for s in part], pad_token_id, [s.loss_mask for s in part]
        )
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        # Logits at position t predict token t + 1: keep those of the sampled tokens only.
        where = loss_mask[:, 1:].to(device).bool()
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        with torch.no_grad():
            ref_logits = reference(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).logits
        log_p = torch.log_softmax(logits[:, :-1][where].float(), dim=-1)
        log_q = torch.log_softmax(ref_logits[:, :-1][where].float(), dim=-1)
        kl = (log_q.exp() * (log_q - log_p)).sum()
        if scale:
            (kl * (scale / total_tokens)).backward()
        kl_sum += float(kl.detach())
    return kl_sum / total_tokens


def check_mix_weights(weights: Sequence[float], count: int) -> None:
    """Raise ValueError unless `weights` are `count` finite, non-negative shares, not all 0."""
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} environments")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, not negative, and not all 0: {list(weights)}")


# Training tasks drawn in a row without a solution before imitation gives up on a domain.
SOLUTION_TRIES = 64


class NoSolutionsError(ValueError):
    """Raised when an environment gives no solution for SOLUTION_TRIES training tasks in a row."""


def _solved_task(env: Environment, rng: random.Random) -> list[Message]:
    """The solution of a training task drawn with `rng`; tasks the environment has no solution
    for (`NO_SOLUTION_ERRORS`) are skipped, up to SOLUTION_TRIES in a row."""
    for _ in range(SOLUTION_TRIES):
        (task,) = env.tasks("train", 1, seed=rng.randrange(2**62))
        try:
            return env.solve(task)
        except NO_SOLUTION_ERRORS:
            continue
    raise NoSolutionsError(
        f"{env.name}: none of {SOLUTION_TRIES} training tasks drawn in a row has a solution, so "
        "its solutions cannot be imitated"
    )


# "adamw": AdamW (betas, eps); "sgd": SGD with momentum betas[0]. Adam moves every parameter
# with a non-zero gradient by about the learning rate, however small and noisy its gradient; SGD
# moves each in proportion to its gradient. On the embedded tiny base, RL with AdamW lowered
# held-out search success in every setting tried, and SGD raised it (node/recipes.py).
OptimizerName = Literal["adamw", "sgd"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)


def build_optimizer(
    kind: OptimizerName,
    model: torch.nn.Module,
    lr: float,
    betas: tuple[float, float],
    *,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer `kind` names (one of `OPTIMIZERS`) over `model`'s parameters."""
    if kind == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
    if kind == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=lr, momentum=betas[0], weight_decay=weight_decay
        )
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")


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
    weights: Sequence[float] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    optimizer: OptimizerName = "adamw",
) -> list[float]:
    """Cross-entropy on the assistant tokens of solver demonstrations (training tasks only),
    with AdamW (or `optimizer="sgd"`: SGD with momentum 0.9) and a warm-up / stable / decay
    schedule (linear warm-up, constant `lr`, then a linear decay to a tenth of it over the last
    fifth). Returns the loss per step.

    Each batch's slots go to the environments in turn; with `weights` (one per environment),
    in proportion to them over the whole run (smooth weighted round robin). `on_step(step, loss)`
    is called after each step (step counts from 1). Tasks the environment has no solution for
    are skipped."""
    if not envs:
        raise ValueError("supervised_warm_start needs at least one environment")
    if weights is not None:
        check_mix_weights(weights, len(envs))
    if steps <= 0:
        return []
    warmup = max(1, min(10, steps // 10)) if warmup_steps is None else warmup_steps
    updates = build_optimizer(optimizer, model, lr, (0.9, 0.95))

    decay_start = int(steps * 0.8)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        return 1.0 - 0.9 * (step - decay_start + 1) / max(1, steps - decay_start)

    schedule = torch.optim.lr_scheduler.LambdaLR(updates, lr_factor)
    schemas = {id(env): env.tool_schemas() for env in envs}
    rng = random.Random(seed)
    credit = [0.0] * len(envs)

    def env_for(slot: int) -> Environment:
        if weights is None:
            return envs[slot % len(envs)]
        for index, weight in enumerate(weights):
            credit[index] += weight
        chosen = max(range(len(envs)), key=lambda index: credit[index])
        credit[chosen] -= sum(weights)
        return envs[chosen]

    losses: list[float] = []
    was_training = model.training
    model.train()
    try:
        for _ in range(steps):
            by_env: dict[int, list[ConversationTokens]] = {}
            for slot in range(batch_size):
                env = env_for(slot)
                by_env.setdefault(id(env), []).append(
                    tokenize_demonstration(tokenizer, _solved_task(env, rng), schemas[id(env)])
                )
            # One forward/backward per environment: its demonstrations share the system prompt
            # (computed once) and pad only to each other. The gradients add up to those of the
            # token mean over the whole batch.
            total_tokens = sum(sum(r.loss_mask) for rs in by_env.values() for r in rs)
            updates.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for records in by_env.values():
                sequences = [record.token_ids for record in records]
                masks = [record.loss_mask for record in records]
                input_ids, attention_mask, (loss_mask,) = right_padded(
                    sequences, tokenizer.pad_token_id, masks
                )
                prefix = shared_prefix_length(sequences, masks)
                logprobs = token_logprobs(model, input_ids, attention_mask, shared_prefix=prefix)
                loss_mask = loss_mask.to(logprobs.device)
                part = -(logprobs * loss_mask).sum() / max(1, total_tokens)
                part.backward()
                loss_sum += part.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            updates.step()
            schedule.step()
            losses.append(loss_sum)
            if on_step is not None:
                on_step(len(losses), loss_sum)
    finally:
        model.train(was_training)
    return losses


class PolicyGradientTrainer:
    """Policy-gradient updates on episodes from a behaviour policy μ that may lag the trainer.

    Advantages are group-relative with turn-level credit and the per-token loss is the
    importance-weighted surrogate of `node.loss` (clipped, truncated or masked ratios π_θ/μ, an
    optional KL penalty to a frozen reference). Samples whose every token has zero advantage
    (their group's returns all equal) are left out of the update; the token mean runs over the
    loss tokens of the samples that remain, or of all samples with `mean_over="all"`. A guided
    episode (`Episode.guided`, the environment's solution added to a failed group) has no
    behaviour logprobs: the current policy's stand in for them, so its importance ratio is 1;
    its advantages are scaled by `guidance_weight`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        lr: float = 2e-4,
        *,
        loss: LossConfig | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 32,
        micro_batch_tokens: int = 8192,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        reference_model: PreTrainedModel | None = None,
        optimizer: OptimizerName = "adamw",
        adam_eps: float = 1e-8,
        guidance_weight: float = 1.0,
    ) -> None:
        if micro_batch_size < 1 or micro_batch_tokens < 1:
            raise ValueError("micro_batch_size and micro_batch_tokens must be positive")
        config = loss or LossConfig()
        overrides = {
            name: value
            for name, value in (("clip_low", clip_low), ("clip_high", clip_high))
            if value is not None
        }
        self.loss_config = LossConfig.model_validate({**config.model_dump(), **overrides})
        if self.loss_config.kl_coef > 0 and reference_model is None:
            raise ValueError("kl_coef > 0 needs a reference_model to measure the KL against")
        self.model = model
        self.tokenizer = tokenizer
        self.reference_model = reference_model
        if guidance_weight <= 0:
            raise ValueError(f"guidance_weight must be positive, got {guidance_weight}")
        self.guidance_weight = guidance_weight
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.optimizer = build_optimizer(
            optimizer, model, lr, betas, eps=adam_eps, weight_decay=weight_decay
        )
        self.updates = 0
        # The KL anchor on other domains' episodes (`node.anchor`), set by the pipeline.
        self.anchor: AnchorBatches | None = None

    def step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """One optimizer update from `episodes` (several per task); returns its metrics.
        When no sample carries a non-zero advantage, nothing is updated and `skipped` is 1."""
        config = self.loss_config
        owners = [episode for episode in episodes for _ in episode.samples]
        rows = [
            (
                sample,
                [a * self.guidance_weight for a in advantages] if episode.guided else advantages,
                episode.temperature,
            )
            for episode, (sample, advantages) in zip(
                owners, episode_token_advantages(episodes, config), strict=True
            )
            if any(a != 0.0 for a, m in zip(advantages, sample.loss_mask, strict=True) if m)
        ]
        guided = {
            id(sample) for episode in episodes if episode.guided for sample in episode.samples
        }
        trained = {id(sample) for sample, _, _ in rows}
        trained_episodes = sum(
            any(id(sample) in trained for sample in episode.samples) for episode in episodes
        )
        metrics: dict[str, float] = {
            "loss": 0.0,
            "trained_episodes": float(trained_episodes),
            "guided_episodes": float(sum(episode.guided for episode in episodes)),
            "trained_tokens": 0.0,
            "clip_fraction": 0.0,
            "masked_fraction": 0.0,
            "truncated_fraction": 0.0,
            "ratio_mean": 1.0,
            "approx_kl": 0.0,
            "ref_kl": 0.0,
            "grad_norm": 0.0,
            "skipped": 1.0,
        }
        if not rows:
            return metrics
        trained_tokens = sum(sample.num_sampled_tokens for sample, _, _ in rows)
        total_tokens, total_sequences = trained_tokens, len(rows)
        if config.mean_over == "all":
            total_tokens = sum(s.num_sampled_tokens for e in episodes for s in e.samples)
            total_sequences = len(owners)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        parts: list[dict[str, float]] = []
        micro_batches = length_sorted_micro_batches(
            [len(sample.token_ids) for sample, _, _ in rows],
            self.micro_batch_size,
            self.micro_batch_tokens,
        )
        for indices in micro_batches:
            part = [rows[index] for index in indices]
            sequences = [sample.token_ids for sample, _, _ in part]
            masks = [sample.loss_mask for sample, _, _ in part]
            input_ids, attention_mask, (old_logprobs, loss_mask, advantages) = right_padded(
                sequences,
                self.tokenizer.pad_token_id,
                [sample.logprobs for sample, _, _ in part],
                masks,
                [values for _, values, _ in part],
            )
            temperatures = torch.tensor([temperature for _, _, temperature in part])
            prefix = shared_prefix_length(sequences, masks)
            new_logprobs = token_logprobs(
                self.model, input_ids, attention_mask, temperatures, shared_prefix=prefix
            )
            guided_rows = torch.tensor([id(sample) in guided for sample, _, _ in part])
            if bool(guided_rows.any()):
                # No policy sampled a guided episode: its behaviour logprobs are the current
                # policy's own (importance ratio 1).
                old_logprobs = torch.where(
                    guided_rows.view(-1, 1).to(new_logprobs.device),
                    new_logprobs.detach(),
                    old_logprobs.to(new_logprobs.device),
                )
            reference = None
            if self.reference_model is not None and config.kl_coef > 0:
                with torch.no_grad():
                    reference = token_logprobs(
                        self.reference_model,
                        input_ids,
                        attention_mask,
                        temperatures,
                        shared_prefix=prefix,
                    )
            device = new_logprobs.device
            loss, part_metrics = policy_loss(
                new_logprobs,
                old_logprobs.to(device),
                advantages.to(device),
                loss_mask.to(device),
                config,
                ref_logprobs=None if reference is None else reference.to(device),
                total_tokens=total_tokens,
                total_sequences=total_sequences,
            )
            loss.backward()
            loss_sum += float(loss.detach())
            parts.append(part_metrics)
        if self.anchor is not None and self.anchor.coef > 0:
            assert self.reference_model is not None, "the anchor needs the reference model"
            kl = anchor_kl(
                self.model,
                self.reference_model,
                self.anchor.take(),
                self.tokenizer.pad_token_id,
                micro_batch_size=self.micro_batch_size,
                micro_batch_tokens=self.micro_batch_tokens,
                scale=self.anchor.coef,
            )
            metrics["anchor_kl"] = kl
            loss_sum += self.anchor.coef * kl
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        )
        combined = combine_loss_metrics(parts)
        metrics.update(
            loss=loss_sum,
            trained_tokens=float(trained_tokens),
            grad_norm=grad_norm,
            **{key: combined[key] for key in LOSS_METRICS if key != "tokens" and key in combined},
        )
        if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            metrics["nonfinite"] = 1.0
            return metrics
        self.optimizer.step()
        self.updates += 1
        metrics["skipped"] = 0.0
        return metrics
