"""The vLLM inference backend for GPU nodes: an in-process engine that takes token prompts, returns
per-token logprobs of the tempered sampling distribution, and has its weights replaced from the
trainer in place. vLLM is imported only when a backend is built (install `skillswarm[gpu]`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from skillswarm.agent.inference import Generation, GenerationRequest
from transformers import AutoTokenizer, PreTrainedTokenizerBase


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed or cannot start here (it needs a CUDA GPU)."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise VLLMUnavailableError(
            "the vllm backend needs the gpu extra on a CUDA machine: "
            "pip install 'skillswarm[gpu]' (or set inference.backend = \"hf\")"
        ) from error
    return vllm


def _load_weights_into_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker: load named tensors into its model."""
    worker.model_runner.model.load_weights(weights=weights)


class VLLMBackend:
    """A vLLM `LLM` engine in this process as the behaviour policy.

    The engine reports logprobs after temperature scaling (`logprobs_mode="processed_logprobs"`),
    so they are the behaviour logprobs the trainer's importance ratios need. It is built with the
    `external_launcher` executor so its workers live in this process and new weights can be
    loaded into them without a copy through disk.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        dtype: str = "bfloat16",
        seed: int = 0,
        enable_sleep_mode: bool = False,
        policy_version: int = 0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        vllm = _import_vllm()
        if not torch.cuda.is_available():
            raise VLLMUnavailableError("the vllm backend needs a CUDA GPU; none is visible")
        self._vllm = vllm
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_path))
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs an eos token marking the end of a turn")
        self.policy_version = policy_version
        self._max_model_len = max_model_len
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher",
            **(engine_options or {}),
        )
        self._stop_token_ids = {self.tokenizer.eos_token_id}

    @property
    def max_context_tokens(self) -> int:
        return self._max_model_len

    def stop_token_ids(self) -> set[int]:
        return set(self._stop_token_ids)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        temperature: float,
        greedy: bool,
        seed: int,
    ) -> list[Generation]:
        if not requests:
            return []
        params = [
            self._vllm.SamplingParams(
                temperature=0.0 if greedy else temperature,
                max_tokens=request.max_new_tokens,
                logprobs=0,
                seed=(seed + index) % 2**63,
                stop_token_ids=sorted(self._stop_token_ids),
                skip_special_tokens=False,
            )
            for index, request in enumerate(requests)
        ]
        prompts = [{"prompt_token_ids": list(request.prompt_ids)} for request in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._generation(output.outputs[0]) for output in outputs]

    def _generation(self, completion: Any) -> Generation:
        token_ids = list(completion.token_ids)
        logprobs = [
            float(position[token].logprob)
            for position, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        stop = token_ids[-1] if token_ids and token_ids[-1] in self._stop_token_ids else None
        return Generation(token_ids, logprobs, stop)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.llm.collective_rpc(_load_weights_into_worker, args=(weights,))
        self.llm.reset_prefix_cache()
        self.policy_version = version
