"""Imitation before a round's RL: supervised steps on the node's own domain's solutions.

RL learns only what the policy already samples now and then. On a domain whose skill is mostly
copying (search: ids, names and numbers carried from a result into the next call and the answer)
the tiny base's RL gains a few points a round, while cross-entropy on the environment's own
solutions (`Environment.solve`, training tasks only) teaches it directly. With
`[train.imitation]` on, a node's round starts with `steps` such updates on its own domain
(`optimizer` at `learning_rate`, the warm start's warm-up / stable / decay schedule:
`node.train.supervised_warm_start`), then runs RL from there; the round's KL terms stay measured
against the round's base. A small learning rate keeps the other domains: at 1e-3 the same AdamW
steps took math and code to zero (docs/training.md, "Imitation before RL").
"""

from __future__ import annotations

import logging
import time

from pydantic import BaseModel, ConfigDict, Field
from skillswarm.agent.envs import Environment
from skillswarm.node.train import NoSolutionsError, OptimizerName, supervised_warm_start
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class ImitationConfig(BaseModel):
    """Supervised steps on the domain's solutions as each run starts (`[train.imitation]`);
    `steps = 0` is off."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=0, ge=0, description="supervised steps before RL; 0: off")
    learning_rate: float = Field(default=1e-4, gt=0, description="the peak learning rate")
    optimizer: OptimizerName = Field(
        default="adamw",
        description="adamw (every weight with a gradient moves by about the learning rate), or "
        "sgd with momentum 0.9 (each in proportion to its gradient, as the RL recipes' updates)",
    )
    batch_size: int = Field(default=16, ge=1, description="solutions per step")

    @property
    def active(self) -> bool:
        return self.steps > 0


def imitate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: Environment,
    config: ImitationConfig,
    seed: int,
) -> list[float]:
    """`config.steps` supervised steps on `env`'s solutions of training tasks drawn with `seed`
    (in place), logged with their first and last loss; returns the loss of each step. An
    environment that gives no solutions (a questions file, a verifiers taskset) is not imitated:
    a warning, and the run goes on to its RL."""
    if not config.active:
        return []
    started = time.perf_counter()
    try:
        losses = supervised_warm_start(
            model,
            tokenizer,
            [env],
            steps=config.steps,
            batch_size=config.batch_size,
            lr=config.learning_rate,
            seed=seed,
            optimizer=config.optimizer,
        )
    except NoSolutionsError as error:
        logger.warning("imitation skipped, RL goes on: %s", error)
        return []
    logger.info(
        "imitation: %d steps of %d %s solutions, %s at lr %g, loss %.3f → %.3f, %.1f s",
        config.steps,
        config.batch_size,
        env.name,
        config.optimizer,
        config.learning_rate,
        losses[0],
        losses[-1],
        time.perf_counter() - started,
    )
    return losses
