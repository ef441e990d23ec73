"""The merge coordinator's configuration: one TOML file, every field with a laptop-ready default."""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FilePath, field_validator, model_validator
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.outer import OuterOptimizerConfig

from skillswarm.tracking import TrackingConfig


class RoundPolicy(BaseModel):
    """When a round's accepted deltas are merged: at a quorum, or at a deadline with a minimum."""

    model_config = ConfigDict(extra="forbid")

    min_deltas: int = Field(default=2, ge=1, description="accepted deltas needed to merge")
    required_domains: list[str] = Field(
        default_factory=list, description="each of these domains needs an accepted delta"
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds after the round opened from which it merges without a quorum",
    )
    min_deltas_at_deadline: int = Field(
        default=1, ge=1, description="accepted deltas needed to merge once the deadline passed"
    )


class EvalConfig(BaseModel):
    """Held-out evaluation of every candidate checkpoint, beside the base and each expert."""

    model_config = ConfigDict(extra="forbid")

    domains: list[str] = Field(default_factory=lambda: ["math"])
    tasks_files: dict[str, FilePath] = Field(
        default_factory=dict,
        description="domain -> JSONL task file (.jsonl or .jsonl.gz) whose held-out split that "
        "domain is scored on, instead of its generator's; give nodes the same file",
    )
    n_tasks: int = Field(
        default=128,
        ge=1,
        description="held-out tasks per domain; every model of a round is scored on the same ones",
    )
    validation_tasks: int | None = Field(
        default=None,
        ge=1,
        description="validation tasks per domain (choosing among candidates, the own-domain "
        "gate, the publication rule); default: n_tasks",
    )
    experts: Literal["all", "own", "none"] = Field(
        default="all",
        description="score each delta applied alone on every domain, on its own domain only, "
        "or not at all",
    )
    level: float = Field(
        default=0.95, gt=0.5, lt=1, description="confidence level of the reported intervals"
    )
    seed: int = Field(default=0, description="held-out tasks of the reported table")
    validation_seed: int | None = Field(
        default=None,
        description="held-out tasks that choose among merge candidates and feed the evaluation "
        "gate, kept apart from the reported ones; default: seed + 1",
    )

    @model_validator(mode="after")
    def _validation_apart_from_report(self) -> EvalConfig:
        if self.validation_seed == self.seed:
            raise ValueError(
                f"eval.validation_seed ({self.validation_seed}) must differ from eval.seed: "
                "choosing on the reported tasks would overstate the published scores"
            )
        return self

    def validation_tasks_seed(self) -> int:
        """The seed of the validation tasks: validation_seed, or seed + 1."""
        return self.seed + 1 if self.validation_seed is None else self.validation_seed

    def validation_task_count(self) -> int:
        """Validation tasks per domain: validation_tasks, or n_tasks."""
        return self.n_tasks if self.validation_tasks is None else self.validation_tasks


class GateConfig(BaseModel):
    """Checks a delta passes before it may join a merge (beyond shapes, dtypes and finiteness).

    The norm bound compares, per tensor, ||Δ|| with ||θ_base|| (the base's RMS is floored at
    `relative_norm_floor`, so tensors that start at zero can move). Measured on the embedded
    model: RL deltas of 8 and 30 steps (lr 2e-4) peak at 0.066 and 0.11, so the default of 1.0
    leaves a 9-15x margin while a delta as large as the weights themselves is refused.
    """

    model_config = ConfigDict(extra="forbid")

    max_relative_norm: float = Field(
        default=1.0, gt=0, description="largest per-tensor ||Δ|| / ||θ_base|| accepted"
    )
    relative_norm_floor: float = Field(
        default=0.01, ge=0, description="RMS below which a base tensor counts as this RMS"
    )
    eval_gate: bool = Field(
        default=False,
        description="score base + Δ alone on the other domains and refuse a delta that harms one",
    )
    domains: list[str] = Field(
        default_factory=list, description="domains the evaluation gate scores; empty: eval.domains"
    )
    n_tasks: int = Field(default=8, ge=1, description="tasks per domain in the evaluation gate")
    min_other_domain_score: float | None = Field(
        default=None, description="lowest mean reward allowed on another domain"
    )
    max_other_domain_drop: float | None = Field(
        default=None, ge=0, description="largest fall of another domain's mean reward vs the base"
    )

    @model_validator(mode="after")
    def _eval_gate_has_a_threshold(self) -> GateConfig:
        if (
            self.eval_gate
            and self.min_other_domain_score is None
            and (self.max_other_domain_drop is None)
        ):
            raise ValueError(
                "gates.eval_gate needs gates.min_other_domain_score or gates.max_other_domain_drop"
            )
        return self


class PublishPolicy(BaseModel):
    """When a merged candidate may replace the current base: never when it is worse than the base
    on a domain beyond the evaluation's noise.

    The rule compares the candidate with the base on the same validation tasks
    (eval.validation_seed, apart from the reported ones), domain by domain, with a one-sided
    paired test at level `alpha`: the exact sign test on the tasks where exactly one of the two
    succeeds (success), or a sign-flip permutation test (reward). A domain where the candidate is
    worse at that level by more than `margin` holds the round: nothing is published, and the
    next round trains again on the current base. With `against_origin`, the candidate is compared
    the same way with the round-0 checkpoint too (from round 2 on), so that small losses that each
    pass the comparison with the base cannot drift the published model below where the swarm began.
    """

    model_config = ConfigDict(extra="forbid")

    no_regression: bool = Field(
        default=True, description="hold a candidate worse than the base on any domain"
    )
    metric: Literal["success", "reward"] = Field(
        default="success", description="per-task outcome the rule compares"
    )
    alpha: float = Field(
        default=0.05, gt=0, lt=0.5, description="one-sided level of the paired test"
    )
    margin: float = Field(
        default=0.0, ge=0, description="a fall in the metric's mean no larger than this is allowed"
    )
    against_origin: bool = Field(
        default=True,
        description="also hold a candidate worse than the round-0 checkpoint on a domain, so "
        "that losses each within noise of the current base cannot add up round after round",
    )


MAX_DOMAIN_WEIGHT = 2.0
MAX_WEIGHTED_DOMAINS = 5
MAX_KEEP_BASE_PATTERNS = 16
MAX_KEEP_BASE_PATTERN_CHARS = 200
MAX_DOMAIN_CHARS = 64  # a domain name, as a delta's manifest bounds it


def _default_domain_scale() -> dict[str, float]:
    return {"math": 0.5}


# The token embedding and the output head (tied into one tensor in the embedded base).
VOCABULARY_TENSORS = ("*embed_tokens.weight", "lm_head.weight")


def _default_keep_base_tensors() -> list[str]:
    return list(VOCABULARY_TENSORS)


def matches_any(tensor: str, patterns: Sequence[str]) -> bool:
    """Whether the tensor name `tensor` matches one of the glob `patterns` (case-sensitive)."""
    return any(fnmatch.fnmatchcase(tensor, p) for p in patterns)


class MergePlan(MergeSpec):
    """The merge to run, and alternatives tried beside it on the validation tasks.

    With `candidates`, every spec (this one first) merges the round; the one with the best mean
    reward over eval.domains on eval.validation_seed is published, ties going to the earlier.
    The default sums the round's task vectors (task arithmetic, λ = 1: each node's delta at its
    full size, as if the nodes' steps had been taken one after another) with math's deltas at
    half their size (`domain_scale`) and the token embedding and output head left at the base
    (`keep_base_tensors`), and tries no other candidate (with `candidates`, those
    too; with `domain_weights`, task arithmetic with a weight per domain); what each method
    measured: docs/merging.md. Before any of it, the own-domain gate leaves out the deltas that
    lower their own domain's score on the validation tasks beyond noise: RL that lowers its own
    skill has nothing to give the merge, and merging it lowers that skill in the swarm; a delta
    within noise of the base is kept, for a short round's delta is most often within noise of it
    either way.
    After it, a merge the publication rule holds is tried again without each delta in turn: one
    domain's delta often lowers another domain, and the others' gains need not wait a round.
    Every merge leaves the tensors `keep_base_tensors` names at the base's weights.
    """

    candidates: list[MergeSpec] = Field(default_factory=list)
    own_domain_gate: bool = Field(
        default=True,
        description="before merging, score each delta applied alone on its own domain's "
        "validation tasks and leave out of the merge any that scores below the base there "
        "(by own_domain_gate_alpha); a round whose every delta is left out is held",
    )
    own_domain_gate_alpha: float = Field(
        default=0.05,
        ge=0.0,
        lt=0.5,
        description="the gate leaves a delta out only when it is below the base beyond noise: "
        "the one-sided paired test on its own domain's per-task validation rewards at this "
        "level; 0: any shortfall in mean reward leaves it out",
    )
    own_domain_min_gain: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="the gate also leaves out a delta whose own domain's mean validation reward "
        "gains less than this over the base (e.g. 0.025: about three tasks in 128); 0: off. "
        "A delta that no longer gains on its own domain still moves the others",
    )
    domain_weights: list[float] = Field(
        default_factory=list,
        max_length=4,
        description="e.g. [0.5, 1.0]: task arithmetic with a weight per domain joins the "
        "candidates, every assignment of these values to the round's domains that does not "
        "give them all the same (that is the plain λ candidate), a domain's deltas sharing its "
        "weight; the validation tasks may then keep one domain's delta whole while halving "
        "another's that costs other domains. [] (the default) or one value: off. With d "
        "domains, len^d − len candidates more (d ≤ 5)",
    )
    keep_base_tensors: list[str] = Field(
        default_factory=_default_keep_base_tensors,
        max_length=MAX_KEEP_BASE_PATTERNS,
        description="glob patterns (fnmatch) over tensor names: a tensor that matches one is "
        "left out of every task vector, so each merge, candidates and subsets included, keeps "
        "the base's weights there; a pattern written DOMAIN:GLOB applies to that domain's "
        "deltas only (e.g. 'search:lm_head.weight'). The default keeps the token embedding and "
        "the output head (['*embed_tokens.weight', 'lm_head.weight']), through which one node's "
        "delta (search's imitation, a long math round) cost the others most of their gain; [] "
        "merges every tensor. What it measured: docs/merging.md, 'Tensors kept at the base'",
    )
    domain_scale: dict[str, float] = Field(
        default_factory=_default_domain_scale,
        max_length=MAX_WEIGHTED_DOMAINS,
        description="a fixed factor on each named domain's deltas before every merge of the "
        "round (the candidates, the weights per domain and the subsets of a held merge take the "
        "scaled task vector; domains not named keep 1; the own-domain gate scores each delta "
        "whole), so a domain whose delta costs the others is merged at part of its size without "
        "a choice on the validation tasks. The default {math = 0.5} halves the long math rounds' "
        "delta, which costs code, and keeps code's and search's whole; {}: every delta whole. "
        "What it measured: docs/merging.md",
    )
    subsets_on_hold: bool = Field(
        default=True,
        description="when the publication rule holds the merge of a round's deltas, merge "
        "them again leaving one out at a time (the chosen spec, each subset scored on the "
        "validation tasks and put to the same rule) and publish the best subset that passes; "
        "if none does, go on from the best-scoring subset until one delta is left",
    )
    choose_by: Literal["mean", "shortfall"] = Field(
        default="mean",
        description="'mean': publish the merge of every delta, and after a hold the subset "
        "with the best mean validation reward that passes the rule. 'shortfall': also merge "
        "the round without each delta in turn whether or not the merge of all passes, and "
        "publish, of those that pass, the one whose worst domain falls least short of what "
        "that domain's delta reached alone on its validation tasks (the own-domain gate's "
        "score; ties to the higher mean): a delta that gains little on its own domain and "
        "costs another domain's gain is left out of that round. Needs own_domain_gate and "
        "domain_scale = {}; costs one merge and validation per delta a round",
    )

    @model_validator(mode="before")
    @classmethod
    def _own_method_has_no_default_candidates(cls, data: Any) -> Any:
        """A plan that names its own method or parameters tries only the candidates it lists,
        weights or scales no domain apart and keeps no tensor at the base unless it sets
        domain_weights, domain_scale or keep_base_tensors."""
        if isinstance(data, dict) and ("method" in data or "parameters" in data):
            defaults = {"candidates": [], "domain_weights": [], "domain_scale": {}}
            return {**defaults, "keep_base_tensors": [], **data}
        return data

    @model_validator(mode="after")
    def _shortfall_needs_the_gate(self) -> MergePlan:
        if self.choose_by == "shortfall" and not self.own_domain_gate:
            raise ValueError(
                "choose_by = 'shortfall' measures each delta alone through the own-domain "
                "gate: set own_domain_gate = true"
            )
        if self.choose_by == "shortfall" and any(s != 1.0 for s in self.domain_scale.values()):
            raise ValueError(
                "choose_by = 'shortfall' compares a merge with each delta alone at its whole "
                "size, which a scaled domain cannot reach: set domain_scale = {}"
            )
        return self

    @field_validator("keep_base_tensors")
    @classmethod
    def _short_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            named, colon, glob = pattern.partition(":")
            if not 0 < len(pattern) <= MAX_KEEP_BASE_PATTERN_CHARS or (
                colon and not (0 < len(named) <= MAX_DOMAIN_CHARS and glob and ":" not in glob)
            ):
                raise ValueError(
                    f"keep_base_tensors patterns are GLOB or DOMAIN:GLOB (a domain name of 1 to "
                    f"{MAX_DOMAIN_CHARS} characters), 1 to {MAX_KEEP_BASE_PATTERN_CHARS} "
                    f"characters; got {pattern!r}"
                )
        return value

    @field_validator("domain_scale")
    @classmethod
    def _bounded_scales(cls, value: dict[str, float]) -> dict[str, float]:
        for domain, scale in value.items():
            if not 0 < len(domain) <= MAX_DOMAIN_CHARS or not 0 < scale <= MAX_DOMAIN_WEIGHT:
                raise ValueError(
                    f"domain_scale maps a domain name (1 to {MAX_DOMAIN_CHARS} characters) to a "
                    f"factor in (0, {MAX_DOMAIN_WEIGHT}]; got {domain!r}: {scale}"
                )
        return value

    def kept_for(self, domain: str | None) -> list[str]:
        """The globs of keep_base_tensors that `domain`'s deltas leave at the base: every
        unqualified pattern, and the glob of each DOMAIN:GLOB naming `domain` (None: the
        unqualified ones alone; tensor names hold no colon)."""
        applied = []
        for pattern in self.keep_base_tensors:
            named, colon, glob = pattern.partition(":")
            if not colon:
                applied.append(pattern)
            elif named == domain:
                applied.append(glob)
        return applied

    def keeps_base(self, tensor: str, domain: str | None = None) -> bool:
        """Whether the merge leaves `tensor` of a `domain` delta at the base's weights
        (keep_base_tensors; None: by the unqualified patterns alone)."""
        return matches_any(tensor, self.kept_for(domain))

    @field_validator("domain_weights")
    @classmethod
    def _distinct_positive_weights(cls, value: list[float]) -> list[float]:
        if any(not 0 < w <= MAX_DOMAIN_WEIGHT for w in value):
            raise ValueError(f"domain_weights must lie in (0, {MAX_DOMAIN_WEIGHT}]; got {value}")
        if len(set(value)) != len(value):
            raise ValueError(f"domain_weights repeats a value: {value}")
        return value

    def domain_weight_specs(self, domain_of: Mapping[str, str]) -> list[MergeSpec]:
        """Task arithmetic with a weight per domain, one spec per assignment of
        `domain_weights` to the domains of `domain_of` (expert name → its domain) that does not
        weight them all alike; none with fewer than two domains or weights, or more than
        MAX_WEIGHTED_DOMAINS domains. Dtypes and seed are this spec's."""
        domains = sorted(set(domain_of.values()))
        if len(self.domain_weights) < 2 or not 2 <= len(domains) <= MAX_WEIGHTED_DOMAINS:
            return []
        specs = []
        for weights in itertools.product(self.domain_weights, repeat=len(domains)):
            if len(set(weights)) == 1:
                continue
            by_domain = dict(zip(domains, weights, strict=True))
            specs.append(
                MergeSpec(
                    method="task_arithmetic",
                    parameters={"weight": {n: by_domain[d] for n, d in domain_of.items()}},
                    dtype=self.dtype,
                    out_dtype=self.out_dtype,
                    seed=self.seed,
                )
            )
        return specs

    def recorded(self, spec: MergeSpec) -> dict[str, Any]:
        """`spec` as a round records its merge: the spec's fields, and this plan's domain_scale
        beside them when it scales a domain."""
        scale = {"domain_scale": dict(self.domain_scale)} if self.domain_scale else {}
        return spec.model_dump() | scale

    def specs(self) -> list[MergeSpec]:
        """This spec and the candidates, without repeats, in order."""
        own = MergeSpec.model_validate(self.model_dump(include=set(MergeSpec.model_fields)))
        unique: list[MergeSpec] = []
        for spec in [own, *self.candidates]:
            if spec not in unique:
                unique.append(spec)
        return unique


class FanoutConfig(BaseModel):
    """Merged checkpoints fanned out as deltas. Each published checkpoint is also packed as a
    signed delta from its parent; nodes holding the parent fetch it from peers that already have
    it. The coordinator hands its own copy to at most `seed_slots` nodes at a time, so its upload
    per round stays about one delta whatever the number of nodes; the rest wait for a holder."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    seed_slots: int = Field(
        default=1, ge=1, description="nodes fetching the delta from the coordinator at once"
    )
    seed_grant_s: float = Field(
        default=300.0,
        gt=0,
        description="how long a node may take to fetch from the coordinator before its slot "
        "goes to another (it has died, say)",
    )
    holder_ttl_s: float = Field(
        default=600.0, gt=0, description="a holder not heard from for this long is forgotten"
    )
    holders_per_answer: int = Field(
        default=4, ge=1, le=16, description="holders named to a node, least asked first"
    )


class CoordinatorConfig(BaseModel):
    """Everything `skillswarm coordinator serve` needs."""

    model_config = ConfigDict(extra="forbid")

    work_dir: Path = Path("coordinator-data")
    http_host: str = "127.0.0.1"
    http_port: int = 8470
    public_url: str | None = Field(
        default=None, description="URL nodes use to reach this service; default from host/port"
    )
    p2p_host: str = "127.0.0.1"
    p2p_port: int = 4001
    p2p_announce_addrs: list[str] = Field(
        default_factory=list,
        description="multiaddrs nodes dial, e.g. /ip4/203.0.113.10/tcp/4001 (behind NAT or when "
        "listening on 0.0.0.0); default: the listen addresses",
    )
    identity_file: Path | None = Field(default=None, description="default: work_dir/identity.key")
    swarm: str = "default"
    repo_id: str = "skillswarm/agent"
    database_url: str | None = Field(default=None, description="default: SQLite in work_dir")
    base_checkpoint: Path | None = Field(
        default=None,
        description=(
            "Hugging Face folder published as round 0 (required while the registry is empty; "
            "`skillswarm bootstrap` builds the embedded one)"
        ),
    )
    allowed_peers: list[str] = Field(
        default_factory=list, description="PeerIDs whose deltas are accepted; empty: anyone"
    )
    max_blob_bytes: int = Field(default=8 << 30, ge=1)
    accept_lossy: bool = Field(default=False, description="accept int8 (lossy) deltas")
    keep_rounds: int = Field(
        default=2, ge=1, description="rounds whose delta blobs stay on disk after merging"
    )
    torch_threads: int = Field(default=1, ge=1)
    operator_token_env: str = Field(
        default="SKILLSWARM_OPERATOR_TOKEN",
        min_length=1,
        description="environment variable holding the operator API's bearer token",
    )
    merge: MergePlan = Field(default_factory=MergePlan)
    round: RoundPolicy = Field(default_factory=RoundPolicy)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gates: GateConfig = Field(default_factory=GateConfig)
    publish: PublishPolicy = Field(default_factory=PublishPolicy)
    outer: OuterOptimizerConfig = Field(
        default_factory=OuterOptimizerConfig,
        description="outer optimizer across rounds: the merged delta as a pseudo-gradient",
    )
    fanout: FanoutConfig = Field(
        default_factory=lambda: FanoutConfig(),
        description="merged checkpoints fanned out peer to peer as deltas from their parent",
    )
    tracking: TrackingConfig | None = Field(
        default=None,
        description="experiment tracking of each decided round's scores ([tracking]); unset: off",
    )

    @field_validator("merge", mode="before")
    @classmethod
    def _plain_spec_is_a_plan(cls, value: Any) -> Any:
        if isinstance(value, MergeSpec) and not isinstance(value, MergePlan):
            return value.model_dump()
        return value

    @field_validator("p2p_announce_addrs")
    @classmethod
    def _dialable_multiaddrs(cls, addrs: list[str]) -> list[str]:
        for addr in addrs:
            parts = addr.split("/")
            if (
                len(parts) < 5
                or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6")
                or parts[3] != "tcp"
                or not parts[4].isdigit()
            ):
                raise ValueError(
                    f"p2p_announce_addrs entry {addr!r} is not a TCP multiaddr such as "
                    "/ip4/203.0.113.10/tcp/4001 or /dns4/coordinator.example.org/tcp/4001"
                )
        return addrs

    @property
    def topic(self) -> str:
        return f"skillswarm/{self.swarm}/v1"

    @property
    def identity_path(self) -> Path:
        return self.identity_file or self.work_dir / "identity.key"

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.work_dir / 'coordinator.db').resolve()}"

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.http_host}:{self.http_port}"

    @property
    def gate_domains(self) -> list[str]:
        return self.gates.domains or self.eval.domains
