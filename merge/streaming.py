"""Tensor-by-tensor merges of a base checkpoint with task vectors, through mergekit's methods.

Only one tensor per input is in memory at a time: base tensors are read one by one with
positioned reads, deltas come from a callback, and each merged tensor is written straight into
its output file, whose header is laid out up front from the base's shapes and dtypes. Tensors are
merged in the order `mergekit-yaml` merges them, under the same seed, so randomized methods
(DARE, DELLA) draw the same masks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from skillswarm.merge.methods import MergeSpec
from skillswarm.merge.tensors import (
    SAFETENSORS_INDEX,
    ST_DTYPES,
    CheckpointTensors,
    MergeError,
    element_size,
)
from skillswarm.protocol.checkpoint import MANIFEST_FILE_NAME

RELEASE_AFTER_BYTES = 1 << 20


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by finished tensors back to the OS.

    glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so without
    this a tensor-by-tensor merge's resident size creeps up with every tensor merged.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass(frozen=True)
class TaskVector:
    """One expert: a name for mergekit and a per-tensor getter of the expert's weights.

    `expert(name, base_tensor)` returns the expert's tensor (same shape as the base), or None when
    the expert left it unchanged. The task vector is that tensor minus the base.
    """

    name: str
    expert: Callable[[str, torch.Tensor], torch.Tensor | None]


def mergekit_order(names: Iterable[str]) -> list[str]:
    """The order `mergekit-yaml` merges tensors in: its scheduler sorts tasks by tensor name."""
    return sorted(names)


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor, in the order given to the constructor."""

    def __init__(self, path: Path, layout: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = path
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * element_size(dtype)
            header[name] = {
                "dtype": ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, dtype, shape, nbytes))
            offset += nbytes
        self.data_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close() or abort()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._expected):
            raise MergeError(f"{self.path}: tensor {name} written after the last laid-out one")
        exp_name, dtype, shape, nbytes = self._expected[self._next]
        if name != exp_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise MergeError(
                f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} written where "
                f"{exp_name} {dtype} {shape} was laid out"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise MergeError(f"tensor {name}: {data.nbytes} bytes where {nbytes} were laid out")
        self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            self._file.close()
            raise MergeError(f"{self.path}: {len(self._expected) - self._next} tensors unwritten")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close and delete a partly written file."""
        self._file.close()
        self.path.unlink(missing_ok=True)


def merge_checkpoint(
    base_dir: Path,
    experts: Sequence[TaskVector],
    out_dir: Path,
    spec: MergeSpec,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Merge base + experts' task vectors into a new Hugging Face folder at `out_dir`.

    Each expert's tensors come from its getter; mergekit's method merges base and experts tensor
    by tensor in spec.dtype and writes spec.out_dtype (default: the base's dtype). Tensors are
    merged in mergekit's order with torch's generator seeded by spec.seed, so the result equals
    `mergekit-yaml` on `spec.to_mergekit_yaml(...)` with `spec.mergekit_cli_options()` (seed and
    torch thread count), randomized methods included; the caller's RNG state is restored
    afterwards. The output keeps the base's
    file layout; other files (config, tokenizer…) are copied from the base.
    """
    if not experts:
        raise MergeError("a merge needs at least one task vector")
    names = [e.name for e in experts]
    if len(set(names)) != len(names) or "base" in names:
        raise MergeError(f"task vector names must be unique and not 'base': {names}")
    method = spec.method_object()
    compute = spec.torch_dtype()
    out_float = spec.torch_out_dtype()
    parameters = spec.bound_parameters(names)
    with_base = spec.uses_base()
    base_tensors = CheckpointTensors(base_dir)
    order = mergekit_order(base_tensors.meta)

    def out_dtype(key: str) -> torch.dtype:
        dtype = base_tensors.meta[key][0]
        return out_float if out_float is not None and dtype.is_floating_point else dtype

    out_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[str, SafetensorsStreamWriter] = {}
    try:
        for fname in base_tensors.files:
            layout = [
                (key, out_dtype(key), base_tensors.meta[key][1])
                for key in order
                if base_tensors.file_of(key) == fname
            ]
            writers[fname] = SafetensorsStreamWriter(out_dir / fname, layout)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            for done, key in enumerate(order, start=1):
                base = base_tensors.get(key)
                merged = _merge_one(
                    key, base, experts, names, method, parameters, compute, with_base, out_float
                )
                writers[base_tensors.file_of(key)].write(key, merged)
                nbytes = merged.numel() * merged.element_size()
                del base, merged
                if nbytes >= RELEASE_AFTER_BYTES:
                    release_freed_memory()
                if progress:
                    progress(done, len(order))
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    _copy_side_files(base_dir, out_dir, {f: w.data_bytes for f, w in writers.items()}, spec)
    return out_dir


def _copy_side_files(
    base_dir: Path, out_dir: Path, written: Mapping[str, int], spec: MergeSpec
) -> None:
    """Copy the base's other files; the index and config follow the merged tensors' dtypes."""
    for item in base_dir.iterdir():
        if (
            item.is_file()
            and not item.name.endswith(".safetensors")
            and item.name not in (MANIFEST_FILE_NAME, SAFETENSORS_INDEX)
        ):
            shutil.copy2(item, out_dir / item.name)
    index = base_dir / SAFETENSORS_INDEX
    if index.exists():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(written.values())
        (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(data, indent=2) + "\n")
    config = out_dir / "config.json"
    if spec.out_dtype is not None and config.exists():
        data = json.loads(config.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in data:
                data[key] = spec.out_dtype
        config.write_text(json.dumps(data, indent=2) + "\n")


def _merge_one(
    key: str,
    base: torch.Tensor,
    experts: Sequence[TaskVector],
    names: list[str],
    method: Any,
    parameters: Mapping[str, Any],
    compute: torch.dtype,
    with_base: bool,
    out_float: torch.dtype | None,
) -> torch.Tensor:
    if not base.is_floating_point():
        return base
    inputs = [base]
    for expert in experts:
        tensor = expert.expert(key, base)
        if tensor is None:
            inputs.append(base)
            continue
        if tensor.shape != base.shape:
            raise MergeError(
                f"{expert.name}: tensor {key} has shape {tuple(tensor.shape)}, "
                f"base has {tuple(base.shape)}"
            )
        inputs.append(tensor)
    from mergekit.merge_methods import merge_tensors

    ids: list[str] = ["base", *names]
    base_index: int | None = 0
    if not with_base:
        inputs, ids, base_index = inputs[1:], names, None
    return merge_tensors(
        inputs,
        method,
        parameters=parameters,
        ids=ids,
        base_index=base_index,
        name=key,
        dtype=compute,
        out_dtype=out_float or base.dtype,
    )


def write_checkpoint(
    base_dir: Path,
    out_dir: Path,
    tensor_of: Callable[[str, torch.Tensor], torch.Tensor | None],
) -> Path:
    """Write a Hugging Face folder at `out_dir` laid out as the base's (same files, names, shapes
    and dtypes), tensor by tensor: each is `tensor_of(name, base tensor)`, or the base's own where
    that gives None. The base's other files are copied, except its registry manifest."""
    base = CheckpointTensors(base_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file_name, keys in base.files.items():
        writer = SafetensorsStreamWriter(
            out_dir / file_name, [(key, *base.meta[key]) for key in keys]
        )
        try:
            for key in keys:
                base_tensor = base.get(key)
                tensor = tensor_of(key, base_tensor)
                writer.write(key, base_tensor if tensor is None else tensor)
            writer.close()
        except BaseException:
            writer.abort()
            raise
    for item in Path(base_dir).iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            if item.name != MANIFEST_FILE_NAME:
                shutil.copy2(item, out_dir / item.name)
    return out_dir
