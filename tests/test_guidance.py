"""Off-policy guidance: a group whose sampled episodes all failed gets the environment's solution
as one more episode, tokenized as the warm start tokenizes demonstrations and scored by the
environment; the trainer treats it with importance ratio 1 and raises its likelihood; a run with
guidance on adds one to each failed group and reports success on sampled episodes only."""

from __future__ import annotations

import json

import pytest
import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.envs.math import MathEnvironment
from skillswarm.agent.envs.search import SearchEnvironment
from skillswarm.agent.model import build_tiny_model
from skillswarm.agent.rollout import Episode, play_episodes, tokenize_demonstration
from skillswarm.node.guidance import guide_unsolved_groups, solution_episode
from skillswarm.node.loss import LossConfig, episode_token_advantages, group_advantages
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.node.train import PolicyGradientTrainer, token_logprobs


@pytest.fixture(scope="module")
def env(math_env) -> MathEnvironment:
    return math_env


@pytest.fixture(scope="module")
def tokenizer(math_tokenizer):
    return math_tokenizer


def _sampled(model, tokenizer, env, n_tasks: int, samples: int):
    return play_episodes(
        model,
        tokenizer,
        env,
        env.tasks("train", n_tasks, seed=3),
        samples_per_task=samples,
        seed=0,
        max_new_tokens=8,
    )


def test_only_failed_groups_get_the_solution_tokenized_as_a_demonstration(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    episodes = _sampled(model, tokenizer, env, 3, samples=2)
    assert not any(episode.success for episode in episodes)  # an untrained model
    episodes[2].reward = 1.0  # the second task's group holds a success
    tools = env.tool_schemas()

    guides = guide_unsolved_groups(env, tokenizer, tools, episodes)

    tasks = [episodes[0].task, episodes[4].task]
    assert [guide.task.id for guide in guides] == [task.id for task in tasks]
    for guide, task in zip(guides, tasks, strict=True):
        assert guide.guided and guide.success and guide.reward == 1.0
        assert guide.sample_index == 2  # after the group's two sampled episodes
        assert guide.temperature == episodes[0].temperature
        expected = tokenize_demonstration(tokenizer, env.solve(task), tools)
        assert guide.token_ids == expected.token_ids
        assert guide.loss_mask == expected.loss_mask and sum(guide.loss_mask) > 0
        assistant_turns = [m for m in env.solve(task) if m["role"] == "assistant"]
        assert len(guide.turn_rewards) == len(assistant_turns) == guide.num_turns
        assert guide.final_answer == task.answer


def test_no_guide_where_the_environment_has_no_solution(tokenizer, tmp_path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"id": "ada", "title": "Ada", "text": "Her father was Lord Byron."}) + "\n"
        + json.dumps({"id": "byron", "title": "Lord Byron", "text": "Lord Byron was a poet."})
        + "\n"
    )  # fmt: skip
    questions = tmp_path / "questions.jsonl"
    row = {"answer": "Lord Byron", "supporting_doc_ids": ["ada", "byron"]}
    questions.write_text(
        "".join(json.dumps(row | {"question": f"Who was Ada's father ({i})?"}) + "\n"
                for i in range(20))
    )  # fmt: skip
    env = SearchEnvironment(corpus_file=corpus, questions_file=questions)
    task = env.tasks("train", 1)[0]  # a questions-file task: its solver is unavailable
    episodes = _sampled(
        build_tiny_model(tokenizer, seed=0, hidden=32, layers=1, heads=2, intermediate=64),
        tokenizer,
        env,
        1,
        samples=2,
    )
    assert not any(episode.success for episode in episodes)
    assert guide_unsolved_groups(env, tokenizer, env.tool_schemas(), episodes) == []
    assert solution_episode(env, tokenizer, [], task, sample_index=0, temperature=1.0) is None


def test_a_guided_episode_trains_at_ratio_one_toward_the_solution(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=1, hidden=32, layers=1, heads=2, intermediate=64)
    episodes = _sampled(model, tokenizer, env, 1, samples=3)
    guides = guide_unsolved_groups(env, tokenizer, env.tool_schemas(), episodes)
    assert len(guides) == 1
    guide = guides[0]
    assert set(guide.logprobs) == {0.0}  # no behaviour logprobs were recorded

    def solution_logprob() -> float:
        ids = torch.tensor([guide.token_ids])
        with torch.no_grad():
            values = token_logprobs(model, ids, torch.ones_like(ids), guide.temperature)[0]
        return float((values * torch.tensor(guide.loss_mask)).sum())

    before = solution_logprob()
    trainer = PolicyGradientTrainer(model, tokenizer, lr=0.05, optimizer="sgd")
    metrics = trainer.step([*episodes, guide])
    assert metrics["skipped"] == 0.0 and metrics["guided_episodes"] == 1.0
    # Placeholder logprobs of 0 would make every ratio π/μ = π ≪ 1 and clip the update;
    # the current policy's logprobs stand in for them, so every ratio is 1.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert solution_logprob() > before


def test_guidance_needs_the_full_context_policy() -> None:
    with pytest.raises(ValueError, match="context_policy"):
        RLConfig(guidance=1.0, context_policy="drop_reasoning")
    assert RLConfig(guidance=0.0, context_policy="drop_reasoning").guidance == 0.0


def test_a_run_with_guidance_adds_one_solution_to_each_failed_group(
    tokenizer, env: MathEnvironment
) -> None:
    model = build_tiny_model(tokenizer, seed=2, hidden=32, layers=1, heads=2, intermediate=64)
    config = RLConfig(
        steps=2,
        tasks_per_step=3,
        samples_per_task=2,
        max_new_tokens=48,
        learning_rate=1e-3,
        guidance=0.5,
    )
    run = AsyncRLRun(model, tokenizer, env, config)
    batches = []
    original_step = run.trainer.step

    def recording_step(episodes):
        batches.append(list(episodes))
        return original_step(episodes)

    run.trainer.step = recording_step  # type: ignore[method-assign]
    history = run.run()
    for batch, metrics in zip(batches, history, strict=True):
        sampled = [episode for episode in batch if not episode.guided]
        guided = [episode for episode in batch if episode.guided]
        assert len(sampled) == 6
        failed = {
            task_id
            for task_id in {episode.task.id for episode in sampled}
            if not any(e.success for e in sampled if e.task.id == task_id)
        }
        assert failed and sorted(g.task.id for g in guided) == sorted(failed)
        assert metrics["guided_episodes"] == len(guided)
        # Success is reported on the sampled episodes alone.
        assert metrics["success_rate"] == sum(e.success for e in sampled) / len(sampled)


def test_the_guidance_weight_scales_the_solution_s_advantages(
    tokenizer, env: MathEnvironment
) -> None:
    losses = []
    for weight in (1.0, 0.25):
        model = build_tiny_model(tokenizer, seed=3, hidden=32, layers=1, heads=2, intermediate=64)
        episodes = _sampled(model, tokenizer, env, 1, samples=3)
        guides = guide_unsolved_groups(env, tokenizer, env.tool_schemas(), episodes)
        trainer = PolicyGradientTrainer(
            model,
            tokenizer,
            lr=0.05,
            optimizer="sgd",
            # Failed samples are not pushed down: the solution is the only row trained.
            loss=LossConfig(negative_advantage_weight=0.0),
            guidance_weight=weight,
        )
        metrics = trainer.step([*episodes, *guides])
        assert metrics["trained_episodes"] == 1.0
        losses.append(metrics["loss"])
    assert losses[0] < 0 and losses[1] == pytest.approx(0.25 * losses[0], rel=1e-5)
    with pytest.raises(ValueError, match="guidance_weight"):
        PolicyGradientTrainer(model, tokenizer, guidance_weight=0.0)


def test_the_solution_s_tool_turns_earn_the_turn_credit_a_sampled_turn_would(tokenizer) -> None:
    env = get_environment("search")
    task = next(t for t in env.tasks("train", 20, seed=0) if len(t.metadata["relations"]) == 2)
    guides = guide_unsolved_groups(env, tokenizer, env.tool_schemas(), [_failed(task)])
    assert len(guides) == 1
    rewards = guides[0].turn_rewards
    assert len(rewards) == guides[0].num_turns == 5  # search, ask, search, ask, answer
    # Every search shows a needed document and every ask names the next entity of the path.
    assert rewards == [env.search_credit, env.fact_credit] * 2 + [0.0]


def test_a_solution_longer_than_the_turn_budget_is_not_used(tokenizer, env) -> None:
    task = env.tasks("train", 1, seed=0)[0]
    tools = env.tool_schemas()
    kept = guide_unsolved_groups(env, tokenizer, tools, [_failed(task)])
    assert len(kept) == 1
    longest = max(
        sum(1 for t, m in zip(kept[0].turn_index, kept[0].loss_mask, strict=True) if m and t == k)
        for k in range(kept[0].num_turns)
    )
    assert guide_unsolved_groups(env, tokenizer, tools, [_failed(task)], max_new_tokens=longest)
    assert not guide_unsolved_groups(
        env, tokenizer, tools, [_failed(task)], max_new_tokens=longest - 1
    )
    assert not guide_unsolved_groups(
        env, tokenizer, tools, [_failed(task)], max_total_tokens=len(kept[0].token_ids) - 1
    )


def test_a_solver_that_breaks_leaves_the_group_unguided_and_warns_once(
    tokenizer, env, caplog
) -> None:
    class BrokenSolver(MathEnvironment):
        def solve(self, task):
            raise KeyError("no such table")

    broken = BrokenSolver()
    tasks = broken.tasks("train", 2, seed=0)
    with caplog.at_level("WARNING", logger="skillswarm.node.guidance"):
        guides = guide_unsolved_groups(
            broken, tokenizer, broken.tool_schemas(), [_failed(t) for t in tasks]
        )
    assert guides == []
    warnings = [r for r in caplog.records if "BrokenSolver" in r.getMessage()]
    assert len(warnings) == 1 and "KeyError" in warnings[0].getMessage()


def test_failed_samples_of_a_guided_group_get_pushed_down(tokenizer, env) -> None:
    """Without the solution, a group of failures trains nothing; with it the group has one
    success, so its failed samples get the negative advantage of their group (scaled by
    negative_advantage_weight, not by the guidance weight)."""
    task = env.tasks("train", 1, seed=0)[0]
    failed = [_failed(task, index) for index in range(3)]
    guide = guide_unsolved_groups(env, tokenizer, env.tool_schemas(), failed)[0]
    config = LossConfig(turn_reward_weight=0.0)
    advantages = [a for _, a in episode_token_advantages([*failed, guide], config)]
    assert all(value == 0.0 for row in episode_token_advantages(failed, config) for value in row[1])
    expected = group_advantages([0.0, 0.0, 0.0, 1.0], ["g"] * 4, normalize_std=True)
    for row, value in zip(advantages, expected, strict=True):
        assert {round(a, 6) for a in row if a != 0.0} == {round(value, 6)}


def _failed(task, index: int = 0) -> Episode:
    """A sampled episode of `task` that failed: one token written, reward 0."""
    episode = Episode(task=task, sample_index=index, messages=[], temperature=0.7)
    episode.tokens.add_sampled([1], [-1.0], turn=0)
    episode.turn_rewards = [0.0]
    return episode
