"""One real round end to end: a uvicorn coordinator and two node processes with libp2p hosts on
127.0.0.1; the pulled checkpoint equals mergekit's own task arithmetic of base + the deltas."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file
from skillswarm.coordinator.config import MergePlan
from skillswarm.merge.tensors import iter_base_tensors
from skillswarm.node.pipeline import RLConfig
from skillswarm.protocol.blobstore import BlobStore
from skillswarm.protocol.delta import DeltaReader
from skillswarm.protocol.messages import decode_message
from skillswarm.protocol.pull import pull

from skillswarm.demo import spawn, stop_all, wait_http, write_configs


def _node_expert(node_dir: Path, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The node's tuned weights, rebuilt from the delta it published (its kept signed manifest)."""
    (kept,) = list((node_dir / "deltas").glob("*.msgpack"))
    announced = decode_message(kept.read_bytes())
    reader = DeltaReader(announced.signed.verify(), BlobStore(node_dir / "blobs"))
    return {n: t if (e := reader.expert(n, t)) is None else e for n, t in base.items()}


def _mergekit_task_arithmetic(
    base_dir: Path, experts: list[dict], work: Path, weight: float = 1.0
) -> dict:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    models = []
    for i, tensors in enumerate(experts):
        expert = work / f"expert{i}"
        expert.mkdir(parents=True)
        (expert / "config.json").write_text((base_dir / "config.json").read_text())
        save_file(tensors, expert / "model.safetensors", metadata={"format": "pt"})
        models.append({"model": str(expert), "parameters": {"weight": weight}})
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(base_dir),
            "models": models,
            "dtype": "float32",
            "out_dtype": "float32",
        }
    )
    run_merge(config, str(work / "merged"), options=MergeOptions(copy_tokenizer=False, quiet=True))
    return load_file(work / "merged" / "model.safetensors")


def test_one_round_two_nodes_end_to_end(tmp_path: Path, tiny_base: Path) -> None:
    train = RLConfig(steps=2, tasks_per_step=4, samples_per_task=4)
    coordinator_toml, node_tomls, url = write_configs(tmp_path, tiny_base, 2, train, eval_tasks=4)
    logs = tmp_path / "logs"
    logs.mkdir()
    processes = []
    try:
        coordinator = spawn(
            "coordinator",
            ["coordinator", "serve", "--config", str(coordinator_toml)],
            logs / "coordinator.log",
        )
        processes.append(coordinator)
        wait_http(url, coordinator, timeout=120)
        for i, toml in enumerate(node_tomls):
            processes.append(
                spawn(f"node-{i}", ["node", "run", "--config", str(toml)], logs / f"node-{i}.log")
            )
        deadline = time.monotonic() + 480
        round_one = None
        while time.monotonic() < deadline:
            rounds = httpx.get(f"{url}/v1/rounds", timeout=5).json()
            if rounds and rounds[0]["status"] in ("published", "failed"):
                round_one = rounds[0]
                break
            for p in processes[1:]:
                assert p.popen.poll() in (None, 0), f"{p.name} failed:\n{p.tail()}"
            time.sleep(1)
        assert round_one is not None, "round 1 did not finish:\n" + processes[1].tail()
        assert round_one["status"] == "published", round_one["error"]
        assert len(round_one["inputs"]) == 2
        experts = {f"expert:math:{delta_id[:12]}" for delta_id in round_one["inputs"]}
        assert set(round_one["evaluation"]) == {"base", "merged"} | experts

        checkpoints = httpx.get(f"{url}/v1/checkpoints", timeout=5).json()
        assert [c["round"] for c in checkpoints] == [0, 1]
        assert checkpoints[1]["id"] == round_one["checkpoint_id"]
        deltas = httpx.get(f"{url}/v1/deltas", timeout=5).json()
        assert sorted(d["status"] for d in deltas) == ["merged", "merged"]

        pulled = pull(url, "latest", tmp_path / "pulled", progress=False)
        # Both nodes end their one round once the merged checkpoint is out.
        for p in processes[1:]:
            assert p.popen.wait(timeout=60) == 0, p.tail()
    finally:
        stop_all(processes)

    base = dict(iter_base_tensors(tiny_base))
    experts = [_node_expert(tmp_path / f"node-{i}", base) for i in range(2)]
    assert any(not torch.equal(experts[0][n], base[n]) for n in base)  # training moved weights
    # The default plan: task arithmetic at λ 1, math's deltas at half size, which mergekit-yaml
    # writes as a weight of 0.5 on each (equal up to float32 rounding of the scaled deltas), and
    # the token embedding and output head left at the base.
    assert round_one["method"]["domain_scale"] == {"math": 0.5}
    expected = _mergekit_task_arithmetic(tiny_base, experts, tmp_path / "reference", weight=0.5)
    merged = load_file(pulled / "model.safetensors")
    assert set(merged) == set(expected)
    kept = [name for name in merged if MergePlan().keeps_base(name)]
    assert kept and any(not torch.equal(experts[0][n], base[n]) for n in kept)
    for name, tensor in merged.items():
        if name in kept:
            assert torch.equal(tensor, base[name]), name
            continue
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        if not torch.equal(experts[0][name], base[name]):
            assert not torch.allclose(tensor, base[name], rtol=0, atol=1e-9), name

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pulled)
    model = AutoModelForCausalLM.from_pretrained(pulled)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    generated = out[0, prompt["input_ids"].shape[1] :]
    assert len(generated) >= 1
    assert isinstance(tokenizer.decode(generated), str)
