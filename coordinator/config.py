"""The merge coordinator's configuration: one TOML file, every field with a laptop-ready default."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from merge.methods import MergeSpec


class RoundPolicy(BaseModel):
    """When a round's accepted deltas are merged."""

    model_config = ConfigDict(extra="forbid")

    min_deltas: int = Field(default=2, ge=1, description="accepted deltas needed to merge")
    required_domains: list[str] = Field(
        default_factory=list, description="each of these domains needs an accepted delta"
    )


class EvalConfig(BaseModel):
    """Held-out evaluation of every candidate checkpoint."""

    model_config = ConfigDict(extra="forbid")

    domains: list[str] = Field(default_factory=lambda: ["math"])
    n_tasks: int = Field(default=32, ge=1)
    seed: int = 0


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
    identity_file: Path | None = Field(default=None, description="default: work_dir/identity.key")
    swarm: str = "default"
    repo_id: str = "skillswarm/agent"
    database_url: str | None = Field(default=None, description="default: SQLite in work_dir")
    base_checkpoint: Path | None = Field(
        default=None,
        description="Hugging Face folder published as round 0; default: build the embedded model",
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
    merge: MergeSpec = Field(default_factory=MergeSpec)
    round: RoundPolicy = Field(default_factory=RoundPolicy)
    eval: EvalConfig = Field(default_factory=EvalConfig)

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
