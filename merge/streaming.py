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
from skillswarm.merge.checkpoint import MANIFEST_FILE_NAME
from skillswarm.merge.methods import MergeSpec

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_OF_ST = {st: dtype for dtype, st in _ST_DTYPES.items()}


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
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise MergeError(f"{index} is larger than {MAX_INDEX_BYTES} bytes")
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise MergeError(f"{index} is not a safetensors index: {exc}") from exc
        return sorted(set(shards))
    if (checkpoint / "model.safetensors").exists():
        return ["model.safetensors"]
    raise MergeError(f"{checkpoint} holds no model.safetensors or {SAFETENSORS_INDEX}")


@dataclass(frozen=True)
class _TensorLocation:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (bounded in size) and the offset where its data begins."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise MergeError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise MergeError(f"{path}: header of {length} bytes does not fit the file")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise MergeError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise MergeError(f"{path}: header is not a JSON object")
    return header, 8 + length


def _locate(path: Path, fname: str) -> dict[str, _TensorLocation]:
    header, data_start = _read_header(path)
    data_bytes = path.stat().st_size - data_start
    found: dict[str, _TensorLocation] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPE_OF_ST[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MergeError(f"{path}: tensor {name} has an unsupported header entry") from exc
        nbytes = torch.Size(shape).numel() * _element_size(dtype)
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_bytes:
            raise MergeError(f"{path}: tensor {name} lies outside the file")
        if end - begin != nbytes:
            raise MergeError(f"{path}: tensor {name} spans {end - begin} bytes, needs {nbytes}")
        found[name] = _TensorLocation(fname, dtype, shape, data_start + begin, nbytes)
    return found


class CheckpointTensors:
    """Random access to a checkpoint's tensors by name; each `get` is one positioned read.

    Headers are parsed once. No file stays open or mapped between reads, so only the tensors a
    caller holds take memory, and a checkpoint folder can be deleted while this object lives.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._where: dict[str, _TensorLocation] = {}
        self.files: dict[str, list[str]] = {}  # file name -> its tensors, sorted
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for fname in weight_files(self.folder):
            located = _locate(self.folder / fname, fname)
            duplicated = sorted(set(located) & set(self._where))
            if duplicated:
                raise MergeError(f"{self.folder}: tensors {duplicated[:3]} are in two files")
            self._where.update(located)
            self.files[fname] = sorted(located)
            for key, where in located.items():
                self.meta[key] = (where.dtype, where.shape)

    def names(self) -> list[str]:
        return sorted(self._where)

    def file_of(self, name: str) -> str:
        return self._where[name].file

    def get(self, name: str) -> torch.Tensor:
        where = self._where.get(name)
        if where is None:
            raise MergeError(f"{self.folder} has no tensor {name}")
        tensor = torch.empty(where.shape, dtype=where.dtype)
        if where.nbytes == 0:
            return tensor
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        with open(self.folder / where.file, "rb", buffering=0) as handle:
            handle.seek(where.begin)
            done = 0
            while done < where.nbytes:
                count = handle.readinto(view[done:])
                if not count:
                    raise MergeError(f"{self.folder / where.file} ends inside tensor {name}")
                done += count
        return tensor


def iter_base_tensors(base_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of a checkpoint, one at a time, file by file."""
    tensors = CheckpointTensors(base_dir)
    for names in tensors.files.values():
        for name in names:
            yield name, tensors.get(name)


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
            nbytes = torch.Size(shape).numel() * _element_size(dtype)
            header[name] = {
                "dtype": _ST_DTYPES[dtype],
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
