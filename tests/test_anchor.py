"""The KL anchor on other domains' episodes (`node.anchor`): its KL is the full-vocabulary
KL(base ‖ policy) at each token the base wrote, zero at the base and pulled back down by its
gradient; its settings refuse unknown, repeated or the node's own domains; a run with it plays
the other domains' episodes with the round's base and reports the term every step it trains."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from skillswarm.agent.envs import get_environment
from skillswarm.agent.model import load_policy
from skillswarm.agent.rollout import ConversationTokens, play_episodes
from skillswarm.node.anchor import AnchorBatches, AnchorConfig, play_anchor_samples
from skillswarm.node.config import NodeConfig
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.node.train import anchor_kl


def _search_samples(model, tokenizer, n_tasks: int = 3) -> list[ConversationTokens]:
    env = get_environment("search")
    episodes = play_episodes(
        model, tokenizer, env, env.tasks("train", n_tasks, seed=5), seed=0, max_new_tokens=24
    )
    return [s for e in episodes for s in e.samples if s.num_sampled_tokens > 0]


def _by_hand(model, reference, sample: ConversationTokens) -> float:
    """The mean over sampled tokens of Σ_v q(v) (log q(v) − log p(v)), q the reference's
    distribution at the position that wrote the token."""
    ids = torch.tensor([sample.token_ids])
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        log_q = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
    terms = [
        float((log_q[t - 1].exp() * (log_q[t - 1] - log_p[t - 1])).sum())
        for t, trained in enumerate(sample.loss_mask)
        if trained
    ]
    return sum(terms) / len(terms)


def test_anchor_kl_matches_the_formula_is_zero_at_the_base_and_its_gradient_pulls_back(
    tiny_base,
) -> None:
    model, tokenizer = load_policy(tiny_base)
    reference = copy.deepcopy(model).eval()
    samples = _search_samples(reference, tokenizer)
    assert samples
    pad = tokenizer.pad_token_id

    assert anchor_kl(model, reference, samples, pad, scale=0.0) == pytest.approx(0.0, abs=1e-6)
    assert all(p.grad is None for p in model.parameters())

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    one = samples[:1]
    assert anchor_kl(model, reference, one, pad, scale=0.0) == pytest.approx(
        _by_hand(model, reference, one[0]), rel=1e-4
    )
    tokens = [s.num_sampled_tokens for s in samples]
    per_sample = [_by_hand(model, reference, s) for s in samples]
    moved = anchor_kl(model, reference, samples, pad, micro_batch_size=2)
    assert moved == pytest.approx(
        sum(k * n for k, n in zip(per_sample, tokens, strict=True)) / sum(tokens), rel=1e-4
    )
    assert moved > 1e-3
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(20):
        optimizer.zero_grad()
        anchor_kl(model, reference, samples, pad)
        optimizer.step()
    assert anchor_kl(model, reference, samples, pad, scale=0.0) < 0.5 * moved


def test_anchor_settings_refuse_unknown_repeated_or_own_domains() -> None:
    with pytest.raises(ValidationError, match="not registered"):
        AnchorConfig(coef=1.0, domains=["chess"])
    with pytest.raises(ValidationError, match="repeat"):
        AnchorConfig(coef=1.0, domains=["code", "code"])
    assert not AnchorConfig(domains=["code"]).active  # coef 0: off
    assert not AnchorConfig(coef=1.0).active  # no domain: off
    with pytest.raises(ValidationError, match="own domain"):
        NodeConfig(domain="math", train={"anchor": {"coef": 1.0, "domains": ["math", "code"]}})
    config = NodeConfig(domain="math", train={"anchor": {"coef": 0.5, "domains": ["code"]}})
    assert config.train.anchor.coef == 0.5 and config.train.anchor.domains == ["code"]
    assert config.train.steps == RLConfig.model_validate(config.train.model_dump()).steps
    assert "anchor.coef" in config.train_overrides
    with pytest.raises(ValueError, match="not the node's own"):
        play_anchor_samples(lambda env: None, AnchorConfig(coef=1.0, domains=["math"]), "math")


def test_anchor_batches_cycle_through_every_sample_in_order() -> None:
    samples = [ConversationTokens(token_ids=[i]) for i in range(5)]
    batches = AnchorBatches(samples, per_step=2)
    taken = [batches.take() for _ in range(4)]
    assert [[s.token_ids[0] for s in batch] for batch in taken] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert AnchorBatches([], per_step=3).take() == []
    assert len(AnchorBatches(samples[:2], per_step=3).take()) == 2
    with pytest.raises(ValueError):
        AnchorBatches(samples, per_step=0)


def test_a_run_with_an_anchor_plays_the_other_domain_with_the_base_and_reports_its_kl(
    tiny_base,
) -> None:
    model, tokenizer = load_policy(tiny_base)
    config = RLConfig(
        steps=3,
        tasks_per_step=4,
        samples_per_task=4,
        optimizer="sgd",
        learning_rate=0.01,
        temperature=1.0,
        max_new_tokens=24,
        anchor=AnchorConfig(coef=1.0, domains=["search"], episodes=3, per_step=2),
    )
    run = AsyncRLRun(model, tokenizer, get_environment("math"), config)
    history = run.run()

    assert run.trainer.anchor is not None and run.trainer.anchor.coef == 1.0
    samples = run.trainer.anchor.samples
    assert 1 <= len(samples) <= 3 and all(s.num_sampled_tokens > 0 for s in samples)
    search_tools = {tool["function"]["name"] for tool in get_environment("search").tool_schemas()}
    math_tools = {tool["function"]["name"] for tool in get_environment("math").tool_schemas()}
    prompts = [tokenizer.decode(s.token_ids) for s in samples]
    assert all(any(name in text for name in search_tools - math_tools) for text in prompts)
    # The base wrote them: its policy versions are the first, before any update.
    assert all(
        v == 0 for s in samples for v, m in zip(s.policy_version, s.loss_mask, strict=True) if m
    )
    for metrics in history:
        assert ("anchor_kl" in metrics) == (metrics["skipped"] == 0.0)
        if "anchor_kl" in metrics:
            assert metrics["anchor_kl"] >= 0.0


def test_anchor_episodes_alternate_between_the_anchored_domains(tiny_base) -> None:
    from skillswarm.agent.inference import HFBackend
    from skillswarm.agent.rollout import RolloutEngine

    model, tokenizer = load_policy(tiny_base)
    backend = HFBackend(model, tokenizer)
    played_by: list[str] = []

    def engine_for(env):
        engine = RolloutEngine(backend, env, max_new_tokens=16)
        play = engine.play

        def recording_play(tasks, **options):
            episodes = play(tasks, **options)
            played_by.extend([env.name] * sum(len(e.samples) for e in episodes))
            return episodes

        engine.play = recording_play  # type: ignore[method-assign]
        return engine

    config = AnchorConfig(coef=1.0, domains=["search", "math"], episodes=3)
    samples = play_anchor_samples(engine_for, config, "code", seed=4)
    assert played_by == ["search"] * 3 + ["math"] * 3  # one episode a task, domain by domain
    opening = {d: get_environment(d).system_prompt[:40] for d in ("search", "math")}
    assert opening["search"] != opening["math"]
    kinds = [
        next(d for d, text in opening.items() if text in tokenizer.decode(s.token_ids))
        for s in samples
    ]
    assert len(samples) >= 4 and kinds[:4] == ["search", "math", "search", "math"]
    again = play_anchor_samples(engine_for, config, "code", seed=5)
    assert [s.token_ids for s in again] != [s.token_ids for s in samples]  # other tasks
