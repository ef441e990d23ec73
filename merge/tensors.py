"""Reading a safetensors checkpoint (single file or sharded) tensor by tensor: headers parsed
once and bounded in size, each tensor fetched with one positioned read."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024
ST_DTYPES = {
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
_DTYPE_OF_ST = {st: dtype for dtype, st in ST_DTYPES.items()}


class MergeError(RuntimeError):
    """A merge could not be carried out; the message names the input or tensor at fault."""


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


def element_size(dtype: torch.dtype) -> int:
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
        nbytes = torch.Size(shape).numel() * element_size(dtype)
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
