"""Building the embedded base checkpoint: tokenizer and tiny model from config, optional copy
pretraining, then a short supervised warm start on the environments' solver demonstrations."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from skillswarm.agent.envs import get_environment
from skillswarm.agent.envs.base import Environment
from skillswarm.agent.model import (
    TEMPLATE_FIXED_STRINGS,
    build_tiny_model,
    build_tokenizer,
    save_tokenizer,
    set_torch_threads,
)
from skillswarm.node.pretrain import (
    COPY_TARGET_ACCURACY,
    WHOLE_WORD_SHARE,
    copy_pretraining,
    corpus_words,
)
from skillswarm.node.train import check_mix_weights, supervised_warm_start
from transformers import PreTrainedTokenizerBase

# Demonstrations the tokenizer is trained on, per domain.
TOKENIZER_CORPUS_TASKS = 2000
# A math-only warm start (what `create_base_checkpoint` does by default): the model starts copying
# numbers into calculator calls between steps 340 and 440 (one thread, batch 16); after 520 steps
# it solved 14 of 32 held-out tasks greedily, after 220 one.
DEFAULT_WARM_START_STEPS = 480
# The base `skillswarm bootstrap` gives: copy pretraining (node.pretrain) until the model copies
# 90% of a held-out batch of repeated words right (at most MULTI_DOMAIN_COPY_STEPS steps; 450
# here), then 300 warm-start steps on all three domains. Without the copy pretraining, copying
# names and numbers arrived only after 850 to over 1,400 warm-start steps, abruptly, and where in
# that range depended on the machine (a 1,200-step run left search at 91.4% on one machine and 0%
# on another); after it, each domain rises smoothly within a few hundred steps, so a short warm
# start leaves RL room on every domain. Greedy held-out success of that base: see the README.
MULTI_DOMAIN_WARM_START_STEPS = 300
MULTI_DOMAIN_COPY_STEPS = 2000
# Each domain's share of those steps' demonstrations.
DEFAULT_DOMAIN_WEIGHTS: dict[str, float] = {"math": 4.0, "code": 3.0, "search": 12.0}
DEFAULT_WARM_START_BATCH_SIZE = 16
DEFAULT_WARM_START_LR = 1.5e-3
# The embedded base's size: about 1.2M parameters with its 1,028-token vocabulary.
DEFAULT_HIDDEN_SIZE = 128
DEFAULT_LAYERS = 4
ATTENTION_HEADS = 4


EMBEDDED_BASE_PACKAGE = "skillswarm"
EMBEDDED_BASE_FOLDER = "embedded_base"


class EmbeddedBaseMissing(FileNotFoundError):
    """The package was installed without the prebuilt embedded base."""


def embedded_base() -> Path:
    """The prebuilt embedded base shipped inside the package (built by `skillswarm bootstrap`
    with the recommended settings; its `skillswarm_base.json` says how). Every machine starts
    from these same weights; `skillswarm bootstrap DIR` rebuilds one."""
    from importlib.resources import files

    folder = Path(str(files(EMBEDDED_BASE_PACKAGE) / EMBEDDED_BASE_FOLDER))
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise EmbeddedBaseMissing(
            f"the prebuilt base is not in this installation ({folder}); build one with "
            "`skillswarm bootstrap DIR`"
        )
    return folder


def render_demonstrations(
    tokenizer: PreTrainedTokenizerBase,
    environments: Sequence[Environment],
    n_per_env: int,
    seed: int,
) -> list[str]:
    """Solver demonstrations on training tasks, rendered through `tokenizer`'s chat template."""
    texts: list[str] = []
    for environment in environments:
        schemas = environment.tool_schemas()
        for task in environment.tasks("train", n_per_env, seed=seed):
            texts.append(
                tokenizer.apply_chat_template(
                    environment.solve(task), tools=schemas, tokenize=False
                )
            )
    return texts


def check_model_size(hidden_size: int, layers: int) -> None:
    """Refuse a model size `create_base_checkpoint` cannot build (ValueError)."""
    if hidden_size < ATTENTION_HEADS or hidden_size % ATTENTION_HEADS:
        raise ValueError(
            f"hidden size {hidden_size} is not a positive multiple of {ATTENTION_HEADS}, "
            "the attention heads"
        )
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")


def create_base_checkpoint(
    out_dir: Path,
    seed: int = 0,
    warm_start_steps: int = DEFAULT_WARM_START_STEPS,
    domains: Sequence[str] = ("math",),
    *,
    warm_start_batch_size: int = DEFAULT_WARM_START_BATCH_SIZE,
    warm_start_lr: float = DEFAULT_WARM_START_LR,
    num_threads: int | None = 1,
    tokenizer_corpus_tasks: int = TOKENIZER_CORPUS_TASKS,
    domain_weights: Mapping[str, float] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    copy_steps: int = 0,
    on_copy_check: Callable[[int, float], None] | None = None,
    copy_target: float = COPY_TARGET_ACCURACY,
    copy_whole_word_share: float = WHOLE_WORD_SHARE,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    layers: int = DEFAULT_LAYERS,
) -> Path:
    """Build the tokenizer and tiny model, warm-start them on the domains' solver demonstrations
    and save a Hugging Face folder at `out_dir`. `domain_weights` sets each domain's share of the
    demonstrations (a domain not named weighs 1; None: equal shares). With `copy_steps`, the model
    is first copy-pretrained (`node.pretrain`) for at most that many steps, on the words of the
    tokenizer's corpus (`copy_whole_word_share` of them words the tokenizer keeps as one
    token), stopping once it copies `copy_target` of a held-out batch's repeated tokens right in
    each kind; `on_copy_check(step, accuracy)` sees its checks. The same seed and thread
    count give the same checkpoint. `hidden_size` (a multiple of the 4 attention heads; the MLP is
    4 times as wide) and `layers` size the model."""
    check_model_size(hidden_size, layers)
    weights = None
    if domain_weights is not None:  # checked before the minutes of tokenizer and warm start
        unknown = sorted(set(domain_weights) - set(domains))
        if unknown:
            raise ValueError(f"weights name domains not being trained: {', '.join(unknown)}")
        weights = [float(domain_weights.get(domain, 1.0)) for domain in domains]
        check_mix_weights(weights, len(domains))
    if num_threads is not None:
        set_torch_threads(num_threads)
    environments = [get_environment(domain) for domain in domains]
    template_only = build_tokenizer(TEMPLATE_FIXED_STRINGS)
    corpus = list(TEMPLATE_FIXED_STRINGS)
    corpus += render_demonstrations(template_only, environments, tokenizer_corpus_tasks, seed)
    tokenizer = build_tokenizer(corpus)
    model = build_tiny_model(
        tokenizer,
        seed=seed,
        hidden=hidden_size,
        layers=layers,
        heads=ATTENTION_HEADS,
        intermediate=4 * hidden_size,
    )
    copied = None
    if copy_steps:
        words = corpus_words(corpus[len(TEMPLATE_FIXED_STRINGS) :])
        copied = copy_pretraining(
            model,
            tokenizer,
            words,
            copy_steps,
            seed=seed,
            on_check=on_copy_check,
            target_accuracy=copy_target,
            whole_word_share=copy_whole_word_share,
        )
    losses = supervised_warm_start(
        model,
        tokenizer,
        environments,
        steps=warm_start_steps,
        batch_size=warm_start_batch_size,
        lr=warm_start_lr,
        seed=seed,
        weights=weights,
        on_step=on_step,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    provenance = {
        "seed": seed,
        "hidden_size": hidden_size,
        "layers": layers,
        "domains": list(domains),
        "domain_weights": weights,
        "warm_start_steps": warm_start_steps,
        "warm_start_batch_size": warm_start_batch_size,
        "warm_start_lr": warm_start_lr,
        "warm_start_final_loss": losses[-1] if losses else None,
        "copy_target": None if copied is None else copy_target,
        "copy_whole_word_share": None if copied is None else copy_whole_word_share,
        "copy_pretraining_steps": 0 if copied is None else copied.steps,
        "copy_accuracy": None if copied is None else copied.accuracy,
        "built_with": _versions(),
    }
    (out_dir / "skillswarm_base.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return out_dir


def _versions() -> dict[str, str]:
    """The library versions a base was built with (its weights follow them to the last bits)."""
    import platform

    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "machine": platform.machine(),
    }
