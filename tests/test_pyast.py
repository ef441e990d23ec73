"""agent.pyast: the parser called from many threads while garbage collections run finalizers."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from skillswarm.agent import pyast

pytestmark = pytest.mark.timeout(120)

SWITCH_S, WORKERS, PARSES = 1e-5, 3, 20
NESTED = repr([("result", i, [1, (3, {"a": [5, {"b": (7, [8])}]})]) for i in range(200)])


class _Cycle:
    def __del__(self) -> None:  # a finalizer: a collection runs Python code, and may switch
        pass


def _errors_under_contention(parse: Callable[[str], Any]) -> list[str]:
    errors: list[str] = []
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            cycle = _Cycle()
            cycle.self = cycle  # type: ignore[attr-defined]

    def work() -> None:
        for _ in range(PARSES):
            try:
                assert parse(NESTED)[199][0] == "result"
            except SystemError as error:
                errors.append(str(error))
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        churner = threading.Thread(target=churn)
        churner.start()
        workers = [threading.Thread(target=work) for _ in range(WORKERS)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        stop.set()
        churner.join()
    finally:
        sys.setswitchinterval(interval)
    return errors


def test_parsing_from_many_threads_never_trips_the_recursion_depth_check() -> None:
    assert _errors_under_contention(pyast.literal_eval) == []


def test_parse_and_literal_eval_give_what_ast_gives() -> None:
    tree = pyast.parse("def check(candidate):\n    assert candidate(1) == 2\n")
    assert tree.body[0].name == "check"
    assert pyast.parse("1 + 2", mode="eval").body.op.__class__.__name__ == "Add"
    record = ("done", [1, 2.5], {"a": None})
    assert pyast.literal_eval("  " + repr(record)) == record
    with pytest.raises(ValueError):
        pyast.literal_eval("__import__('os')")
    with pytest.raises(SyntaxError):
        pyast.parse("def (")
