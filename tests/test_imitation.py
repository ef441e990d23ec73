"""Imitation before RL (`node.imitation`): supervised steps on the node's own domain's solutions
as a fresh run starts, the KL reference left at the round's base, none on a resumed run; the warm
start's skipping of tasks without a solution; the node's summary line."""

from __future__ import annotations

import pytest
import torch
from skillswarm.agent.envs.math import MathEnvironment
from skillswarm.agent.envs.search import SolverUnavailableError
from skillswarm.agent.model import build_tiny_model
from skillswarm.agent.rollout import tokenize_demonstration
from skillswarm.node.daemon import NodeConfig, training_summary
from skillswarm.node.imitation import ImitationConfig, imitate
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.node.recipes import recipe_for
from skillswarm.node.train import (
    OPTIMIZERS,
    SOLUTION_TRIES,
    NoSolutionsError,
    right_padded,
    supervised_warm_start,
    token_logprobs,
)

from skillswarm.demo import demo_settings


def _small_model(tokenizer):
    return build_tiny_model(tokenizer, seed=0, hidden=32, layers=1, heads=2, intermediate=64)


def _config(**overrides: object) -> RLConfig:
    settings = {
        "steps": 1,
        "tasks_per_step": 2,
        "samples_per_task": 2,
        "max_new_tokens": 8,
        "learning_rate": 1e-3,
        "max_staleness": 0,
    }
    return RLConfig.model_validate({**settings, **overrides})


def _solution_nll(model, tokenizer, env) -> float:
    """Mean negative log-likelihood per assistant token of the solutions of 8 fixed tasks."""
    records = [
        tokenize_demonstration(tokenizer, env.solve(task), env.tool_schemas())
        for task in env.tasks("train", 8, seed=12345)
    ]
    ids, attention, (mask,) = right_padded(
        [r.token_ids for r in records], tokenizer.pad_token_id, [r.loss_mask for r in records]
    )
    with torch.no_grad():
        logprobs = token_logprobs(model, ids, attention)
    return float(-(logprobs * mask).sum() / mask.sum())


def test_imitation_raises_the_likelihood_of_the_domains_solutions(math_env, math_tokenizer):
    model = _small_model(math_tokenizer)
    before = _solution_nll(model, math_tokenizer, math_env)
    assert imitate(model, math_tokenizer, math_env, ImitationConfig(), seed=0) == []
    assert _solution_nll(model, math_tokenizer, math_env) == before  # steps = 0: off
    losses = imitate(
        model, math_tokenizer, math_env, ImitationConfig(steps=15, learning_rate=3e-3), seed=0
    )
    assert len(losses) == 15
    assert _solution_nll(model, math_tokenizer, math_env) < 0.7 * before


def test_sgd_imitation_moves_each_weight_by_its_gradient_and_adamw_by_the_learning_rate(
    math_env, math_tokenizer
):
    moved = {}
    for optimizer in OPTIMIZERS:
        model = _small_model(math_tokenizer)
        start = [p.detach().clone() for p in model.parameters()]
        config = ImitationConfig(steps=1, learning_rate=1e-3, optimizer=optimizer)
        assert len(imitate(model, math_tokenizer, math_env, config, seed=0)) == 1
        sizes = torch.cat(
            [
                (p.detach() - s).abs().flatten()
                for p, s in zip(model.parameters(), start, strict=True)
            ]
        )
        moved[optimizer] = sizes[sizes > 0]
    # AdamW's first step is ±lr wherever the gradient is not zero; SGD's follows the gradient.
    assert torch.allclose(moved["adamw"].median(), torch.tensor(1e-3), rtol=0.05)
    assert moved["sgd"].max() > 20 * moved["sgd"].median()
    with pytest.raises(ValueError, match="optimizer"):
        ImitationConfig(optimizer="lion")


def test_sgd_imitation_raises_the_likelihood_of_the_domains_solutions(math_env, math_tokenizer):
    model = _small_model(math_tokenizer)
    before = _solution_nll(model, math_tokenizer, math_env)
    config = ImitationConfig(steps=15, learning_rate=0.3, optimizer="sgd")
    assert len(imitate(model, math_tokenizer, math_env, config, seed=0)) == 15
    assert _solution_nll(model, math_tokenizer, math_env) < 0.8 * before


def test_a_fresh_run_imitates_first_and_its_kl_reference_is_the_starting_weights(
    math_env, math_tokenizer
):
    model = _small_model(math_tokenizer)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = _config(
        imitation={"steps": 3, "learning_rate": 3e-3, "batch_size": 4}, loss={"kl_coef": 0.5}
    )
    run = AsyncRLRun(model, math_tokenizer, math_env, config)
    at_first_step: dict[str, torch.Tensor] = {}
    original_step = run.trainer.step

    def step(episodes):
        if not at_first_step:
            at_first_step.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return original_step(episodes)

    run.trainer.step = step
    history = run.run()
    assert len(history) == 1 and len(run.imitation_losses) == 3
    moved = [name for name, p in at_first_step.items() if not torch.equal(p, start[name])]
    assert moved, "the imitation steps ran before the first RL step"
    for name, p in run.trainer.reference_model.named_parameters():
        assert torch.equal(p, start[name]), name


def test_a_resumed_run_does_not_imitate_again(math_env, math_tokenizer, tmp_path):
    config = _config(imitation={"steps": 2, "batch_size": 2}, steps=1, checkpoint_every=1)
    first = AsyncRLRun(
        _small_model(math_tokenizer), math_tokenizer, math_env, config, checkpoint_dir=tmp_path
    )
    first.run()
    assert len(first.imitation_losses) == 2
    resumed = AsyncRLRun(
        _small_model(math_tokenizer),
        math_tokenizer,
        math_env,
        config.model_copy(update={"steps": 2}),
        checkpoint_dir=tmp_path,
    )
    assert len(resumed.run()) == 1  # the second step only
    assert resumed.imitation_losses == []


class _PartlySolvedMath(MathEnvironment):
    """Math whose solver knows only every `every`-th task it is asked (0: none)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self.asked = 0

    def solve(self, task):
        self.asked += 1
        if self.every == 0 or self.asked % self.every:
            raise SolverUnavailableError(f"no solution for {task.id}")
        return super().solve(task)


def test_the_warm_start_skips_tasks_without_a_solution(math_tokenizer):
    env = _PartlySolvedMath(every=3)
    losses = supervised_warm_start(
        _small_model(math_tokenizer), math_tokenizer, [env], steps=2, batch_size=4, lr=1e-3, seed=0
    )
    assert len(losses) == 2 and env.asked == 3 * 2 * 4
    with pytest.raises(NoSolutionsError, match="cannot be imitated"):
        supervised_warm_start(
            _small_model(math_tokenizer),
            math_tokenizer,
            [_PartlySolvedMath(every=0)],
            steps=1,
            batch_size=1,
            lr=1e-3,
            seed=0,
        )
    assert SOLUTION_TRIES >= 16


def test_a_domain_without_solutions_is_not_imitated_and_its_rl_goes_on(
    math_tokenizer, caplog: pytest.LogCaptureFixture
):
    run = AsyncRLRun(
        _small_model(math_tokenizer),
        math_tokenizer,
        _PartlySolvedMath(every=0),
        _config(imitation={"steps": 3}),
    )
    with caplog.at_level("WARNING", logger="skillswarm.node.imitation"):
        history = run.run()
    assert run.imitation_losses == [] and len(history) == 1  # no imitation; the RL step ran
    assert "imitation skipped" in caplog.text and "cannot be imitated" in caplog.text


def test_the_summary_names_the_imitation_steps():
    config = NodeConfig(domain="chess", train={"imitation": {"steps": 20, "learning_rate": 3e-4}})
    assert ", 20 imitation steps at lr 0.0003 first)" in training_summary(config)
    assert "imitation" not in training_summary(NodeConfig(domain="chess"))


def test_the_full_demo_keeps_the_recipes_imitation_and_the_quick_one_turns_it_off():
    def search_node(train: RLConfig | None) -> RLConfig:
        return NodeConfig(domain="search", **({} if train is None else {"train": train})).train

    assert recipe_for("search").imitation.active
    assert demo_settings(quick=False, steps=None, eval_tasks=None).train() is None
    full = search_node(demo_settings(quick=False, steps=4, eval_tasks=None).train())
    assert full.steps == 4 and full.imitation == recipe_for("search").imitation
    quick = search_node(demo_settings(quick=True, steps=None, eval_tasks=None).train())
    assert quick.steps == 2 and not quick.imitation.active
    assert quick.imitation.learning_rate == recipe_for("search").imitation.learning_rate
