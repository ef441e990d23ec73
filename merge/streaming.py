"""Tensor-by-tensor merges of a base checkpoint with task vectors, through mergekit's methods.

Only one tensor per input is in memory at a time: base tensors come from the safetensors files by
mmap, deltas from a callback, and each merged tensor is written straight into the output file,
whose header is laid out up front from the base's shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from merge.checkpoint import MANIFEST_FILE_NAME
from merge.methods import MergeSpec

SAFETENSORS_INDEX = "model.safetensors.index.json"
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class MergeError(RuntimeError):
    """A merge could not be carried out; the message names the input or tensor at fault."""


@dataclass(frozen=True)
class TaskVector:
    """One expert: a name for mergekit and a per-tensor getter of the expert's weights.

    `expert(name, base_tensor)` returns the expert's tensor (same shape as the base), or None when
    the expert left it unchanged. The task vector is that tensor minus the base.
    """

    name: str
    expert: Callable[[str, torch.Tensor], torch.Tensor | None]


def weight_files(checkpoint: Path) -> list[str]:
    """The safetensors files of a Hugging Face folder, single-file or sharded."""
    index = checkpoint / SAFETENSORS_INDEX
    if index.exists():
        shards = json.loads(index.read_text())["weight_map"].values()
        return sorted(set(shards))
    if (checkpoint / "model.safetensors").exists():
        return ["model.safetensors"]
    raise MergeError(f"{checkpoint} holds no model.safetensors or {SAFETENSORS_INDEX}")


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor, in the order given to the constructor."""

    def __init__(self, path: Path, layout: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = path
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._expected.append((name, dtype, shape, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        exp_name, dtype, shape, nbytes = self._expected[self._next]
        if name != exp_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise MergeError(
                f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} written where "
                f"{exp_name} {dtype} {shape} was laid out"
            )
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == nbytes
        self._file.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            self._file.close()
            raise MergeError(f"{self.path}: {len(self._expected) - self._next} tensors unwritten")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


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
    by tensor, computing in spec.dtype and writing the base's dtype. Other files (config,
    tokenizer…) are copied from the base.
    """
    if not experts:
        raise MergeError("a merge needs at least one task vector")
    names = [e.name for e in experts]
    if len(set(names)) != len(names) or "base" in names:
        raise MergeError(f"task vector names must be unique and not 'base': {names}")
    method = spec.method_object()
    compute = spec.torch_dtype()
    parameters = spec.bound_parameters(names)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_tensors = CheckpointTensors(base_dir)
    with_base = spec.uses_base()
    total, done = len(base_tensors.meta), 0
    torch.manual_seed(spec.seed)
    for fname, keys in base_tensors.files.items():
        layout = [(key, *base_tensors.meta[key]) for key in keys]
        writer = SafetensorsStreamWriter(out_dir / fname, layout)
        with safe_open(base_dir / fname, framework="pt") as f:
            for key in keys:
                base = f.get_tensor(key)
                merged = _merge_one(
                    key, base, experts, names, method, parameters, compute, with_base
                )
                writer.write(key, merged)
                done += 1
                if progress:
                    progress(done, total)
        writer.close()
    for item in base_dir.iterdir():
        if (
            item.is_file()
            and not item.name.endswith(".safetensors")
            and item.name != MANIFEST_FILE_NAME
        ):
            shutil.copy2(item, out_dir / item.name)
    return out_dir


def _merge_one(
    key: str,
    base: torch.Tensor,
    experts: Sequence[TaskVector],
    names: list[str],
    method: Any,
    parameters: Mapping[str, Any],
    compute: torch.dtype,
    with_base: bool,
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

    if not with_base:
        return merge_tensors(
            inputs[1:],
            method,
            parameters=parameters,
            ids=names,
            name=key,
            dtype=compute,
            out_dtype=base.dtype,
        )
    return merge_tensors(
        inputs,
        method,
        parameters=parameters,
        ids=["base", *names],
        base_index=0,
        name=key,
        dtype=compute,
        out_dtype=base.dtype,
    )


def _dtype_from_st(name: str) -> torch.dtype:
    for dtype, st in _ST_DTYPES.items():
        if st == name:
            return dtype
    raise MergeError(f"unsupported safetensors dtype {name}")


class CheckpointTensors:
    """Random access to a checkpoint's tensors by name, one tensor read at a time (mmap)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._where: dict[str, str] = {}
        self.files: dict[str, list[str]] = {}  # file name -> its tensors, in file order
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for fname in weight_files(self.folder):
            with safe_open(self.folder / fname, framework="pt") as f:
                self.files[fname] = list(f.keys())
                for key in self.files[fname]:
                    sl = f.get_slice(key)
                    self._where[key] = fname
                    self.meta[key] = (_dtype_from_st(sl.get_dtype()), tuple(sl.get_shape()))

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.folder / self._where[name], framework="pt") as f:
            return f.get_tensor(name)


def iter_base_tensors(base_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of a checkpoint, one at a time."""
    for fname in weight_files(base_dir):
        with safe_open(base_dir / fname, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
