"""Python's parser made safe to call from several threads at once.

CPython before 3.11.8 and 3.12.2 (gh-106905) counts the depth of the AST objects it builds in
state that every thread shares. When one thread drops the GIL while it builds a tree (a garbage
collection that runs a finalizer is enough), another thread's parse moves the count, and the
first fails with `SystemError: AST constructor recursion depth mismatch`. The tool workers parse
model-written code, calculator expressions and the sandbox's reports concurrently: `parse` holds
one lock around the tree's construction, which takes microseconds for such inputs.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_PARSE_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> Any:
    """`ast.parse(source, mode=mode)`, one thread at a time."""
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)


def literal_eval(source: str) -> Any:
    """`ast.literal_eval(source)`, whose parse goes through `parse`."""
    return ast.literal_eval(parse(source.lstrip(" \t"), mode="eval"))
