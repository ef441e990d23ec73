"""The RL loss module: advantages with turn-level credit, the three trust regions, the k3 KL
penalty and the aggregations, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from skillswarm.node.loss import (
    LossConfig,
    combine_loss_metrics,
    episode_token_advantages,
    group_advantages,
    policy_loss,
    token_advantages,
    turn_advantages,
    turn_credit,
)

NAN, INF = float("nan"), float("inf")

# Two rows of four tokens. Row 0: a prompt token (mask 0) then three sampled tokens; row 1: a
# sampled token, a two-token tool result (mask 0), a sampled token. The masked positions hold
# wild values (NaN, ±inf, huge) that must not reach the loss or the gradient.
# The five loss tokens, with ratio r = π_θ/μ and advantage A:
#   t1 r=1.0 A=1    t2 r=1.5 A=1    t3 r=0.5 A=-0.5    (row 0)
#   t4 r=1.1 A=-1   t5 r=3.0 A=-1                      (row 1; t2, t3, t5 are stale: outside
#                                                       the band [0.8, 1.2])
NEW = [[30.0, -1.0, -0.5, -2.0], [-0.25, NAN, 1e4, -1.0]]
RATIOS = [[1.0, 1.0, 1.5, 0.5], [1.1, 1.0, 1.0, 3.0]]
WILD_OLD = {(0, 0): -INF, (1, 1): 0.0, (1, 2): -1e4}
MASK = [[0, 1, 1, 1], [1, 0, 0, 1]]
ADVANTAGES = [[1e9, 1.0, 1.0, -0.5], [-1.0, NAN, INF, -1.0]]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    new = torch.tensor(NEW, requires_grad=True)
    old = [
        [WILD_OLD.get((b, t), NEW[b][t] - math.log(RATIOS[b][t])) for t in range(4)]
        for b in range(2)
    ]
    return new, torch.tensor(old), torch.tensor(ADVANTAGES), torch.tensor(MASK)


def loss_and_grad(config: LossConfig, **kwargs) -> tuple[float, torch.Tensor, dict[str, float]]:
    new, old, advantages, mask = batch()
    loss, metrics = policy_loss(new, old, advantages, mask, config, **kwargs)
    loss.backward()
    assert new.grad is not None
    return loss.item(), new.grad, metrics


# Per-token gradient of the token-mean loss w.r.t. new logprobs, by hand (N = 5 loss tokens):
#   clip:     unclipped tokens -r·A/N (t1: -0.2, t4: 0.22, t5: 0.6 — with A < 0 and r > 1.2 the
#             min keeps the unclipped branch, as in PPO); t2, t3 clipped: 0
#   truncate: -min(r, 2)·A/N = t1 -0.2, t2 -0.3, t3 0.05, t4 0.22, t5 -2·(-1)/5 = 0.4
#   mask:     -r·A/N inside [0.8, 1.2] (t1 -0.2, t4 0.22), 0 outside
@pytest.mark.parametrize(
    ("trust_region", "expected_loss", "expected_grad", "fraction_name", "fraction"),
    [
        # ℓ: t1 -1, t2 -1.2 (clipped), t3 +0.4 (clipped: -min(-0.25, -0.4)), t4 1.1, t5 3 → 2.3/5
        ("clip", 0.46, [[0, -0.2, 0, 0], [0.22, 0, 0, 0.6]], "clip_fraction", 0.4),
        # ℓ = -min(r,2)·A·logπ: t1 1·1·1 = 1, t2 0.75, t3 -0.5, t4 -0.275, t5 -2 → -1.025/5
        ("truncate", -0.205, [[0, -0.2, -0.3, 0.05], [0.22, 0, 0, 0.4]], "truncated_fraction", 0.2),
        # ℓ: t1 -1, t4 1.1, others masked → 0.1/5
        ("mask", 0.02, [[0, -0.2, 0, 0], [0.22, 0, 0, 0]], "masked_fraction", 0.6),
    ],
)
def test_stale_tokens_under_each_trust_region(
    trust_region: str,
    expected_loss: float,
    expected_grad: list[list[float]],
    fraction_name: str,
    fraction: float,
) -> None:
    config = LossConfig(trust_region=trust_region)
    loss, grad, metrics = loss_and_grad(config)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(expected_grad), atol=1e-6, rtol=0)
    assert metrics[fraction_name] == pytest.approx(fraction)
    for other in {"clip_fraction", "truncated_fraction", "masked_fraction"} - {fraction_name}:
        assert metrics[other] == 0.0
    assert metrics["tokens"] == 5.0
    assert metrics["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.1 + 3.0) / 5)
    # k3 of KL(μ‖π_θ) = r - 1 - ln r per token: 0, 0.0945349, 0.1931472, 0.0046898, 0.9013877
    expected_kl = (0.0 + 0.0945349 + 0.1931472 + 0.0046898 + 0.9013877) / 5
    assert metrics["approx_kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert metrics["ref_kl"] == 0.0


def test_masked_tool_span_contributes_nothing_whatever_its_values() -> None:
    config = LossConfig()
    loss_wild, grad_wild, _ = loss_and_grad(config)
    assert torch.isfinite(grad_wild).all()
    assert grad_wild[0, 0] == 0 and grad_wild[1, 1] == 0 and grad_wild[1, 2] == 0
    # The same batch with tame values on the masked positions gives the same loss and gradient.
    new, old, advantages, mask = batch()
    tame = mask.bool()
    new = torch.where(tame, new.detach(), -1.0).requires_grad_(True)
    loss, _ = policy_loss(
        new, torch.where(tame, old, -1.0), torch.where(tame, advantages, 0.0), mask, config
    )
    loss.backward()
    assert loss.item() == pytest.approx(loss_wild)
    torch.testing.assert_close(new.grad, grad_wild)


def test_sequence_mean_averages_row_means() -> None:
    # Row 0 mean: (-1 - 1.2 + 0.4)/3 = -0.6; row 1 mean: (1.1 + 3)/2 = 2.05; (−0.6 + 2.05)/2.
    loss, grad, _ = loss_and_grad(LossConfig(aggregation="sequence_mean"))
    assert loss == pytest.approx(0.725, abs=1e-6)
    # Row 0 tokens weigh 1/(3·2), row 1 tokens 1/(2·2): t1 -1/6, t4 1.1/4, t5 3/4.
    expected = torch.tensor([[0, -1 / 6, 0, 0], [0.275, 0, 0, 0.75]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("trust_region", ["clip", "truncate", "mask"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batches_sum_to_the_whole_update(trust_region: str, aggregation: str) -> None:
    config = LossConfig(trust_region=trust_region, aggregation=aggregation)
    whole_loss, whole_grad, whole_metrics = loss_and_grad(config)
    new, old, advantages, mask = batch()
    total = 0.0
    parts = []
    for row in (slice(0, 1), slice(1, 2)):
        loss, metrics = policy_loss(
            new[row],
            old[row],
            advantages[row],
            mask[row],
            config,
            total_tokens=5,
            total_sequences=2,
        )
        loss.backward()
        total += loss.item()
        parts.append(metrics)
    assert total == pytest.approx(whole_loss, abs=1e-6)
    torch.testing.assert_close(new.grad, whole_grad)
    combined = combine_loss_metrics(parts)
    assert combined == pytest.approx(whole_metrics)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    length=st.integers(1, 6),
    trust_region=st.sampled_from(["clip", "truncate", "mask"]),
    aggregation=st.sampled_from(["token_mean", "sequence_mean"]),
    data=st.data(),
)
def test_any_split_into_micro_batches_matches_the_whole(
    seed: int, rows: int, length: int, trust_region: str, aggregation: str, data: st.DataObject
) -> None:
    generator = torch.Generator().manual_seed(seed)
    new = torch.randn(rows, length, generator=generator, dtype=torch.float64) - 1
    old = new + 0.5 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, length, generator=generator, dtype=torch.float64)
    ref = new + 0.3 * torch.randn(rows, length, generator=generator, dtype=torch.float64)
    mask = (torch.rand(rows, length, generator=generator) < 0.6).long()
    config = LossConfig(trust_region=trust_region, aggregation=aggregation, kl_coef=0.05)
    whole_new = new.clone().requires_grad_(True)
    whole_loss, whole_metrics = policy_loss(whole_new, old, advantages, mask, config, ref)
    whole_loss.backward()
    cut = data.draw(st.integers(0, rows))
    split_new = new.clone().requires_grad_(True)
    total_tokens = int(mask.sum())
    total_sequences = int((mask.sum(dim=1) > 0).sum())
    loss_sum = 0.0
    parts = []
    for part in (slice(0, cut), slice(cut, rows)):
        loss, metrics = policy_loss(
            split_new[part],
            old[part],
            advantages[part],
            mask[part],
            config,
            ref[part],
            total_tokens=total_tokens,
            total_sequences=total_sequences,
        )
        loss.backward()
        loss_sum += loss.item()
        parts.append(metrics)
    assert loss_sum == pytest.approx(whole_loss.item(), abs=1e-9)
    assert split_new.grad is not None and whole_new.grad is not None
    torch.testing.assert_close(split_new.grad, whole_new.grad)
    assert combine_loss_metrics(parts) == pytest.approx(whole_metrics)


def test_combine_loss_metrics_refuses_what_policy_loss_did_not_make() -> None:
    with pytest.raises(ValueError, match="at least one micro-batch"):
        combine_loss_metrics([])
    with pytest.raises(ValueError, match="expected policy_loss metrics"):
        combine_loss_metrics([{"tokens": 1.0, "loss": 0.5}])
    _, _, metrics = loss_and_grad(LossConfig())
    empty = {**metrics, "tokens": 0.0}
    assert combine_loss_metrics([empty, metrics]) == pytest.approx(metrics)


def test_asymmetric_band_clips_higher() -> None:
    def single(ratio: float, advantage: float, config: LossConfig) -> tuple[float, float, float]:
        new = torch.tensor([[math.log(0.5)]], requires_grad=True)
        old = torch.tensor([[math.log(0.5) - math.log(ratio)]])
        loss, metrics = policy_loss(
            new, old, torch.tensor([[advantage]]), torch.tensor([[1]]), config
        )
        loss.backward()
        assert new.grad is not None
        return loss.item(), float(new.grad), metrics["clip_fraction"]

    # r = 1.25, A = 1: clipped at 1.2 by the symmetric band, inside [0.8, 1.28].
    assert single(1.25, 1.0, LossConfig()) == pytest.approx((-1.2, 0.0, 1.0))
    assert single(1.25, 1.0, LossConfig(clip_high=0.28)) == pytest.approx((-1.25, -1.25, 0.0))
    # r = 0.75, A = -1: -min(-0.75, -0.8) = 0.8, clipped by the lower edge.
    assert single(0.75, -1.0, LossConfig(clip_high=0.28)) == pytest.approx((0.8, 0.0, 1.0))


def test_extremely_stale_token_stays_finite() -> None:
    # log r = 100 is clamped to 20: the loss is finite and the token has no gradient.
    new = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    loss, metrics = policy_loss(
        new, old, torch.tensor([[-1.0, 0.0]]), torch.tensor([[1, 1]]), LossConfig()
    )
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(20) / 2)
    assert new.grad is not None and new.grad.tolist() == [[0.0, 0.0]]
    assert math.isfinite(metrics["approx_kl"])


def test_k3_kl_to_the_reference_policy() -> None:
    # On-policy tokens with zero advantage: only the KL term is left. log π_ref - log π_θ is
    # ln 2, 0, -ln 2 → k3 = e^δ - 1 - δ = 1 - ln 2, 0, ln 2 - 1/2 (sum exactly 1/2).
    new = torch.tensor([[-1.0, -2.0, -0.5, 7.0]], requires_grad=True)
    old = new.detach().clone()
    ref = torch.tensor([[-1.0 + math.log(2), -2.0, -0.5 - math.log(2), NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages = torch.zeros(1, 4)
    loss, metrics = policy_loss(new, old, advantages, mask, LossConfig(kl_coef=0.1), ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * 0.5 / 3)
    assert metrics["ref_kl"] == pytest.approx(0.5 / 3)
    assert metrics["approx_kl"] == pytest.approx(0.0)
    # d k3 / d log π_θ = 1 - e^δ: -1, 0, 1/2; times kl_coef / N.
    expected = torch.tensor([[-0.1 / 3, 0.0, 0.05 / 3, 0.0]])
    assert new.grad is not None
    torch.testing.assert_close(new.grad, expected)
    # kl_coef 0 with reference logprobs: reported, not trained on.
    silent, silent_metrics = policy_loss(new, old, advantages, mask, LossConfig(), ref)
    assert silent.item() == 0.0 and silent_metrics["ref_kl"] == pytest.approx(0.5 / 3)


def test_empty_batch_gives_zero_loss_and_neutral_metrics() -> None:
    new = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(
        new, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), LossConfig()
    )
    loss.backward()
    assert loss.item() == 0.0
    assert new.grad is not None and not new.grad.any()
    assert metrics["tokens"] == 0.0 and metrics["ratio_mean"] == 1.0


def test_policy_loss_refuses_bad_inputs() -> None:
    new, old, advantages, mask = batch()
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(new, old, advantages[:, :3], mask, LossConfig())
    with pytest.raises(ValueError, match="loss_mask must hold only 0 and 1"):
        policy_loss(new, old, advantages, mask * 2, LossConfig())
    with pytest.raises(ValueError, match="no ref_logprobs"):
        policy_loss(new, old, advantages, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="total_tokens is 4"):
        policy_loss(new, old, advantages, mask, LossConfig(), total_tokens=4)
    with pytest.raises(ValueError, match="total_sequences is 1"):
        policy_loss(
            new, old, advantages, mask, LossConfig(aggregation="sequence_mean"), total_sequences=1
        )
    with pytest.raises(ValueError, match="batch, length"):
        policy_loss(new[0], old[0], advantages[0], mask[0], LossConfig())


def test_config_defaults() -> None:
    config = LossConfig()
    assert config.model_dump() == {
        "normalize_advantage_std": True,
        "trust_region": "clip",
        "clip_low": 0.2,
        "clip_high": 0.2,
        "truncation_cap": 2.0,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "aggregation": "token_mean",
        "mean_over": "informative",
        "negative_advantage_weight": 1.0,
        "turn_discount": 1.0,
        "turn_reward_weight": 1.0,
    }


@pytest.mark.parametrize(
    "bad",
    [
        {"clip_low": 0.0},
        {"clip_low": 1.0},
        {"clip_high": 0.0},
        {"truncation_cap": 0.5},
        {"kl_coef": -0.1},
        {"kl_coef": NAN},
        {"turn_discount": 0.0},
        {"turn_discount": 1.5},
        {"turn_reward_weight": -1.0},
        {"negative_advantage_weight": -0.1},
        {"negative_advantage_weight": 1.5},
        {"turn_reward_weight": INF},
        {"trust_region": "ppo"},
        {"kl_estimator": "k1"},
        {"aggregation": "sum"},
        {"clip_ratio": 0.2},
    ],
)
def test_config_refuses_invalid_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        LossConfig(**bad)


# ---------------------------------------------------------------------------------------------
# Advantages


def test_group_advantages_with_and_without_std() -> None:
    rewards = [1.0, 0.0, 2.0, 2.0, 3.0, 0.0, 0.0, 3.0]
    groups = ["a", "a", "b", "b", "c", "d", "d", "d"]
    # a: mean 0.5, std 0.5. b: all equal. c: alone. d: mean 1, std √2.
    centred = group_advantages(rewards, groups, normalize_std=False)
    assert centred == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, -1.0, -1.0, 2.0])
    normalized = group_advantages(rewards, groups, normalize_std=True)
    root2 = math.sqrt(2)
    assert normalized == pytest.approx(
        [1.0, -1.0, 0.0, 0.0, 0.0, -1 / root2, -1 / root2, 2 / root2], abs=1e-5
    )
    assert normalized[2:5] == [0.0, 0.0, 0.0]


def test_group_advantages_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="2 values but 1 group ids"):
        group_advantages([1.0, 0.0], ["a"], normalize_std=True)
    with pytest.raises(ValueError, match="rewards\\[1\\] is nan"):
        group_advantages([1.0, NAN], ["a", "a"], normalize_std=True)


def test_turn_credit_is_the_discounted_turn_reward_to_go() -> None:
    # r = (0.5, 0, 1), γ = 0.5: C_2 = 1; C_1 = 0 + 0.5·1 = 0.5; C_0 = 0.5 + 0.5·0.5 = 0.75.
    assert turn_credit([0.5, 0.0, 1.0], 0.5) == pytest.approx([0.75, 0.5, 1.0])
    assert turn_credit([0.5, 0.0, 1.0], 1.0) == pytest.approx([1.5, 1.0, 1.0])
    assert turn_credit([0.0, 0.0], 1.0) == [0.0, 0.0]
    assert turn_credit([], 0.5) == []
    with pytest.raises(ValueError, match="discount must be in"):
        turn_credit([1.0], 0.0)
    with pytest.raises(ValueError, match="turn_rewards\\[0\\] is nan"):
        turn_credit([NAN], 1.0)


def test_turn_advantages_add_per_position_centred_credit_to_the_outcome_advantage() -> None:
    # γ = 0.5.
    # Group a, both answers right (outcome part 0 whatever the normalisation):
    #   e0: r = (0.1, 0, 0.1) → C = (0.125, 0.05, 0.1);  e1: r = (0, 0.1) → C = (0.05, 0.1).
    #   Baselines per turn position: b_0 = 0.0875, b_1 = 0.075, b_2 = (0.1 + 0) / 2 = 0.05.
    #   e0: (0.0375, -0.025, 0.05); e1: (-0.0375, 0.025). Small, never ±1: the turn credit is
    #   not divided by an outcome std.
    # Group b: e2 R = 1, e3 R = 0, no turn rewards: ±0.5 centred, ±1 normalised, on every turn.
    # Group c: one episode: its credit is its own baseline, and its outcome part is 0.
    args = (
        [1.0, 1.0, 1.0, 0.0, 4.0],
        [[0.1, 0.0, 0.1], [0.0, 0.1], [0.0], [0.0, 0.0], [1.0, 1.0]],
        ["a", "a", "b", "b", "c"],
    )
    centred = turn_advantages(*args, normalize_std=False, discount=0.5, turn_reward_weight=1.0)
    expected_a = [pytest.approx([0.0375, -0.025, 0.05]), pytest.approx([-0.0375, 0.025])]
    assert centred == [*expected_a, pytest.approx([0.5]), pytest.approx([-0.5, -0.5]), [0, 0]]
    normalized = turn_advantages(*args, normalize_std=True, discount=0.5, turn_reward_weight=1.0)
    assert normalized[:2] == expected_a
    assert normalized[2:4] == [
        pytest.approx([1.0], abs=1e-5),
        pytest.approx([-1.0, -1.0], abs=1e-5),
    ]
    assert normalized[4] == [0.0, 0.0]
    weighted = turn_advantages(*args, normalize_std=True, discount=0.5, turn_reward_weight=2.0)
    assert weighted[0] == pytest.approx([0.075, -0.05, 0.1])
    assert weighted[2:4] == normalized[2:4]
    unweighted = turn_advantages(*args, normalize_std=True, discount=0.5, turn_reward_weight=0.0)
    assert unweighted[0] == [0.0, 0.0, 0.0] and unweighted[1] == [0.0, 0.0]


def test_token_advantages_refuse_inconsistent_turns() -> None:
    def advantages(turn_index: list[int], loss_mask: list[int]) -> list[list[float]]:
        return token_advantages(
            [1.0, 0.0],
            [[0.0, 0.0], [0.0]],
            ["g", "g"],
            [0],
            [turn_index],
            [loss_mask],
            normalize_std=True,
            discount=1.0,
            turn_reward_weight=1.0,
        )

    with pytest.raises(ValueError, match="belongs to turn 2, but the episode has 2 turns"):
        advantages([0, 1, 2], [1, 1, 1])
    with pytest.raises(ValueError, match="3 turn indices but 2 mask values"):
        advantages([0, 0, 0], [1, 1])
    # A context token's turn is never looked up.
    assert advantages([0, 1, 7], [1, 1, 0]) == [[pytest.approx(1.0, abs=1e-5)] * 2 + [0.0]]


def test_without_turn_rewards_token_advantages_are_grpo() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.3]
    groups = [7, 7, 7, 8, 8]
    turn_rewards = [[0.0], [0.0, 0.0], [0.0, 0.0, 0.0], [0.0], [0.0, 0.0]]
    rows = token_advantages(
        rewards,
        turn_rewards,
        groups,
        row_episode=[0, 1, 2, 3, 4],
        row_turn_index=[[-1, 0], [-1, 0, 1], [0, 1, 2], [0], [-1, 1]],
        row_loss_mask=[[0, 1], [0, 1, 1], [1, 1, 1], [1], [0, 1]],
        normalize_std=True,
        discount=1.0,
        turn_reward_weight=1.0,
    )
    expected = group_advantages(rewards, groups, normalize_std=True)
    assert rows == [
        [0.0, expected[0]],
        [0.0, expected[1], expected[1]],
        [expected[2]] * 3,
        [expected[3]],
        [0.0, expected[4]],
    ]


def test_token_advantages_refuses_rows_naming_missing_episodes() -> None:
    with pytest.raises(ValueError, match="row 0 names episode 3 of 1"):
        token_advantages(
            [1.0],
            [[0.0]],
            ["a"],
            [3],
            [[0]],
            [[1]],
            normalize_std=True,
            discount=1.0,
            turn_reward_weight=1.0,
        )


def test_episodes_with_several_samples_get_their_turns_advantages() -> None:
    from skillswarm.agent.envs.base import Task
    from skillswarm.agent.rollout import ConversationTokens, Episode

    def episode(task_id: str, reward: float, turn_rewards: list[float]) -> Episode:
        played = Episode(Task(task_id, "q", "a"), 0, [], 1.0)
        played.reward, played.turn_rewards = reward, turn_rewards
        return played

    # Episode a (task t): two samples, its history rewritten before turn 1. Turn rewards
    # (0.25, 0.5), γ = 0.5: C_1 = 0.5, C_0 = 0.25 + 0.5·0.5 = 0.5; R = 1.
    a = episode("t", 1.0, [0.25, 0.5])
    a.samples[0].add_context([1, 2], -1)
    a.samples[0].add_sampled([3, 4], [-0.1, -0.2], 0)
    a.samples[0].add_context([5], 0)
    rewritten = ConversationTokens()
    rewritten.add_context([1, 2, 5], -1)
    rewritten.add_sampled([6, 7], [-0.3, -0.4], 1)
    a.samples.append(rewritten)
    # Episode b (task t): one turn, C_0 = 0, R = 0. Outcome mean 0.5, std 0.5; credit baselines
    # b_0 = (0.5 + 0) / 2 = 0.25, b_1 = (0.5 + 0) / 2 = 0.25. Episode c: alone in task u.
    # a: 0.5 + 0.25 on both turns; b: -0.5 - 0.25. Normalised: a 1 + 0.25, b -1 - 0.25.
    b = episode("t", 0.0, [0.0])
    b.samples[0].add_context([1, 2], -1)
    b.samples[0].add_sampled([8, 9, 10], [-0.1, -0.1, -0.1], 0)
    c = episode("u", 1.0, [0.0])
    c.samples[0].add_sampled([11], [-0.5], 0)

    config = LossConfig(turn_discount=0.5, normalize_advantage_std=False)
    rows = episode_token_advantages([a, b, c], config)
    assert [sample for sample, _ in rows] == [
        a.samples[0],
        a.samples[1],
        b.samples[0],
        c.samples[0],
    ]
    assert rows[0][0] is a.samples[0] and rows[1][0] is rewritten
    assert [values for _, values in rows] == [
        pytest.approx([0, 0, 0.75, 0.75, 0]),
        pytest.approx([0, 0, 0, 0.75, 0.75]),
        pytest.approx([0, 0, -0.75, -0.75, -0.75]),
        [0.0],
    ]
    normalized = episode_token_advantages([a, b, c], LossConfig(turn_discount=0.5))
    assert [values for _, values in normalized][:3] == [
        pytest.approx([0, 0, 1.25, 1.25, 0], abs=1e-5),
        pytest.approx([0, 0, 0, 1.25, 1.25], abs=1e-5),
        pytest.approx([0, 0, -1.25, -1.25, -1.25], abs=1e-5),
    ]
    # negative_advantage_weight scales only the negative advantages: b's tokens by 0.2, and to
    # exactly zero with weight 0 (b then has nothing to train on).
    for weight, b_row in (
        (0.2, pytest.approx([0, 0, -0.25, -0.25, -0.25], abs=1e-5)),
        (0.0, [0.0] * 5),
    ):
        scaled = episode_token_advantages(
            [a, b, c], LossConfig(turn_discount=0.5, negative_advantage_weight=weight)
        )
        assert [values for _, values in scaled][:3] == [
            pytest.approx([0, 0, 1.25, 1.25, 0], abs=1e-5),
            pytest.approx([0, 0, 0, 1.25, 1.25], abs=1e-5),
            b_row,
        ]
