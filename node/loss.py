"""The RL trainer's objective: group-relative advantages with turn-level credit, and the
off-policy policy-gradient loss over sampled tokens (clipped, truncated or masked importance ratios
π_θ/μ, an optional k3 KL penalty to a reference policy, token- or sequence-mean aggregation).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from skillswarm.agent.rollout import ConversationTokens, Episode

# Log importance ratios are clamped to ±LOG_RATIO_BOUND before exponentiating, so a very stale
# token cannot overflow to inf (and turn a zero gradient into NaN); beyond it, it has no gradient.
LOG_RATIO_BOUND = 20.0
LOSS_METRICS = (
    "tokens",
    "clip_fraction",
    "masked_fraction",
    "truncated_fraction",
    "ratio_mean",
    "approx_kl",
    "ref_kl",
)


class LossConfig(BaseModel):
    """How rewards become advantages and advantages become the loss of one update.

    Trust regions on the per-token ratio r = π_θ/μ (μ: the behaviour policy that sampled):
    `clip` is PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with an optionally
    asymmetric band (DAPO's clip-higher, e.g. clip_high=0.28); `truncate` is truncated importance
    sampling, gradient min(r, C)·A·∇log π_θ; `mask` drops the gradient of tokens outside the band.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    normalize_advantage_std: bool = Field(
        default=True, description="divide by the group's std (GRPO); off: mean-centred only"
    )
    trust_region: Literal["clip", "truncate", "mask"] = "clip"
    clip_low: float = Field(default=0.2, gt=0, lt=1, description="band's lower edge 1 - clip_low")
    clip_high: float = Field(default=0.2, gt=0, description="band's upper edge 1 + clip_high")
    truncation_cap: float = Field(
        default=2.0, ge=1, description="truncate: the importance weight is min(r, cap)"
    )
    kl_coef: float = Field(default=0.0, ge=0, description="weight of KL(π_θ‖π_ref); 0 is off")
    kl_estimator: Literal["k3"] = "k3"
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    mean_over: Literal["informative", "all"] = Field(
        default="informative",
        description="the mean's denominator: the tokens (or sequences) of the samples with a "
        "non-zero advantage, or of every sample in the update, so that an update learned from "
        "few informative groups is a smaller step",
    )
    negative_advantage_weight: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="scales negative token advantages: 1 pushes failed samples down as much as "
        "successes up; 0 learns from the better samples only (rejection-sampling-like)",
    )
    turn_discount: float = Field(default=1.0, gt=0, le=1, description="γ between turns")
    turn_reward_weight: float = Field(default=1.0, ge=0, description="w on turn-level rewards")


# ---------------------------------------------------------------------------------------------
# Advantages


def _check_finite(name: str, values: Sequence[float]) -> None:
    for position, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"{name}[{position}] is {value}; rewards must be finite numbers")


def _group_statistics(
    values: Sequence[float], group_ids: Sequence[Hashable], epsilon: float
) -> list[tuple[float, float] | None]:
    """Per item: its group's (mean, population std), or None when that std is below `epsilon`
    (every member scored the same, so the group says nothing about which was better)."""
    if len(values) != len(group_ids):
        raise ValueError(f"{len(values)} values but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for position, group in enumerate(group_ids):
        members[group].append(position)
    statistics: list[tuple[float, float] | None] = [None] * len(values)
    for positions in members.values():
        group_values = [values[i] for i in positions]
        mean = math.fsum(group_values) / len(group_values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in group_values) / len(group_values))
        if std >= epsilon:
            for i in positions:
                statistics[i] = (mean, std)
    return statistics


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    normalize_std: bool,
    epsilon: float = 1e-6,
) -> list[float]:
    """GRPO advantages (DeepSeekMath, arXiv:2402.03300): A_i = (R_i - mean_g) / (std_g + ε), or
    R_i - mean_g without `normalize_std`; mean and population std over i's group g. Groups whose
    std is below ε (all rewards equal, or a single episode) get 0."""
    _check_finite("rewards", rewards)
    statistics = _group_statistics(rewards, group_ids, epsilon)
    advantages: list[float] = []
    for reward, stats in zip(rewards, statistics, strict=True):
        if stats is None:
            advantages.append(0.0)
            continue
        mean, std = stats
        advantages.append((reward - mean) / (std + epsilon if normalize_std else 1.0))
    return advantages


def turn_credit(turn_rewards: Sequence[float], discount: float) -> list[float]:
    """The turn-reward-to-go C_k of each assistant turn k = 0..T-1 (T = len(turn_rewards), r_j
    turn j's reward, γ the discount):

        C_k = Σ_{j=k}^{T-1} γ^(j-k) · r_j,   i.e. C_{T-1} = r_{T-1} and C_k = r_k + γ·C_{k+1}.

    A turn is credited with its own reward and the discounted rewards after it, never with
    rewards earned before it. The final reward is not in it (see `turn_advantages`)."""
    if not 0 < discount <= 1:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    _check_finite("turn_rewards", turn_rewards)
    credit = [0.0] * len(turn_rewards)
    following = 0.0
    for turn in reversed(range(len(turn_rewards))):
        credit[turn] = turn_rewards[turn] + discount * following
        following = credit[turn]
    return credit


def _spread_over_tokens(
    per_turn: Sequence[float], token_turn_index: Sequence[int], loss_mask: Sequence[int]
) -> list[float]:
    """Each loss token gets its turn's value, every other token 0."""
    if len(token_turn_index) != len(loss_mask):
        raise ValueError(f"{len(token_turn_index)} turn indices but {len(loss_mask)} mask values")
    values: list[float] = []
    for position, (turn, trained) in enumerate(zip(token_turn_index, loss_mask, strict=True)):
        if not trained:
            values.append(0.0)
        elif 0 <= turn < len(per_turn):
            values.append(per_turn[turn])
        else:
            raise ValueError(
                f"loss token {position} belongs to turn {turn}, but the episode has "
                f"{len(per_turn)} turns (one turn reward per assistant turn)"
            )
    return values


def turn_advantages(
    final_rewards: Sequence[float],
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[Hashable],
    *,
    normalize_std: bool,
    discount: float,
    turn_reward_weight: float,
    epsilon: float = 1e-6,
) -> list[list[float]]:
    """Per episode, the advantage of each of its turns: an outcome part shared by all its turns
    plus a turn-credit part of its own,

        A_{i,k} = A_i  +  w · (C_{i,k} - b_{g,k}).

    A_i is episode i's GRPO advantage on its final reward (`group_advantages`: centred on its
    group g's mean, divided by the group's std with `normalize_std`, 0 when the group's final
    rewards are all equal). C_{i,k} is turn k's turn-reward-to-go (`turn_credit`, discount γ) and
    b_{g,k} the mean of C_{·,k} over the group's episodes (0 for an episode without a turn k):
    a baseline per turn position, so a late turn is compared with late turns, and a turn that
    earned more credit than its peers is pushed up whatever the outcome. w is the turn-reward
    weight. The two parts are normalised apart: turn credit is never divided by the outcome's
    std, so a group whose final answers are all right (A_i = 0) but whose turns earned slightly
    different credit gets small advantages, not ±1. With no turn rewards every turn gets A_i.
    """
    if len(final_rewards) != len(turn_rewards):
        raise ValueError(f"{len(final_rewards)} final rewards but {len(turn_rewards)} turn lists")
    outcome = group_advantages(final_rewards, group_ids, normalize_std, epsilon)
    credits = [turn_credit(rewards, discount) for rewards in turn_rewards]
    members: dict[Hashable, list[int]] = defaultdict(list)
    for position, group in enumerate(group_ids):
        members[group].append(position)
    baselines: dict[Hashable, list[float]] = {}
    for group, positions in members.items():
        longest = max(len(credits[i]) for i in positions)
        baselines[group] = [
            math.fsum(credits[i][k] for i in positions if k < len(credits[i])) / len(positions)
            for k in range(longest)
        ]
    return [
        [
            advantage + turn_reward_weight * (value - baselines[group][k])
            for k, value in enumerate(credit)
        ]
        for advantage, credit, group in zip(outcome, credits, group_ids, strict=True)
    ]


def token_advantages(
    final_rewards: Sequence[float],
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[Hashable],
    row_episode: Sequence[int],
    row_turn_index: Sequence[Sequence[int]],
    row_loss_mask: Sequence[Sequence[int]],
    *,
    normalize_std: bool,
    discount: float,
    turn_reward_weight: float,
    epsilon: float = 1e-6,
) -> list[list[float]]:
    """Per-token advantages of training rows. Episodes are given by their final rewards, turn
    rewards and group ids; each row is one training sample of episode `row_episode[r]`, with its
    tokens' turn indices and loss mask. An episode may own several rows (its history was
    rewritten); every row's loss tokens take the advantage of their turn (`turn_advantages`), so
    splitting an episode into samples changes nothing. Context tokens get 0."""
    per_episode = turn_advantages(
        final_rewards,
        turn_rewards,
        group_ids,
        normalize_std=normalize_std,
        discount=discount,
        turn_reward_weight=turn_reward_weight,
        epsilon=epsilon,
    )
    if not len(row_episode) == len(row_turn_index) == len(row_loss_mask):
        raise ValueError(
            f"rows disagree: {len(row_episode)} episode indices, {len(row_turn_index)} turn "
            f"index lists, {len(row_loss_mask)} loss masks"
        )
    rows: list[list[float]] = []
    for row, (episode, turns, mask) in enumerate(
        zip(row_episode, row_turn_index, row_loss_mask, strict=True)
    ):
        if not 0 <= episode < len(per_episode):
            raise ValueError(f"row {row} names episode {episode} of {len(per_episode)}")
        rows.append(_spread_over_tokens(per_episode[episode], turns, mask))
    return rows


def episode_token_advantages(
    episodes: Sequence[Episode], config: LossConfig, epsilon: float = 1e-6
) -> list[tuple[ConversationTokens, list[float]]]:
    """Every training sample of every episode (episodes in order, then each one's samples in
    order) paired with its per-token advantages; episodes are grouped by task id and rewarded by
    `reward` and `turn_rewards`, with the config's std normalisation, γ and turn-reward weight;
    negative advantages are then scaled by `negative_advantage_weight`."""
    rows = [(index, sample) for index, episode in enumerate(episodes) for sample in episode.samples]
    values = token_advantages(
        [episode.reward for episode in episodes],
        [episode.turn_rewards for episode in episodes],
        [episode.task.id for episode in episodes],
        [index for index, _ in rows],
        [sample.turn_index for _, sample in rows],
        [sample.loss_mask for _, sample in rows],
        normalize_std=config.normalize_advantage_std,
        discount=config.turn_discount,
        turn_reward_weight=config.turn_reward_weight,
        epsilon=epsilon,
    )
    weight = config.negative_advantage_weight
    if weight != 1.0:
        values = [[a * weight if a < 0 else a for a in row] for row in values]
    return [(sample, advantages) for (_, sample), advantages in zip(rows, values, strict=True)]


# ---------------------------------------------------------------------------------------------
# Loss


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(q‖p) from x ~ q with log_ratio = log p(x) - log q(x):
    exp(log_ratio) - 1 - log_ratio (unbiased, never negative)."""
    return log_ratio.exp() - 1 - log_ratio


def _check_batch(tensors: Mapping[str, torch.Tensor | None]) -> None:
    shape = tensors["new_logprobs"].shape  # type: ignore[union-attr]
    if len(shape) != 2:
        raise ValueError(f"new_logprobs must be (batch, length), got shape {tuple(shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    mask = tensors["loss_mask"]
    assert mask is not None
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("loss_mask must hold only 0 and 1 (1 on tokens the policy sampled)")


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    total_tokens: int | None = None,
    total_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a (micro-)batch and its metrics. Tensors are (B, L): π_θ's logprobs (with
    grad), the behaviour policy μ's logprobs, per-token advantages A, the loss mask (1 on sampled
    tokens) and optionally a reference policy's logprobs. Tokens with mask 0 contribute nothing
    to the loss or its gradient, whatever their values (NaN and inf included).

    Per loss token, with r = exp(clamp(log π_θ - log μ, ±20)) and band [1-ε_low, 1+ε_high]:
      clip:     ℓ = -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)
      truncate: ℓ = -min(r, C)·A·log π_θ with min(r, C) detached (gradient -min(r, C)·A·∇log π_θ)
      mask:     ℓ = -r·A inside the band, 0 outside (no gradient)
    plus kl_coef·k3 with k3 = exp(log π_ref - log π_θ) - 1 - (log π_ref - log π_θ), Schulman's
    estimator of KL(π_θ‖π_ref) as in GRPO.

    token_mean: Σ_tokens ℓ / N, N = `total_tokens` (the loss tokens of the whole update when it is
    split into micro-batches; the micro-batch losses then sum to the update's loss) or this
    batch's count. sequence_mean: Σ_rows mean_row(ℓ) / S over rows with loss tokens, S =
    `total_sequences` or this batch's count. The other mode's total is ignored.

    Metrics are means over this batch's loss tokens (combine micro-batches with
    `combine_loss_metrics`): clip/masked/truncated_fraction (the share of tokens the active trust
    region clipped, masked or truncated; 0 for the other modes), ratio_mean, approx_kl (k3 of
    KL(μ‖π_θ), i.e. r - 1 - log r), ref_kl (k3 of KL(π_θ‖π_ref); 0 without reference logprobs),
    and tokens (the loss-token count).
    """
    _check_batch(
        {
            "new_logprobs": new_logprobs,
            "old_logprobs": old_logprobs,
            "advantages": advantages,
            "loss_mask": loss_mask,
            "ref_logprobs": ref_logprobs,
        }
    )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {config.kl_coef} but no ref_logprobs were given")
    dtype = torch.promote_types(new_logprobs.dtype, torch.float32)
    selected = loss_mask.bool()
    weight = selected.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=new_logprobs.device)
    new = torch.where(selected, new_logprobs.to(dtype), zero)
    old = torch.where(selected, old_logprobs.to(dtype), zero)
    advantage = torch.where(selected, advantages.to(dtype), zero)
    log_ratio = (new - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()

    lower, upper = 1 - config.clip_low, 1 + config.clip_high
    if config.trust_region == "clip":
        unclipped = ratio * advantage
        clipped = ratio.clamp(lower, upper) * advantage
        per_token = -torch.minimum(unclipped, clipped)
        limited = clipped < unclipped
    elif config.trust_region == "truncate":
        per_token = -ratio.detach().clamp(max=config.truncation_cap) * advantage * new
        limited = ratio.detach() > config.truncation_cap
    else:
        in_band = (ratio >= lower) & (ratio <= upper)
        per_token = -torch.where(in_band, ratio * advantage, zero)
        limited = ~in_band

    reference_k3: torch.Tensor | None = None
    if ref_logprobs is not None:
        ref = torch.where(selected, ref_logprobs.to(dtype), zero)
        reference_k3 = _k3((ref - new).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * reference_k3

    tokens = int(weight.sum().item())
    masked_sum = per_token * weight
    if config.aggregation == "token_mean":
        if total_tokens is not None and total_tokens < tokens:
            raise ValueError(
                f"total_tokens is {total_tokens} but this batch alone has {tokens} loss tokens"
            )
        loss = masked_sum.sum() / max(total_tokens if total_tokens is not None else tokens, 1)
    else:
        row_tokens = weight.sum(dim=1)
        rows = int((row_tokens > 0).sum().item())
        if total_sequences is not None and total_sequences < rows:
            raise ValueError(
                f"total_sequences is {total_sequences} but this batch alone has {rows} rows "
                "with loss tokens"
            )
        row_means = masked_sum.sum(dim=1) / row_tokens.clamp(min=1)
        loss = row_means.sum() / max(total_sequences if total_sequences is not None else rows, 1)

    with torch.no_grad():

        def token_mean(values: torch.Tensor) -> float:
            return float((values * weight).sum()) / tokens if tokens else 0.0

        limited_share = token_mean(limited.to(dtype))
        metrics = {
            "tokens": float(tokens),
            "clip_fraction": limited_share if config.trust_region == "clip" else 0.0,
            "masked_fraction": limited_share if config.trust_region == "mask" else 0.0,
            "truncated_fraction": limited_share if config.trust_region == "truncate" else 0.0,
            "ratio_mean": token_mean(ratio) if tokens else 1.0,
            "approx_kl": token_mean(_k3(log_ratio)),
            "ref_kl": token_mean(reference_k3) if reference_k3 is not None else 0.0,
        }
    return loss, metrics


def combine_loss_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The metrics of a whole update from its micro-batches' `policy_loss` metrics: tokens add
    up, every other metric is the token-weighted mean (what one call on the whole batch gives)."""
    if not parts:
        raise ValueError("combine_loss_metrics needs the metrics of at least one micro-batch")
    for part in parts:
        if set(part) != set(LOSS_METRICS):
            raise ValueError(f"expected policy_loss metrics {LOSS_METRICS}, got {sorted(part)}")
    total = math.fsum(part["tokens"] for part in parts)
    if total == 0:
        return dict(parts[0])
    combined = {
        name: math.fsum(part[name] * part["tokens"] for part in parts) / total
        for name in LOSS_METRICS
        if name != "tokens"
    }
    return {"tokens": total, **combined}
