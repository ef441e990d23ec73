"""The `search` environment: multi-hop questions over a document collection, answered with a BM25
`search` tool and an `ask` sub-agent tool that reads one document and answers a focused question,
so whole pages never enter the policy's context.

Questions come from the generated linked corpus (every task has a solver) or from a JSONL
questions file over any corpus (those tasks have no solver: `solve` raises SolverUnavailableError,
because the file names the supporting documents but not the hops between them).

With the generated corpus, training questions are asked about other generated worlds (same kinds
of facts, other made-up names) and held-out questions about the environment's own world, so
neither a warm start nor RL can pass held-out questions by recalling names from training: what
carries over is the skill of copying a name into a search and following the facts.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from skillswarm.agent.chat_backends import ChatBackend, ChatMessage
from skillswarm.agent.envs import register_environment
from skillswarm.agent.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolFunction,
    check_split,
    split_of_text,
    strip_reasoning,
)
from skillswarm.agent.search_corpus import (
    Corpus,
    Document,
    LinkedCorpus,
    LinkedEntity,
    Question,
    generate_linked_corpus,
    load_jsonl_corpus,
    load_jsonl_questions,
    split_sentences,
)
from skillswarm.agent.tools import TOOL_ERROR_PREFIX, ToolResult

logger = logging.getLogger(__name__)

HELDOUT_FRACTION = 0.2
MAX_QUERY_CHARS = 300
MAX_QUESTION_CHARS = 500
MAX_READER_ANSWER_CHARS = 300
DEFAULT_SEARCH_CREDIT = 0.1
DEFAULT_FACT_CREDIT = 0.1
MAX_HOPS = 3
# Default question lengths, drawn in equal shares: one-hop questions (search, ask, answer) are what
# a small base first learns to solve, and give multi-hop training its first rewards.
DEFAULT_HOPS: tuple[int, ...] = (1, 2)
QUESTIONS_FILE_FAMILY = "questions_file"
# Training questions over the generated corpus come from this many other generated worlds. Each
# world gives about 6,100 training questions, so a warm start of ~12,000 search demonstrations sees
# each question about 0.1 times, and recalling a world's names cannot stand in for copying them.
DEFAULT_TRAIN_WORLDS = 16
# Training world i of an environment generated with `seed` is generate_linked_corpus(seed +
# TRAIN_WORLD_SEED_STRIDE * (i + 1)), far from any seed a user would pick for the world itself.
TRAIN_WORLD_SEED_STRIDE = 1_000_000
# One search result a line: "[doc_id] title: snippet"; turn rewards read the ids back from it.
_RESULT_LINE_PATTERN = re.compile(r"^\[([^\]\s]+)\] ", re.MULTILINE)


class SolverUnavailableError(RuntimeError):
    """Raised by `solve` for a task that has no known solution path (a questions-file task)."""


class SolverFailedError(RuntimeError):
    """Raised by `solve` when the tools do not lead to the answer (a corpus that breaks the
    generator's guarantees, such as a needed document missing from the search results)."""


# ---- readers: the sub-agent behind `ask` ---------------------------------------------------


class DocumentReader(Protocol):
    """Answers a focused question from one document only."""

    def answer(self, document: Document, question: str) -> str:
        """The answer to `question` according to `document`."""
        ...


_READER_STOPWORDS = frozenset(
    "a an and are as at be by did do does for from had has have he her his how in is it its of "
    "on or she that the their them they this to was were what when where which who whom whose "
    "why with".split()
)
_WORD_PATTERN = re.compile(r"\w+")


def _stem(word: str) -> str:
    """A light suffix stripper so 'works'/'work' and 'founded'/'founder' meet."""
    for suffix, min_length in (("ing", 6), ("ed", 5), ("er", 6), ("es", 5), ("s", 4)):
        if word.endswith(suffix) and len(word) >= min_length and not word.endswith("ss"):
            return word[: -len(suffix)]
    return word


def _content_terms(text: str) -> set[str]:
    words = _WORD_PATTERN.findall(text.casefold())
    return {_stem(word) for word in words if word not in _READER_STOPWORDS}


class ExtractiveReader:
    """Returns the document sentence that best matches the question (deterministic).

    Sentences score by the question words they share, each weighted by how rare it is among the
    document's sentences. Words of the document's title count only to break ties (they name what
    every sentence is about, even where a pronoun stands for them). Remaining ties go to the
    earlier sentence."""

    NO_MATCH = "The document does not answer that question."

    def answer(self, document: Document, question: str) -> str:
        sentences = split_sentences(document.text)
        question_terms = _content_terms(question)
        title_terms = question_terms & _content_terms(document.title)
        sentence_terms = [_content_terms(sentence) for sentence in sentences]
        frequency = Counter(term for terms in sentence_terms for term in terms & question_terms)

        def weight(terms: set[str]) -> float:
            return sum(math.log(1.0 + len(sentences) / frequency[term]) for term in terms)

        best_sentence, best_score = None, (0.0, 0.0)
        for sentence, terms in zip(sentences, sentence_terms, strict=True):
            shared = terms & question_terms
            score = (weight(shared - title_terms), weight(shared & title_terms))
            if score > best_score:
                best_sentence, best_score = sentence, score
        if best_sentence is None:
            return self.NO_MATCH
        if len(best_sentence) > MAX_READER_ANSWER_CHARS:
            return best_sentence[: MAX_READER_ANSWER_CHARS - 3] + "..."
        return best_sentence


READER_SYSTEM_PROMPT = (
    "You answer a question using only the document you are given. Reply with the answer alone, "
    "as short as possible (a name or a short phrase). If the document does not say, reply: "
    + ExtractiveReader.NO_MATCH
)


class ChatReader:
    """Asks a chat model (any ChatBackend: the local policy, an OpenAI-compatible endpoint) to
    answer from the document. When the backend raises or replies with no text, the answer comes
    from `fallback` (an ExtractiveReader by default) and the failure is logged."""

    def __init__(
        self,
        backend: ChatBackend,
        max_tokens: int = 64,
        *,
        max_document_chars: int = 6000,
        fallback: DocumentReader | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if max_document_chars < 100:
            raise ValueError(f"max_document_chars must be at least 100, got {max_document_chars}")
        self.backend = backend
        self.max_tokens = max_tokens
        self.max_document_chars = max_document_chars
        self.fallback: DocumentReader = fallback if fallback is not None else ExtractiveReader()

    def messages(self, document: Document, question: str) -> list[ChatMessage]:
        """The conversation sent to the backend for `question` about `document`."""
        text = document.text[: self.max_document_chars]
        return [
            {"role": "system", "content": READER_SYSTEM_PROMPT},
            {
                "role": "user",
                "content": f"Document: {document.title}\n{text}\n\nQuestion: {question}",
            },
        ]

    def answer(self, document: Document, question: str) -> str:
        try:
            reply = self.backend.complete(
                self.messages(document, question), max_tokens=self.max_tokens, temperature=0.0
            )
        except Exception as error:  # any backend failure falls back; the episode goes on
            logger.warning(
                "reader backend %s failed on document %s (%s: %s); using the extractive answer",
                type(self.backend).__name__,
                document.doc_id,
                type(error).__name__,
                error,
            )
            return self.fallback.answer(document, question)
        text = strip_reasoning(reply).strip() if isinstance(reply, str) else ""
        if not text or "<think>" in text:
            logger.warning(
                "reader backend %s gave no answer for document %s; using the extractive answer",
                type(self.backend).__name__,
                document.doc_id,
            )
            return self.fallback.answer(document, question)
        if len(text) > MAX_READER_ANSWER_CHARS:
            return text[: MAX_READER_ANSWER_CHARS - 3] + "..."
        return text


# ---- questions over the linked corpus ------------------------------------------------------


@dataclass(frozen=True)
class RelationQuestion:
    """How a relation is asked: as a question about `{subject}` (also the focused question the
    solver asks the reader) and as a noun phrase nested inside a longer question."""

    question: str
    phrase: str


# Each focused question shares a keyword with the sentence that states the fact (see
# LINK_RELATIONS), which is what lets the extractive reader find that sentence.
RELATION_QUESTIONS: dict[str, RelationQuestion] = {
    "born_in": RelationQuestion("Where was {subject} born?", "the city where {subject} was born"),
    "works_for": RelationQuestion(
        "Which company does {subject} work for?", "the company {subject} works for"
    ),
    "country": RelationQuestion(
        "In which country is {subject}?", "the country that {subject} is in"
    ),
    "mayor": RelationQuestion("Who is the mayor of {subject}?", "the mayor of {subject}"),
    "capital": RelationQuestion("What is the capital of {subject}?", "the capital of {subject}"),
    "founder": RelationQuestion("Who founded {subject}?", "the founder of {subject}"),
    "based_in": RelationQuestion("Where is {subject} based?", "the city where {subject} is based"),
}


def compose_question(relations: Sequence[str], start_name: str) -> str:
    """The question that follows `relations` from the entity named `start_name`."""
    subject = start_name
    for relation in relations[:-1]:
        subject = RELATION_QUESTIONS[relation].phrase.format(subject=subject)
    return RELATION_QUESTIONS[relations[-1]].question.format(subject=subject)


def _chains(corpus: LinkedCorpus, start: LinkedEntity, hops: int) -> list[list[str]]:
    """Every relation path of length `hops` from `start` that never revisits an entity."""
    paths: list[list[str]] = []

    def extend(path: list[str], visited: list[str]) -> None:
        if len(path) == hops:
            paths.append(path)
            return
        current = corpus.entity(visited[-1])
        for relation, target in current.links.items():
            if target not in visited:
                extend([*path, relation], [*visited, target])

    extend([], [start.entity_id])
    return paths


def normalize_answer(text: str) -> str:
    """Case-folded, punctuation turned to spaces, whitespace collapsed, a leading 'the' dropped."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    spaced = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in folded)
    words = spaced.split()
    if words and words[0] == "the":
        words = words[1:]
    return " ".join(words)


def result_doc_ids(search_output: str) -> list[str]:
    """The document ids listed in a `search` tool result, in order."""
    return _RESULT_LINE_PATTERN.findall(search_output)


def _task_id(question: str, world_seed: int | None = None) -> str:
    key = question if world_seed is None else f"{world_seed}\n{question}"
    return "search-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


class _Drawer:
    """Draws tasks from one family without replacement, each draw O(1) however large the family
    (a Fisher-Yates shuffle done only as far as the draws go, its swaps kept in a dict)."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.tasks = tasks
        self.drawn = 0
        self._swapped: dict[int, int] = {}

    @property
    def left(self) -> int:
        return len(self.tasks) - self.drawn

    def draw(self, rng: random.Random) -> Task:
        position = rng.randrange(self.drawn, len(self.tasks))
        picked = self._swapped.get(position, position)
        self._swapped[position] = self._swapped.get(self.drawn, self.drawn)
        self.drawn += 1
        return self.tasks[picked]


def search_corpus(corpus: Corpus, query: str, top_k: int) -> str:
    """The `search` tool's reply for `query` over `corpus`: the best `top_k` hits, one a line."""
    query = " ".join(query.split())
    if not query:
        return f"{TOOL_ERROR_PREFIX}the query is empty; search for a name"
    if len(query) > MAX_QUERY_CHARS:
        return f"{TOOL_ERROR_PREFIX}the query is longer than {MAX_QUERY_CHARS} characters"
    hits = corpus.search(query, top_k)
    if not hits:
        return f'No results for "{query}". Search for a name from the question or an answer.'
    return "\n".join(f"[{hit.doc_id}] {hit.title}: {hit.snippet}" for hit in hits)


def ask_document(corpus: Corpus, reader: DocumentReader, doc_id: str, question: str) -> str:
    """The `ask` tool's reply: `reader`'s answer to `question` from one document of `corpus`."""
    doc_id = doc_id.strip()
    document = corpus.get(doc_id)
    if document is None:
        shown = doc_id if len(doc_id) <= 40 else doc_id[:40] + "..."
        return (
            f"{TOOL_ERROR_PREFIX}unknown doc_id {shown!r}; pass an id shown in brackets in "
            "the search results"
        )
    question = " ".join(question.split())
    if not question:
        return f"{TOOL_ERROR_PREFIX}the question is empty"
    if len(question) > MAX_QUESTION_CHARS:
        return f"{TOOL_ERROR_PREFIX}the question is longer than {MAX_QUESTION_CHARS} characters"
    return reader.answer(document, question)


@register_environment
class SearchEnvironment(Environment):
    """Multi-hop questions: search for the named entity, ask its document for the linking fact,
    search for the entity that fact names, and so on, then `<answer>NAME</answer>`.

    `corpus` or `corpus_file` (JSONL, see `load_jsonl_corpus`) replaces the default generated
    corpus (`generate_linked_corpus(seed)`). Tasks come from `questions_file` (JSONL, see
    `load_jsonl_questions`) when given; otherwise the corpus must be a LinkedCorpus and questions
    of `hops` hops are generated from its facts: one count, or several drawn in equal shares.
    With the generated corpus, training questions are asked about `train_worlds` other generated
    worlds (each task's tools search that task's world, see `bind_tools`) and held-out questions
    about `corpus`; `train_worlds=0`, or a corpus passed in, splits one corpus's questions.
    `reader` answers `ask` (ExtractiveReader by default; a ChatReader puts a model behind it).
    Each search whose results first show a document the task needs earns `search_credit` as a
    turn reward, and each `ask` whose reply first names an entity on the question's path (the
    fact a hop is after: the company someone works for, a city's mayor…) earns `fact_credit`;
    questions-file tasks name no path, so only their searches earn credit."""

    name = "search"
    system_prompt = (
        "Answer the question about made-up people, places and companies. Search for a name, "
        "then ask that document a short question to learn a fact. Follow the facts from "
        "document to document and reply with the final name as <answer>NAME</answer>."
    )

    def __init__(
        self,
        corpus: Corpus | None = None,
        corpus_file: Path | str | None = None,
        questions_file: Path | str | None = None,
        reader: DocumentReader | None = None,
        top_k: int = 3,
        seed: int = 0,
        hops: int | Sequence[int] = DEFAULT_HOPS,
        max_turns: int | None = None,
        search_credit: float = DEFAULT_SEARCH_CREDIT,
        fact_credit: float = DEFAULT_FACT_CREDIT,
        tool_timeout_s: float | None = None,
        train_worlds: int = DEFAULT_TRAIN_WORLDS,
    ) -> None:
        if corpus is not None and corpus_file is not None:
            raise ValueError("pass either corpus or corpus_file, not both")
        if isinstance(train_worlds, bool) or not isinstance(train_worlds, int) or train_worlds < 0:
            raise ValueError(f"train_worlds must be a whole number >= 0, got {train_worlds!r}")
        if not 1 <= top_k <= 20:
            raise ValueError(f"top_k must be from 1 to 20, got {top_k}")
        hop_counts = (hops,) if isinstance(hops, int) else tuple(hops)
        if not hop_counts or any(
            isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_HOPS
            for h in hop_counts
        ):
            raise ValueError(f"hops must be from 1 to {MAX_HOPS} (one or several), got {hops!r}")
        if search_credit < 0 or fact_credit < 0:
            raise ValueError(
                f"search_credit and fact_credit must not be negative, got {search_credit} and "
                f"{fact_credit}"
            )
        generated = corpus is None and corpus_file is None and questions_file is None
        if corpus_file is not None:
            corpus = load_jsonl_corpus(corpus_file)
        self.corpus: Corpus = corpus if corpus is not None else generate_linked_corpus(seed)
        # Seeds of the worlds training questions come from (empty: the corpus's own questions).
        self.train_world_seeds: tuple[int, ...] = (
            tuple(seed + TRAIN_WORLD_SEED_STRIDE * (i + 1) for i in range(train_worlds))
            if generated
            else ()
        )
        self._worlds: dict[int, LinkedCorpus] = {}
        self.questions: list[Question] | None = None
        if questions_file is not None:
            self.questions = load_jsonl_questions(questions_file, self.corpus)
        elif not isinstance(self.corpus, LinkedCorpus):
            raise ValueError(
                "this corpus has no generated facts to make questions from; pass questions_file "
                "(JSONL with question, answer, supporting_doc_ids)"
            )
        self.reader: DocumentReader = reader if reader is not None else ExtractiveReader()
        self.top_k = top_k
        self.hop_counts: tuple[int, ...] = tuple(sorted(set(hop_counts)))
        self.hops = max(self.hop_counts)
        self.max_turns = 2 * self.hops + 3 if max_turns is None else max_turns
        if self.max_turns < 2:
            raise ValueError("max_turns must be at least 2: one tool turn and one answer turn")
        self.search_credit = search_credit
        self.fact_credit = fact_credit
        if tool_timeout_s is not None:
            self.tool_timeout_s = tool_timeout_s
        elif not isinstance(self.reader, ExtractiveReader):
            self.tool_timeout_s = 60.0  # a model behind `ask` may take a while
        self._task_pools: dict[Split, list[list[Task]]] = {}

    # ---- tools ----

    def search(self, query: str) -> str:
        """Find documents by name. Lists the best matches as [doc_id] title: first sentence.

        Args:
            query: A name or other words to look for.
        """
        return search_corpus(self.corpus, query, self.top_k)

    def ask(self, doc_id: str, question: str) -> str:
        """Ask a reader a short question about one document; it answers from that document only.

        Args:
            doc_id: A document id, as shown in brackets in the search results.
            question: A short question about the document, such as "Who founded it?".
        """
        return ask_document(self.corpus, self.reader, doc_id, question)

    @property
    def tools(self) -> list[ToolFunction]:
        return [self.search, self.ask]

    def world(self, task: Task) -> Corpus:
        """The corpus `task` is asked about: a training world's, or this environment's own."""
        world_seed = task.metadata.get("world_seed")
        return self.corpus if world_seed is None else self._train_world(world_seed)

    def _train_world(self, world_seed: int) -> LinkedCorpus:
        if world_seed not in self.train_world_seeds:
            raise ValueError(f"{world_seed} is not one of this environment's training worlds")
        world = self._worlds.get(world_seed)
        if world is None:
            # Generated once per environment and kept (generate_linked_corpus caches only a few).
            world = self._worlds.setdefault(world_seed, generate_linked_corpus(world_seed))
        return world

    def bind_tools(self, task: Task) -> dict[str, ToolFunction]:
        """`search` and `ask` over the world `task` is asked about."""
        corpus = self.world(task)
        if corpus is self.corpus:
            return self.tools_by_name()

        @functools.wraps(self.search)
        def search(query: str) -> str:
            return search_corpus(corpus, query, self.top_k)

        @functools.wraps(self.ask)
        def ask(doc_id: str, question: str) -> str:
            return ask_document(corpus, self.reader, doc_id, question)

        return {"search": search, "ask": ask}

    # ---- tasks ----

    def _generated_pool(self, split: Split) -> list[list[Task]]:
        """All generated tasks of `split`, grouped by family (relation path), in a fixed order:
        training tasks from every training world when there are any."""
        families: dict[str, list[Task]] = {}
        if split == "train" and self.train_world_seeds:
            for world_seed in self.train_world_seeds:
                self._add_generated_tasks(
                    families, self._train_world(world_seed), split, world_seed
                )
        else:
            assert isinstance(self.corpus, LinkedCorpus)
            self._add_generated_tasks(families, self.corpus, split, None)
        return [families[family] for family in sorted(families)]

    def _add_generated_tasks(
        self,
        families: dict[str, list[Task]],
        corpus: LinkedCorpus,
        split: Split,
        world_seed: int | None,
    ) -> None:
        # A training world's questions are filtered by split too, so that no training question
        # has the text of a held-out one.
        for start in corpus.entities:
            for relations in (p for h in self.hop_counts for p in _chains(corpus, start, h)):
                question = compose_question(relations, start.name)
                if split_of_text(question, HELDOUT_FRACTION) != split:
                    continue
                path = [start]
                for relation in relations:
                    path.append(corpus.entity(path[-1].links[relation]))
                doc_ids = [entity.entity_id for entity in path]
                family = ">".join(relations)
                metadata: dict[str, Any] = {
                    "family": family,
                    "relations": list(relations),
                    "entities": [entity.name for entity in path],
                    "doc_ids": doc_ids,
                    "needed_doc_ids": doc_ids[:-1],
                }
                if world_seed is not None:
                    metadata["world_seed"] = world_seed
                task = Task(
                    id=_task_id(question, world_seed),
                    prompt=question,
                    answer=path[-1].name,
                    metadata=metadata,
                )
                families.setdefault(family, []).append(task)

    def _hops_label(self) -> str:
        return ",".join(str(h) for h in self.hop_counts)

    def _questions_pool(self, split: Split) -> list[Task]:
        assert self.questions is not None
        return [
            Task(
                id=_task_id(question.question),
                prompt=question.question,
                answer=question.answer,
                metadata={
                    "family": QUESTIONS_FILE_FAMILY,
                    "needed_doc_ids": list(question.supporting_doc_ids),
                },
            )
            for question in self.questions
            if split_of_text(question.question, HELDOUT_FRACTION) == split
        ]

    def tasks(self, split: Split, n: int, seed: int = 0) -> list[Task]:
        """`n` distinct tasks of `split`. Generated tasks are drawn family by family (a hop count
        picked uniformly among those with tasks left, then a family of that many hops), so every
        question shape appears and each hop count gets an equal share."""
        check_split(split)
        rng = random.Random(f"search/{split}/{seed}/{self._hops_label()}")
        if self.questions is not None:
            pool = self._questions_pool(split)
            if n > len(pool):
                raise ValueError(f"the questions file has {len(pool)} {split} questions, not {n}")
            return rng.sample(pool, n)
        if split not in self._task_pools:
            self._task_pools[split] = self._generated_pool(split)
        by_hops: dict[int, list[_Drawer]] = {}
        for tasks in self._task_pools[split]:
            hops = len(tasks[0].metadata["relations"])
            by_hops.setdefault(hops, []).append(_Drawer(tasks))
        available = sum(len(family.tasks) for families in by_hops.values() for family in families)
        if n > available:
            raise ValueError(
                f"the corpus yields {available} {split} tasks of {self._hops_label()} hops, not {n}"
            )
        chosen: list[Task] = []
        while len(chosen) < n:
            hops = rng.choice([h for h in sorted(by_hops) if any(f.left for f in by_hops[h])])
            family = rng.choice([f for f in by_hops[hops] if f.left])
            chosen.append(family.draw(rng))
        return chosen

    def reward(self, task: Task, final_answer: str | None) -> float:
        if final_answer is None:
            return 0.0
        given = normalize_answer(final_answer)
        return 1.0 if given and given == normalize_answer(task.answer) else 0.0

    def new_episode_memory(self, task: Task) -> dict[str, Any]:
        return {"found_doc_ids": set(), "found_facts": set()}

    def turn_reward(
        self, task: Task, results: Sequence[ToolResult], memory: dict[str, Any]
    ) -> float:
        """`search_credit` for each needed document a search shows for the first time, and
        `fact_credit` for each entity of the question's path after its start that an `ask`
        reply names for the first time."""
        needed = set(task.metadata.get("needed_doc_ids", ()))
        facts = [normalize_answer(name) for name in task.metadata.get("entities", ())[1:]]
        found: set[str] = memory.setdefault("found_doc_ids", set())
        found_facts: set[str] = memory.setdefault("found_facts", set())
        credit = 0.0
        for result in results:
            if result.is_error:
                continue
            if result.call.name == "search":
                for doc_id in result_doc_ids(result.content):
                    if doc_id in needed and doc_id not in found:
                        found.add(doc_id)
                        credit += self.search_credit
            elif result.call.name == "ask" and facts:
                reply = f" {normalize_answer(result.content)} "
                for fact in facts:
                    if fact not in found_facts and f" {fact} " in reply:
                        found_facts.add(fact)
                        credit += self.fact_credit
        return credit

    # ---- solver ----

    def solve(self, task: Task) -> list[Message]:
        """For each hop: search for the current entity's name, ask its document the relation's
        focused question, and go on with the entity that fact names (taken from the task's
        metadata); finally answer with the last entity's name. Raises SolverUnavailableError for
        questions-file tasks."""
        metadata = task.metadata
        if metadata.get("family") == QUESTIONS_FILE_FAMILY or "relations" not in metadata:
            raise SolverUnavailableError(
                f"task {task.id} comes from a questions file, which names the supporting "
                "documents but not the hops and questions that lead from one to the next, so "
                "no demonstration can be built; use the generated corpus for demonstrations"
            )
        tools = self.bind_tools(task)
        messages = self.initial_messages(task)
        relations: list[str] = metadata["relations"]
        for hop, relation in enumerate(relations):
            name, doc_id = metadata["entities"][hop], metadata["doc_ids"][hop]
            found = tools["search"](name)
            if doc_id not in result_doc_ids(found):
                raise SolverFailedError(
                    f"task {task.id}: searching {name!r} does not list document {doc_id}"
                )
            messages += _tool_turn("search", {"query": name}, found)
            focused = RELATION_QUESTIONS[relation].question.format(subject=name)
            answer = tools["ask"](doc_id, focused)
            messages += _tool_turn("ask", {"doc_id": doc_id, "question": focused}, answer)
        messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
        return messages


def _tool_turn(name: str, arguments: dict[str, str], result: str) -> list[Message]:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": result},
    ]
