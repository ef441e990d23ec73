"""The outer optimizer across rounds (DiLoCo's outer step): each round's merged delta is a
pseudo-gradient, stepped with Nesterov or classic momentum, the buffers kept crash-safe on disk.

Reference: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
https://arxiv.org/abs/2311.08455 (the outer step is SGD with Nesterov momentum on the averaged
pseudo-gradient).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file
from skillswarm.merge.streaming import SafetensorsStreamWriter, write_checkpoint
from skillswarm.merge.tensors import CheckpointTensors, MergeError
from skillswarm.protocol.checkpoint import MANIFEST_FILE_NAME
from skillswarm.protocol.durable import fsync_directory, write_bytes_atomically

log = logging.getLogger(__name__)

STATE_FILE = "state.json"  # the committed state: buffers leading to a published checkpoint
PENDING_FILE = "pending.json"  # a stepped candidate's buffers, until it is published
MAX_STATE_JSON_BYTES = 1 << 20
_BUFFERS_NAME = re.compile(r"momentum-[0-9a-f]{16}\.safetensors")


class OuterOptimizerConfig(BaseModel):
    """The outer step: checkpoint_r+1 = base_r + learning_rate · u_r on g_r = merged_r − base_r,
    with m_r = momentum · m_r−1 + g_r and u_r = g_r + momentum · m_r (Nesterov) or u_r = m_r.
    The defaults (learning_rate 1, momentum 0) publish the merged checkpoint as it is."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(1.0, gt=0, allow_inf_nan=False)
    momentum: float = Field(0.0, ge=0, lt=1)
    nesterov: bool = True

    def is_identity(self) -> bool:
        """Whether the step publishes the merged checkpoint unchanged."""
        return self.learning_rate == 1.0 and self.momentum == 0.0


class _StateRecord(BaseModel):
    """The JSON beside a buffers file: the checkpoint the buffers lead to (None while pending),
    the round and base that produced them, the steps they accumulate, and the config used."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_id: str | None
    parent_id: str
    round: int
    steps: int = Field(ge=1)
    config: OuterOptimizerConfig
    buffers: str = Field(pattern=_BUFFERS_NAME.pattern)


def outer_step(
    base_dir: Path,
    merged_dir: Path,
    out_dir: Path,
    config: OuterOptimizerConfig,
    momentum: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Write base + lr · u (computed in float32) to `out_dir`, tensor by tensor, laid out as the
    merged checkpoint (its files, and each tensor's dtype, which is the base's unless the merge
    set an out_dtype); non-floating tensors and side files (config, tokenizer…) are the merged
    checkpoint's. `momentum` is m_r−1 (None: zero). Returns m_r (float32) for every floating
    tensor, or {} when config.momentum is 0, as nothing then carries into the next round. An
    identity config copies the merged folder's files as they are, without arithmetic."""
    base, merged = CheckpointTensors(base_dir), CheckpointTensors(merged_dir)
    _check_same_layout(base, merged)
    floating = {name for name, (dtype, _) in merged.meta.items() if dtype.is_floating_point}
    if momentum is not None:
        _check_momentum(momentum, floating, merged)
    out_dir = Path(out_dir)
    if out_dir.resolve() in (Path(base_dir).resolve(), Path(merged_dir).resolve()):
        raise MergeError(f"the outer step cannot write into its own input folder {out_dir}")
    if config.is_identity():
        out_dir.mkdir(parents=True, exist_ok=True)
        for item in Path(merged_dir).iterdir():
            if item.is_file() and item.name != MANIFEST_FILE_NAME:
                shutil.copy2(item, out_dir / item.name)
        return {}
    lr, mu = config.learning_rate, config.momentum
    buffers: dict[str, torch.Tensor] = {}

    def stepped(name: str, merged_tensor: torch.Tensor) -> torch.Tensor | None:
        if name not in floating:
            return None
        theta = base.get(name).float()
        g = merged_tensor.float() - theta
        m = g if momentum is None else mu * momentum[name].float() + g
        u = g + mu * m if config.nesterov else m
        if mu > 0:
            buffers[name] = m
        return (theta + lr * u).to(merged_tensor.dtype)

    write_checkpoint(Path(merged_dir), out_dir, stepped)
    return buffers


def _check_same_layout(base: CheckpointTensors, merged: CheckpointTensors) -> None:
    missing = sorted(set(base.meta) - set(merged.meta))
    extra = sorted(set(merged.meta) - set(base.meta))
    if missing or extra:
        raise MergeError(
            f"{merged.folder} does not hold the tensors of its base {base.folder}: "
            f"missing {missing[:3]}, unexpected {extra[:3]}"
        )
    for name, (dtype, shape) in base.meta.items():
        merged_dtype, merged_shape = merged.meta[name]
        if merged_shape != shape or merged_dtype.is_floating_point != dtype.is_floating_point:
            raise MergeError(
                f"tensor {name} is {merged_dtype} {merged_shape} in {merged.folder} but "
                f"{dtype} {shape} in its base {base.folder}; the merged checkpoint must keep "
                "the base's shapes"
            )


def _check_momentum(
    momentum: Mapping[str, torch.Tensor], floating: set[str], merged: CheckpointTensors
) -> None:
    wrong = sorted(floating ^ set(momentum))
    wrong += sorted(
        name
        for name in floating & set(momentum)
        if tuple(momentum[name].shape) != merged.meta[name][1]
    )
    if wrong:
        raise MergeError(
            "the momentum buffers do not fit the checkpoint's floating tensors "
            f"(e.g. {wrong[:3]}); delete the outer optimizer's state folder to restart the "
            "momentum from zero"
        )


# State on disk -------------------------------------------------------------------------------
# state_dir holds momentum-<16 hex>.safetensors files and the JSONs naming them. Replacing
# state.json is the single commit point; a buffers file no JSON names is garbage.


def write_pending(
    state_dir: Path,
    buffers: Mapping[str, torch.Tensor],
    round: int,
    parent_id: str,
    *,
    config: OuterOptimizerConfig | None = None,
    steps: int = 1,
) -> None:
    """Keep the buffers of a stepped candidate (round `round` on base `parent_id`) until it is
    published: a fresh buffers file, then pending.json naming it, each written atomically."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    name = f"momentum-{os.urandom(8).hex()}.safetensors"
    temporary = state_dir / f".{name}.{os.getpid()}.tmp"
    layout = [(key, torch.float32, tuple(buffers[key].shape)) for key in sorted(buffers)]
    writer = SafetensorsStreamWriter(temporary, layout)
    try:
        for key in sorted(buffers):
            writer.write(key, buffers[key].float())
        writer.close()  # flushes and fsyncs
        os.replace(temporary, state_dir / name)
    except BaseException:
        writer.abort()
        raise
    fsync_directory(state_dir)
    record = _StateRecord(
        checkpoint_id=None,
        parent_id=parent_id,
        round=round,
        steps=steps,
        config=config or OuterOptimizerConfig(),
        buffers=name,
    )
    _write_record(state_dir / PENDING_FILE, record)
    _collect_garbage(state_dir)


def commit_pending(state_dir: Path, checkpoint_id: str) -> None:
    """The pending candidate was published as `checkpoint_id`: its buffers become the state."""
    pending = _read_record(Path(state_dir) / PENDING_FILE)
    if pending is None:
        raise MergeError(
            f"{state_dir} holds no pending outer-optimizer state to commit as {checkpoint_id}; "
            "commit follows a step whose candidate was published"
        )
    _promote(Path(state_dir), pending, checkpoint_id)


def discard_pending(state_dir: Path) -> None:
    """Drop a pending candidate's buffers (it was not published); the committed state stays."""
    state_dir = Path(state_dir)
    if (state_dir / PENDING_FILE).exists():
        (state_dir / PENDING_FILE).unlink()
        fsync_directory(state_dir)
    if state_dir.is_dir():
        _collect_garbage(state_dir)


def recover(state_dir: Path, published: Callable[[int, str], str | None]) -> str | None:
    """At start-up: promote a pending state whose candidate was published (`published(round,
    parent_id)` gives its id), else drop it; remove leftovers of interrupted writes. Returns the
    id of the checkpoint a pending state was promoted for, or None."""
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        return None
    promoted = None
    pending = _read_record(state_dir / PENDING_FILE)
    if pending is not None:
        committed = _read_record(state_dir / STATE_FILE)
        if committed is not None and committed.buffers == pending.buffers:
            promoted = committed.checkpoint_id  # a commit stopped after its commit point
        else:
            promoted = published(pending.round, pending.parent_id)
        if promoted is not None:
            log.info("outer optimizer: round %d's state promoted for %s", pending.round, promoted)
            _promote(state_dir, pending, promoted)
            return promoted
        log.info("outer optimizer: round %d was not published; its state dropped", pending.round)
    discard_pending(state_dir)
    return promoted


def load_state(
    state_dir: Path, current_checkpoint_id: str, config: OuterOptimizerConfig | None = None
) -> dict[str, torch.Tensor] | None:
    """The committed momentum buffers if they lead to `current_checkpoint_id` (and were made
    under `config`, when given); else None, with the reason logged: the momentum restarts."""
    state_dir = Path(state_dir)
    record = _read_record(state_dir / STATE_FILE)
    if record is None:
        reason = "no committed state"
    elif record.checkpoint_id != current_checkpoint_id:
        reason = (
            f"the state leads to {record.checkpoint_id}, not to the base {current_checkpoint_id}"
        )
    elif config is not None and record.config != config:
        reason = f"the config changed from {record.config.model_dump()} to {config.model_dump()}"
    else:
        try:
            buffers = load_file(state_dir / record.buffers)
        except (OSError, SafetensorError) as exc:
            reason = f"{record.buffers} is unreadable: {exc}"
        else:
            if all(tensor.dtype == torch.float32 for tensor in buffers.values()):
                return buffers
            reason = f"{record.buffers} holds tensors that are not float32"
    log.info("outer optimizer: momentum restarts from zero: %s", reason)
    return None


def _state_steps(state_dir: Path) -> int:
    record = _read_record(Path(state_dir) / STATE_FILE)
    return 0 if record is None else record.steps


def _promote(state_dir: Path, pending: _StateRecord, checkpoint_id: str) -> None:
    _write_record(
        state_dir / STATE_FILE, pending.model_copy(update={"checkpoint_id": checkpoint_id})
    )
    (state_dir / PENDING_FILE).unlink(missing_ok=True)
    fsync_directory(state_dir)
    _collect_garbage(state_dir)


def _write_record(path: Path, record: _StateRecord) -> None:
    write_bytes_atomically(path, (record.model_dump_json(indent=2) + "\n").encode())


def _read_record(path: Path) -> _StateRecord | None:
    """A state JSON, or None where there is none or it is unreadable (logged)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_STATE_JSON_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_STATE_JSON_BYTES:
        log.warning("outer optimizer: %s is over %d bytes; ignored", path, MAX_STATE_JSON_BYTES)
        return None
    try:
        return _StateRecord.model_validate_json(raw)
    except ValidationError as exc:
        log.warning("outer optimizer: %s is not a state record; ignored: %s", path, exc)
        return None


def _collect_garbage(state_dir: Path) -> None:
    """Remove temp files and buffers files that no state JSON names."""
    named = {
        record.buffers
        for record in (_read_record(state_dir / STATE_FILE), _read_record(state_dir / PENDING_FILE))
        if record is not None
    }
    for item in state_dir.iterdir():
        stale_temp = item.name.startswith(".") and item.name.endswith(".tmp")
        if stale_temp or (_BUFFERS_NAME.fullmatch(item.name) and item.name not in named):
            item.unlink(missing_ok=True)


class OuterOptimizer:
    """The outer optimizer as a round uses it: `step` after the merge, then `commit` once the
    candidate is published or `discard` if it is not; `recover` at start-up. One coordinator owns
    `state_dir`. Without momentum no state is kept (nothing carries from round to round)."""

    def __init__(self, state_dir: Path, config: OuterOptimizerConfig) -> None:
        self.state_dir = Path(state_dir)
        self.config = config

    @property
    def keeps_state(self) -> bool:
        return self.config.momentum > 0

    def step(
        self, base_id: str, base_dir: Path, merged_dir: Path, out_dir: Path, round: int
    ) -> Path:
        """The checkpoint to publish for round `round` on base `base_id`: `merged_dir` itself
        under an identity config, else the stepped checkpoint written to `out_dir`."""
        if self.config.is_identity():
            return Path(merged_dir)
        momentum = None
        if self.keeps_state:
            momentum = load_state(self.state_dir, base_id, self.config)
        buffers = outer_step(base_dir, merged_dir, out_dir, self.config, momentum)
        if self.keeps_state:
            steps = 1 if momentum is None else _state_steps(self.state_dir) + 1
            write_pending(self.state_dir, buffers, round, base_id, config=self.config, steps=steps)
        return Path(out_dir)

    def commit(self, checkpoint_id: str) -> None:
        """The stepped candidate was published as `checkpoint_id`."""
        if self.keeps_state:
            commit_pending(self.state_dir, checkpoint_id)

    def discard(self) -> None:
        """The stepped candidate was not published; the momentum stays as it was."""
        if self.keeps_state:
            discard_pending(self.state_dir)

    def recover(self, published: Callable[[int, str], str | None]) -> str | None:
        """Settle a step a crash left pending; see `recover`."""
        return recover(self.state_dir, published) if self.keeps_state else None
