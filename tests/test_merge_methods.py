"""The streaming merge equals the real `mergekit-yaml` CLI bit for bit, for every method we offer,
randomized ones (DARE, DELLA) included; a spec reads and writes mergekit YAML faithfully."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from skillswarm.merge.methods import MergeConfigError, MergeSpec
from skillswarm.merge.streaming import TaskVector, merge_checkpoint
from skillswarm.merge.tensors import (
    SAFETENSORS_INDEX,
    CheckpointTensors,
    MergeError,
    iter_base_tensors,
    weight_files,
)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

EXPERTS = ("math", "code", "search")
_PER_MODEL = """
models:
  - model: math
    parameters: {{{math}}}
  - model: code
    parameters: {{{code}}}
  - model: search
    parameters: {{{search}}}
"""


def _fragment(head: str, math: str = "", code: str = "", search: str = "") -> str:
    return head.strip() + "\n" + _PER_MODEL.format(math=math, code=code, search=search)


FRAGMENTS = {
    "linear": _fragment("merge_method: linear", "weight: 0.5", "weight: 0.3", "weight: 0.2"),
    "task_arithmetic": _fragment(
        "merge_method: task_arithmetic\nparameters: {weight: 0.4, lambda: 0.9}",
        "weight: 1.0",
    ),
    "ties": _fragment(
        "merge_method: ties\nparameters: {density: 0.6}",
        "weight: 0.7",
        "weight: 0.5, density: 0.3",
        "weight: 0.4",
    ),
    "dare_ties": _fragment(
        "merge_method: dare_ties\nparameters: {weight: 0.5}",
        "density: 0.5",
        "density: 0.7",
        "density: 0.4",
    ),
    "dare_linear": _fragment(
        "merge_method: dare_linear\nparameters: {density: 0.6}",
        "weight: 0.6",
        "weight: 0.3",
        "weight: 0.3",
    ),
    "breadcrumbs": _fragment(
        "merge_method: breadcrumbs\nparameters: {weight: 0.5, density: 0.8, gamma: 0.05}",
        "density: 0.7",
    ),
    "breadcrumbs_ties": _fragment(
        "merge_method: breadcrumbs_ties\nparameters: {weight: 0.5, density: 0.8, gamma: 0.02}"
    ),
    "della": _fragment(
        "merge_method: della\nparameters: {weight: 0.5, density: 0.5, epsilon: 0.1}",
        "epsilon: 0.2",
    ),
    "della_linear": _fragment(
        "merge_method: della_linear\nparameters: {weight: 0.4, density: 0.6, epsilon: 0.15}"
    ),
    "ram": "merge_method: ram\nparameters: {epsilon: 1.0e-5}",
    "ramplus_tl": "merge_method: ramplus_tl\nparameters: {r: 0.2, alpha: 0.3}",
    "model_stock": "merge_method: model_stock",
    "sce": "merge_method: sce\nparameters: {select_topk: 0.5}",
    "karcher": "merge_method: karcher\nparameters: {max_iter: 5}",
}
RANDOMIZED = {"dare_ties", "dare_linear", "della", "della_linear"}
CASES = [(model, method) for model in ("qwen_f32", "llama_bf16") for method in FRAGMENTS]
CASES.append(("llama_bf16", "task_arithmetic_out_f32"))
SEED = 1234

# Runs the `mergekit-yaml` command (mergekit.scripts.run_yaml:main, the console script's entry
# point) once per job in one interpreter, so the ~10 s import is paid once for every config.
# torch's thread count is set once here: `--num-threads` can be given once per process.
_CLI_DRIVER = """
import json, sys, torch
from mergekit.scripts.run_yaml import main
torch.set_num_threads(int(sys.argv[2]))
for config, out, options in json.load(open(sys.argv[1])):
    main([config, out, *options], standalone_mode=False)
"""
_CLI_FLAGS = ["--no-copy-tokenizer", "--no-write-model-card", "--quiet"]


def _save_experts(base_dir: Path, root: Path, dtype: torch.dtype) -> dict[str, Path]:
    """Experts = base + random sparse deltas (20% of weights move), saved as HF folders."""
    experts = {}
    for index, name in enumerate(EXPERTS):
        gen = torch.Generator().manual_seed(100 + index)
        tensors = {}
        for key, tensor in iter_base_tensors(base_dir):
            delta = torch.randn(tensor.shape, generator=gen) * 0.02
            delta *= torch.rand(tensor.shape, generator=gen) < 0.2
            tensors[key] = (tensor.float() + delta).to(dtype)
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text((base_dir / "config.json").read_text())
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        experts[name] = folder
    return experts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """A float32 Qwen2 with tied embeddings in one file, and a bfloat16 Llama sharded across
    files, each with 3 experts. The Llama has 11 layers, so "layers.10" sorts before "layers.2",
    and embeddings over 32768 elements, where torch sums in per-thread chunks."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            max_position_embeddings=64,
        )
    )
    qwen.save_pretrained(root / "qwen_f32" / "base")
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=4096,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=11,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            max_position_embeddings=64,
        )
    ).to(torch.bfloat16)
    llama.save_pretrained(root / "llama_bf16" / "base", max_shard_size="16KB")
    built = {}
    for key, dtype in (("qwen_f32", torch.float32), ("llama_bf16", torch.bfloat16)):
        base = root / key / "base"
        built[key] = (base, _save_experts(base, root / key, dtype))
    assert len(weight_files(built["llama_bf16"][0])) > 1
    return built


def _spec(method: str) -> MergeSpec:
    if method == "task_arithmetic_out_f32":
        spec = MergeSpec.from_mergekit_yaml(FRAGMENTS["task_arithmetic"], EXPERTS, seed=SEED)
        return spec.model_copy(update={"out_dtype": "float32"})
    return MergeSpec.from_mergekit_yaml(FRAGMENTS[method], EXPERTS, seed=SEED)


def _run_mergekit_cli(jobs: list[tuple[Path, Path, list[str]]], work: Path) -> None:
    listing = work / "jobs.json"
    listing.write_text(json.dumps([[str(c), str(o), opts] for c, o, opts in jobs]))
    done = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, str(listing), str(torch.get_num_threads())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def mergekit_outputs(models, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case merged by the mergekit-yaml command, from the YAML our spec writes; the hardest
    case also by the installed `mergekit-yaml` executable in a process of its own, with exactly
    the options `MergeSpec.mergekit_cli_options()` gives (seed and thread count)."""
    work = tmp_path_factory.mktemp("mergekit")
    jobs, outputs = [], {}
    for model, method in CASES:
        base, experts = models[model]
        spec = _spec(method)
        config = work / f"{model}-{method}.yml"
        config.write_text(spec.to_mergekit_yaml(base, experts))
        outputs[f"{model}-{method}"] = work / f"{model}-{method}"
        jobs.append((config, outputs[f"{model}-{method}"], ["--random-seed", str(spec.seed)]))
    executable = Path(sys.executable).with_name("mergekit-yaml")
    outputs["executable"] = work / "executable"
    alone = subprocess.Popen(
        [
            str(executable),
            str(work / "llama_bf16-dare_ties.yml"),
            str(outputs["executable"]),
            *_spec("dare_ties").mergekit_cli_options(),
            *_CLI_FLAGS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _run_mergekit_cli([(c, o, [*opts, *_CLI_FLAGS]) for c, o, opts in jobs], work)
    finally:
        log, _ = alone.communicate(timeout=300)
    assert alone.returncode == 0, log[-4000:]
    return outputs


def _experts_as_task_vectors(experts: dict[str, Path]) -> list[TaskVector]:
    vectors = []
    for name, folder in experts.items():
        tensors = CheckpointTensors(folder)
        vectors.append(TaskVector(name=name, expert=lambda key, base, t=tensors: t.get(key)))
    return vectors


def _assert_same_tensors(ours: Path, reference: Path) -> None:
    mine, theirs = dict(iter_base_tensors(ours)), dict(iter_base_tensors(reference))
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name


@pytest.mark.parametrize("model,method", CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_streaming_merge_equals_mergekit_yaml(models, mergekit_outputs, tmp_path, model, method):
    base, experts = models[model]
    spec = _spec(method)
    out = merge_checkpoint(base, _experts_as_task_vectors(experts), tmp_path / "ours", spec)
    _assert_same_tensors(out, mergekit_outputs[f"{model}-{method}"])
    assert weight_files(out) == weight_files(base)
    merged = CheckpointTensors(out)
    base_tensors = CheckpointTensors(base)
    assert any(not torch.equal(merged.get(n), base_tensors.get(n)) for n in merged.names())
    if spec.out_dtype is not None:
        assert json.loads((out / "config.json").read_text())["dtype"] == spec.out_dtype
        index = json.loads((out / SAFETENSORS_INDEX).read_text())
        data = sum(t.numel() * t.element_size() for _, t in iter_base_tensors(out))
        assert index["metadata"]["total_size"] == data


def test_mergekit_executable_matches_and_seed_decides_randomized_merges(
    models, mergekit_outputs, tmp_path
):
    base, experts = models["llama_bf16"]
    _assert_same_tensors(mergekit_outputs["executable"], mergekit_outputs["llama_bf16-dare_ties"])
    vectors = _experts_as_task_vectors(experts)
    spec = _spec("dare_ties")
    torch.manual_seed(7)
    caller_state = torch.get_rng_state()
    again = merge_checkpoint(base, vectors, tmp_path / "again", spec)
    assert torch.equal(torch.get_rng_state(), caller_state)  # the caller's RNG is untouched
    _assert_same_tensors(again, mergekit_outputs["executable"])
    for method in sorted(RANDOMIZED):  # the seed is what decides their masks
        reseeded = _spec(method).model_copy(update={"seed": SEED + 1})
        other = merge_checkpoint(base, vectors, tmp_path / method, reseeded)
        a = dict(iter_base_tensors(mergekit_outputs[f"llama_bf16-{method}"]))
        b = dict(iter_base_tensors(other))
        assert any(not torch.equal(a[n], b[n]) for n in a), method


def test_yaml_fragment_round_trips(models, tmp_path):
    base, experts = models["qwen_f32"]
    spec = MergeSpec.from_mergekit_yaml(FRAGMENTS["ties"], EXPERTS, seed=5)
    assert spec.method == "ties" and spec.seed == 5 and spec.dtype == "float32"
    assert spec.parameters == {
        "weight": {"math": 0.7, "code": 0.5, "search": 0.4},
        "density": {"math": 0.6, "code": 0.3, "search": 0.6},
    }
    text = spec.to_mergekit_yaml(base, experts)
    written = yaml.safe_load(text)
    assert written["base_model"] == str(base)
    assert written["out_dtype"] == "float32"
    assert [m["model"] for m in written["models"]] == [str(experts[n]) for n in EXPERTS]
    by_path = {str(path): name for name, path in experts.items()}
    assert MergeSpec.from_mergekit_yaml(text, by_path, seed=5) == spec.model_copy(
        update={"out_dtype": "float32"}
    )

    # Without expert names, global parameters stay scalars and go back out as globals.
    shared = MergeSpec.from_mergekit_yaml(
        "merge_method: dare_ties\nparameters: {weight: 0.5, density: 0.3, rescale: false}\n"
        "dtype: bfloat16\n"
    )
    assert shared.parameters == {"weight": 0.5, "density": 0.3, "rescale": False}
    assert shared.dtype == "bfloat16"
    written = yaml.safe_load(shared.to_mergekit_yaml(base, experts))
    assert written["parameters"] == shared.parameters
    assert all("parameters" not in m for m in written["models"])
    reread = MergeSpec.from_mergekit_yaml(
        yaml.safe_dump(written), {str(p): n for n, p in experts.items()}
    )
    assert reread.parameters == {
        "weight": dict.fromkeys(EXPERTS, 0.5),
        "density": dict.fromkeys(EXPERTS, 0.3),
        "rescale": False,
    }

    # linear ignores the base: no base_model is written, and one listed is refused.
    linear = MergeSpec.from_mergekit_yaml(FRAGMENTS["linear"])
    assert "base_model" not in yaml.safe_load(linear.to_mergekit_yaml(base, experts))
    # A model listed as base_model among the models is the base, not an expert.
    with_base = MergeSpec.from_mergekit_yaml(
        "merge_method: task_arithmetic\nbase_model: b\nmodels:\n  - model: b\n"
        "  - model: math\n    parameters: {weight: 0.3}\n"
    )
    assert with_base.parameters == {"weight": {"math": 0.3}}


@pytest.mark.parametrize(
    "text,expert_names,message",
    [
        ("merge_method: [unclosed", None, "malformed mergekit YAML"),
        ("- just\n- a list\n", None, "must be a mapping"),
        ("merge_method: averaging_by_vibes", None, "unknown merge method"),
        ("parameters: {weight: 1}", None, "needs `merge_method"),
        ("merge_method: ties\nslices: []", None, "not supported"),
        ("merge_method: ties\nparameters: {weight: 1, dropout: 0.1}", None, "no parameter"),
        ("merge_method: ties\nparameters: {density: 0.5}", None, "needs parameter"),
        ("merge_method: ties\nparameters: {weight: [0.1, 0.9]}", None, "gradients"),
        ("merge_method: ties\nparameters: {weight: abc}", None, "not a valid value"),
        ("merge_method: ties\nparameters: {weight: 1}\ndtype: int8", None, "dtype"),
        ("merge_method: linear\nbase_model: b\nparameters: {weight: 1}", None, "ignores a base"),
        (
            "merge_method: ties\nparameters: {weight: 1}\n"
            "models:\n  - model: math\n    parameters: {normalize: false}",
            ["math"],
            "shared by all inputs",
        ),
        (
            "merge_method: ties\nparameters: {weight: 1}\nmodels:\n  - model: math",
            ["math", "code"],
            "must be exactly the experts",
        ),
        (
            "merge_method: ties\nmodels:\n  - model: math\n    parameters: {weight: 1}\n"
            "  - model: code",
            None,
            "no value for model 'code'",
        ),
        ("merge_method: ties\nmodels:\n  - math", None, "needs `model:"),
    ],
)
def test_bad_mergekit_yaml_is_refused(text, expert_names, message):
    with pytest.raises(MergeConfigError, match=message):
        MergeSpec.from_mergekit_yaml(text, expert_names)


def test_spec_checks_parameters_against_the_method(models, tmp_path):
    with pytest.raises(ValueError, match="takes no parameter"):
        MergeSpec(method="ties", parameters={"weight": 1.0, "dropout": 0.1})
    with pytest.raises(ValueError, match="shared by all inputs"):
        MergeSpec(method="ties", parameters={"weight": 1.0, "lambda": {"math": 1.0}})
    with pytest.raises(ValueError, match="needs parameter"):
        MergeSpec(method="slerp", parameters={})
    base, experts = models["qwen_f32"]
    spec = MergeSpec(method="ties", parameters={"weight": {"math": 1.0}})
    with pytest.raises(MergeConfigError, match="no value for"):
        spec.to_mergekit_yaml(base, experts)


def test_checkpoint_reader_refuses_broken_files(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(MergeError, match="does not fit"):
        CheckpointTensors(folder)
    save_file({"w": torch.arange(6, dtype=torch.float32)}, folder / "model.safetensors")
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:-4])
    with pytest.raises(MergeError, match="outside the file"):
        CheckpointTensors(folder)


def test_failed_merge_leaves_no_partial_weights(models, tmp_path):
    base, experts = models["llama_bf16"]
    vectors = _experts_as_task_vectors(experts)

    def broken(key: str, base_tensor: torch.Tensor) -> torch.Tensor:
        if key == "model.layers.3.mlp.up_proj.weight":
            raise OSError("delta blob vanished")
        return base_tensor

    vectors.append(TaskVector(name="broken", expert=broken))
    seen: list[tuple[int, int]] = []
    with pytest.raises(OSError, match="vanished"):
        merge_checkpoint(
            base,
            vectors,
            tmp_path / "out",
            _spec("task_arithmetic").model_copy(update={"parameters": {"weight": 0.25}}),
            progress=lambda done, total: seen.append((done, total)),
        )
    assert seen and seen[-1][0] < seen[-1][1]
    assert list((tmp_path / "out").glob("*.safetensors")) == []
