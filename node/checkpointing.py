"""Crash-safe checkpoints of the RL trainer: weights (a loadable Hugging Face folder), optimizer and
scheduler state, RNG streams and the run's position, written atomically so that a kill at any moment
leaves a complete checkpoint for `load_training_checkpoint` to resume from.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_model
from skillswarm.protocol.durable import fsync_directory, write_bytes_atomically

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "skillswarm-training-checkpoint/1"
LATEST_POINTER = "latest"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

_STEP_DIR = re.compile(r"step-(\d+)")
# Leftovers of an interrupted save: a half-built checkpoint, a step folder moved aside while a
# checkpoint of the same step replaced it, a pruned folder being deleted, the pointer's temp file.
_BUILDING_PREFIX = ".tmp-"
_REPLACED_PREFIX = ".replaced-"
_PRUNED_PREFIX = ".pruned-"
_REPLACED_DIR = re.compile(r"\.replaced-(step-\d+)-[0-9a-f]+")
_POINTER_TEMP = re.compile(r"\.latest\..*\.tmp")
_TORCH_LOAD_ERRORS = (
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
)


class TrainingCheckpointError(RuntimeError):
    """Base class of the errors raised when saving or loading a training checkpoint."""


class CorruptCheckpointError(TrainingCheckpointError):
    """A checkpoint's files are damaged or missing; the message names the file."""


class IncompatibleCheckpointError(TrainingCheckpointError):
    """A checkpoint is intact but does not fit the model, optimizer or scheduler given."""


@dataclass
class TrainingState:
    """Where a run stands: its step, its position in the task stream, the policy version it has
    published or served, and any further JSON-able bookkeeping the trainer wants back."""

    step: int
    data_position: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        """The fields as they go into `state.json`."""
        return {
            "step": self.step,
            "data_position": self.data_position,
            "policy_version": self.policy_version,
            "extra": self.extra,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> TrainingState:
        """Read the fields back, checking their types (ValueError when wrong)."""
        step, version = data.get("step"), data.get("policy_version")
        position, extra = data.get("data_position"), data.get("extra")
        if not (isinstance(step, int) and isinstance(version, int)):
            raise ValueError("step and policy_version must be integers")
        if not (isinstance(position, dict) and isinstance(extra, dict)):
            raise ValueError("data_position and extra must be JSON objects")
        return cls(step=step, data_position=position, policy_version=version, extra=extra)


def step_directory_name(step: int) -> str:
    """The name of the folder holding the checkpoint of `step` (`step-000123`)."""
    return f"step-{step:06d}"


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def _step_directories(directory: Path) -> list[Path]:
    """Visible step folders, newest step first."""
    found = [(step, path) for path in directory.iterdir() if (step := _step_of(path)) is not None]
    return [path for _, path in sorted(found, reverse=True)]


def _read_manifest(step_dir: Path) -> dict[str, Any] | None:
    """The parsed `state.json` of a complete checkpoint, or None: complete means it parses,
    has this format, and every file it lists exists with the size it recorded."""
    try:
        manifest = json.loads((step_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, size in files.items():
        candidate = step_dir / name
        if "/" in name or name.startswith(".") or not candidate.is_file():
            return None
        if candidate.stat().st_size != size:
            return None
    try:
        TrainingState.from_json_dict(manifest)
    except ValueError:
        return None
    return manifest


def _read_latest_pointer(directory: Path) -> str | None:
    try:
        name = (directory / LATEST_POINTER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.fullmatch(name) else None


def _candidates(directory: Path) -> list[Path]:
    """Complete checkpoints in the order to try them: the one `latest` names, then the others
    newest step first."""
    complete = [path for path in _step_directories(directory) if _read_manifest(path) is not None]
    pointed = _read_latest_pointer(directory)
    if pointed is not None and (directory / pointed) in complete:
        complete.remove(directory / pointed)
        complete.insert(0, directory / pointed)
    elif complete:
        logger.warning(
            "%s: %s; using %s",
            directory,
            "no valid latest pointer" if pointed is None else f"{pointed} is incomplete",
            complete[0].name,
        )
    return complete


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint folder a resume would load: the one `latest` names when complete, else the
    newest complete one; None when there is none. Reads only, changes nothing."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = _candidates(directory)
    return candidates[0] if candidates else None


def _clean_leftovers(directory: Path) -> None:
    """Finish what an interrupted save left: delete half-built and pruned folders and the pointer's
    temp file; put a moved-aside checkpoint back when nothing replaced it, else delete it."""
    for path in directory.iterdir():
        name = path.name
        if name.startswith((_BUILDING_PREFIX, _PRUNED_PREFIX)) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif _POINTER_TEMP.fullmatch(name) and path.is_file():
            path.unlink(missing_ok=True)
        elif (match := _REPLACED_DIR.fullmatch(name)) and path.is_dir():
            original = directory / match.group(1)
            if not original.exists() and _read_manifest(path) is not None:
                os.replace(path, original)
                fsync_directory(directory)
            else:
                shutil.rmtree(path, ignore_errors=True)


def _capture_rng() -> dict[str, Any]:
    numpy_state = np.random.get_state(legacy=False)
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng(states: dict[str, Any], source: Path) -> None:
    try:
        python_version, python_internal, python_gauss = states["python"]
        numpy_state = states["numpy"]
        random.setstate((python_version, tuple(python_internal), python_gauss))
        np.random.set_state(
            {
                "bit_generator": numpy_state["bit_generator"],
                "state": {
                    "key": numpy_state["key"].numpy().astype(np.uint32),
                    "pos": numpy_state["pos"],
                },
                "has_gauss": numpy_state["has_gauss"],
                "gauss": numpy_state["gauss"],
            }
        )
        torch.set_rng_state(states["torch_cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CorruptCheckpointError(f"{source}: unusable RNG state ({error})") from error
    cuda_states = states.get("torch_cuda")
    if cuda_states is None or not torch.cuda.is_available():
        return
    if len(cuda_states) != torch.cuda.device_count():
        logger.warning(
            "%s holds RNG states for %d CUDA devices but %d are visible; CUDA RNG not restored",
            source,
            len(cuda_states),
            torch.cuda.device_count(),
        )
        return
    torch.cuda.set_rng_state_all(cuda_states)


def _save_weights(
    model: torch.nn.Module, folder: Path, tokenizer: PreTrainedTokenizerBase | None
) -> None:
    """Hugging Face models through `save_pretrained` (without its per-save progress bar, which
    would break a trainer's own progress display), other modules as one safetensors file."""
    if hasattr(model, "save_pretrained"):
        from transformers.utils import logging as transformers_logging

        bar_was_enabled = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            model.save_pretrained(folder)
        finally:
            if bar_was_enabled:
                transformers_logging.enable_progress_bar()
    else:
        save_model(model, str(folder / SINGLE_WEIGHTS_FILE))
    if tokenizer is not None:
        from skillswarm.agent.model import save_tokenizer

        save_tokenizer(tokenizer, folder)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def save_training_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    scheduler: LRScheduler | None = None,
    keep: int = 2,
) -> Path:
    """Write `directory/step-NNNNNN/` (weights as safetensors via `save_pretrained`, so the folder
    loads as a Hugging Face checkpoint, plus the tokenizer when given; optimizer, scheduler and RNG
    state; `state.json` last) in a temp folder, fsync it, rename it into place, then point `latest`
    at it. Keeps the `keep` newest checkpoints up to this step and deletes the rest, including any
    with a later step (left by a run that resumed from an earlier one). Returns the folder.

    One process writes a given `directory` at a time."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if state.step < 0:
        raise ValueError(f"step must be non-negative, got {state.step}")
    TrainingState.from_json_dict(state.to_json_dict())
    try:
        json.dumps(state.to_json_dict(), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"training state is not plain JSON: {error}") from error

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(directory)
    name = step_directory_name(state.step)
    final = directory / name
    building = directory / f"{_BUILDING_PREFIX}{name}-{os.getpid()}-{os.urandom(4).hex()}"
    building.mkdir()
    try:
        _save_weights(model, building, tokenizer)
        torch.save(optimizer.state_dict(), building / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), building / SCHEDULER_FILE)
        torch.save(_capture_rng(), building / RNG_FILE)
        files: dict[str, int] = {}
        for path in sorted(building.iterdir()):
            if not path.is_file():
                raise TrainingCheckpointError(
                    f"unexpected non-file {path.name} in a checkpoint being written"
                )
            _fsync_file(path)
            files[path.name] = path.stat().st_size
        manifest = {
            "format": CHECKPOINT_FORMAT,
            **state.to_json_dict(),
            "saved_at": time.time(),
            "has_scheduler": scheduler is not None,
            "files": files,
        }
        with open(building / STATE_FILE, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(manifest, indent=2, allow_nan=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        fsync_directory(building)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise

    replaced: Path | None = None
    if final.exists():
        replaced = directory / f"{_REPLACED_PREFIX}{name}-{os.urandom(4).hex()}"
        os.replace(final, replaced)
    os.replace(building, final)
    fsync_directory(directory)
    write_bytes_atomically(directory / LATEST_POINTER, f"{name}\n".encode())
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    _prune(directory, newest_step=state.step, keep=keep, protected=final)
    return final


def _prune(directory: Path, *, newest_step: int, keep: int, protected: Path) -> None:
    """Delete every step folder except `protected` and the `keep` newest complete ones at or
    below `newest_step`; each is renamed aside first so no half-deleted folder stays visible."""
    kept = {protected}
    for path in _step_directories(directory):
        if len(kept) >= keep:
            break
        step = _step_of(path)
        if step is not None and step <= newest_step and _read_manifest(path) is not None:
            kept.add(path)
    doomed = [path for path in _step_directories(directory) if path not in kept]
    for path in doomed:
        aside = directory / f"{_PRUNED_PREFIX}{path.name}-{os.urandom(4).hex()}"
        os.replace(path, aside)
    if doomed:
        fsync_directory(directory)
    for path in directory.iterdir():
        if path.name.startswith(_PRUNED_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


def _weight_files(step_dir: Path, manifest: dict[str, Any]) -> list[Path]:
    files = manifest["files"]
    if WEIGHTS_INDEX_FILE in files:
        index_path = step_dir / WEIGHTS_INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"{index_path}: unreadable shard index ({error})"
            ) from error
        for shard in shard_names:
            if shard not in files:
                raise CorruptCheckpointError(f"{index_path} names {shard}, which is not saved")
        return [step_dir / shard for shard in shard_names]
    if SINGLE_WEIGHTS_FILE in files:
        return [step_dir / SINGLE_WEIGHTS_FILE]
    raise CorruptCheckpointError(f"{step_dir} holds no {SINGLE_WEIGHTS_FILE} or shard index")


def _load_weights(model: torch.nn.Module, files: list[Path]) -> None:
    """Copy the tensors of `files` into `model`, after checking every name and shape first: all
    of the model's parameters and persistent buffers must be present (tied ones once)."""
    targets = model.state_dict()
    found: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    if name not in targets:
                        raise IncompatibleCheckpointError(
                            f"{path} holds tensor {name}, which the model does not have"
                        )
                    shape = tuple(handle.get_slice(name).get_shape())
                    if shape != tuple(targets[name].shape):
                        raise IncompatibleCheckpointError(
                            f"{path}: tensor {name} has shape {shape}, "
                            f"the model expects {tuple(targets[name].shape)}"
                        )
                    found[name] = path
        except SafetensorError as error:
            raise CorruptCheckpointError(
                f"{path}: not a readable safetensors file ({error})"
            ) from error
    loaded_storage = {targets[name].data_ptr() for name in found}
    missing = [
        name
        for name, tensor in targets.items()
        if name not in found and tensor.data_ptr() not in loaded_storage
    ]
    if missing:
        raise IncompatibleCheckpointError(
            f"{files[0].parent} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}"
        )
    with torch.no_grad():
        for path in files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        targets[name].copy_(handle.get_tensor(name))
            except SafetensorError as error:
                raise CorruptCheckpointError(f"{path}: unreadable tensor data ({error})") from error


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except _TORCH_LOAD_ERRORS as error:
        raise CorruptCheckpointError(f"{path}: unreadable ({error})") from error


def _load_one(
    step_dir: Path,
    manifest: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    restore_rng: bool,
) -> TrainingState:
    state = TrainingState.from_json_dict(manifest)
    files = manifest["files"]
    if optimizer is not None and OPTIMIZER_FILE not in files:
        raise CorruptCheckpointError(f"{step_dir} has no {OPTIMIZER_FILE}")
    if scheduler is not None and SCHEDULER_FILE not in files:
        raise IncompatibleCheckpointError(
            f"{step_dir} was saved without a scheduler; cannot restore the one given"
        )
    optimizer_state = _torch_load(step_dir / OPTIMIZER_FILE) if optimizer is not None else None
    scheduler_state = _torch_load(step_dir / SCHEDULER_FILE) if scheduler is not None else None
    rng_states = _torch_load(step_dir / RNG_FILE) if restore_rng else None
    _load_weights(model, _weight_files(step_dir, manifest))
    if optimizer is not None:
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError) as error:
            raise IncompatibleCheckpointError(
                f"{step_dir / OPTIMIZER_FILE} does not fit the optimizer given: {error}"
            ) from error
    if scheduler is not None:
        try:
            scheduler.load_state_dict(scheduler_state)
        except (ValueError, KeyError, TypeError) as error:
            raise IncompatibleCheckpointError(
                f"{step_dir / SCHEDULER_FILE} does not fit the scheduler given: {error}"
            ) from error
    if rng_states is not None:
        _restore_rng(rng_states, step_dir / RNG_FILE)
    return state


def load_training_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: LRScheduler | None = None,
    *,
    restore_rng: bool = True,
) -> TrainingState | None:
    """Restore the checkpoint `latest_checkpoint` picks into `model` (strict, shape-checked), the
    optimizer and scheduler when given, and the global RNG streams; return its state, or None
    when `directory` holds no checkpoint. A checkpoint whose files prove damaged is skipped for the
    next older complete one; a checkpoint that does not fit the model raises at once."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    _clean_leftovers(directory)
    candidates = _candidates(directory)
    if not candidates:
        broken = _step_directories(directory)
        if broken:
            raise CorruptCheckpointError(
                f"{directory} holds step folders but none is complete "
                f"(e.g. {broken[0].name}: {STATE_FILE} missing, unreadable or listing absent "
                "files); move them away to start afresh"
            )
        return None
    failures: list[str] = []
    for step_dir in candidates:
        manifest = _read_manifest(step_dir)
        if manifest is None:
            failures.append(f"{step_dir}: became incomplete while loading")
            continue
        try:
            return _load_one(step_dir, manifest, model, optimizer, scheduler, restore_rng)
        except CorruptCheckpointError as error:
            logger.warning("skipping damaged checkpoint: %s", error)
            failures.append(str(error))
    raise CorruptCheckpointError(
        f"no checkpoint in {directory} could be loaded: " + "; ".join(failures)
    )


def save_optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, *, domain: str, round: int
) -> None:
    """Write `optimizer`'s state atomically to `path`, with its class and the domain and round it
    ended, for the next round's optimizer to start from (`restore_optimizer_state`)."""
    buffer = io.BytesIO()
    torch.save(
        {
            "optimizer": type(optimizer).__name__,
            "domain": domain,
            "round": round,
            "state": optimizer.state_dict(),
        },
        buffer,
    )
    write_bytes_atomically(Path(path), buffer.getbuffer())


def restore_optimizer_state(
    path: Path, optimizer: torch.optim.Optimizer, *, domain: str, round: int
) -> int | None:
    """Load the state `save_optimizer_state` wrote into `optimizer`, keeping its learning rates
    and other settings, and return the round it ended. None, with `optimizer` left fresh and the
    reason logged, when there is none or it is unreadable, of another kind of optimizer, another
    model's parameters, another domain, or not from an earlier round than `round`."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        saved = _torch_load(path)
    except CorruptCheckpointError as error:
        logger.warning("optimizer state not carried over: %s", error)
        return None
    kind = type(optimizer).__name__
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        logger.warning("optimizer state not carried over: %s holds no optimizer state", path)
        return None
    if saved.get("optimizer") != kind or saved.get("domain") != domain:
        logger.warning(
            "optimizer state not carried over: %s is %s state of %s, not %s of %s",
            path,
            saved.get("optimizer"),
            saved.get("domain"),
            kind,
            domain,
        )
        return None
    ended = saved.get("round")
    if not isinstance(ended, int) or ended >= round:
        logger.warning(
            "optimizer state not carried over: %s ended round %s, not one before %d",
            path,
            ended,
            round,
        )
        return None
    settings = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    try:
        optimizer.load_state_dict(saved["state"])
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as error:
        _fresh(optimizer, settings)
        logger.warning("optimizer state not carried over: %s does not fit (%s)", path, error)
        return None
    _fresh(optimizer, settings, clear=False)
    shapes = [
        (state.shape, param.shape)
        for group in optimizer.param_groups
        for param in group["params"]
        for state in optimizer.state.get(param, {}).values()
        if isinstance(state, torch.Tensor) and state.ndim > 0
    ]
    if any(state != param for state, param in shapes):
        _fresh(optimizer, settings)
        logger.warning("optimizer state not carried over: %s is another model's", path)
        return None
    return ended


def _fresh(
    optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]], clear: bool = True
) -> None:
    """Put `settings` back on the optimizer's groups, and with `clear` drop its state."""
    if clear:
        optimizer.state.clear()
    for group, kept in zip(optimizer.param_groups, settings, strict=True):
        group.update(kept)
