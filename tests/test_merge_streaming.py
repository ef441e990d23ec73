"""Streaming merges equal mergekit's own `run_merge` on the same inputs, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from skillswarm.merge.methods import MergeSpec, available_methods
from skillswarm.merge.streaming import SafetensorsStreamWriter, TaskVector, merge_checkpoint
from skillswarm.merge.tensors import MergeError, iter_base_tensors
from transformers import Qwen2Config, Qwen2ForCausalLM


def _tiny(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module")
def merge_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[dict]]:
    root = tmp_path_factory.mktemp("merge")
    base_dir = root / "base"
    _tiny(0).save_pretrained(base_dir)
    base = dict(iter_base_tensors(base_dir))
    experts, deltas = [], []
    for i in range(2):
        gen = torch.Generator().manual_seed(100 + i)
        delta = {n: torch.randn(t.shape, generator=gen) * 0.01 for n, t in base.items()}
        # Most weights untouched, as in RL: zero 90% of each delta.
        delta = {n: d * (torch.rand(d.shape, generator=gen) < 0.1) for n, d in delta.items()}
        expert_dir = root / f"expert{i}"
        expert_dir.mkdir()
        (expert_dir / "config.json").write_text((base_dir / "config.json").read_text())
        save_file(
            {n: base[n] + delta[n] for n in base},
            expert_dir / "model.safetensors",
            metadata={"format": "pt"},
        )
        experts.append(expert_dir)
        deltas.append(delta)
    return base_dir, experts, deltas


def _mergekit_reference(
    base_dir: Path, experts: list[Path], method: str, params: dict, out: Path
) -> dict[str, torch.Tensor]:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    raw = {
        "merge_method": method,
        "models": [{"model": str(e), "parameters": params} for e in experts],
        "dtype": "float32",
        "out_dtype": "float32",
    }
    if MergeSpec(method=method).uses_base():
        raw["base_model"] = str(base_dir)
    config = MergeConfiguration.model_validate(raw)
    torch.manual_seed(0)
    run_merge(config, str(out), options=MergeOptions(copy_tokenizer=False, quiet=True))
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize(
    "method,params",
    [
        ("task_arithmetic", {"weight": 1.0}),
        ("linear", {"weight": 0.5}),
        ("ties", {"weight": 1.0, "density": 0.5}),
    ],
)
def test_streaming_merge_equals_mergekit_run_merge(merge_inputs, tmp_path, method, params):
    base_dir, experts, deltas = merge_inputs
    reference = _mergekit_reference(base_dir, experts, method, params, tmp_path / "ref")
    spec = MergeSpec(method=method, parameters=params)
    vectors = [
        TaskVector(name=f"e{i}", expert=lambda n, b, d=d: b + d[n]) for i, d in enumerate(deltas)
    ]
    out = merge_checkpoint(base_dir, vectors, tmp_path / "ours", spec)
    ours = load_file(out / "model.safetensors")
    assert (out / "config.json").exists()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    if method == "task_arithmetic":
        base = dict(iter_base_tensors(base_dir))
        name = next(iter(base))
        expected = (
            base[name]
            + ((base[name] + deltas[0][name]) - base[name])
            + ((base[name] + deltas[1][name]) - base[name])
        )
        assert torch.equal(ours[name], expected)


def test_unknown_method_and_bad_inputs_refused(merge_inputs, tmp_path):
    base_dir, _, deltas = merge_inputs
    assert "ties" in available_methods()
    with pytest.raises(ValueError, match="unknown merge method"):
        MergeSpec(method="averaging-by-vibes")
    with pytest.raises(MergeError, match="at least one"):
        merge_checkpoint(base_dir, [], tmp_path / "x", MergeSpec())
    wrong = TaskVector(name="bad", expert=lambda n, b: torch.zeros(3))
    with pytest.raises(MergeError, match="shape"):
        merge_checkpoint(base_dir, [wrong], tmp_path / "y", MergeSpec())


def test_stream_writer_refuses_out_of_order_tensor(tmp_path):
    writer = SafetensorsStreamWriter(
        tmp_path / "w.safetensors", [("a", torch.float32, (2,)), ("b", torch.bfloat16, (3,))]
    )
    with pytest.raises(MergeError, match="laid out"):
        writer.write("b", torch.zeros(3, dtype=torch.bfloat16))
    writer.write("a", torch.ones(2))
    writer.write("b", torch.arange(3, dtype=torch.bfloat16))
    writer.close()
    loaded = load_file(tmp_path / "w.safetensors")
    assert torch.equal(loaded["a"], torch.ones(2))
    assert torch.equal(loaded["b"], torch.arange(3, dtype=torch.bfloat16))


def test_a_domain_weighted_candidate_weights_each_delta_by_its_domain(merge_inputs, tmp_path):
    from skillswarm.coordinator.config import MergePlan

    base_dir, _, deltas = merge_inputs
    vectors = [
        TaskVector(name=f"e{i}", expert=lambda n, b, d=d: b + d[n]) for i, d in enumerate(deltas)
    ]
    specs = MergePlan(domain_weights=[0.5, 1.0]).domain_weight_specs({"e0": "math", "e1": "code"})
    assert [s.parameters for s in specs] == [
        {"weight": {"e0": 1.0, "e1": 0.5}},  # code (sorted first) 0.5, math 1
        {"weight": {"e0": 0.5, "e1": 1.0}},
    ]
    out = merge_checkpoint(base_dir, vectors, tmp_path / "weighted", specs[0])
    merged = load_file(out / "model.safetensors")
    for name, tensor in iter_base_tensors(base_dir):
        expected = tensor + 1.0 * deltas[0][name] + 0.5 * deltas[1][name]
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)
