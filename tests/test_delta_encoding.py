"""Delta encoding round trips bit for bit over random tensors, dtypes and sparsities; damaged
payloads are refused with DeltaError, never a crash or a wrong tensor."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from skillswarm.protocol.delta import DTYPE_NAMES, DeltaError, _pack, decode_tensor, encode_tensor
from skillswarm.protocol.manifest import TensorEntry

BLOB = "00" * 32


def _entry(base: torch.Tensor, encoded) -> TensorEntry:
    return TensorEntry(
        blob=BLOB,
        offset=0,
        length=len(encoded.payload),
        encoding=encoded.encoding,
        dtype=DTYPE_NAMES[base.dtype],
        shape=tuple(base.shape),
        nnz=encoded.nnz,
        index_bytes=encoded.index_bytes,
        scale=encoded.scale,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    changed=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_encode_decode_is_bit_exact(dtype, shape, changed, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen).to(dtype)
    # Arbitrary new bit patterns (NaNs and infinities included) at a random subset of elements.
    random_bits = torch.randint(-(2**15), 2**15, base.shape, generator=gen)
    if base.element_size() == 4:
        random_bits = random_bits * 65536 + torch.randint(0, 2**16, base.shape, generator=gen)
    new = random_bits.to(_bits(base).dtype).view(dtype)
    mask = torch.rand(base.shape, generator=gen) < changed
    tuned = torch.where(mask, new, base)
    encoded = encode_tensor(base, tuned)
    if torch.equal(_bits(base), _bits(tuned)):
        assert encoded is None
        return
    rebuilt = decode_tensor(_entry(base, encoded), encoded.payload, base)
    assert rebuilt.dtype == dtype
    assert torch.equal(_bits(rebuilt), _bits(tuned))
    if encoded.encoding == "sparse":
        assert len(encoded.payload) < base.numel() * base.element_size()


def test_sparse_rl_like_delta_is_small():
    base = torch.randn(256, 256).to(torch.bfloat16)
    tuned = base.clone()
    flat = tuned.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))[:600]
    flat[idx] = (flat[idx].float() * 1.01).to(torch.bfloat16)
    encoded = encode_tensor(base, tuned)
    assert encoded.encoding == "sparse"
    assert len(encoded.payload) * 20 < base.numel() * 2


def test_damaged_payloads_are_refused():
    base = torch.randn(100)
    tuned = base.clone()
    tuned[[3, 50, 99]] += 1
    encoded = encode_tensor(base, tuned)
    entry = _entry(base, encoded)
    with pytest.raises(DeltaError, match="manifest says"):
        decode_tensor(entry, encoded.payload[:-1], base)
    garbage = b"\xff" * entry.index_bytes + encoded.payload[entry.index_bytes :]
    with pytest.raises(DeltaError, match="inflate"):
        decode_tensor(entry, garbage, base)
    out_of_range = _pack(np.array([1, 1, 500], dtype=np.uint32))
    payload = out_of_range + encoded.payload[entry.index_bytes :]
    bad = entry.model_copy(update={"index_bytes": len(out_of_range), "length": len(payload)})
    with pytest.raises(DeltaError, match="out of range"):
        decode_tensor(bad, payload, base)
    zero_gap = _pack(np.array([1, 0, 5], dtype=np.uint32))
    payload = zero_gap + encoded.payload[entry.index_bytes :]
    bad = entry.model_copy(update={"index_bytes": len(zero_gap), "length": len(payload)})
    with pytest.raises(DeltaError, match="increasing"):
        decode_tensor(bad, payload, base)
    with pytest.raises(DeltaError, match="dtype"):
        decode_tensor(entry, encoded.payload, base.to(torch.bfloat16))


def test_int8_is_lossy_and_close():
    base = torch.randn(64)
    tuned = base + 0.01 * torch.randn(64)
    encoded = encode_tensor(base, tuned, lossy_int8=True)
    assert encoded.encoding == "int8"
    rebuilt = decode_tensor(_entry(base, encoded), encoded.payload, base)
    assert (rebuilt - tuned).abs().max() <= encoded.scale / 2 + 1e-6


@pytest.mark.gpu
def test_a_delta_trained_on_the_gpu_packs_against_the_base_read_on_the_cpu(tmp_path) -> None:
    """A GPU node's state dict lives on the GPU and its base checkpoint is read on the CPU:
    packing compares them bit for bit all the same and the rebuild is exact."""
    from skillswarm.protocol.blobstore import BlobStore
    from skillswarm.protocol.delta import DeltaReader, pack_delta

    base = {"w": torch.randn(64, 32).to(torch.bfloat16)}
    tuned = {"w": (base["w"].float() + 0.05 * torch.randn(64, 32)).cuda()}
    store = BlobStore(tmp_path / "blobs")
    manifest = pack_delta(
        base, tuned, store, peer_id="p", public_key=b"", domain="math", base_id="ab" * 32,
        round=1, steps=1,
    )  # fmt: skip
    rebuilt = DeltaReader(manifest, store).expert("w", base["w"])
    want = tuned["w"].to(torch.bfloat16).cpu()
    assert torch.equal(rebuilt.view(torch.int16), want.view(torch.int16))
