"""The search environment: generated linked corpus, BM25 search, the `ask` sub-agent readers,
JSONL corpora and questions, rewards and the solver's demonstrations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import skillswarm.agent.search_corpus as search_corpus
from skillswarm.agent.chat_backends import ChatBackend, ChatMessage
from skillswarm.agent.envs import get_environment
from skillswarm.agent.envs.base import InvalidSplitError, Task
from skillswarm.agent.envs.search import (
    DEFAULT_TRAIN_WORLDS,
    RELATION_QUESTIONS,
    ChatReader,
    ExtractiveReader,
    SearchEnvironment,
    SolverUnavailableError,
    compose_question,
    normalize_answer,
    result_doc_ids,
)
from skillswarm.agent.model import TEMPLATE_FIXED_STRINGS, build_tokenizer
from skillswarm.agent.search_corpus import (
    LINK_RELATIONS,
    Corpus,
    CorpusFormatError,
    Document,
    LinkedCorpus,
    generate_linked_corpus,
    load_jsonl_corpus,
    load_jsonl_questions,
)
from skillswarm.agent.tools import (
    TOOL_ERROR_PREFIX,
    ToolCall,
    ToolResult,
    execute_tool_call,
    parse_tool_calls,
)
from transformers import PreTrainedTokenizerFast
from transformers.utils import get_json_schema


@pytest.fixture(scope="module")
def env() -> SearchEnvironment:
    environment = get_environment("search")
    assert isinstance(environment, SearchEnvironment)
    return environment


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(TEMPLATE_FIXED_STRINGS)


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


SMALL_CORPUS_ROWS = [
    {"id": "ada", "title": "Ada Lovelace", "text": "Ada Lovelace was a mathematician. She wrote "
     "the first published program. Her father was Lord Byron."},
    {"id": "byron", "title": "Lord Byron", "text": "Lord Byron was a poet.\nHe died in Greece."},
    {"id": "greece", "title": "Greece", "text": "Greece is a country. Its capital is Athens."},
]  # fmt: skip


def _search_call(query: str) -> ToolCall:
    return ToolCall(raw="", name="search", arguments={"query": query})


# ---- the solver's demonstrations -------------------------------------------------------------


def _replay(
    env: SearchEnvironment, task: Task, tokenizer: PreTrainedTokenizerFast
) -> Iterator[tuple[list[ToolResult], list[dict], str]]:
    """For each assistant turn of the demonstration: the results of running its tool calls as
    parsed from the chat-template rendering, the demonstration's tool messages, and the text."""
    messages = env.solve(task)
    tools = env.bind_tools(task)
    position = 2
    while position < len(messages):
        message = messages[position]
        assert message["role"] == "assistant"
        text = tokenizer.apply_chat_template([message], tokenize=False)
        calls = parse_tool_calls(text)
        results = [execute_tool_call(call, tools) for call in calls]
        expected = messages[position + 1 : position + 1 + len(results)]
        yield results, expected, text
        position += 1 + len(results)


def test_solver_trajectories_score_full_reward_on_heldout(
    env: SearchEnvironment, tokenizer: PreTrainedTokenizerFast
) -> None:
    tasks = env.tasks("heldout", 240)
    solved = 0
    for task in tasks:
        memory = env.new_episode_memory(task)
        turn_credit = 0.0
        tool_turns = 0
        final_text = ""
        for results, expected, text in _replay(env, task, tokenizer):
            if not results:
                final_text = text
                break
            tool_turns += 1
            assert [
                {"role": "tool", "name": r.call.name, "content": r.content} for r in results
            ] == (expected)
            assert not any(result.is_error for result in results)
            turn_credit += env.turn_reward(task, results, memory)
            if results[0].call.name == "ask":
                # the reader's sentence names the entity the next step goes on with
                hop = (tool_turns - 1) // 2
                assert task.metadata["entities"][hop + 1] in results[0].content
        hops = len(task.metadata["relations"])
        assert tool_turns == 2 * hops
        assert turn_credit == pytest.approx((env.search_credit + env.fact_credit) * hops)
        solved += env.reward(task, env.final_answer(final_text)) == 1.0
    assert solved >= 0.99 * len(tasks)


def test_default_tasks_mix_one_and_two_hops_in_equal_shares(env: SearchEnvironment) -> None:
    assert env.hop_counts == (1, 2)
    assert env.max_turns == 2 * 2 + 3
    for split in ("train", "heldout"):
        tasks = env.tasks(split, 200, seed=3)
        counts = {h: sum(len(t.metadata["relations"]) == h for t in tasks) for h in (1, 2)}
        assert counts[1] + counts[2] == 200
        assert 70 <= counts[1] <= 130, counts
        for task in tasks:  # the question's shape matches its hop count
            relations = task.metadata["relations"]
            assert task.prompt == compose_question(relations, task.metadata["entities"][0])
    # one-hop questions are asked of every relation, and the same seed gives the same tasks
    one_hop = {
        t.metadata["family"] for t in env.tasks("train", 300) if ">" not in t.metadata["family"]
    }
    assert one_hop == set(RELATION_QUESTIONS)
    assert [t.id for t in env.tasks("train", 50, seed=9)] == [
        t.id for t in SearchEnvironment().tasks("train", 50, seed=9)
    ]


def test_a_single_hop_count_keeps_its_task_order() -> None:
    """`hops=2` and `hops=(2,)` are the same environment, drawing the same tasks."""
    two = SearchEnvironment(hops=2)
    assert two.hop_counts == (2,) and two.max_turns == 7
    assert [t.id for t in two.tasks("heldout", 40, seed=1)] == [
        t.id for t in SearchEnvironment(hops=(2,)).tasks("heldout", 40, seed=1)
    ]
    assert all(len(t.metadata["relations"]) == 2 for t in two.tasks("heldout", 40, seed=1))


@pytest.mark.parametrize("hops", [1, 3])
def test_other_hop_counts_are_solved(hops: int, tokenizer: PreTrainedTokenizerFast) -> None:
    env = SearchEnvironment(hops=hops)
    assert env.max_turns >= 2 * hops + 1
    for task in env.tasks("heldout", 30, seed=2):
        assert len(task.metadata["relations"]) == hops
        turns = list(_replay(env, task, tokenizer))
        assert len(turns) == 2 * hops + 1
        for results, expected, _ in turns[:-1]:
            assert [result.content for result in results] == [m["content"] for m in expected]
        assert env.reward(task, env.final_answer(turns[-1][2])) == 1.0


def test_solver_uses_the_configured_readers_output() -> None:
    reader = ChatReader(RecordingBackend(reply="  Orlu Vance  "))
    env = SearchEnvironment(reader=reader)
    task = env.tasks("train", 1)[0]
    asks = [m for m in env.solve(task) if m["role"] == "tool" and m["name"] == "ask"]
    assert [m["content"] for m in asks] == ["Orlu Vance"] * len(task.metadata["relations"])
    assert env.tool_timeout_s > 10.0


# ---- the generated corpus and search ---------------------------------------------------------


def test_search_finds_each_entitys_document_first(env: SearchEnvironment) -> None:
    corpus = env.corpus
    assert isinstance(corpus, LinkedCorpus)
    for entity in corpus.entities:
        hits = corpus.search(entity.name, 3)
        assert hits[0].doc_id == entity.entity_id, (entity.name, hits)
        assert all(hit.score > 0 for hit in hits)
    output = env.search(corpus.entities[0].name)
    assert result_doc_ids(output)[0] == corpus.entities[0].entity_id
    assert len(output.splitlines()) <= env.top_k


def test_queries_without_known_words_say_no_results(env: SearchEnvironment) -> None:
    for query in ("zzqx wvvq", "the of and", "?!"):
        output = env.search(query)
        assert output.startswith("No results for"), output
        assert result_doc_ids(output) == []
        assert env.corpus.search(query, 5) == []
    assert env.search("   ").startswith(TOOL_ERROR_PREFIX)
    assert env.search("x" * 400).startswith(TOOL_ERROR_PREFIX)
    with pytest.raises(ValueError, match="k must be"):
        env.corpus.search("anything", 0)


def test_generated_documents_state_linked_facts() -> None:
    corpus = generate_linked_corpus(5, n_people=40, n_cities=10, n_countries=3, n_companies=8)
    kinds = {entity.kind for entity in corpus.entities}
    assert kinds == {"person", "city", "country", "company"}
    names = [entity.name for entity in corpus.entities]
    assert len(set(names)) == len(names)
    for entity in corpus.entities:
        text = corpus.get(entity.entity_id).text  # type: ignore[union-attr]
        assert text.startswith(entity.name)
        for relation, target in entity.links.items():
            assert LINK_RELATIONS[relation].subject_kind == entity.kind
            assert corpus.entity(target).kind == LINK_RELATIONS[relation].object_kind
            assert corpus.entity(target).name in text
    capitals = [e for e in corpus.entities if e.kind == "country"]
    for country in capitals:
        assert corpus.entity(country.links["capital"]).links["country"] == country.entity_id
    with pytest.raises(ValueError, match="n_people"):
        generate_linked_corpus(0, n_people=5, n_cities=4, n_countries=2, n_companies=4)


def test_corpus_and_tasks_are_deterministic_and_splits_disjoint(env: SearchEnvironment) -> None:
    fresh = generate_linked_corpus.__wrapped__(0)
    assert fresh.documents == env.corpus.documents
    assert generate_linked_corpus(1).documents != env.corpus.documents
    train = env.tasks("train", 400, seed=0)
    assert env.tasks("train", 400, seed=0) == train
    assert env.tasks("train", 50, seed=1) != train[:50]
    assert len({task.prompt for task in train}) == 400
    heldout = env.tasks("heldout", 300, seed=0) + env.tasks("heldout", 300, seed=4)
    train += env.tasks("train", 400, seed=9)
    assert not {task.prompt for task in train} & {task.prompt for task in heldout}
    families = {task.metadata["family"] for task in train}
    assert len(families) >= 10
    assert len(env.tasks("train", 2000)) == 2000  # enough for the tokenizer corpus
    with pytest.raises(InvalidSplitError):
        env.tasks("test", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="yields"):
        env.tasks("heldout", 100_000)


def test_training_questions_are_asked_about_other_worlds(
    env: SearchEnvironment, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Training tasks come from the training worlds, each with tools bound to its own world, so
    their demonstrations replay with full reward; held-out tasks stay on the environment's
    corpus. No world repeats the held-out world's names beyond chance."""
    assert len(env.train_world_seeds) == DEFAULT_TRAIN_WORLDS
    train = env.tasks("train", 300, seed=4)
    seeds = {task.metadata["world_seed"] for task in train}
    assert seeds <= set(env.train_world_seeds) and len(seeds) >= DEFAULT_TRAIN_WORLDS // 2
    assert len({task.id for task in train}) == len(train)
    heldout_names = {entity.name for entity in env.corpus.entities}
    starts = [task.metadata["entities"][0] for task in train]
    assert sum(name in heldout_names for name in starts) <= 0.05 * len(starts)
    for task in train[:40]:
        world = env.world(task)
        assert world is not env.corpus
        first_doc = task.metadata["doc_ids"][0]
        assert world.get(first_doc).title == task.metadata["entities"][0]  # type: ignore[union-attr]
        found = env.bind_tools(task)["search"](task.metadata["entities"][0])
        assert first_doc in result_doc_ids(found)
        final_text = ""
        for results, expected, text in _replay(env, task, tokenizer):
            if not results:
                final_text = text
                break
            assert [
                {"role": "tool", "name": r.call.name, "content": r.content} for r in results
            ] == expected
        assert env.reward(task, env.final_answer(final_text)) == 1.0
    for task in env.tasks("heldout", 50, seed=4):
        assert "world_seed" not in task.metadata and env.world(task) is env.corpus
    # the bound tools keep the tools' names and documentation, which their schemas come from
    bound = env.bind_tools(train[0])
    assert [get_json_schema(bound[name]) for name in ("search", "ask")] == env.tool_schemas()


def test_train_worlds_zero_splits_the_environments_own_corpus() -> None:
    """`train_worlds=0` asks training questions about the corpus itself; a corpus passed in
    never has training worlds."""
    own = SearchEnvironment(train_worlds=0)
    assert own.train_world_seeds == ()
    train = own.tasks("train", 100, seed=2)
    names = {entity.name for entity in own.corpus.entities}
    assert all(task.metadata["entities"][0] in names for task in train)
    assert all(own.world(task) is own.corpus for task in train)
    assert SearchEnvironment(corpus=own.corpus).train_world_seeds == ()
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="train_worlds"):
            SearchEnvironment(train_worlds=bad)  # type: ignore[arg-type]
    foreign = Task(id="x", prompt="q", answer="a", metadata={"world_seed": 12345})
    with pytest.raises(ValueError, match="training worlds"):
        own.world(foreign)


def test_every_relation_has_a_question_and_composes() -> None:
    assert set(RELATION_QUESTIONS) == set(LINK_RELATIONS)
    assert (
        compose_question(["born_in", "country"], "Mira Talen")
        == "In which country is the city where Mira Talen was born?"
    )
    assert compose_question(["works_for", "founder"], "Mira Talen") == (
        "Who founded the company Mira Talen works for?"
    )


def test_concurrent_searches_build_one_index_and_agree() -> None:
    corpus = Corpus(generate_linked_corpus(0).documents)
    queries = [document.title for document in corpus.documents[:200]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda query: corpus.search(query, 3), queries))
    assert concurrent == [corpus.search(query, 3) for query in queries]
    assert [hits[0].doc_id for hits in concurrent] == [d.doc_id for d in corpus.documents[:200]]


# ---- JSONL corpora and questions ----------------------------------------------------------------


def test_jsonl_corpus_loads_and_searches(tmp_path: Path) -> None:
    corpus = load_jsonl_corpus(_write_jsonl(tmp_path / "corpus.jsonl", SMALL_CORPUS_ROWS))
    assert len(corpus) == 3 and "byron" in corpus
    assert corpus.get("greece") == Document("greece", "Greece", SMALL_CORPUS_ROWS[2]["text"])
    assert corpus.search("poet Byron", 10)[0].doc_id == "byron"
    assert corpus.search("capital Athens", 10)[0].snippet == "Greece is a country."


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "a", "title": "A", "text": "x."}', "{not json"], r":2: not valid JSON"),
        (['{"id": "a", "title": "A", "text": "x."}', '["a"]'], r":2: expected a JSON object"),
        (['{"id": "a", "title": "A"}'], r":1: field 'text' must be a non-empty string"),
        (['{"id": "a b", "title": "A", "text": "x."}'], r":1: document id 'a b' is invalid"),
        (
            [
                '{"id": "a", "title": "A", "text": "x."}',
                "",
                '{"id": "a", "title": "B", "text": "y."}',
            ],
            r":3: duplicate document id 'a' \(first on line 1\)",
        ),
        ([""], r"holds no documents"),
    ],
)
def test_jsonl_corpus_errors_name_the_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CorpusFormatError, match=message):
        load_jsonl_corpus(path)


def test_jsonl_lines_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(search_corpus, "MAX_JSONL_LINE_BYTES", 100)
    rows = [
        {"id": "a", "title": "A", "text": "short."},
        {"id": "b", "title": "B", "text": "x" * 200},
    ]
    with pytest.raises(CorpusFormatError, match=r":2: line longer than 100 bytes"):
        load_jsonl_corpus(_write_jsonl(tmp_path / "long.jsonl", rows))
    (tmp_path / "binary.jsonl").write_bytes(b'{"id": "a", "title": "\xff", "text": "x"}\n')
    with pytest.raises(CorpusFormatError, match=r":1: not UTF-8"):
        load_jsonl_corpus(tmp_path / "binary.jsonl")
    with pytest.raises(CorpusFormatError, match="cannot read"):
        load_jsonl_corpus(tmp_path / "missing.jsonl")


def test_corpus_refuses_duplicate_and_malformed_documents() -> None:
    with pytest.raises(CorpusFormatError, match="duplicate document id 'a'"):
        Corpus([Document("a", "A", "x."), Document("a", "B", "y.")])
    with pytest.raises(CorpusFormatError, match="non-empty title"):
        Corpus([Document("a", " ", "x.")])
    with pytest.raises(CorpusFormatError, match="at least one document"):
        Corpus([])


def _questions_rows(count: int) -> list[dict]:
    return [
        {
            "question": f"Who was the father of Ada Lovelace, question {i}?",
            "answer": "Lord Byron",
            "supporting_doc_ids": ["ada", "byron"],
        }
        for i in range(count)
    ]


def test_questions_file_tasks_have_rewards_but_no_solver(tmp_path: Path) -> None:
    corpus_file = _write_jsonl(tmp_path / "corpus.jsonl", SMALL_CORPUS_ROWS)
    questions_file = _write_jsonl(tmp_path / "questions.jsonl", _questions_rows(40))
    env = get_environment("search", corpus_file=corpus_file, questions_file=questions_file)
    train, heldout = env.tasks("train", 20), env.tasks("heldout", 3)
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    task = train[0]
    assert task.metadata["needed_doc_ids"] == ["ada", "byron"]
    assert env.reward(task, "lord byron.") == 1.0
    assert env.ask("ada", "Who was her father?") == "Her father was Lord Byron."
    with pytest.raises(SolverUnavailableError, match="questions file"):
        env.solve(task)
    with pytest.raises(ValueError, match="questions"):
        env.tasks("train", 1000)

    bad = _write_jsonl(tmp_path / "bad.jsonl", [*_questions_rows(1), {"question": "Q?",
                       "answer": "A", "supporting_doc_ids": ["ada", "nowhere"]}])  # fmt: skip
    with pytest.raises(CorpusFormatError, match=r":2: supporting documents not in the corpus"):
        load_jsonl_questions(bad, env.corpus)
    with pytest.raises(ValueError, match="questions_file"):
        SearchEnvironment(corpus_file=corpus_file)
    with pytest.raises(ValueError, match="not both"):
        SearchEnvironment(corpus=env.corpus, corpus_file=corpus_file)
    for hops in (4, 0, (), (1, 4), (True,), (1.5,)):
        with pytest.raises(ValueError, match="hops must be from 1 to 3"):
            SearchEnvironment(hops=hops)  # type: ignore[arg-type]


# ---- rewards and tools -------------------------------------------------------------------------


def test_reward_normalizes_case_space_punctuation_and_article(env: SearchEnvironment) -> None:
    task = Task(id="t", prompt="Where?", answer="Velda Labs")
    for given in ("Velda Labs", "  velda   labs ", "VELDA LABS.", "The Velda Labs", "velda-labs"):
        assert env.reward(task, given) == 1.0, given
    for given in ("Velda", "Velda Labs Inc", "", None):
        assert env.reward(task, given) == 0.0, given
    assert normalize_answer("  The  Oskar, City! ") == "oskar city"
    assert env.reward(task, env.final_answer("so <answer>the velda labs</answer>")) == 1.0


def test_turn_reward_credits_each_needed_document_once(env: SearchEnvironment) -> None:
    task = env.tasks("heldout", 1)[0]
    first, second = task.metadata["entities"][:2]
    memory = env.new_episode_memory(task)
    tools = env.bind_tools(task)

    def search(query: str) -> list[ToolResult]:
        return [execute_tool_call(_search_call(query), tools)]

    assert env.turn_reward(task, search("zzqx"), memory) == 0.0
    assert env.turn_reward(task, search(first), memory) == pytest.approx(env.search_credit)
    assert env.turn_reward(task, search(first), memory) == 0.0
    ask = ToolCall(raw="", name="ask", arguments={"doc_id": task.metadata["doc_ids"][1],
                                                  "question": "zzqx?"})  # fmt: skip
    assert env.turn_reward(task, [execute_tool_call(ask, tools)], memory) == 0.0
    both = search(first) + search(second)
    assert env.turn_reward(task, both, memory) == pytest.approx(env.search_credit)
    assert env.turn_reward(task, search(second), memory) == 0.0
    assert memory["found_doc_ids"] == set(task.metadata["needed_doc_ids"])
    fresh = env.new_episode_memory(task)
    assert env.turn_reward(task, both, fresh) == pytest.approx(2 * env.search_credit)


def test_turn_reward_credits_each_fact_on_the_path_once(env: SearchEnvironment) -> None:
    task = next(t for t in env.tasks("heldout", 50) if len(t.metadata["relations"]) == 2)
    start_id, middle_id = task.metadata["doc_ids"][:2]
    path = set(task.metadata["entities"])
    tools = env.bind_tools(task)
    memory = env.new_episode_memory(task)

    def ask(doc_id: str, relation: str) -> list[ToolResult]:
        question = RELATION_QUESTIONS[relation].question.format(subject="it")
        call = ToolCall(raw="", name="ask", arguments={"doc_id": doc_id, "question": question})
        return [execute_tool_call(call, tools)]

    start = env.world(task).entity(start_id)
    off_path = next(
        relation
        for relation, target in start.links.items()
        if env.world(task).entity(target).name not in path
    )
    assert env.turn_reward(task, ask(start_id, off_path), memory) == 0.0
    first, second = task.metadata["relations"]
    assert env.turn_reward(task, ask(start_id, first), memory) == pytest.approx(env.fact_credit)
    assert env.turn_reward(task, ask(start_id, first), memory) == 0.0
    assert env.turn_reward(task, ask(middle_id, second), memory) == pytest.approx(env.fact_credit)
    assert memory["found_facts"] == {normalize_answer(n) for n in task.metadata["entities"][1:]}
    no_credit = SearchEnvironment(fact_credit=0.0)
    assert (
        no_credit.turn_reward(task, ask(start_id, first), no_credit.new_episode_memory(task)) == 0
    )
    with pytest.raises(ValueError, match="must not be negative"):
        SearchEnvironment(fact_credit=-0.1)


def test_unknown_doc_id_is_a_tool_error(env: SearchEnvironment) -> None:
    tools = env.bind_tools(env.tasks("train", 1)[0])
    call = ToolCall(raw="", name="ask", arguments={"doc_id": "p99999", "question": "Who?"})
    result = execute_tool_call(call, tools)
    assert result.is_error
    assert result.content.startswith(TOOL_ERROR_PREFIX + "unknown doc_id 'p99999'")
    assert env.ask("p1", "  ").startswith(TOOL_ERROR_PREFIX)


def test_tool_schemas_describe_search_and_ask(env: SearchEnvironment) -> None:
    schemas = {schema["function"]["name"]: schema["function"] for schema in env.tool_schemas()}
    assert set(schemas) == {"search", "ask"}
    assert schemas["search"]["parameters"]["required"] == ["query"]
    assert schemas["ask"]["parameters"]["required"] == ["doc_id", "question"]
    assert "search results" in schemas["ask"]["parameters"]["properties"]["doc_id"]["description"]


# ---- readers ----------------------------------------------------------------------------------


def test_extractive_reader_returns_the_matching_sentence() -> None:
    reader = ExtractiveReader()
    document = Document("ada", "Ada Lovelace", SMALL_CORPUS_ROWS[0]["text"])
    assert reader.answer(document, "Who was Ada Lovelace's father?") == "Her father was Lord Byron."
    assert (
        reader.answer(document, "Which program did she write?")
        == "She wrote the first published program."
    )
    assert (
        reader.answer(document, "Tell me about Ada Lovelace") == "Ada Lovelace was a mathematician."
    )
    assert reader.answer(document, "zebra?") == ExtractiveReader.NO_MATCH


class RaisingBackend:
    """A chat backend whose every call fails, like an unreachable endpoint."""

    def __init__(self) -> None:
        self.calls = 0

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        self.calls += 1
        raise ConnectionError("endpoint unreachable")


class RecordingBackend:
    """A chat backend that returns a fixed reply and records what it was sent (stands in for a
    model only to check the prompt and the plumbing)."""

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.sent: list[tuple[list[ChatMessage], int, float]] = []

    def complete(
        self, messages: list[ChatMessage], *, max_tokens: int = 256, temperature: float = 0.0
    ) -> str:
        self.sent.append((messages, max_tokens, temperature))
        return self.reply


def test_chat_reader_falls_back_to_extractive_when_the_backend_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    document = Document("ada", "Ada Lovelace", SMALL_CORPUS_ROWS[0]["text"])
    question = "Who was Ada Lovelace's father?"
    backend = RaisingBackend()
    assert isinstance(backend, ChatBackend)
    with caplog.at_level("WARNING", logger="skillswarm.agent.envs.search"):
        assert ChatReader(backend).answer(document, question) == "Her father was Lord Byron."
    assert backend.calls == 1
    assert "endpoint unreachable" in caplog.text
    for empty_reply in ("", "   ", "<think>still thinking", "<think>done</think>  "):
        reader = ChatReader(RecordingBackend(empty_reply))
        assert reader.answer(document, question) == "Her father was Lord Byron."


def test_chat_reader_sends_document_and_question() -> None:
    backend = RecordingBackend("<think>her father</think>Lord Byron")
    reader = ChatReader(backend, max_tokens=32)
    document = Document("ada", "Ada Lovelace", SMALL_CORPUS_ROWS[0]["text"])
    assert reader.answer(document, "Who was her father?") == "Lord Byron"
    ((messages, max_tokens, temperature),) = backend.sent
    assert (max_tokens, temperature) == (32, 0.0)
    assert document.text in messages[-1]["content"]
    assert "Who was her father?" in messages[-1]["content"]
