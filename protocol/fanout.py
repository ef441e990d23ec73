"""Merged checkpoints as deltas: checkpoint C_r rebuilt bit-exactly from C_(r-1) and a signed
checkpoint delta, so that nodes holding C_(r-1) fetch a delta from each other instead of C_r whole
from the registry.

A checkpoint delta carries C_r's checkpoint manifest (whose sha256 is C_r's id) and, for every file
of C_r, how to make it:

- `base`: the file of C_(r-1) with the same bytes (config, tokenizer, … unchanged by a merge);
- `safetensors`: the file's header from the delta's blob, then each tensor in the header's order,
  either unchanged (the base's tensor of that name, same dtype and shape, byte for byte) or rebuilt
  from the base's tensor and its entry in `tensors`, encoded as a node's delta is (sparse XOR of bit
  patterns, or dense; always lossless);
- `blob`: the file's bytes whole from the delta's blob (anything else that changed).

Every file rebuilt is checked against C_r's manifest (size and sha256) before the folder takes its
name, so no byte from a peer reaches a checkpoint unchecked.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

import msgpack
import torch
from libp2p.crypto.keys import KeyPair
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from skillswarm.protocol import identity
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.canonical import WireCount, canonical_packb
from skillswarm.protocol.checkpoint import (
    MANIFEST_FILE_NAME,
    MAX_FILES,
    CheckpointError,
    CheckpointManifest,
    CheckpointMismatch,
    read_manifest,
    sha256_of_file,
    validate_relative_path,
    write_manifest,
)
from skillswarm.protocol.checkpoint import MAX_MANIFEST_BYTES as MAX_CHECKPOINT_MANIFEST_BYTES
from skillswarm.protocol.delta import DTYPE_NAMES, DeltaError, decode_tensor, encode_tensor
from skillswarm.protocol.durable import fsync_directory
from skillswarm.protocol.manifest import (
    MAX_TENSORS,
    ManifestError,
    TensorEntry,
    check_ranges_tile,
    check_signature,
    decode_bounded,
)

FANOUT_SCHEMA = "skillswarm.checkpoint-delta/1"
MAX_FANOUT_MANIFEST_BYTES = MAX_CHECKPOINT_MANIFEST_BYTES + 16 * 1024 * 1024
# safetensors itself refuses headers over 100 MB.
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
_COPY_CHUNK = 1 << 20
_TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_ELEMENT_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


class FanoutError(ValueError):
    """A checkpoint delta is malformed, does not apply to the base at hand, or rebuilds a file
    that is not the one its checkpoint manifest names."""


class FileSource(BaseModel):
    """How one file of the target checkpoint is made (see the module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(max_length=1024)
    source: Literal["base", "safetensors", "blob"]
    base_path: str | None = Field(default=None, max_length=1024)
    blob: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    offset: WireCount = 0
    length: WireCount = 0

    @model_validator(mode="after")
    def _source_is_complete(self) -> FileSource:
        validate_relative_path(self.path)
        if self.source == "base":
            if self.base_path is None or self.blob is not None:
                raise ValueError(f"{self.path}: a file from the base names a base path, no blob")
            validate_relative_path(self.base_path)
        elif self.blob is None or self.base_path is not None:
            raise ValueError(f"{self.path}: a {self.source} file names a blob, no base path")
        elif self.source == "safetensors" and self.length < 8:
            raise ValueError(f"{self.path}: a safetensors header takes at least 8 bytes")
        return self


class CheckpointDelta(BaseModel):
    """C_r as a delta from its parent C_(r-1), published by the coordinator that merged it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["skillswarm.checkpoint-delta/1"] = Field(default=FANOUT_SCHEMA, alias="schema")
    peer_id: str = Field(max_length=128)
    public_key: bytes = Field(max_length=256)
    base_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    checkpoint_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: WireCount
    created_at: str = Field(max_length=64)
    checkpoint_manifest: bytes = Field(max_length=MAX_CHECKPOINT_MANIFEST_BYTES)
    blobs: dict[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")], WireCount] = Field(
        max_length=8, description="blob sha256 -> size in bytes"
    )
    files: tuple[FileSource, ...] = Field(max_length=MAX_FILES)
    tensors: dict[str, TensorEntry] = Field(description="changed tensors, by name")

    @model_validator(mode="after")
    def _consistent(self) -> CheckpointDelta:
        """The manifest is the target's (its bytes hash to the id), a child of the base; the
        files are the manifest's, in its order; the ranges tile the blobs exactly."""
        if hashlib.sha256(self.checkpoint_manifest).hexdigest() != self.checkpoint_id:
            raise ValueError("the checkpoint manifest does not hash to the checkpoint id")
        try:
            target = CheckpointManifest.decode(self.checkpoint_manifest)
        except CheckpointError as exc:
            raise ValueError(str(exc)) from exc
        if target.checkpoint_id != self.checkpoint_id:
            raise ValueError("the checkpoint manifest is not in canonical form")
        if target.parent != self.base_id:
            raise ValueError(
                f"checkpoint {self.checkpoint_id[:12]} is a child of "
                f"{(target.parent or 'nothing')[:12]}, not of base {self.base_id[:12]}"
            )
        if [f.path for f in self.files] != [f.path for f in target.files]:
            raise ValueError("the files are not those of the checkpoint manifest, in its order")
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS} tensors")
        ranges = [
            (entry.blob, entry.offset, entry.length, f"tensor {name}")
            for name, entry in self.tensors.items()
        ]
        if any(entry.encoding == "int8" for entry in self.tensors.values()):
            raise ValueError("a checkpoint delta is lossless; int8 entries are refused")
        ranges += [
            (f.blob, f.offset, f.length, f"file {f.path}") for f in self.files if f.blob is not None
        ]
        check_ranges_tile(self.blobs, ranges)
        return self

    @cached_property
    def target(self) -> CheckpointManifest:
        return CheckpointManifest.decode(self.checkpoint_manifest)

    @property
    def download_size(self) -> int:
        return sum(self.blobs.values())

    def encode(self) -> bytes:
        return canonical_packb(self.model_dump(by_alias=True, mode="python"))

    @classmethod
    def decode(cls, raw: bytes) -> CheckpointDelta:
        return decode_bounded(
            cls, raw, "checkpoint delta", MAX_FANOUT_MANIFEST_BYTES, MAX_TENSORS + 16
        )


class SignedCheckpointDelta(BaseModel):
    """A checkpoint delta's bytes and the signature over exactly those bytes."""

    model_config = ConfigDict(frozen=True)

    manifest_bytes: bytes = Field(max_length=MAX_FANOUT_MANIFEST_BYTES)
    signature: bytes = Field(max_length=256)

    @property
    def manifest_id(self) -> str:
        return hashlib.sha256(self.manifest_bytes).hexdigest()

    def verify(self, signer: str) -> CheckpointDelta:
        """Decode, and check it is signed by peer `signer` (the coordinator); ManifestError
        naming what failed otherwise."""
        delta = CheckpointDelta.decode(self.manifest_bytes)
        check_signature(delta.peer_id, delta.public_key, self.manifest_bytes, self.signature)
        if delta.peer_id != signer:
            raise ManifestError(
                f"checkpoint delta signed by {delta.peer_id}, not by the coordinator {signer}"
            )
        return delta

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.manifest_bytes, self.signature], use_bin_type=True)

    @classmethod
    def from_bytes(cls, raw: bytes) -> SignedCheckpointDelta:
        if len(raw) > MAX_FANOUT_MANIFEST_BYTES + 1024:
            raise ManifestError("signed checkpoint delta is too large")
        try:
            manifest_bytes, signature = msgpack.unpackb(raw, raw=False, max_array_len=2)
            return cls(manifest_bytes=manifest_bytes, signature=signature)
        except (ValueError, TypeError, ValidationError, msgpack.UnpackException) as exc:
            raise ManifestError(f"malformed signed checkpoint delta: {exc}") from exc


def sign_checkpoint_delta(delta: CheckpointDelta, key_pair: KeyPair) -> SignedCheckpointDelta:
    if delta.peer_id != identity.peer_id_of(key_pair):
        raise ManifestError("checkpoint delta peer_id does not match the signing key")
    raw = delta.encode()
    return SignedCheckpointDelta(manifest_bytes=raw, signature=identity.sign(key_pair, raw))


# safetensors files, read as bytes -----------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    def read(self) -> bytes:
        with open(self.path, "rb") as handle:
            handle.seek(self.start)
            data = handle.read(self.end - self.start)
        if len(data) != self.end - self.start:
            raise FanoutError(f"{self.path} ends inside a tensor")
        return data

    def tensor(self) -> torch.Tensor:
        data = bytearray(self.read())
        dtype = _TORCH_DTYPES[self.dtype]
        if not data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(self.shape)


def _read_header(handle: BinaryIO, what: str) -> tuple[bytes, dict]:
    """The raw header (length prefix included) and its parsed JSON."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise FanoutError(f"{what} is too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_SAFETENSORS_HEADER_BYTES:
        raise FanoutError(f"{what}'s safetensors header of {length} bytes is too large")
    raw = handle.read(length)
    if len(raw) != length:
        raise FanoutError(f"{what} ends inside its safetensors header")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FanoutError(f"{what}'s safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise FanoutError(f"{what}'s safetensors header is not an object")
    return prefix + raw, header


def _layout(header: dict, data_start: int, path: Path, what: str) -> list[tuple[str, _Tensor]]:
    """The tensors of a safetensors header in file order, checked to tile the data region (no
    holes, no overlaps) as the format requires; dtypes other than F32/BF16/F16 have no name in
    the delta encoding and are refused (such a file travels whole)."""
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FanoutError(f"{what}: tensor {name!r} has no dtype, shape and offsets") from exc
        if dtype not in _ELEMENT_BYTES or not all(type(d) is int and d >= 0 for d in shape):
            raise FanoutError(f"{what}: tensor {name!r} of dtype {dtype!r} is not supported")
        numel = 1
        for d in shape:
            numel *= d
        if (
            type(begin) is not int
            or type(end) is not int
            or end - begin != numel * _ELEMENT_BYTES[dtype]
        ):
            raise FanoutError(f"{what}: tensor {name!r}'s offsets do not fit its shape")
        tensors.append((name, _Tensor(path, dtype, shape, data_start + begin, data_start + end)))
    tensors.sort(key=lambda item: item[1].start)
    position = data_start
    for name, tensor in tensors:
        if tensor.start != position:
            raise FanoutError(f"{what}: tensor {name!r} does not start where the last one ended")
        position = tensor.end
    return tensors


def _file_tensors(path: Path) -> tuple[bytes, list[tuple[str, _Tensor]]]:
    with open(path, "rb") as handle:
        raw, header = _read_header(handle, str(path))
    tensors = _layout(header, len(raw), path, str(path))
    end = tensors[-1][1].end if tensors else len(raw)
    if path.stat().st_size != end:
        raise FanoutError(f"{path} has bytes past its last tensor")
    return raw, tensors


def _base_tensors(base_dir: Path, base: CheckpointManifest) -> dict[str, _Tensor]:
    """Every tensor of the base's safetensors files, by name."""
    found: dict[str, _Tensor] = {}
    for entry in base.files:
        if entry.path.endswith(".safetensors"):
            try:
                _, tensors = _file_tensors(base_dir / entry.path)
            except FanoutError:
                continue  # a file with other dtypes: its tensors are nobody's base
            found.update(tensors)
    return found


# packing (the coordinator) -------------------------------------------------------------------


class _BlobWriter:
    """Appends ranges to a temp file in the store's folder, then stores it as one blob."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        fd, name = tempfile.mkstemp(prefix=".fanout-", dir=store.root)
        self.path = Path(name)
        self.handle = os.fdopen(fd, "wb")
        self.size = 0

    def append(self, data: bytes) -> tuple[int, int]:
        self.handle.write(data)
        offset, self.size = self.size, self.size + len(data)
        return offset, len(data)

    def store_blob(self) -> tuple[str, int]:
        self.handle.close()
        try:
            return self.store.put_file(self.path), self.size
        finally:
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        self.handle.close()
        self.path.unlink(missing_ok=True)


def pack_checkpoint_delta(
    base_dir: Path,
    target_dir: Path,
    store: BlobStore,
    *,
    peer_id: str,
    public_key: bytes,
) -> CheckpointDelta:
    """C_target − C_base as one blob in `store` (both folders hold their checkpoint manifests;
    the target's parent must be the base); returns the unsigned checkpoint delta."""
    base, target = read_manifest(base_dir), read_manifest(target_dir)
    if target.parent != base.checkpoint_id:
        raise FanoutError(
            f"checkpoint {target.checkpoint_id[:12]} is not a child of {base.checkpoint_id[:12]}"
        )
    base_by_sha = {entry.sha256: entry.path for entry in base.files}
    base_tensors = _base_tensors(base_dir, base)
    writer = _BlobWriter(store)
    try:
        plans: list[dict] = []
        tensor_ranges: dict[str, dict] = {}
        for entry in target.files:
            if entry.sha256 in base_by_sha:
                plans.append(
                    {"path": entry.path, "source": "base", "base_path": base_by_sha[entry.sha256]}
                )
                continue
            path = target_dir / entry.path
            encoded = (
                _encode_safetensors(path, base_tensors)
                if entry.path.endswith(".safetensors")
                else None
            )
            if encoded is None:
                with open(path, "rb") as handle:
                    offset, length = writer.append(handle.read())
                plans.append(
                    {"path": entry.path, "source": "blob", "offset": offset, "length": length}
                )
                continue
            header, changed = encoded
            offset, length = writer.append(header)
            plans.append(
                {"path": entry.path, "source": "safetensors", "offset": offset, "length": length}
            )
            for name, item in changed.items():
                offset, length = writer.append(item.payload)
                tensor_ranges[name] = {
                    "offset": offset,
                    "length": length,
                    "encoding": item.encoding,
                    "dtype": base_tensors[name].dtype,
                    "shape": base_tensors[name].shape,
                    "nnz": item.nnz,
                    "index_bytes": item.index_bytes,
                }
        sha, size = writer.store_blob()
    except BaseException:
        writer.discard()
        raise
    needs_blob = {"safetensors", "blob"}
    return CheckpointDelta(
        peer_id=peer_id,
        public_key=public_key,
        base_id=base.checkpoint_id,
        checkpoint_id=target.checkpoint_id,
        round=target.round,
        created_at=dt.datetime.now(dt.UTC).isoformat(),
        checkpoint_manifest=target.encode(),
        blobs={sha: size} if size or any(p["source"] in needs_blob for p in plans) else {},
        files=tuple(
            FileSource(**plan, **({"blob": sha} if plan["source"] in needs_blob else {}))
            for plan in plans
        ),
        tensors={name: TensorEntry(blob=sha, **item) for name, item in tensor_ranges.items()},
    )


def _encode_safetensors(path: Path, base_tensors: dict[str, _Tensor]) -> tuple[bytes, dict] | None:
    """(header bytes, changed tensors' encodings) when every tensor of the file has a base
    tensor of its name, dtype and shape; None when the file must travel whole."""
    try:
        header, tensors = _file_tensors(path)
    except FanoutError:
        return None
    pairs = []
    for name, tensor in tensors:
        base = base_tensors.get(name)
        if base is None or base.dtype != tensor.dtype or base.shape != tensor.shape:
            return None
        pairs.append((name, base, tensor))
    changed = {}
    for name, base, tensor in pairs:
        encoded = encode_tensor(base.tensor(), tensor.tensor())
        if encoded is not None:
            changed[name] = encoded
    return header, changed


# rebuilding (a node) -------------------------------------------------------------------------


def rebuild_checkpoint(
    delta: CheckpointDelta, base_dir: Path, store: BlobStore, out_dir: Path
) -> Path:
    """Write checkpoint C_r into `out_dir` from its base folder (holding C_(r-1) and its
    manifest) and the delta's blobs in `store`. Every file is checked against C_r's manifest
    before the folder is renamed into place; on any failure nothing is left at `out_dir` and
    FanoutError (or CheckpointMismatch, a CheckpointError) says which file and why."""
    base = read_manifest(base_dir)
    if base.checkpoint_id != delta.base_id:
        raise FanoutError(
            f"{base_dir} holds {base.checkpoint_id[:12]}, not the delta's base {delta.base_id[:12]}"
        )
    for sha, size in delta.blobs.items():
        if not store.has(sha) or store.size(sha) != size:
            raise FanoutError(f"blob {sha[:12]} of the checkpoint delta is not in the store")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(
        tempfile.mkdtemp(prefix=f".rebuild-{delta.checkpoint_id[:16]}-", dir=out_dir.parent)
    )
    try:
        base_tensors = _base_tensors(base_dir, base)
        used: set[str] = set()
        for source in delta.files:
            entry = delta.target.file(source.path)
            assert entry is not None  # the validator matched the files to the manifest
            destination = work / source.path
            destination.parent.mkdir(parents=True, exist_ok=True)
            if source.source == "base":
                if base.file(source.base_path or "") is None:
                    raise FanoutError(f"{source.path}: the base has no file {source.base_path}")
                shutil.copyfile(base_dir / (source.base_path or ""), destination)
            else:
                with open(destination, "wb") as out:
                    if source.source == "blob":
                        out.writelines(_blob_range(store, source))
                    else:
                        used |= _write_safetensors(delta, source, store, base_tensors, out)
                    out.flush()
                    os.fsync(out.fileno())
            size = destination.stat().st_size
            if size != entry.size:
                raise CheckpointMismatch(source.path, f"rebuilt as {size} bytes, not {entry.size}")
            if sha256_of_file(destination) != entry.sha256:
                raise CheckpointMismatch(source.path, "rebuilt with another sha256")
        if unused := set(delta.tensors) - used:
            raise FanoutError(f"the delta changes tensors no file holds, e.g. {sorted(unused)[:3]}")
        write_manifest(work, delta.target)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(work, out_dir)
        fsync_directory(out_dir.parent)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out_dir


def _blob_range(store: BlobStore, source: FileSource) -> Iterator[bytes]:
    with open(store.path(source.blob or ""), "rb") as handle:
        handle.seek(source.offset)
        left = source.length
        while left:
            chunk = handle.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise FanoutError(f"{source.path}: the blob ends early")
            left -= len(chunk)
            yield chunk


def _write_safetensors(
    delta: CheckpointDelta,
    source: FileSource,
    store: BlobStore,
    base_tensors: dict[str, _Tensor],
    out: BinaryIO,
) -> set[str]:
    """The file's header, then each tensor: the base's bytes, or rebuilt from its entry."""
    raw = b"".join(_blob_range(store, source))
    handle = io.BytesIO(raw)
    header_bytes, header = _read_header(handle, source.path)
    if len(header_bytes) != len(raw):
        raise FanoutError(f"{source.path}: bytes follow the safetensors header in the delta")
    out.write(header_bytes)
    names = []
    for name, tensor in _layout(header, len(header_bytes), Path(source.path), source.path):
        base = base_tensors.get(name)
        if base is None or base.dtype != tensor.dtype or base.shape != tensor.shape:
            raise FanoutError(f"{source.path}: tensor {name!r} has no base of its dtype and shape")
        entry = delta.tensors.get(name)
        if entry is None:
            out.write(base.read())
        else:
            with open(store.path(entry.blob), "rb") as blob:
                blob.seek(entry.offset)
                payload = blob.read(entry.length)
            try:
                rebuilt = decode_tensor(entry, payload, base.tensor())
            except DeltaError as exc:
                raise FanoutError(f"{source.path}: tensor {name!r}: {exc}") from exc
            out.write(rebuilt.contiguous().view(torch.uint8).numpy().tobytes())
        names.append(name)
    return set(names)


def holds_checkpoint(folder: Path, checkpoint_id: str) -> bool:
    """Whether `folder` holds a complete checkpoint of this id (its manifest is written last)."""
    if not (folder / MANIFEST_FILE_NAME).is_file():
        return False
    try:
        return read_manifest(folder).checkpoint_id == checkpoint_id
    except CheckpointError:
        return False
