"""The multi-turn rollout engine: many episodes at once, their assistant turns generated in batches
by an inference backend, their tool calls run concurrently in worker threads with per-call
timeouts, each episode re-joining generation as soon as its tool results are in. Episodes end on a
final answer, the turn limit or the context budget; every token keeps what the trainer needs.

Token invariant: a training sample's `token_ids` are exactly what the model saw and sampled. The
prompt and every environment segment are the tokenization of what the chat template adds to its
previous rendering, appended after the sampled end-of-turn token (a special token, so tokenization
restarts there). With the `full` context policy an episode is one sample. With `drop_reasoning`,
earlier turns' `<think>…</think>` spans are removed from later turns' context; whenever that
rewrites the history, the next turn starts a new sample whose prompt is the rewritten rendering, so
every sample is still exactly what the policy saw.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Literal

from skillswarm.agent.envs.base import Environment, Message, Task, strip_reasoning
from skillswarm.agent.inference import (
    DEFAULT_MAX_BATCH_SIZE,
    ConversationKV,
    Generation,
    GenerationRequest,
    HFBackend,
    InferenceBackend,
)
from skillswarm.agent.toolcalls import tool_call_parser
from skillswarm.agent.tools import (
    TOOL_ERROR_PREFIX,
    ToolCall,
    ToolResult,
    execute_tool_call,
    tool_messages,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PROMPT_TURN = -1
DEFAULT_MAX_NEW_TOKENS = 96
DEFAULT_MAX_TOTAL_TOKENS = 2048
DEFAULT_TOOL_WORKERS = 16
DEFAULT_GATHER_WINDOW_S = 0.01
SUCCESS_REWARD = 1.0

ContextPolicy = Literal["full", "drop_reasoning"]
CONTEXT_POLICIES: tuple[ContextPolicy, ...] = ("full", "drop_reasoning")
Schedule = Literal["as_ready", "waves"]


class TemplatePrefixError(RuntimeError):
    """The chat template re-rendered earlier turns differently, so tokens cannot be appended."""


@dataclass
class ConversationTokens:
    """Token-level record of one training sample: ids, behaviour logprobs, loss mask, the
    assistant turn of each token and the policy version that sampled it (-1 on context)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)

    def add_context(self, ids: Sequence[int], turn: int) -> None:
        """Append tokens the policy did not sample (prompt, tool results, template glue)."""
        self.token_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.turn_index.extend([turn] * len(ids))
        self.policy_version.extend([-1] * len(ids))

    def add_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], turn: int, version: int = 0
    ) -> None:
        """Append tokens written by the policy (loss-bearing) with their behaviour logprobs."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(ids)
        self.logprobs.extend(float(value) for value in logprobs)
        self.loss_mask.extend([1] * len(ids))
        self.turn_index.extend([turn] * len(ids))
        self.policy_version.extend([version] * len(ids))

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode:
    """One played episode: the conversation, its outcome and its token-level training samples.

    `turn_index` is -1 on the prompt and k on assistant turn k's sampled tokens and on the tool
    results that follow it. `turn_rewards[k]` is the environment's turn-level credit for turn k.
    `finish_reason` is one of: answer, no_tool_call, max_turns (the turn limit came with tool
    calls still pending; they are not run), length (the turn hit max_new_tokens), context (the
    token budget is spent), stop_token (a stop token other than the end-of-turn token).
    `rendered_text` is the text the current sample's tokens stand for, kept to append later
    turns exactly. `guided` marks an episode no policy sampled: the environment's own solution,
    added to a group that failed (`skillswarm.node.guidance`); its tokens carry no behaviour
    logprobs.
    """

    task: Task
    sample_index: int
    messages: list[Message]
    temperature: float
    samples: list[ConversationTokens] = field(default_factory=lambda: [ConversationTokens()])
    final_answer: str | None = None
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_timeouts: int = 0
    finish_reason: str = "running"
    rendered_text: str = ""
    memory: dict[str, Any] = field(default_factory=dict)
    guided: bool = False

    @property
    def tokens(self) -> ConversationTokens:
        """The sample later turns append to (the only one under the `full` context policy)."""
        return self.samples[-1]

    def _single_sample(self) -> ConversationTokens:
        if len(self.samples) != 1:
            raise ValueError(
                f"this episode has {len(self.samples)} training samples (its history was "
                "rewritten); read `samples` instead of the whole-episode token fields"
            )
        return self.samples[0]

    @property
    def token_ids(self) -> list[int]:
        return self._single_sample().token_ids

    @property
    def logprobs(self) -> list[float]:
        return self._single_sample().logprobs

    @property
    def loss_mask(self) -> list[int]:
        return self._single_sample().loss_mask

    @property
    def turn_index(self) -> list[int]:
        return self._single_sample().turn_index

    @property
    def num_sampled_tokens(self) -> int:
        return sum(sample.num_sampled_tokens for sample in self.samples)

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


def context_messages(messages: Sequence[Message], policy: ContextPolicy) -> list[Message]:
    """The history a later turn sees: everything (`full`), or with every assistant message's
    `<think>…</think>` spans removed (`drop_reasoning`)."""
    if policy == "full":
        return list(messages)
    visible: list[Message] = []
    for message in messages:
        content = message.get("content")
        if message["role"] == "assistant" and isinstance(content, str) and "<think>" in content:
            message = {**message, "content": strip_reasoning(content)}
        visible.append(message)
    return visible


@dataclass
class _ToolJob:
    """One tool call in flight: its future and when a worker started running it."""

    episode: Episode
    position: int
    call: ToolCall
    future: Future[ToolResult]
    started: list[float]  # set by the worker; a list so the worker can write it
    result: ToolResult | None = None


@dataclass
class _PendingTurn:
    """An episode waiting for the tool calls of its latest turn."""

    episode: Episode
    turn: int
    jobs: list[_ToolJob]


class RolloutEngine:
    """Plays episodes of one environment with one inference backend.

    `schedule="as_ready"` sends episodes back to generation as soon as their tool results are in
    (tool latency overlaps with other episodes' generation; results arriving within
    `gather_window_s` of the first share its batch); `"waves"` waits for all tool calls of a
    round before the next batch, so seeded runs repeat exactly.

    Tool calls are read in the format the tokenizer's templates define (see `toolcalls`);
    `tool_call_format` names one of `toolcalls.TOOL_CALL_FORMATS` instead.
    """

    def __init__(
        self,
        backend: InferenceBackend,
        env: Environment,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        max_total_tokens: int | None = None,
        context_policy: ContextPolicy = "full",
        tool_workers: int = DEFAULT_TOOL_WORKERS,
        schedule: Schedule = "as_ready",
        gather_window_s: float = DEFAULT_GATHER_WINDOW_S,
        tool_call_format: str | None = None,
    ) -> None:
        if max_new_tokens < 1 or tool_workers < 1:
            raise ValueError("max_new_tokens and tool_workers must be positive")
        if context_policy not in CONTEXT_POLICIES:
            raise ValueError(
                f"unknown context policy {context_policy!r}; expected one of "
                + ", ".join(CONTEXT_POLICIES)
            )
        if schedule not in ("as_ready", "waves"):
            raise ValueError(f"unknown schedule {schedule!r}; expected as_ready or waves")
        tokenizer = backend.tokenizer
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs eos (end of turn) and pad tokens for rollouts")
        self.backend = backend
        self.env = env
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_total_tokens = min(
            max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS, backend.max_context_tokens
        )
        self.context_policy = context_policy
        self.tool_workers = tool_workers
        self.schedule = schedule
        self.gather_window_s = gather_window_s
        self.tools = env.tool_schemas()
        self.tool_call_parser = tool_call_parser(tokenizer, self.tools, tool_call_format)
        self.abandoned_tool_calls = 0

    def play(
        self,
        tasks: Sequence[Task],
        *,
        samples_per_task: int = 1,
        temperature: float = 1.0,
        greedy: bool = False,
        seed: int | None = None,
        on_episode_done: Callable[[Episode], None] | None = None,
    ) -> list[Episode]:
        """Play `samples_per_task` episodes of every task (in task order) and score them."""
        if not greedy and temperature <= 0:
            raise ValueError("temperature must be positive when sampling; pass greedy=True instead")
        if samples_per_task < 1:
            raise ValueError("samples_per_task must be positive")
        rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(62))
        episodes = [
            self._start_episode(task, sample_index, 1.0 if greedy else temperature)
            for task in tasks
            for sample_index in range(samples_per_task)
        ]
        bound_tools = {task.id: self.env.bind_tools(task) for task in tasks}
        executor = ThreadPoolExecutor(self.tool_workers, thread_name_prefix="tool")
        pending: list[_PendingTurn] = []
        ready = [episode for episode in episodes if not episode.done]
        # The backend's KV cache of each episode waiting on tools, handed back with its next turn.
        kv_caches: dict[int, ConversationKV | None] = {}
        try:
            while ready or pending:
                if ready:
                    generations = self.backend.generate(
                        [
                            self._request(episode, kv_caches.pop(id(episode), None))
                            for episode in ready
                        ],
                        temperature=temperature,
                        greedy=greedy,
                        seed=rng.getrandbits(62),
                    )
                    for episode, generation in zip(ready, generations, strict=True):
                        calls = self._record_turn(episode, generation)
                        if calls:
                            kv_caches[id(episode)] = generation.kv
                            pending.append(
                                self._submit_calls(executor, episode, calls, bound_tools)
                            )
                    ready = []
                if pending:
                    block = self.schedule == "waves" or not ready
                    executor = self._collect(executor, pending, ready, block=block)
                ready = [episode for episode in ready if not episode.done]
            self._score(episodes, executor, on_episode_done)
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
        return episodes

    def _start_episode(self, task: Task, sample_index: int, temperature: float) -> Episode:
        messages = self.env.initial_messages(task)
        episode = Episode(
            task=task,
            sample_index=sample_index,
            messages=messages,
            temperature=temperature,
            memory=self.env.new_episode_memory(task),
        )
        prompt_text = render_conversation(self.tokenizer, messages, self.tools, True)
        episode.tokens.add_context(encode_text(self.tokenizer, prompt_text), PROMPT_TURN)
        episode.rendered_text = prompt_text
        if len(episode.tokens.token_ids) >= self.max_total_tokens:
            episode.finish_reason = "context"
        return episode

    def _request(self, episode: Episode, kv: ConversationKV | None) -> GenerationRequest:
        budget = min(self.max_new_tokens, self.max_total_tokens - len(episode.tokens.token_ids))
        return GenerationRequest(
            prompt_ids=episode.tokens.token_ids,
            max_new_tokens=budget,
            task=episode.task,
            turn=episode.num_turns,
            kv=kv,
        )

    def _record_turn(self, episode: Episode, generation: Generation) -> list[ToolCall]:
        """Record one sampled assistant turn; return its tool calls to run (empty when the
        episode ended)."""
        turn = episode.num_turns
        prompt = episode.rendered_text
        episode.num_turns += 1
        episode.turn_rewards.append(0.0)
        episode.tokens.add_sampled(
            generation.token_ids, generation.logprobs, turn, self.backend.policy_version
        )
        stopped = generation.stop_token is not None
        content_ids = generation.token_ids[:-1] if stopped else generation.token_ids
        content = self.tokenizer.decode(content_ids, skip_special_tokens=False)
        episode.messages.append({"role": "assistant", "content": content})
        episode.rendered_text += self.tokenizer.decode(
            generation.token_ids, skip_special_tokens=False
        )
        if not stopped:
            episode.finish_reason = (
                "context" if len(episode.tokens.token_ids) >= self.max_total_tokens else "length"
            )
            return []
        if generation.stop_token != self.tokenizer.eos_token_id:
            episode.finish_reason = "stop_token"
            return []
        answer = self.env.final_answer(content)
        if answer is not None:
            episode.final_answer = answer
            episode.finish_reason = "answer"
            return []
        calls = self.tool_call_parser.parse(content, prompt)
        if not calls:
            episode.finish_reason = "no_tool_call"
            return []
        if episode.num_turns >= self.env.max_turns:
            episode.finish_reason = "max_turns"
            return []
        return calls

    def _submit_calls(
        self,
        executor: ThreadPoolExecutor,
        episode: Episode,
        calls: list[ToolCall],
        bound_tools: dict[str, dict[str, Callable[..., Any]]],
    ) -> _PendingTurn:
        tools = bound_tools[episode.task.id]
        limit = self.env.max_tool_output_chars
        jobs: list[_ToolJob] = []
        for position, call in enumerate(calls):
            started: list[float] = []

            def run(call: ToolCall = call, started: list[float] = started) -> ToolResult:
                started.append(time.monotonic())
                return execute_tool_call(call, tools, max_chars=limit)

            jobs.append(_ToolJob(episode, position, call, executor.submit(run), started))
        return _PendingTurn(episode, episode.num_turns - 1, jobs)

    def _collect(
        self,
        executor: ThreadPoolExecutor,
        pending: list[_PendingTurn],
        ready: list[Episode],
        *,
        block: bool,
    ) -> ThreadPoolExecutor:
        """Move finished or timed-out tool calls into their episodes; episodes whose turn is
        complete join `ready`. With `block`, wait for at least one turn (waves: all of them).
        Returns the executor to use next (a fresh one when too many workers are stuck)."""
        timeout_s = self.env.tool_timeout_s
        gather_until: float | None = None
        while True:
            now = time.monotonic()
            waiting: list[Future[ToolResult]] = []
            next_deadline = now + timeout_s
            for turn in pending:
                for job in turn.jobs:
                    if job.result is not None:
                        continue
                    if job.future.done():
                        job.result = job.future.result()
                    elif job.started and now - job.started[0] >= timeout_s:
                        job.result = ToolResult(
                            job.call,
                            f"{TOOL_ERROR_PREFIX}{job.call.name} timed out after {timeout_s:g} s",
                            is_error=True,
                        )
                        job.episode.num_tool_timeouts += 1
                        self.abandoned_tool_calls += 1
                    else:
                        waiting.append(job.future)
                        if job.started:
                            next_deadline = min(next_deadline, job.started[0] + timeout_s)
            completed = [turn for turn in pending if all(job.result for job in turn.jobs)]
            for turn in completed:
                pending.remove(turn)
                self._finish_tools(turn)
                if not turn.episode.done:
                    ready.append(turn.episode)
            if self.abandoned_tool_calls >= max(1, self.tool_workers // 2):
                logger.warning(
                    "%d tool calls overran their %g s limit and still hold worker threads; "
                    "starting a fresh tool pool",
                    self.abandoned_tool_calls,
                    timeout_s,
                )
                executor.shutdown(wait=False, cancel_futures=False)
                executor = ThreadPoolExecutor(self.tool_workers, thread_name_prefix="tool")
                self.abandoned_tool_calls = 0
            if not pending or not block:
                return executor
            wait_s = next_deadline - time.monotonic()
            if self.schedule == "as_ready" and ready:
                # Give calls finishing at nearly the same moment a short window to join the batch.
                if gather_until is None:
                    gather_until = time.monotonic() + self.gather_window_s
                remaining = gather_until - time.monotonic()
                if remaining <= 0:
                    return executor
                wait_s = min(wait_s, remaining)
            wait(waiting, timeout=max(0.0, wait_s) + 0.001, return_when=FIRST_COMPLETED)

    def _finish_tools(self, turn: _PendingTurn) -> None:
        """Append a turn's tool results to its episode (or end it on the context budget)."""
        episode = turn.episode
        results = [job.result for job in turn.jobs if job.result is not None]
        episode.num_tool_calls += len(results)
        episode.num_tool_errors += sum(result.is_error for result in results)
        episode.turn_rewards[turn.turn] += float(
            self.env.turn_reward(episode.task, results, episode.memory)
        )
        results_messages = tool_messages(results)
        episode.messages.extend(results_messages)
        visible = context_messages(episode.messages, self.context_policy)
        full_text = render_conversation(self.tokenizer, visible, self.tools, True)
        if full_text.startswith(episode.rendered_text):
            suffix_ids = encode_text(self.tokenizer, full_text[len(episode.rendered_text) :])
            if len(episode.tokens.token_ids) + len(suffix_ids) >= self.max_total_tokens:
                episode.finish_reason = "context"
                return
            episode.tokens.add_context(suffix_ids, turn.turn)
        elif self.context_policy == "drop_reasoning":
            prompt_ids = encode_text(self.tokenizer, full_text)
            if len(prompt_ids) >= self.max_total_tokens:
                episode.finish_reason = "context"
                return
            rewritten = ConversationTokens()
            rewritten.add_context(prompt_ids, PROMPT_TURN)
            episode.samples.append(rewritten)
        else:
            raise TemplatePrefixError(
                "the chat template renders earlier turns differently once later turns are "
                "added; multi-turn token records need a template whose renderings extend "
                "each other"
            )
        episode.rendered_text = full_text

    def _score(
        self,
        episodes: list[Episode],
        executor: ThreadPoolExecutor,
        on_episode_done: Callable[[Episode], None] | None,
    ) -> None:
        """Final rewards, computed concurrently (a reward may run code, as in the code domain)."""
        futures = {
            executor.submit(self.env.reward, episode.task, episode.final_answer): episode
            for episode in episodes
        }
        for future in futures:
            episode = futures[future]
            episode.reward = float(future.result())
            if on_episode_done is not None:
                on_episode_done(episode)


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
    context_policy: ContextPolicy = "full",
) -> list[Episode]:
    """Play `samples_per_task` episodes of every task with a transformers model, in waves (so a
    seeded run repeats exactly), and score them with the environment's reward."""
    if max_new_tokens < 1 or max_batch_size < 1:
        raise ValueError("samples_per_task, max_new_tokens and max_batch_size must be positive")
    engine = RolloutEngine(
        HFBackend(model, tokenizer, max_batch_size=max_batch_size),
        env,
        max_new_tokens=max_new_tokens,
        max_total_tokens=max_total_tokens,
        context_policy=context_policy,
        schedule="waves",
    )
    return engine.play(
        tasks,
        samples_per_task=samples_per_task,
        temperature=temperature,
        greedy=greedy,
        seed=seed,
    )


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
