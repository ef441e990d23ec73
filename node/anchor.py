"""A KL anchor on other domains' episodes: what a node's round may not change elsewhere.

A node's KL term to the round's base (`LossConfig.kl_coef`) is measured on its own domain's
episodes only, so nothing holds what its update does to the skills of the other domains, which
the merge then has to trade against. With an anchor, the node plays a few episodes of each other
domain with the round's base as it starts (sampled at `temperature`), and every step adds

    coef × mean over those episodes' sampled tokens of KL(π_base(· | context) ‖ π_θ(· | context))

computed over the whole vocabulary at each token the base wrote, on `per_step` of them in turn.
It is distillation from the base on the base's own behaviour in the other domains: a step may
move them only as far as the RL gradient is worth the divergence. The trainer computes the
term with `node.train.anchor_kl`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator
from skillswarm.agent.envs import Environment, get_environment, list_environments
from skillswarm.agent.rollout import ConversationTokens, RolloutEngine


class AnchorConfig(BaseModel):
    """The KL anchor on other domains' episodes (`[train.anchor]`); `coef = 0` is off."""

    model_config = ConfigDict(extra="forbid")

    coef: float = Field(default=0.0, ge=0, description="weight of the anchor's KL; 0: off")
    domains: list[str] = Field(
        default_factory=list,
        description="environments whose episodes the anchor holds (registered names; not the "
        "node's own)",
    )
    episodes: int = Field(default=32, ge=1, description="episodes played per anchored domain")
    per_step: int = Field(default=4, ge=1, description="anchor episodes each step trains on")
    temperature: float = Field(default=0.7, gt=0, description="the base's sampling temperature")

    @field_validator("domains")
    @classmethod
    def _known_domains(cls, domains: list[str]) -> list[str]:
        known = set(list_environments())
        unknown = [d for d in domains if d not in known]
        if unknown:
            raise ValueError(
                f"anchor domains {unknown} are not registered environments "
                f"({', '.join(sorted(known))})"
            )
        if len(set(domains)) != len(domains):
            raise ValueError(f"anchor domains repeat: {domains}")
        return domains

    @property
    def active(self) -> bool:
        return self.coef > 0 and bool(self.domains)


def play_anchor_samples(
    engine_for: Callable[[Environment], RolloutEngine],
    config: AnchorConfig,
    own_domain: str | None = None,
    seed: int = 0,
) -> list[ConversationTokens]:
    """Episodes of every anchored domain, played by the engine `engine_for` makes for its
    environment (on the backend that holds the round's base), as training samples:
    `config.episodes` tasks per domain drawn with `seed` (the run's: a node's changes every
    round), one episode each, taken in turn from each domain (so that every few steps hold them
    all). Samples with no sampled token are dropped."""
    if own_domain is not None and own_domain in config.domains:
        raise ValueError(
            f"the anchor holds other domains' episodes, not the node's own ({own_domain})"
        )
    per_domain: list[list[ConversationTokens]] = []
    for index, domain in enumerate(config.domains):
        env = get_environment(domain)
        domain_seed = seed * 1_000_003 + 7919 * (index + 1)
        tasks = env.tasks("train", config.episodes, seed=domain_seed)
        played = engine_for(env).play(tasks, temperature=config.temperature, seed=domain_seed)
        per_domain.append([s for e in played for s in e.samples if s.num_sampled_tokens > 0])
    interleaved = itertools.chain.from_iterable(itertools.zip_longest(*per_domain))
    return [sample for sample in interleaved if sample is not None]


class AnchorBatches:
    """The anchor a trainer holds: its weight `coef`, and its samples, handed out `per_step` at a
    time, cycling through all of them in order."""

    def __init__(
        self, samples: Sequence[ConversationTokens], per_step: int, coef: float = 1.0
    ) -> None:
        if per_step < 1:
            raise ValueError("per_step must be positive")
        self.samples = list(samples)
        self.per_step = per_step
        self.coef = coef
        self._next = 0

    def take(self) -> list[ConversationTokens]:
        if not self.samples:
            return []
        count = min(self.per_step, len(self.samples))
        batch = [self.samples[(self._next + i) % len(self.samples)] for i in range(count)]
        self._next = (self._next + count) % len(self.samples)
        return batch
