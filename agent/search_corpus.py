"""Document collections for the search domain: documents, a BM25 index over them, a JSONL loader
for corpora and question sets, and a seeded generator of linked made-up facts (people, cities,
countries, companies) whose questions cannot be answered from prior knowledge.
"""

from __future__ import annotations

import functools
import json
import random
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import bm25s
from bm25s.stopwords import STOPWORDS_EN

MAX_JSONL_LINE_BYTES = 1_000_000
MAX_TITLE_CHARS = 300
DEFAULT_SNIPPET_CHARS = 80
DOC_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/#-]{0,127}")
_SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+|\n+")
_BM25_STOPWORDS = "en"  # bm25s's list, STOPWORDS_EN


class CorpusFormatError(ValueError):
    """A corpus or question file (or a document handed to `Corpus`) that cannot be used."""


@dataclass(frozen=True)
class Document:
    """One document: a stable id the model copies into tool calls, a one-line title, the text."""

    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class SearchHit:
    """One search result: the document's id and title, a short snippet and its BM25 score."""

    doc_id: str
    title: str
    snippet: str
    score: float


@dataclass(frozen=True)
class Question:
    """A question over a corpus with its reference answer and the documents that support it."""

    question: str
    answer: str
    supporting_doc_ids: tuple[str, ...]


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` (split after . ! ? and at line breaks), whitespace collapsed."""
    pieces = (" ".join(piece.split()) for piece in _SENTENCE_BOUNDARY.split(text))
    return [piece for piece in pieces if piece]


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _check_document(document: Document) -> None:
    if not isinstance(document.doc_id, str) or not DOC_ID_PATTERN.fullmatch(document.doc_id):
        raise CorpusFormatError(
            f"document id {str(document.doc_id)[:80]!r} is invalid: use 1-128 letters, digits "
            "or _ . : / # - (starting with a letter or digit)"
        )
    if not isinstance(document.title, str) or not document.title.strip():
        raise CorpusFormatError(f"document {document.doc_id} needs a non-empty title")
    if "\n" in document.title or len(document.title) > MAX_TITLE_CHARS:
        raise CorpusFormatError(
            f"document {document.doc_id}: the title must be one line of at most "
            f"{MAX_TITLE_CHARS} characters"
        )
    if not isinstance(document.text, str) or not document.text.strip():
        raise CorpusFormatError(f"document {document.doc_id} needs a non-empty text")


class Corpus:
    """An immutable document collection with lookup by id and BM25 search.

    The index is built on the first search, once, under a lock; searches after that only read it
    and may run from many threads at once.
    """

    def __init__(
        self, documents: Iterable[Document], *, snippet_chars: int = DEFAULT_SNIPPET_CHARS
    ) -> None:
        if snippet_chars < 10:
            raise ValueError(f"snippet_chars must be at least 10, got {snippet_chars}")
        self._documents = tuple(documents)
        if not self._documents:
            raise CorpusFormatError("a corpus needs at least one document")
        self._by_id: dict[str, Document] = {}
        for document in self._documents:
            _check_document(document)
            if document.doc_id in self._by_id:
                raise CorpusFormatError(f"duplicate document id {document.doc_id!r}")
            self._by_id[document.doc_id] = document
        self._snippet_chars = snippet_chars
        self._index: tuple[bm25s.BM25, frozenset[str]] | None = None
        self._index_lock = threading.Lock()

    @property
    def documents(self) -> tuple[Document, ...]:
        """All documents, in the order given."""
        return self._documents

    @property
    def snippet_chars(self) -> int:
        """The longest snippet a search hit carries."""
        return self._snippet_chars

    def __len__(self) -> int:
        return len(self._documents)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._by_id

    def get(self, doc_id: str) -> Document | None:
        """The document with `doc_id`, or None when there is none."""
        return self._by_id.get(doc_id)

    def snippet(self, document: Document) -> str:
        """A short preview of `document`: its first sentence, cut to `snippet_chars`."""
        sentences = split_sentences(document.text)
        return _shorten(sentences[0] if sentences else "", self.snippet_chars)

    def _ensure_index(self) -> tuple[bm25s.BM25, frozenset[str]]:
        index = self._index
        if index is None:
            with self._index_lock:
                if self._index is None:
                    texts = [f"{document.title}\n{document.text}" for document in self._documents]
                    tokens = bm25s.tokenize(texts, stopwords=_BM25_STOPWORDS, show_progress=False)
                    retriever = bm25s.BM25()
                    retriever.index(tokens, show_progress=False)
                    self._index = (retriever, frozenset(tokens.vocab))
                index = self._index
        return index

    def search(self, query: str, k: int) -> list[SearchHit]:
        """The best `k` documents for `query` by BM25, best first; documents that share no word
        with the query are never returned (so a query of unknown words gives an empty list)."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        retriever, vocabulary = self._ensure_index()
        (query_tokens,) = bm25s.tokenize(
            [query], stopwords=_BM25_STOPWORDS, return_ids=False, show_progress=False
        )
        known_tokens = [token for token in query_tokens if token in vocabulary]
        if not known_tokens:
            return []
        indices, scores = retriever.retrieve(
            [known_tokens], k=min(k, len(self._documents)), show_progress=False, n_threads=0
        )
        hits: list[SearchHit] = []
        for position, score in zip(indices[0], scores[0], strict=True):
            if float(score) <= 0.0:
                continue
            document = self._documents[int(position)]
            hits.append(
                SearchHit(document.doc_id, document.title, self.snippet(document), float(score))
            )
        return hits


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, JSON object) for each non-blank line; bad lines raise CorpusFormatError."""
    try:
        handle: IO[bytes] = path.open("rb")
    except OSError as error:
        raise CorpusFormatError(f"cannot read {path}: {error.strerror or error}") from error
    with handle:
        line_number = 0
        while True:
            raw = handle.readline(MAX_JSONL_LINE_BYTES + 1)
            if not raw:
                return
            line_number += 1
            if len(raw) > MAX_JSONL_LINE_BYTES:
                raise CorpusFormatError(
                    f"{path}:{line_number}: line longer than {MAX_JSONL_LINE_BYTES} bytes"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusFormatError(f"{path}:{line_number}: not UTF-8 ({error})") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusFormatError(
                    f"{path}:{line_number}: not valid JSON ({error.msg} at column {error.colno})"
                ) from error
            if not isinstance(record, dict):
                raise CorpusFormatError(f"{path}:{line_number}: expected a JSON object")
            yield line_number, record


def _string_field(record: dict[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise CorpusFormatError(f"{where}: field {name!r} must be a non-empty string")
    return value


def load_jsonl_corpus(path: Path | str, *, snippet_chars: int = DEFAULT_SNIPPET_CHARS) -> Corpus:
    """Read a corpus from JSONL, one document a line with string fields `id`, `title`, `text`.
    Raises CorpusFormatError naming the file and line of the first bad or duplicate entry."""
    path = Path(path)
    documents: list[Document] = []
    first_line_of: dict[str, int] = {}
    for line_number, record in _jsonl_records(path):
        where = f"{path}:{line_number}"
        doc_id = _string_field(record, "id", where).strip()
        title = " ".join(_string_field(record, "title", where).split())
        text = _string_field(record, "text", where)
        if doc_id in first_line_of:
            raise CorpusFormatError(
                f"{where}: duplicate document id {doc_id!r} (first on line {first_line_of[doc_id]})"
            )
        document = Document(doc_id, title, text)
        try:
            _check_document(document)
        except CorpusFormatError as error:
            raise CorpusFormatError(f"{where}: {error}") from error
        first_line_of[doc_id] = line_number
        documents.append(document)
    if not documents:
        raise CorpusFormatError(f"{path} holds no documents")
    return Corpus(documents, snippet_chars=snippet_chars)


def load_jsonl_questions(path: Path | str, corpus: Corpus | None = None) -> list[Question]:
    """Read questions from JSONL: `question` and `answer` strings and `supporting_doc_ids`, a
    list of document ids (each must be in `corpus` when one is given). Raises CorpusFormatError
    naming the file and line of the first bad entry."""
    path = Path(path)
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for line_number, record in _jsonl_records(path):
        where = f"{path}:{line_number}"
        text = " ".join(_string_field(record, "question", where).split())
        answer = _string_field(record, "answer", where).strip()
        supporting = record.get("supporting_doc_ids")
        if not isinstance(supporting, list) or not all(
            isinstance(doc_id, str) and doc_id for doc_id in supporting
        ):
            raise CorpusFormatError(
                f"{where}: field 'supporting_doc_ids' must be a list of document id strings"
            )
        if corpus is not None:
            missing = [doc_id for doc_id in supporting if doc_id not in corpus]
            if missing:
                raise CorpusFormatError(
                    f"{where}: supporting documents not in the corpus: {missing}"
                )
        if text in seen:
            raise CorpusFormatError(f"{where}: duplicate question (first on line {seen[text]})")
        seen[text] = line_number
        questions.append(Question(text, answer, tuple(supporting)))
    if not questions:
        raise CorpusFormatError(f"{path} holds no questions")
    return questions


# ---- generated corpus of linked facts ----------------------------------------------------------


@dataclass(frozen=True)
class LinkRelation:
    """A fact linking a subject entity to an object entity, and the sentence that states it in
    the subject's document (`{pronoun}` is the subject's pronoun, `{object}` the object's name)."""

    name: str
    subject_kind: str
    object_kind: str
    sentence: str


LINK_RELATIONS: dict[str, LinkRelation] = {
    relation.name: relation
    for relation in (
        LinkRelation("born_in", "person", "city", "{pronoun} was born in {object}."),
        LinkRelation("works_for", "person", "company", "{pronoun} works for {object}."),
        LinkRelation("country", "city", "country", "It is in the country of {object}."),
        LinkRelation("mayor", "city", "person", "Its mayor is {object}."),
        LinkRelation("capital", "country", "city", "Its capital is {object}."),
        LinkRelation("founder", "company", "person", "It was founded by {object}."),
        LinkRelation("based_in", "company", "city", "It is based in {object}."),
    )
}

ENTITY_KINDS: tuple[str, ...] = ("person", "city", "country", "company")

OCCUPATIONS = (
    "baker", "painter", "pilot", "teacher", "nurse", "carpenter", "chemist", "farmer", "poet",
    "tailor", "engineer", "sailor", "doctor", "singer", "potter", "lawyer",
)  # fmt: skip
CITY_FEATURES = (
    "on the coast", "in the hills", "on a river", "near a lake", "in a valley", "on a plateau",
    "by a forest", "in the desert",
)  # fmt: skip
COUNTRY_REGIONS = (
    "in the north", "in the south", "in the east", "in the west", "on an island", "by the sea",
    "in the mountains", "on the plains",
)  # fmt: skip
INDUSTRIES: tuple[tuple[str, str], ...] = (
    ("food", "Foods"), ("software", "Systems"), ("shipping", "Lines"), ("mining", "Mining"),
    ("textile", "Textiles"), ("toy", "Toys"), ("energy", "Power"), ("media", "Media"),
    ("research", "Labs"), ("car", "Motors"), ("glass", "Glassworks"), ("paper", "Mills"),
)  # fmt: skip
CITY_SUFFIXES = ("", "", "", "ton", "vik", "holm", "ford")
COUNTRY_SUFFIXES = ("land", "ia", "mark", "ora", "stan")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("n", "l", "r", "s")


def _template_words() -> frozenset[str]:
    """Every word the document templates use: generated names must differ from all of them."""
    texts = [relation.sentence for relation in LINK_RELATIONS.values()]
    texts += [*OCCUPATIONS, *CITY_FEATURES, *COUNTRY_REGIONS, *CITY_SUFFIXES, *COUNTRY_SUFFIXES]
    texts += [word for pair in INDUSTRIES for word in pair]
    texts += ["is a city", "is a country", "company", "she he it its the of", *STOPWORDS_EN]
    return frozenset(re.findall(r"[a-z]+", " ".join(texts).lower()))


@dataclass(frozen=True)
class LinkedEntity:
    """An entity of the generated world: its document id, kind, name, pronoun and links
    (relation name -> the linked entity's id)."""

    entity_id: str
    kind: str
    name: str
    pronoun: str = "It"
    links: dict[str, str] = field(default_factory=dict)


class LinkedCorpus(Corpus):
    """A generated corpus that also knows the facts behind its documents (one entity a
    document, the entity id being the document id), so questions and solutions can be made."""

    def __init__(
        self,
        documents: Iterable[Document],
        entities: Sequence[LinkedEntity],
        *,
        snippet_chars: int = DEFAULT_SNIPPET_CHARS,
    ) -> None:
        super().__init__(documents, snippet_chars=snippet_chars)
        self._entities = tuple(entities)
        self._entity_by_id = {entity.entity_id: entity for entity in self._entities}
        for entity in self._entities:
            if entity.entity_id not in self:
                raise CorpusFormatError(f"entity {entity.entity_id} has no document")
            for relation_name, target in entity.links.items():
                if relation_name not in LINK_RELATIONS or target not in self._entity_by_id:
                    raise CorpusFormatError(
                        f"entity {entity.entity_id}: bad link {relation_name} -> {target}"
                    )

    @property
    def entities(self) -> tuple[LinkedEntity, ...]:
        """All entities, in document order."""
        return self._entities

    def entity(self, entity_id: str) -> LinkedEntity:
        """The entity with `entity_id` (KeyError when there is none)."""
        return self._entity_by_id[entity_id]


class _NameMaker:
    """Pronounceable made-up words, each used once in a corpus."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._used: set[str] = set(_template_words())

    def _syllable(self) -> str:
        coda = self._rng.choice(_CODAS) if self._rng.random() < 0.25 else ""
        return self._rng.choice(_ONSETS) + self._rng.choice(_VOWELS) + coda

    def word(self, suffix: str = "") -> str:
        for _ in range(10_000):
            stem = self._syllable() + self._syllable()
            if stem[-1] in _VOWELS and self._rng.random() < 0.3:
                stem += self._rng.choice(_CODAS)
            candidate = (stem + suffix).lower()
            if candidate not in self._used:
                self._used.add(candidate)
                return candidate.capitalize()
        raise RuntimeError("ran out of distinct made-up names; generate a smaller corpus")


def _entity_document(
    entity: LinkedEntity, names: dict[str, str], descriptor: str, rng: random.Random
) -> Document:
    facts = [
        LINK_RELATIONS[relation].sentence.format(pronoun=entity.pronoun, object=names[target])
        for relation, target in entity.links.items()
    ]
    rng.shuffle(facts)
    return Document(entity.entity_id, entity.name, " ".join([descriptor, *facts]))


@functools.lru_cache(maxsize=4)
def generate_linked_corpus(
    seed: int = 0,
    n_people: int = 1000,
    n_cities: int = 150,
    n_countries: int = 20,
    n_companies: int = 150,
    *,
    snippet_chars: int = DEFAULT_SNIPPET_CHARS,
) -> LinkedCorpus:
    """A world of made-up people, cities, countries and companies whose documents state linked
    facts ("Mira Talen ... was born in Dovra." / "Dovra ... is in the country of Brenland.").

    Every name is a distinct made-up word, so no question is answerable from prior knowledge and
    a search for a name finds its documents. The same arguments give the same corpus (the result
    is cached and shared; corpora are immutable)."""
    if min(n_people, n_cities, n_countries, n_companies) < 1:
        raise ValueError("every entity count must be at least 1")
    if n_cities < n_countries:
        raise ValueError("n_cities must be at least n_countries: every country needs a capital")
    if n_people < n_cities + n_companies:
        raise ValueError(
            "n_people must be at least n_cities + n_companies: mayors and founders are distinct"
        )
    rng = random.Random(f"search-corpus/{seed}/{n_people}/{n_cities}/{n_countries}/{n_companies}")
    name_maker = _NameMaker(rng)
    person_ids = [f"p{i}" for i in range(1, n_people + 1)]
    city_ids = [f"c{i}" for i in range(1, n_cities + 1)]
    country_ids = [f"n{i}" for i in range(1, n_countries + 1)]
    company_ids = [f"f{i}" for i in range(1, n_companies + 1)]
    industries = {company: rng.choice(INDUSTRIES) for company in company_ids}
    names: dict[str, str] = {}
    for person in person_ids:
        names[person] = f"{name_maker.word()} {name_maker.word()}"
    for city in city_ids:
        names[city] = name_maker.word(rng.choice(CITY_SUFFIXES))
    for country in country_ids:
        names[country] = name_maker.word(rng.choice(COUNTRY_SUFFIXES))
    for company in company_ids:
        names[company] = f"{name_maker.word()} {industries[company][1]}"

    country_of = {
        city: country_ids[i] if i < n_countries else rng.choice(country_ids)
        for i, city in enumerate(city_ids)
    }
    cities_in = {
        country: [c for c in city_ids if country_of[c] == country] for country in country_ids
    }
    officials = rng.sample(person_ids, n_cities + n_companies)
    mayor_of = dict(zip(city_ids, officials[:n_cities], strict=True))
    founder_of = dict(zip(company_ids, officials[n_cities:], strict=True))

    entities: list[LinkedEntity] = []
    documents: list[Document] = []

    def add(entity: LinkedEntity, descriptor: str) -> None:
        entities.append(entity)
        documents.append(_entity_document(entity, names, descriptor, rng))

    for person in person_ids:
        links = {"born_in": rng.choice(city_ids), "works_for": rng.choice(company_ids)}
        entity = LinkedEntity(person, "person", names[person], rng.choice(("She", "He")), links)
        add(entity, f"{names[person]} is a {rng.choice(OCCUPATIONS)}.")
    for city in city_ids:
        links = {"country": country_of[city], "mayor": mayor_of[city]}
        add(
            LinkedEntity(city, "city", names[city], "It", links),
            f"{names[city]} is a city {rng.choice(CITY_FEATURES)}.",
        )
    for country in country_ids:
        links = {"capital": rng.choice(cities_in[country])}
        add(
            LinkedEntity(country, "country", names[country], "It", links),
            f"{names[country]} is a country {rng.choice(COUNTRY_REGIONS)}.",
        )
    for company in company_ids:
        links = {"founder": founder_of[company], "based_in": rng.choice(city_ids)}
        add(
            LinkedEntity(company, "company", names[company], "It", links),
            f"{names[company]} is a {industries[company][0]} company.",
        )
    return LinkedCorpus(documents, entities, snippet_chars=snippet_chars)
