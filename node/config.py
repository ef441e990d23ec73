"""A training node's configuration: one TOML file, every field with a laptop-ready default."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    """The RL budget and hyper-parameters of one round on this node."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=8, ge=1, description="policy updates per round")
    tasks_per_step: int = Field(default=8, ge=1)
    samples_per_task: int = Field(default=4, ge=2, description="group size for advantages")
    learning_rate: float = Field(default=2e-4, gt=0)
    temperature: float = Field(default=1.0, gt=0)


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
    train: TrainConfig = Field(default_factory=TrainConfig)

    @property
    def identity_path(self) -> Path:
        return self.identity_file or self.work_dir / "identity.key"
