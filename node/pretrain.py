"""Copy pretraining: before its warm start, the freshly initialised tiny model learns to repeat
sequences of the domains' own words, the in-context copying a pretrained language model brings.

Every skill here leans on copying: a name from the question into a search, a number into the
calculator, a function name into code. Learned from the demonstrations alone, copying arrived late
and abruptly (a phase change somewhere between 850 and more than 1,400 warm-start steps, depending
on the machine's floating-point rounding), and a name's first letter was the last thing copied
right. On repeated random words the same ability forms within a few hundred cheap steps, and the
warm start after it learns each domain smoothly.

A quarter of the words drawn are words the tokenizer keeps as one token ("Lines", "Mining",
"born"), and the accuracy that ends the stage is that of the kind copied worse. Drawn evenly from
the corpus's words (some 12,000, of which a few hundred are one token), those were two in a hundred
draws, and a model that copied 91% of its repeated tokens right copied 4% of a company's last
word, the word a search answer must repeat from the document that names it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from skillswarm.node.train import right_padded, token_logprobs
from transformers import PreTrainedModel, PreTrainedTokenizerBase

COPY_MIN_WORDS = 4
COPY_MAX_WORDS = 16
COPY_BATCH_SIZE = 32
COPY_LR = 1.5e-3
# The share of a held-out batch's repeated tokens the model must predict right to stop early.
COPY_TARGET_ACCURACY = 0.9
COPY_CHECK_EVERY = 50
COPY_CHECK_SEQUENCES = 64
# The share of an example's words drawn from those the tokenizer encodes as a single token.
WHOLE_WORD_SHARE = 0.25
_WORD_PATTERN = re.compile(r"[A-Za-z0-9_]+")
_MARKUP_PATTERN = re.compile(r"<[^<>\s]*>")


@dataclass(frozen=True)
class CopyPretraining:
    """What a copy pretraining did: its steps, and the held-out copy accuracy at the last check."""

    steps: int
    accuracy: float


def corpus_words(texts: Iterable[str]) -> list[str]:
    """The distinct words, numbers and identifiers of `texts` (markup such as `<tool_call>` and
    `<|im_end|>` left out), sorted, so the same texts give the same list."""
    words: set[str] = set()
    for text in texts:
        words.update(_WORD_PATTERN.findall(_MARKUP_PATTERN.sub(" ", text)))
    return sorted(words)


@dataclass(frozen=True)
class CopyWords:
    """The words copy examples draw from, split by their encoding: `whole`, each a single token,
    and `spelled`, each several (a made-up name spelled out, a number digit by digit)."""

    whole: tuple[str, ...]
    spelled: tuple[str, ...]
    whole_share: float = WHOLE_WORD_SHARE
    whole_ids: tuple[int, ...] = ()  # the token of each word in `whole`

    @classmethod
    def split(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        words: Sequence[str],
        whole_share: float = WHOLE_WORD_SHARE,
    ) -> CopyWords:
        if not words:
            raise ValueError("copy pretraining needs at least one word")
        if not 0 <= whole_share <= 1:
            raise ValueError(f"the whole-word share must be in [0, 1], got {whole_share}")
        encoded = tokenizer(list(words), add_special_tokens=False)["input_ids"]
        pairs = list(zip(words, encoded, strict=True))
        whole = tuple(word for word, ids in pairs if len(ids) == 1)
        spelled = tuple(word for word, ids in pairs if len(ids) != 1)
        whole_ids = tuple(ids[0] for _, ids in pairs if len(ids) == 1)
        return cls(whole, spelled, whole_share, whole_ids)

    def draw(self, rng: random.Random) -> str:
        """One word: a whole-token word with probability `whole_share` (always, or never, when
        the other kind is missing)."""
        if self.whole and (not self.spelled or rng.random() < self.whole_share):
            return rng.choice(self.whole)
        return rng.choice(self.spelled)


def copy_example(
    tokenizer: PreTrainedTokenizerBase, words: CopyWords, rng: random.Random
) -> tuple[list[int], list[float]]:
    """Token ids and loss mask of one example: 4-16 random words, a newline, the same words
    again and the end-of-turn token. The loss covers the repeat and the end-of-turn token."""
    line = " ".join(words.draw(rng) for _ in range(rng.randint(COPY_MIN_WORDS, COPY_MAX_WORDS)))
    shown = tokenizer(line + "\n", add_special_tokens=False)["input_ids"]
    repeated = tokenizer(line, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return shown + repeated, [0.0] * len(shown) + [1.0] * len(repeated)


def _batch(
    tokenizer: PreTrainedTokenizerBase, words: CopyWords, rng: random.Random, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    examples = [copy_example(tokenizer, words, rng) for _ in range(size)]
    input_ids, attention_mask, (loss_mask,) = right_padded(
        [ids for ids, _ in examples], tokenizer.pad_token_id, [mask for _, mask in examples]
    )
    return input_ids, attention_mask, loss_mask


def copy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    words: Sequence[str],
    seed: int,
    sequences: int = COPY_CHECK_SEQUENCES,
    whole_share: float = WHOLE_WORD_SHARE,
) -> float:
    """The share of repeated tokens that the model's greedy next-token prediction gets right, on
    `sequences` examples drawn with `seed`, in whichever kind it copies worse: the tokens of
    words the tokenizer keeps whole, or the rest (the pieces of spelled words, the spaces, the
    end-of-turn token). `whole_share` of the words drawn are whole-token words."""
    pool = CopyWords.split(tokenizer, words, whole_share)
    return _kind_accuracy(model, tokenizer, pool, seed, sequences)


def _kind_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pool: CopyWords,
    seed: int,
    sequences: int,
) -> float:
    input_ids, attention_mask, loss_mask = _batch(tokenizer, pool, random.Random(seed), sequences)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        model.train(was_training)
    targets = input_ids[:, 1:]
    right = logits[:, :-1].argmax(dim=-1) == targets
    scored = loss_mask[:, 1:].bool()
    whole = torch.isin(targets, torch.tensor(pool.whole_ids, dtype=targets.dtype))
    kinds = [scored & whole, scored & ~whole]
    return min(right[kind].float().mean().item() for kind in kinds if kind.any())


def copy_pretraining(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    words: Sequence[str],
    max_steps: int,
    *,
    batch_size: int = COPY_BATCH_SIZE,
    lr: float = COPY_LR,
    seed: int = 0,
    target_accuracy: float = COPY_TARGET_ACCURACY,
    check_every: int = COPY_CHECK_EVERY,
    on_check: Callable[[int, float], None] | None = None,
    whole_word_share: float = WHOLE_WORD_SHARE,
) -> CopyPretraining:
    """Train `model` in place to repeat random sequences of `words` (cross-entropy on the repeat,
    AdamW at a constant `lr`, gradients clipped to norm 1) until its held-out copy accuracy,
    checked every `check_every` steps, reaches `target_accuracy`, or for `max_steps`.
    `whole_word_share` of the words drawn are words the tokenizer keeps as one token.
    `on_check(step, accuracy)` is called at each check. The same seed gives the same run."""
    pool = CopyWords.split(tokenizer, words, whole_word_share)
    if not 0 < target_accuracy <= 1:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")
    if max_steps < 0 or batch_size < 1 or check_every < 1:
        raise ValueError("max_steps must be >= 0, batch_size and check_every >= 1")
    rng = random.Random(f"copy-pretraining/{seed}")
    check_seed = rng.randrange(2**62)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    accuracy = float("nan")
    was_training = model.training
    model.train()
    try:
        for step in range(1, max_steps + 1):
            input_ids, attention_mask, loss_mask = _batch(tokenizer, pool, rng, batch_size)
            logprobs = token_logprobs(model, input_ids, attention_mask)
            loss = -(logprobs * loss_mask).sum() / loss_mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % check_every == 0 or step == max_steps:
                accuracy = _kind_accuracy(model, tokenizer, pool, check_seed, COPY_CHECK_SEQUENCES)
                if on_check is not None:
                    on_check(step, accuracy)
                if accuracy >= target_accuracy:
                    return CopyPretraining(step, accuracy)
    finally:
        model.train(was_training)
    return CopyPretraining(max_steps, accuracy)
