"""A training node's configuration: one TOML file, every field with a laptop-ready default."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from skillswarm.node.pipeline import RLConfig


class InferenceConfig(BaseModel):
    """Which engine plays the rollouts: `hf` (transformers; CPU default) or `vllm` (a CUDA GPU and
    `pip install 'skillswarm[gpu]'`)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["hf", "vllm"] = "hf"
    max_batch_size: int = Field(default=256, ge=1, description="hf: sequences per forward")
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1, description="vllm")
    max_model_len: int = Field(default=4096, ge=256, description="vllm: context length")
    dtype: str = Field(default="bfloat16", description="vllm: weights dtype")
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="vllm: more keyword arguments for vllm.LLM"
    )


class NodeConfig(BaseModel):
    """Everything `skillswarm node run` needs."""

    model_config = ConfigDict(extra="forbid")

    work_dir: Path = Path("node-data")
    domain: str = "math"
    coordinator_url: str = "http://127.0.0.1:8470"
    repo_id: str = "skillswarm/agent"
    identity_file: Path | None = Field(default=None, description="default: work_dir/identity.key")
    p2p_host: str = "127.0.0.1"
    p2p_port: int = 0
    bootstrap_peers: list[str] = Field(
        default_factory=list, description="extra multiaddrs to dial besides the coordinator"
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
        description="one round's RL budget and hyper-parameters ([train], [train.loss])",
    )
    inference: InferenceConfig = Field(default_factory=InferenceConfig)

    @property
    def identity_path(self) -> Path:
        return self.identity_file or self.work_dir / "identity.key"
