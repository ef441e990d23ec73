"""Reading the code domain's task files: JSONL (plain or gzipped) of HumanEval records (Chen et al.
2021, github.com/openai/human-eval) or MBPP records (Austin et al. 2021,
github.com/google-research/google-research/tree/master/mbpp), as those projects ship them.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skillswarm.agent import pyast

GZIP_MAGIC = b"\x1f\x8b"
HUMANEVAL_FIELDS = ("task_id", "prompt", "entry_point", "test")


class TaskFileError(ValueError):
    """A task file that cannot be read; the message names the file and, for a bad record, the
    line."""


@dataclass(frozen=True)
class FileTask:
    """One problem of a task file, in the form the code domain plays it: the prompt the model
    reads, the function it writes (`entry_point`), the tests `run_tests` shows and the ones that
    score the answer (asserts, or a HumanEval `check(...)` call), trusted `setup` code run before
    the function and each test, and the reference code (None when the record has none)."""

    task_id: str
    prompt: str
    entry_point: str
    visible_tests: tuple[str, ...]
    hidden_tests: tuple[str, ...]
    setup: str
    solution: str | None
    source: str  # "humaneval" or "mbpp"


def load_task_file(path: str | Path) -> list[FileTask]:
    """Read a JSONL task file (gzipped when it starts with gzip's magic bytes, e.g. .jsonl.gz):
    one HumanEval or MBPP record per line, blank lines skipped. Raises TaskFileError naming the
    file and the line of the first bad record."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw.startswith(GZIP_MAGIC):
            raw = gzip.decompress(raw)
        lines = raw.decode("utf-8").splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
        raise TaskFileError(f"cannot read task file {path}: {error}") from error
    tasks: list[FileTask] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            task = _record_task(json.loads(line))
        except json.JSONDecodeError as error:
            raise TaskFileError(f"{where}: not valid JSON ({error.msg})") from error
        except _BadRecord as error:
            raise TaskFileError(f"{where}: {error}") from error
        if task.task_id in seen:
            raise TaskFileError(f"{where}: task_id {task.task_id!r} appears twice")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"task file {path} holds no tasks")
    return tasks


class _BadRecord(ValueError):
    """What is wrong with one record; load_task_file adds the file and line."""


def _record_task(record: Any) -> FileTask:
    if not isinstance(record, dict):
        raise _BadRecord("each line must be a JSON object")
    if "test_list" in record:
        return _mbpp_task(record)
    if any(key in record for key in ("entry_point", "test")):
        return _humaneval_task(record)
    raise _BadRecord(
        "neither a HumanEval record (task_id, prompt, entry_point, test) nor an MBPP record "
        "(text or prompt, code, test_list)"
    )


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord(f"field {key!r} must be a non-empty string")
    return value


def _task_id(record: dict[str, Any]) -> str:
    value = record.get("task_id")
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise _BadRecord("field 'task_id' must be a non-empty string or an integer")
    return str(value)


def _python(source: str, key: str) -> ast.Module:
    try:
        return pyast.parse(source)
    except SyntaxError as error:
        raise _BadRecord(
            f"field {key!r} is not valid Python ({error.msg}, line {error.lineno})"
        ) from error
    except ValueError as error:  # e.g. a NUL byte in the source
        raise _BadRecord(f"field {key!r} is not valid Python ({error})") from error


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _humaneval_task(record: dict[str, Any]) -> FileTask:
    """A HumanEval record: `prompt` holds the signature and docstring, `test` defines
    `check(candidate)`. Visible and hidden tests are both `check(entry_point)`; the prompt (when
    it is valid Python) is setup code, so helpers it defines exist."""
    task_id = _task_id(record)
    prompt, entry_point, test = (_text(record, key) for key in HUMANEVAL_FIELDS[1:])
    canonical = record.get("canonical_solution")
    if canonical is not None and not isinstance(canonical, str):
        raise _BadRecord("field 'canonical_solution' must be a string")
    if not entry_point.isidentifier():
        raise _BadRecord(f"entry_point {entry_point!r} is not a Python name")
    tree = _python(test, "test")
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise _BadRecord("field 'test' must define check(candidate)")
    check_call = f"{test}\n\ncheck({entry_point})\n"
    return FileTask(
        task_id=task_id,
        prompt=f"Complete the Python function `{entry_point}`.\n\n{prompt.strip()}",
        entry_point=entry_point,
        visible_tests=(check_call,),
        hidden_tests=(check_call,),
        setup=prompt if _compiles(prompt) else "",
        solution=None if canonical is None else prompt + canonical,
        source="humaneval",
    )


def _mbpp_task(record: dict[str, Any]) -> FileTask:
    """An MBPP record (`text`, or `prompt` in the sanitized set; `code`; `test_list` of asserts;
    optionally `task_id`, `test_setup_code`, `test_imports`, `challenge_test_list`). The prompt
    shows the tests, as in the MBPP paper; they are the visible tests, and with the challenge
    tests the hidden ones. The function is the one the tests call that `code` defines. A record
    without task_id is named by a hash of its text."""
    text = _text(record, "text" if "text" in record else "prompt")
    code = _text(record, "code")
    tests = _assert_list(record, "test_list", required=True)
    challenge = _assert_list(record, "challenge_test_list", required=False)
    setup_code = record.get("test_setup_code", "")
    imports = record.get("test_imports", [])
    if not isinstance(setup_code, str):
        raise _BadRecord("field 'test_setup_code' must be a string")
    if not isinstance(imports, list) or not all(isinstance(line, str) for line in imports):
        raise _BadRecord("field 'test_imports' must be a list of strings")
    defined = [
        node.name
        for node in _python(code, "code").body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    called = [
        node.func.id
        for test in tests
        for node in ast.walk(pyast.parse(test))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    entry_point = next((name for name in called if name in defined), None)
    if entry_point is None:
        raise _BadRecord("no test in 'test_list' calls a function that 'code' defines")
    if "task_id" in record:
        task_id = _task_id(record)
    else:
        task_id = "mbpp-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    shown = "\n".join(tests)
    return FileTask(
        task_id=task_id,
        prompt=f"{text.strip()}\nYour code should pass these tests:\n\n{shown}",
        entry_point=entry_point,
        visible_tests=tuple(tests),
        hidden_tests=(*tests, *challenge),
        setup="\n".join([*imports, setup_code]).strip(),
        solution=code,
        source="mbpp",
    )


def _assert_list(record: dict[str, Any], key: str, *, required: bool) -> list[str]:
    tests = record.get(key, None if required else [])
    if not isinstance(tests, list) or (required and not tests):
        raise _BadRecord(f"field {key!r} must be a {'non-empty ' * required}list of asserts")
    for test in tests:
        if not isinstance(test, str) or not test.strip():
            raise _BadRecord(f"field {key!r} must hold non-empty strings")
        _python(test, key)
    return tests
