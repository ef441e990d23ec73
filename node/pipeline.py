"""The asynchronous RL pipeline of a node: a rollout producer thread plays batches of training
tasks with the behaviour policy while the trainer updates on earlier batches, with bounded lag.

Each batch ("chunk") holds `tasks_per_step` groups of `samples_per_task` episodes and is tagged with
the policy version that generated it (each sampled token also carries its own). Weights reach the
inference backend every `weight_sync_every` = k steps, and the producer runs at most
`max_staleness - (k - 1)` chunks ahead of the trainer, so a chunk is at most `max_staleness`
versions old when it is trained; a chunk found older than that anyway (a resumed run) is dropped
and counted. `max_staleness = 0` is the synchronous baseline: generate, train, push, generate.
Checkpoints (model, optimizer, RNG, step, the task-stream position) are written atomically every
`checkpoint_every` steps; a restarted run continues from the last one.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from skillswarm.agent.envs.base import Environment
from skillswarm.agent.inference import HFBackend, InferenceBackend
from skillswarm.agent.model import set_torch_threads
from skillswarm.agent.rollout import (
    DEFAULT_MAX_NEW_TOKENS,
    ContextPolicy,
    Episode,
    RolloutEngine,
    summarize_episodes,
)
from skillswarm.node.anchor import AnchorBatches, AnchorConfig, play_anchor_samples
from skillswarm.node.checkpointing import (
    TrainingState,
    load_training_checkpoint,
    save_training_checkpoint,
)
from skillswarm.node.guidance import guide_unsolved_groups
from skillswarm.node.imitation import ImitationConfig, imitate
from skillswarm.node.loss import LossConfig
from skillswarm.node.metrics import MetricsLogger, StalenessHistogram, StepTracker, read_metrics
from skillswarm.node.train import OptimizerName, PolicyGradientTrainer
from skillswarm.protocol.durable import write_bytes_atomically
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

StepCallback = Callable[[dict[str, float]], None]


class RLConfig(BaseModel):
    """The RL run of one node: batch shape, sampling, loss, pipeline lag and checkpoints."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=8, ge=1, description="policy updates")
    tasks_per_step: int = Field(default=8, ge=1)
    samples_per_task: int = Field(default=4, ge=2, description="group size for advantages")
    learning_rate: float = Field(default=2e-4, gt=0)
    optimizer: OptimizerName = Field(default="adamw", description="adamw, or sgd with momentum 0.9")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW's epsilon")
    temperature: float = Field(default=1.0, gt=0)
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, description="per turn")
    context_policy: ContextPolicy = "full"
    loss: LossConfig = Field(default_factory=LossConfig)
    anchor: AnchorConfig = Field(
        default_factory=AnchorConfig,
        description="a KL term to the round's base on other domains' episodes (`node.anchor`)",
    )
    imitation: ImitationConfig = Field(
        default_factory=ImitationConfig,
        description="supervised steps on the domain's solutions before the run's RL "
        "(`node.imitation`)",
    )
    guidance: float = Field(
        default=0.0,
        ge=0,
        description="off-policy guidance (`node.guidance`): above 0, a group whose sampled "
        "episodes all failed gets the environment's own solution as one more episode, its "
        "advantages scaled by this weight; 0: off",
    )
    max_staleness: int = Field(
        default=1, ge=0, description="policy versions a trained batch may lag; 0 is synchronous"
    )
    weight_sync_every: int = Field(default=1, ge=1, description="push weights every k steps")
    rollout_workers: int = Field(
        default=2,
        ge=1,
        description="producer threads (used when max_staleness lets more than one chunk run)",
    )
    device: str = Field(
        default="auto",
        description="where the trainer's model lives: cpu, cuda, cuda:1…; auto: "
        "cuda when a GPU is visible",
    )
    micro_batch_size: int = Field(default=32, ge=1, description="most samples in one forward")
    micro_batch_tokens: int = Field(
        default=8192,
        ge=1,
        description="most padded tokens in one forward: samples go in by length, so that short "
        "ones are not padded to long ones",
    )
    max_grad_norm: float = Field(default=1.0, gt=0)
    checkpoint_every: int = Field(default=0, ge=0, description="steps between checkpoints; 0: off")
    keep_checkpoints: int = Field(default=2, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _guidance_needs_full_context(self) -> RLConfig:
        if self.guidance > 0 and self.context_policy != "full":
            raise ValueError(
                "guidance tokenizes the whole solution as one sample, which needs "
                f"context_policy = 'full', not {self.context_policy!r}"
            )
        return self

    @model_validator(mode="after")
    def _lag_covers_weight_pushes(self) -> RLConfig:
        if self.max_staleness < self.weight_sync_every - 1:
            raise ValueError(
                f"weights pushed every {self.weight_sync_every} steps make batches up to "
                f"{self.weight_sync_every - 1} versions old; raise max_staleness to at least that"
            )
        return self


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when one is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device is {name!r} but no CUDA GPU is visible")
    return device


@dataclass
class Chunk:
    """One step's worth of scored episodes and the policy version that generated them."""

    index: int
    episodes: list[Episode]
    policy_version: int
    generation_seconds: float
    sampled_tokens: int


class PipelineStopped(RuntimeError):
    """The pipeline was stopped (or its producer failed) before the run finished."""


class _VersionGate:
    """The producer's permission to start a chunk: counted from where this run started, at most
    `max_staleness` chunks beyond those the trainer has finished with (trained, weights pushed,
    or dropped)."""

    def __init__(self, first_chunk: int, max_staleness: int) -> None:
        self._condition = threading.Condition()
        self._first_chunk = first_chunk
        self._consumed = 0
        self._max_staleness = max_staleness
        self._stopped = False

    def wait_for(self, chunk: int) -> bool:
        """Block until chunk `chunk` may start; False when the pipeline stopped meanwhile."""
        with self._condition:
            self._condition.wait_for(
                lambda: (
                    self._stopped
                    or chunk - self._first_chunk <= self._consumed + self._max_staleness
                )
            )
            return not self._stopped

    def consumed(self) -> None:
        """The trainer is done with one more chunk."""
        with self._condition:
            self._consumed += 1
            self._condition.notify_all()

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify_all()


class _ChunkCounter:
    """Hands out chunk indices, in order, to the producer threads."""

    def __init__(self, first: int) -> None:
        self._next = first
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            index = self._next
            self._next += 1
            return index


class RolloutProducer(threading.Thread):
    """Plays chunk after chunk of training tasks and puts them in a bounded queue. Several
    producers may share one counter and one backend: while one waits on tool calls, another
    generates."""

    def __init__(
        self,
        engine: RolloutEngine,
        env: Environment,
        config: RLConfig,
        counter: _ChunkCounter,
        gate: _VersionGate,
        out: queue.Queue[Chunk | BaseException],
        name: str = "rollout-producer",
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.engine = engine
        self.env = env
        self.config = config
        self.counter = counter
        self.gate = gate
        self.out = out
        self.stopped = threading.Event()

    def chunk_seed(self, index: int) -> int:
        return self.config.seed * 1_000_003 + index

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                index = self.counter.take()
                if not self.gate.wait_for(index):
                    return
                seed = self.chunk_seed(index)
                tasks = self.env.tasks("train", self.config.tasks_per_step, seed=seed)
                version = self.engine.backend.policy_version
                started = time.perf_counter()
                episodes = self.engine.play(
                    tasks,
                    samples_per_task=self.config.samples_per_task,
                    temperature=self.config.temperature,
                    seed=seed,
                )
                seconds = time.perf_counter() - started
                sampled = sum(episode.num_sampled_tokens for episode in episodes)
                if self.config.guidance > 0:
                    engine = self.engine
                    episodes += guide_unsolved_groups(
                        self.env,
                        engine.tokenizer,
                        engine.tools,
                        episodes,
                        max_new_tokens=engine.max_new_tokens,
                        max_total_tokens=engine.max_total_tokens,
                    )
                self._put(Chunk(index, episodes, version, seconds, sampled))
        except BaseException as error:  # handed to the trainer, which raises it
            self._put(error)

    def _put(self, item: Chunk | BaseException) -> None:
        while not self.stopped.is_set():
            try:
                self.out.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def stop(self) -> None:
        self.stopped.set()
        self.gate.stop()


class AsyncRLRun:
    """A node's RL run: a trainer, a behaviour copy of the policy behind an inference backend,
    and the producer thread between them. `run()` trains `config.steps` steps (continuing from
    the last checkpoint in `checkpoint_dir` when there is one) and returns each step's metrics;
    each step's metrics also go to `metrics_path` (JSONL) and `tracker` when given.
    `tool_call_format` names the rollouts' tool-call format (None: the chat template's).
    With `config.loss.kl_coef` above 0 the KL term is measured against `reference_model`, or,
    when none is given, a frozen copy of `model` as the run starts. With `config.imitation` on,
    a run that starts fresh first takes supervised steps on the environment's solutions
    (`node.imitation`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        env: Environment,
        config: RLConfig,
        *,
        checkpoint_dir: Path | None = None,
        metrics_path: Path | None = None,
        backend: InferenceBackend | None = None,
        on_step: StepCallback | None = None,
        reference_model: PreTrainedModel | None = None,
        tracker: StepTracker | None = None,
        tool_call_format: str | None = None,
    ) -> None:
        if config.checkpoint_every and checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        model.to(resolve_device(config.device))
        if (config.loss.kl_coef > 0 or config.anchor.active) and reference_model is None:
            # The KL terms' reference: the policy as the run starts (a node's round base).
            reference_model = copy.deepcopy(model).eval()
        self.model = model
        self.tokenizer = tokenizer
        self.env = env
        self.config = config
        self.checkpoint_dir = checkpoint_dir
        self.metrics_path = metrics_path
        self.on_step = on_step
        self.tracker = tracker
        self.tool_call_format = tool_call_format
        self.trainer = PolicyGradientTrainer(
            model,
            tokenizer,
            lr=config.learning_rate,
            loss=config.loss,
            max_grad_norm=config.max_grad_norm,
            micro_batch_size=config.micro_batch_size,
            micro_batch_tokens=config.micro_batch_tokens,
            reference_model=reference_model,
            optimizer=config.optimizer,
            adam_eps=config.adam_eps,
            guidance_weight=config.guidance or 1.0,
        )
        self.backend = backend or HFBackend(copy.deepcopy(model).eval(), tokenizer)
        self.imitation_losses: list[float] = []
        self.stop_requested = threading.Event()

    def request_stop(self) -> None:
        """Finish the step in progress, write a checkpoint, and return from `run()`."""
        self.stop_requested.set()

    def rollout_engine(self, env: Environment | None = None) -> RolloutEngine:
        """A rollout engine on this run's backend and environment (or `env`), as the producers
        play with."""
        return RolloutEngine(
            self.backend,
            env or self.env,
            max_new_tokens=self.config.max_new_tokens,
            context_policy=self.config.context_policy,
            tool_call_format=self.tool_call_format,
        )

    def _push_weights(self, version: int) -> None:
        self.backend.update_weights(
            ((name, tensor.detach()) for name, tensor in self.model.state_dict().items()),
            version,
        )

    def _save(self, step: int, next_chunk: int, version: int) -> None:
        assert self.checkpoint_dir is not None
        save_training_checkpoint(
            self.checkpoint_dir,
            self.model,
            self.trainer.optimizer,
            TrainingState(
                step=step, data_position={"next_chunk": next_chunk}, policy_version=version
            ),
            tokenizer=self.tokenizer,
            keep=self.config.keep_checkpoints,
        )

    def run(self) -> list[dict[str, float]]:
        config = self.config
        start_step, next_chunk, version = 0, 0, 0
        if self.checkpoint_dir is not None:
            state = load_training_checkpoint(
                self.checkpoint_dir, self.model, self.trainer.optimizer
            )
            if state is not None:
                start_step = state.step
                next_chunk = int(state.data_position.get("next_chunk", state.step))
                version = state.policy_version
                logger.info("resuming at step %d (chunk %d)", start_step, next_chunk)
        if self.metrics_path is not None:
            _forget_steps_from(self.metrics_path, start_step)
        self.trainer.updates = start_step
        if config.anchor.active:
            # Played before the trainer's weights are pushed: a backend with its own copy still
            # holds the policy the run was handed (the round's base), resumed or not.
            samples = play_anchor_samples(
                self.rollout_engine, config.anchor, self.env.name, seed=config.seed
            )
            self.trainer.anchor = AnchorBatches(samples, config.anchor.per_step, config.anchor.coef)
            logger.info(
                "anchor: %d episodes of %s, %d a step at weight %g",
                len(samples),
                ", ".join(config.anchor.domains),
                config.anchor.per_step,
                config.anchor.coef,
            )
        if start_step == 0 and config.imitation.active:
            # After the anchor's episodes and the KL reference: both hold the round's base. A
            # resumed run's checkpoint already holds the imitation.
            self.imitation_losses = imitate(
                self.model, self.tokenizer, self.env, config.imitation, seed=config.seed
            )
        self._push_weights(version)
        # Weights reach the backend every k steps, so they lag the trainer by up to k - 1 versions:
        # the producer may run ahead by what is left of the staleness budget.
        run_ahead = config.max_staleness - (config.weight_sync_every - 1)
        gate = _VersionGate(next_chunk, run_ahead)
        chunks: queue.Queue[Chunk | BaseException] = queue.Queue(maxsize=config.max_staleness + 2)
        workers = max(1, min(config.rollout_workers, run_ahead + 1))
        counter = _ChunkCounter(next_chunk)
        producers = [
            RolloutProducer(
                self.rollout_engine(),
                self.env,
                config,
                counter,
                gate,
                chunks,
                name=f"rollout-producer-{worker}",
            )
            for worker in range(workers)
        ]
        metrics_log = MetricsLogger(self.metrics_path) if self.metrics_path else None
        history: list[dict[str, float]] = []
        staleness = StalenessHistogram()
        waited = 0.0
        run_started = time.perf_counter()
        dropped_groups = 0
        for producer in producers:
            producer.start()
        waiting_room: dict[int, Chunk] = {}
        try:
            step = start_step
            while step < config.steps and not self.stop_requested.is_set():
                step_started = time.perf_counter()
                chunk = self._next_chunk(chunks, producers, waiting_room, next_chunk)
                waited_now = time.perf_counter() - step_started
                waited += waited_now
                next_chunk = chunk.index + 1
                lag = version - chunk.policy_version
                if lag > config.max_staleness:
                    dropped_groups += config.tasks_per_step
                    logger.info("dropped chunk %d: %d versions old", chunk.index, lag)
                    gate.consumed()
                    continue
                staleness.add(lag, config.tasks_per_step)
                update_started = time.perf_counter()
                update = self.trainer.step(chunk.episodes)
                update_seconds = time.perf_counter() - update_started
                version += 1
                if version % config.weight_sync_every == 0 or step + 1 == config.steps:
                    self._push_weights(version)
                gate.consumed()
                elapsed = time.perf_counter() - run_started
                sampled = [episode for episode in chunk.episodes if not episode.guided]
                metrics = {
                    "step": float(step),
                    **summarize_episodes(sampled),
                    **update,
                    "policy_version": float(version),
                    "staleness": float(lag),
                    "staleness_mean": staleness.mean(),
                    "dropped_groups": float(dropped_groups),
                    "rollout_seconds": chunk.generation_seconds,
                    "generated_tokens_per_s": chunk.sampled_tokens
                    / max(chunk.generation_seconds, 1e-9),
                    "trainer_wait_seconds": waited_now,
                    "update_seconds": update_seconds,
                    "trainer_idle_fraction": waited / max(elapsed, 1e-9),
                    "step_seconds": time.perf_counter() - step_started,
                    "tokens": float(chunk.sampled_tokens),
                }
                metrics.update({f"staleness_{k}": float(v) for k, v in staleness.as_dict().items()})
                history.append(metrics)
                if metrics_log is not None:
                    metrics_log.log(step, metrics)
                if self.tracker is not None:
                    self.tracker.record(step, metrics, sampled)
                if self.on_step is not None:
                    self.on_step(metrics)
                step += 1
                if config.checkpoint_every and (
                    step % config.checkpoint_every == 0
                    or step == config.steps
                    or self.stop_requested.is_set()
                ):
                    self._save(step, next_chunk, version)
        finally:
            for producer in producers:
                producer.stop()
            for producer in producers:
                producer.join(timeout=60)
            if metrics_log is not None:
                metrics_log.close()
        return history

    def _next_chunk(
        self,
        chunks: queue.Queue[Chunk | BaseException],
        producers: list[RolloutProducer],
        waiting_room: dict[int, Chunk],
        index: int,
    ) -> Chunk:
        """Chunk `index` (chunks from several producers can arrive out of order)."""
        while index not in waiting_room:
            try:
                item = chunks.get(timeout=0.5)
            except queue.Empty:
                if not any(producer.is_alive() for producer in producers):
                    raise PipelineStopped("the rollout producers ended unexpectedly") from None
                continue
            if isinstance(item, BaseException):
                raise PipelineStopped(f"a rollout producer failed: {item!r}") from item
            waiting_room[item.index] = item
        return waiting_room.pop(index)


def _forget_steps_from(path: Path, step: int) -> None:
    """Drop log lines of steps at or after `step`: a run killed after logging a step but before
    its checkpoint redoes that step after the restart, and logs it again."""
    if not path.is_file():
        return
    kept = [record for record in read_metrics(path) if int(record["step"]) < step]
    lines = "".join(json.dumps(record, allow_nan=False) + "\n" for record in kept)
    write_bytes_atomically(path, lines.encode("utf-8"))


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
    max_staleness: int = 0,
    num_threads: int | None = None,
    **config_options: object,
) -> list[dict[str, float]]:
    """Train `model` in place for `steps` updates and return each step's metrics. With the
    default `max_staleness = 0` every batch is played by the current weights (the model itself
    serves the rollouts, no copy); above 0 a behaviour copy runs ahead in its own thread.
    `num_threads`, when given, sets torch's threads first."""
    if num_threads is not None:
        set_torch_threads(num_threads)
    config = RLConfig.model_validate(
        {
            "steps": steps,
            "tasks_per_step": tasks_per_step,
            "samples_per_task": samples_per_task,
            "seed": seed,
            "learning_rate": lr,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "max_staleness": max_staleness,
            **config_options,
        }
    )
    backend = HFBackend(model, tokenizer) if max_staleness == 0 else None
    return AsyncRLRun(model, tokenizer, env, config, backend=backend, on_step=on_step).run()
