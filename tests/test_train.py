"""Supervised warm start, GRPO-style policy-gradient updates and the synchronous RL loop."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.envs.base import Task
from skillswarm.agent.envs.math import MathEnvironment
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.agent.rollout import Episode, play_episodes, tokenize_demonstration
from skillswarm.node.bootstrap import render_demonstrations
from skillswarm.node.loss import LossConfig, group_advantages
from skillswarm.node.pipeline import RLConfig, train_rl
from skillswarm.node.train import (
    PolicyGradientTrainer,
    length_sorted_micro_batches,
    shared_prefix_length,
    supervised_warm_start,
    token_logprobs,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook


@pytest.fixture(scope="module")
def env(math_env) -> MathEnvironment:
    return math_env


@pytest.fixture(scope="module")
def tokenizer(math_tokenizer):
    return math_tokenizer


def _sequence_logprob(model, episode: Episode) -> float:
    ids = torch.tensor([episode.token_ids])
    with torch.no_grad():
        logprobs = token_logprobs(model, ids, torch.ones_like(ids), episode.temperature)[0]
    return float((logprobs * torch.tensor(episode.loss_mask)).sum())


def _half_rewarded_episodes(
    model, tokenizer, env: MathEnvironment, n_tasks: int, samples: int, max_new_tokens: int
) -> list[Episode]:
    """Episodes of `n_tasks` training tasks with rewards set by hand: every second one wins, so
    each group of `samples` (an even number) is half winners."""
    episodes = play_episodes(
        model,
        tokenizer,
        env,
        env.tasks("train", n_tasks),
        samples_per_task=samples,
        seed=0,
        max_new_tokens=max_new_tokens,
    )
    for index, episode in enumerate(episodes):
        episode.reward = float(index % 2)
    return episodes


def test_supervised_warm_start_trains_only_assistant_tokens(
    tokenizer, env: MathEnvironment
) -> None:
    record = tokenize_demonstration(
        tokenizer, env.solve(env.tasks("train", 1)[0]), env.tool_schemas()
    )
    trained = tokenizer.decode(
        [t for t, m in zip(record.token_ids, record.loss_mask, strict=True) if m]
    )
    assert trained.startswith("<tool_call>") and trained.endswith("</answer><|im_end|>")
    assert "<tool_response>" not in trained and "<|im_start|>" not in trained

    model = build_tiny_model(tokenizer, seed=0)
    losses = supervised_warm_start(model, tokenizer, [env], steps=12, batch_size=8, lr=3e-3, seed=0)
    assert len(losses) == 12 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0]
    again = build_tiny_model(tokenizer, seed=0)
    assert (
        supervised_warm_start(again, tokenizer, [env], steps=12, batch_size=8, lr=3e-3, seed=0)
        == losses
    )


def test_shared_prefix_gives_the_same_logprobs_and_gradients(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=2)
    records = [
        tokenize_demonstration(tokenizer, env.solve(task), env.tool_schemas())
        for task in env.tasks("train", 4)
    ]
    sequences = [r.token_ids for r in records]
    masks = [r.loss_mask for r in records]
    prefix = shared_prefix_length(sequences, masks)
    assert prefix > 50 and all(not any(m[:prefix]) for m in masks)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    results = []
    for shared in (0, prefix):
        model.zero_grad()
        logprobs = token_logprobs(model, ids, attention, 0.8, shared_prefix=shared)
        (-(logprobs * loss_mask).sum()).backward()
        results.append((logprobs * loss_mask, [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    for plain, shared in zip(results[0][1], results[1][1], strict=True):
        # float32 sums in another order: the embedding's gradient adds up every position's, up to
        # a few hundred, so its smaller entries differ by up to ~1e-4 (seen: 8.4e-5 at 275).
        scale = float(plain.abs().max())
        assert torch.allclose(plain, shared, rtol=1e-4, atol=1e-5 + 1e-6 * scale)


def test_warm_start_on_several_environments_takes_the_whole_batch_token_mean(
    env: MathEnvironment,
) -> None:
    """Each environment's demonstrations run as their own forward pass; the first step's loss
    and the update equal those of the token mean over the whole mixed batch."""
    import random

    envs = [env, get_environment("code")]
    renderer = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    corpus = list(TEMPLATE_FIXED_STRINGS) + render_demonstrations(renderer, envs, 50, seed=0)
    mixed_tokenizer = build_tokenizer(corpus)
    rng = random.Random(7)  # the draws supervised_warm_start(seed=7) makes for its first step
    records = []
    for slot in range(4):
        chosen = envs[slot % 2]
        (task,) = chosen.tasks("train", 1, seed=rng.randrange(2**62))
        records.append(
            tokenize_demonstration(mixed_tokenizer, chosen.solve(task), chosen.tool_schemas())
        )
    sequences = [r.token_ids for r in records]
    width = max(len(s) for s in sequences)
    pad = mixed_tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    loss_mask = torch.tensor(
        [r.loss_mask + [0] * (width - len(r.loss_mask)) for r in records], dtype=torch.float32
    )
    reference = build_tiny_model(mixed_tokenizer, seed=3)
    logprobs = token_logprobs(reference, ids, attention)
    expected = -(logprobs * loss_mask).sum() / loss_mask.sum()
    expected.backward()
    # The gradients the optimizer steps on, read by a global pre-step hook.
    model = build_tiny_model(mixed_tokenizer, seed=3)
    captured: list[list[torch.Tensor]] = []

    def capture(optimizer, args, kwargs) -> None:
        captured.append([p.grad.clone() for p in model.parameters()])

    handle = register_optimizer_step_pre_hook(capture)
    try:
        losses = supervised_warm_start(
            model,
            mixed_tokenizer,
            envs,
            steps=1,
            batch_size=4,
            lr=1e-3,
            seed=7,
            max_grad_norm=1e9,
        )
    finally:
        handle.remove()
    assert len(captured) == 1
    assert losses[0] == pytest.approx(expected.item(), rel=1e-5)
    for grad, want in zip(captured[0], [p.grad for p in reference.parameters()], strict=True):
        assert torch.allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_warm_start_weights_share_the_demonstrations_in_proportion(
    tokenizer, env: MathEnvironment
) -> None:
    """Weights 1:3 over two environments give them a quarter and three quarters of all the
    slots over the run (exactly, whatever the batch size), and `on_step` sees every step."""
    from skillswarm.agent.envs.math import MathEnvironment as Math

    class Counting(Math):
        def __init__(self) -> None:
            super().__init__()
            self.solved = 0

        def solve(self, task):
            self.solved += 1
            return super().solve(task)

    light, heavy = Counting(), Counting()
    seen: list[tuple[int, float]] = []
    model = build_tiny_model(tokenizer, seed=0)
    warm_start = functools.partial(supervised_warm_start, model, tokenizer, lr=1e-3, seed=0)
    losses = warm_start(
        [light, heavy],
        steps=6,
        batch_size=6,
        weights=[1.0, 3.0],
        on_step=lambda step, loss: seen.append((step, loss)),
    )
    assert (light.solved, heavy.solved) == (9, 27)
    assert seen == list(enumerate(losses, start=1))
    zero = Counting()
    warm_start([zero, light], steps=2, batch_size=4, weights=[0, 1])
    assert zero.solved == 0
    for bad in ([1.0], [0.0, 0.0], [-1.0, 2.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="weights"):
            warm_start([light, heavy], steps=1, batch_size=2, weights=bad)


def _episode(task_id: str, reward: float) -> Episode:
    episode = Episode(task=Task(task_id, "p", "1"), sample_index=0, messages=[], temperature=1.0)
    episode.reward = reward
    return episode


def test_group_advantages_are_normalised_per_task() -> None:
    episodes = [_episode("a", r) for r in (1.0, 0.0, 0.0, 1.0)] + [
        _episode("b", r) for r in (1.0, 1.0)
    ]
    advantages = group_advantages(
        [e.reward for e in episodes], [e.task.id for e in episodes], normalize_std=True
    )
    assert advantages[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert advantages[4:] == [0.0, 0.0]
    lone = group_advantages([1.0, 0.0, 0.0], ["c"] * 3, normalize_std=True)
    assert sum(lone) == pytest.approx(0.0, abs=1e-9) and lone[0] > 0 > lone[1]


def test_policy_gradient_step_moves_toward_rewarded_episodes(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    episodes = _half_rewarded_episodes(model, tokenizer, env, 3, samples=4, max_new_tokens=12)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    logprob_before = [_sequence_logprob(model, e) for e in episodes]
    trainer = PolicyGradientTrainer(model, tokenizer, lr=1e-3, micro_batch_size=5)
    metrics = trainer.step(episodes)
    assert metrics["skipped"] == 0.0 and trainer.updates == 1
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert metrics["trained_episodes"] == 12
    assert metrics["trained_tokens"] == sum(e.num_sampled_tokens for e in episodes)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy data
    assert metrics["clip_fraction"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    change = [
        _sequence_logprob(model, e) - b for e, b in zip(episodes, logprob_before, strict=True)
    ]
    winners = sum(c for i, c in enumerate(change) if i % 2) / 6
    losers = sum(c for i, c in enumerate(change) if not i % 2) / 6
    assert winners > losers


def test_micro_batches_group_rows_of_similar_length_within_the_budget() -> None:
    lengths = [50, 10, 400, 12, 55, 11, 900, 52]
    batches = length_sorted_micro_batches(lengths, max_rows=3, max_tokens=200)
    assert batches == [[1, 5, 3], [0, 7, 4], [2], [6]]
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 200
    assert length_sorted_micro_batches(lengths, 8, 10**6) == [[1, 5, 3, 0, 7, 4, 2, 6]]
    assert length_sorted_micro_batches([], 4, 100) == []
    with pytest.raises(ValueError, match="positive"):
        length_sorted_micro_batches(lengths, 0, 100)


def test_an_update_in_length_sorted_micro_batches_equals_the_whole_batch(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    episodes = _half_rewarded_episodes(model, tokenizer, env, 3, samples=4, max_new_tokens=12)
    lengths = {len(e.tokens.token_ids) for e in episodes}
    assert len(lengths) > 2  # rows of several lengths, so that sorting them matters
    updated = []
    for micro_batch_tokens in (10**6, 2 * max(lengths)):
        copy = build_tiny_model(tokenizer, seed=1)
        trainer = PolicyGradientTrainer(
            copy, tokenizer, lr=0.1, optimizer="sgd", micro_batch_tokens=micro_batch_tokens
        )
        metrics = trainer.step(episodes)
        updated.append((metrics, dict(copy.named_parameters())))
    (whole, whole_params), (split, split_params) = updated
    assert whole["loss"] == pytest.approx(split["loss"], abs=1e-6)  # advantages sum to 0
    assert whole["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-4)
    for name, parameter in whole_params.items():
        torch.testing.assert_close(parameter, split_params[name], rtol=1e-4, atol=1e-6)


def test_stale_ratios_are_clipped(tokenizer, env: MathEnvironment) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    episodes = _half_rewarded_episodes(model, tokenizer, env, 2, samples=2, max_new_tokens=8)
    for episode in episodes:
        sampled = [i for i, m in enumerate(episode.loss_mask) if m]
        for i in sampled:  # pretend the behaviour policy was much less likely to pick these tokens
            episode.tokens.logprobs[i] -= 1.0
    metrics = PolicyGradientTrainer(model, tokenizer, clip_high=0.2).step(episodes)
    assert metrics["ratio_mean"] > 2.0
    assert 0.4 < metrics["clip_fraction"] <= 1.0
    masked = PolicyGradientTrainer(model, tokenizer, loss=LossConfig(trust_region="mask")).step(
        episodes
    )
    assert masked["masked_fraction"] > 0.4 and masked["clip_fraction"] == 0.0


def test_step_without_reward_variance_is_skipped(tokenizer, env: MathEnvironment) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    episodes = play_episodes(
        model, tokenizer, env, env.tasks("train", 2), samples_per_task=2, seed=0, max_new_tokens=4
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer = PolicyGradientTrainer(model, tokenizer)
    metrics = trainer.step(episodes)
    assert metrics["skipped"] == 1.0 and trainer.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_mean_over_all_samples_scales_the_update_by_the_informative_share(
    tokenizer, env: MathEnvironment
) -> None:
    """With `mean_over="all"` the token mean's denominator counts the samples of groups that all
    scored the same too: on on-policy data (ratio 1) the loss is the informative-only loss times
    informative tokens / all tokens, and the gradient shrinks by the same factor."""
    model = build_tiny_model(tokenizer, seed=1)
    episodes = play_episodes(
        model, tokenizer, env, env.tasks("train", 3), samples_per_task=2, seed=0, max_new_tokens=8
    )
    for index, episode in enumerate(episodes):  # only the first task's group differs
        episode.reward = 1.0 if index == 0 else 0.0
    informative = episodes[0].num_sampled_tokens + episodes[1].num_sampled_tokens
    everything = sum(e.num_sampled_tokens for e in episodes)
    results = {}
    for mean_over in ("informative", "all"):
        fresh = build_tiny_model(tokenizer, seed=1)
        trainer = PolicyGradientTrainer(
            fresh, tokenizer, loss=LossConfig(mean_over=mean_over), max_grad_norm=1e9
        )
        results[mean_over] = trainer.step(episodes)
        assert results[mean_over]["trained_tokens"] == informative
        assert results[mean_over]["trained_episodes"] == 2
    assert everything > informative
    assert results["all"]["loss"] == pytest.approx(
        results["informative"]["loss"] * informative / everything, rel=1e-5, abs=1e-9
    )
    assert results["all"]["grad_norm"] == pytest.approx(
        results["informative"]["grad_norm"] * informative / everything, rel=1e-4
    )


def test_optimizer_choice_sets_how_far_each_parameter_moves(
    tokenizer, env: MathEnvironment
) -> None:
    """SGD's first step moves each parameter by exactly lr times its (clipped) gradient; AdamW's
    moves every parameter with a gradient by about lr whatever the gradient's size, unless its
    epsilon is large against the gradients."""
    episodes = _half_rewarded_episodes(
        build_tiny_model(tokenizer, seed=1), tokenizer, env, 2, samples=2, max_new_tokens=8
    )
    moves: dict[str, float] = {}
    for name, options in {
        "sgd": {"optimizer": "sgd", "lr": 0.5},
        "adamw": {"lr": 1e-3},
        "adamw_large_eps": {"lr": 1e-3, "adam_eps": 10.0},
    }.items():
        model = build_tiny_model(tokenizer, seed=1)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = PolicyGradientTrainer(model, tokenizer, **options)  # type: ignore[arg-type]
        assert trainer.step(episodes)["skipped"] == 0.0
        if name == "sgd":
            assert isinstance(trainer.optimizer, torch.optim.SGD)
            for n, p in model.named_parameters():
                assert p.grad is not None
                torch.testing.assert_close(before[n] - p.detach(), 0.5 * p.grad)
        moves[name] = max(
            float((before[n] - p.detach()).abs().max()) for n, p in model.named_parameters()
        )
    assert moves["adamw"] == pytest.approx(1e-3, rel=0.05)
    assert moves["adamw_large_eps"] < 1e-4
    with pytest.raises(ValueError, match="optimizer must be one of"):
        PolicyGradientTrainer(build_tiny_model(tokenizer, seed=1), tokenizer, optimizer="adam")
    with pytest.raises(ValueError, match="optimizer"):
        RLConfig(optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="adam_eps"):
        RLConfig(adam_eps=0.0)


def test_train_rl_reports_each_step(tokenizer, env: MathEnvironment) -> None:
    model = build_tiny_model(tokenizer, seed=0)
    supervised_warm_start(model, tokenizer, [env], steps=20, batch_size=8, lr=3e-3, seed=0)
    seen: list[dict[str, float]] = []
    history = train_rl(
        model, tokenizer, env, steps=2, tasks_per_step=2, samples_per_task=3, seed=0,
        on_step=seen.append, max_new_tokens=40,
    )  # fmt: skip
    assert history == seen and [h["step"] for h in history] == [0.0, 1.0]
    for metrics in history:
        assert metrics["episodes"] == 6
        assert 0.0 <= metrics["success_rate"] <= 1.0
        assert metrics["tool_calls_mean"] >= 0.0
        assert metrics["skipped"] in (0.0, 1.0) and math.isfinite(metrics["loss"])
        assert metrics["step_seconds"] > 0 and metrics["rollout_seconds"] > 0
        assert metrics["staleness"] == 0.0 and metrics["dropped_groups"] == 0.0
