"""Copy pretraining: its examples, its word list, and that it teaches a fresh model to copy."""

from __future__ import annotations

import random

import pytest
import torch
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tiny_model, build_tokenizer
from skillswarm.node.pretrain import (
    COPY_MAX_WORDS,
    COPY_MIN_WORDS,
    WHOLE_WORD_SHARE,
    CopyWords,
    copy_accuracy,
    copy_example,
    copy_pretraining,
    corpus_words,
)

WORDS = ["Kutu", "Lines", "Dengu", "f73", "482", "add_5", "Vubas", "born", "p404", "Mills"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer([*TEMPLATE_FIXED_STRINGS, " ".join(WORDS) * 3])


def test_corpus_words_leave_markup_out_and_are_sorted() -> None:
    texts = [
        '<|im_start|>user\nWhere is Kutu Lines?<|im_end|>\n<tool_call>{"query": "Kutu"}',
        "<answer>add_5</answer> 482 p404",
    ]
    words = corpus_words(texts)
    assert words == sorted(set(words))
    assert {"Kutu", "Lines", "add_5", "482", "p404", "query", "Where"} <= set(words)
    assert not {"im_start", "im_end", "tool_call", "answer"} & set(words)
    assert corpus_words(reversed(texts)) == words


def test_copy_words_split_by_encoding_and_draw_whole_words_at_their_share(tokenizer) -> None:
    words = CopyWords.split(tokenizer, WORDS)
    assert sorted(words.whole + words.spelled) == sorted(WORDS)
    assert words.whole and words.spelled
    for word in words.whole:
        assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) == 1
    assert words.whole_ids == tuple(
        tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in words.whole
    )
    for word in words.spelled:
        assert len(tokenizer(word, add_special_tokens=False)["input_ids"]) > 1
    rng = random.Random(5)
    draws = [words.draw(rng) for _ in range(4000)]
    share = sum(word in words.whole for word in draws) / len(draws)
    assert abs(share - WHOLE_WORD_SHARE) < 0.03, share
    assert set(draws) == set(WORDS)
    # With one kind missing, every draw is of the other.
    only_spelled = CopyWords((), words.spelled)
    assert {only_spelled.draw(rng) for _ in range(50)} <= set(words.spelled)
    only_whole = CopyWords(words.whole, ())
    assert {only_whole.draw(rng) for _ in range(50)} <= set(words.whole)
    none_whole = CopyWords.split(tokenizer, WORDS, whole_share=0.0)
    assert {none_whole.draw(rng) for _ in range(200)} == set(words.spelled)
    with pytest.raises(ValueError, match="at least one word"):
        CopyWords.split(tokenizer, [])
    with pytest.raises(ValueError, match="whole-word share"):
        CopyWords.split(tokenizer, WORDS, whole_share=1.5)


def test_copy_example_trains_on_the_repeat_alone(tokenizer) -> None:
    rng = random.Random(3)
    words = CopyWords.split(tokenizer, WORDS)
    for _ in range(20):
        ids, mask = copy_example(tokenizer, words, rng)
        assert len(ids) == len(mask)
        shown = ids[: mask.index(1.0)]
        repeated = ids[mask.index(1.0) :]
        assert all(mask[len(shown) :]) and not any(mask[: len(shown)])
        assert repeated[-1] == tokenizer.eos_token_id
        line = tokenizer.decode(repeated[:-1])
        assert tokenizer.decode(shown) == line + "\n"
        assert COPY_MIN_WORDS <= len(line.split()) <= COPY_MAX_WORDS
        assert set(line.split()) <= set(WORDS)


def test_copy_pretraining_teaches_a_fresh_model_to_copy_and_repeats_exactly(tokenizer) -> None:
    def pretrained(max_steps: int, target: float) -> tuple[torch.nn.Module, object]:
        model = build_tiny_model(tokenizer, seed=0, hidden=64, layers=2, heads=4, intermediate=128)
        model.eval()  # left as it was found
        checks: list[tuple[int, float]] = []
        result = copy_pretraining(
            model,
            tokenizer,
            WORDS,
            max_steps,
            batch_size=16,
            lr=3e-3,
            target_accuracy=target,
            check_every=20,
            on_check=lambda step, accuracy: checks.append((step, accuracy)),
            whole_word_share=0.5,
        )
        return model, (result, checks)

    fresh = build_tiny_model(tokenizer, seed=0, hidden=64, layers=2, heads=4, intermediate=128)
    before = copy_accuracy(fresh, tokenizer, WORDS, seed=11, whole_share=0.5)
    model, (result, checks) = pretrained(120, 1.0)
    after = copy_accuracy(model, tokenizer, WORDS, seed=11, whole_share=0.5)
    assert before < 0.1 and after > before + 0.2, (before, after)
    assert [step for step, _ in checks] == [20, 40, 60, 80, 100, 120]
    assert result.steps == 120 and result.accuracy == checks[-1][1]
    assert not model.training

    # The same seed gives the same run; a reachable target stops it at the first check past it.
    _, (again, _) = pretrained(120, 1.0)
    assert again == result
    reached = next(step for step, accuracy in checks if accuracy >= 0.2)
    _, (early, early_checks) = pretrained(120, 0.2)
    assert early.steps == reached and early_checks == checks[: len(early_checks)]


def test_copy_accuracy_is_that_of_the_kind_copied_worse(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=0, hidden=64, layers=2, heads=4, intermediate=128)
    copy_pretraining(model, tokenizer, WORDS, 60, batch_size=16, lr=3e-3, target_accuracy=1.0)
    words = CopyWords.split(tokenizer, WORDS)
    whole_ids = {tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in words.whole}
    rng = random.Random(11)
    right = {True: [], False: []}
    model.eval()
    for _ in range(64):
        ids, mask = copy_example(tokenizer, words, rng)
        with torch.no_grad():
            predicted = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
        for position in range(1, len(ids)):
            if mask[position]:
                right[ids[position] in whole_ids].append(predicted[position - 1] == ids[position])
    by_kind = {kind: sum(hits) / len(hits) for kind, hits in right.items()}
    assert copy_accuracy(model, tokenizer, WORDS, seed=11) == pytest.approx(
        min(by_kind.values()), abs=1e-6
    )


def test_copy_pretraining_refuses_bad_settings(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    with pytest.raises(ValueError, match="at least one word"):
        copy_pretraining(model, tokenizer, [], 10)
    with pytest.raises(ValueError, match="target_accuracy"):
        copy_pretraining(model, tokenizer, WORDS, 10, target_accuracy=0)
    with pytest.raises(ValueError, match="max_steps"):
        copy_pretraining(model, tokenizer, WORDS, -1)
    assert copy_pretraining(model, tokenizer, WORDS, 0).steps == 0
