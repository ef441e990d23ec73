"""The sandbox: limits and guards hold against hostile code, and test reports cannot be forged."""

from __future__ import annotations

import gc
import os
import signal
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from skillswarm.agent.sandbox import (
    Isolation,
    SandboxConfigError,
    SandboxLimits,
    _as_signal_death,
    run_python,
    run_test_groups_in_sandbox,
    run_tests_in_sandbox,
)

ADD_ONE_TESTS = ["assert add_one(1) == 2", "assert add_one(2) == 3", "assert add_one(-5) == -4"]
ADD_ONE = "def add_one(x):\n    return x + 1\n"


def assert_still_works() -> None:
    """A normal run right after a hostile one succeeds."""
    result = run_python("print(sum(range(10)))")
    assert result.ok, result
    assert result.stdout == "45\n"


def test_normal_code_runs_with_output_and_exit_status() -> None:
    result = run_python(
        "import sys, math, json, collections\n"
        "print(json.dumps({'root': math.isqrt(49)}))\n"
        "print('warning', file=sys.stderr)\n"
        "open('notes.txt', 'w').write('kept inside')\n"
        "print(open('notes.txt').read())\n"
    )
    assert result.ok and not result.timed_out and result.killed_reason is None
    assert result.stdout == '{"root": 7}\nkept inside\n'
    assert result.stderr == "warning\n"
    failed = run_python("import sys\nsys.exit(3)")
    assert failed.returncode == 3 and not failed.ok
    crashed = run_python("raise ValueError('bad input')")
    assert crashed.returncode == 1
    assert "ValueError: bad input" in crashed.stderr


def test_each_run_gets_a_fresh_temp_dir_that_is_removed() -> None:
    first = run_python("import os\nopen('left.txt', 'w').close()\nprint(os.getcwd())")
    workdir = Path(first.stdout.strip())
    assert not workdir.exists()
    second = run_python("import os\nprint(os.listdir('.'))")
    assert second.stdout.strip() == "[]"


def test_infinite_loop_is_stopped_by_the_time_limits() -> None:
    result = run_python("while True:\n    pass", wall_timeout_s=1.0)
    assert result.returncode < 0
    assert result.killed_reason is not None
    assert result.timed_out or "CPU" in result.killed_reason
    assert_still_works()


def test_cpu_limit_reached_before_the_wall_limit_reads_as_sigxcpu() -> None:
    result = run_python("while True:\n    pass", wall_timeout_s=20.0, cpu_seconds=1)
    assert not result.timed_out
    assert result.returncode == -signal.SIGXCPU
    assert result.killed_reason == "CPU time limit of 1 s exceeded"
    assert result.duration_s < 10


def test_bubblewraps_128_plus_signal_status_is_read_as_that_signal() -> None:
    assert _as_signal_death(128 + signal.SIGXCPU, Isolation.BUBBLEWRAP) == -signal.SIGXCPU
    assert _as_signal_death(128 + signal.SIGKILL, Isolation.BUBBLEWRAP) == -signal.SIGKILL
    assert _as_signal_death(3, Isolation.BUBBLEWRAP) == 3
    assert _as_signal_death(128, Isolation.BUBBLEWRAP) == 128
    assert _as_signal_death(255, Isolation.BUBBLEWRAP) == 255
    assert _as_signal_death(-9, Isolation.BUBBLEWRAP) == -9
    # Without bubblewrap in between, the child's own status is exact.
    assert _as_signal_death(152, Isolation.NAMESPACES) == 152
    assert _as_signal_death(152, Isolation.AUDIT_HOOK) == 152


def test_fork_bomb_and_process_creation_are_refused() -> None:
    bomb = run_python("import os\nwhile True:\n    os.fork()")
    assert bomb.returncode == 1
    assert "os.fork is not allowed" in bomb.stderr
    spawn = run_python("import subprocess\nsubprocess.run(['true'])")
    assert spawn.returncode == 1
    shell = run_python("import os\nos.system('touch pwned')")
    assert shell.returncode == 1 and "os.system" in shell.stderr
    # Loading the process-spawning extension by hand is an import like any other.
    native = run_python(
        "import _imp, sys\n"
        "class Spec:\n"
        "    name = '_posixsubprocess'\n"
        "    origin = next(p for p in sys.path if p.endswith('lib-dynload'))\n"
        "_imp.create_dynamic(Spec())"
    )
    assert native.returncode == 1 and "_posixsubprocess" in native.stderr
    assert_still_works()


def test_native_code_cannot_be_loaded_from_the_temp_dir() -> None:
    result = run_python(
        "import os, sys\n"
        "library = next(p for p in sys.path if p.endswith('lib-dynload'))\n"
        "name = next(n for n in os.listdir(library) if n.startswith('_bisect.'))\n"
        "with open(os.path.join(library, name), 'rb') as source, open(name, 'wb') as copy:\n"
        "    copy.write(source.read())\n"
        "sys.path.insert(0, os.getcwd())\n"
        "sys.modules.pop('_bisect', None)\n"
        "import _bisect\n"
        "print(_bisect.__file__)"
    )
    assert result.returncode == 1, result
    assert "loading native code from" in result.stderr


def test_huge_allocation_fails_inside_the_memory_limit() -> None:
    result = run_python("block = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.returncode != 0
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr
    assert_still_works()


def test_network_connections_are_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        attempts = [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
        ]
        for source in attempts:
            result = run_python(source)
            assert result.returncode == 1, result
            assert "PermissionError: sandbox" in result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert_still_works()


def test_writes_outside_the_temp_dir_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.remove({str(victim)!r})",
        f"open('inside', 'w').close()\nimport os\nos.rename('inside', {str(target)!r})",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
        f"import shutil\nshutil.copy('/dev/null', {str(target)!r})",
    ]
    for source in attempts:
        result = run_python(source)
        assert result.returncode == 1, (source, result)
        assert "PermissionError" in result.stderr
    assert not target.exists()
    assert victim.read_text() == "original"
    reading = run_python(f"print(open({str(victim)!r}).read())")
    assert reading.returncode == 1 and "original" not in reading.stdout
    assert_still_works()


def test_output_is_truncated_with_a_marker() -> None:
    result = run_python(
        "import sys\nprint('x' * 300_000)\nprint('y' * 300_000, file=sys.stderr)",
        max_output_bytes=1000,
    )
    assert result.ok
    assert result.stdout.startswith("x" * 1000)
    assert "truncated" in result.stdout
    assert len(result.stdout) < 1200 and len(result.stderr) < 1200
    file_limit = run_python(
        "with open('big', 'wb') as big:\n    big.write(b'x' * 4096)", max_file_bytes=1024
    )
    assert file_limit.returncode == 1 and "File too large" in file_limit.stderr


def test_limits_are_validated() -> None:
    with pytest.raises(SandboxConfigError):
        SandboxLimits(wall_timeout_s=0)
    with pytest.raises(SandboxConfigError):
        SandboxLimits(memory_bytes=1024)
    with pytest.raises(SandboxConfigError):
        run_tests_in_sandbox(ADD_ONE, [], "add_one")
    with pytest.raises(SandboxConfigError):
        run_tests_in_sandbox(ADD_ONE, ADD_ONE_TESTS, "not a name")


def test_tests_report_passes_failures_and_load_errors() -> None:
    report = run_tests_in_sandbox(ADD_ONE, ADD_ONE_TESTS, "add_one")
    assert (report.passed, report.total, report.first_failure, report.error) == (3, 3, None, None)
    assert report.fraction == 1.0

    partial = run_tests_in_sandbox(
        "def add_one(x):\n    return 2 if x == 1 else 0", ADD_ONE_TESTS, "add_one"
    )
    assert (partial.passed, partial.error) == (1, None)
    assert partial.first_failure == "assert add_one(2) == 3 -> AssertionError: got 0"

    raising = run_tests_in_sandbox(
        "def add_one(x):\n    raise ValueError('negative')", ADD_ONE_TESTS, "add_one"
    )
    assert raising.passed == 0
    assert raising.first_failure == "assert add_one(1) == 2 -> ValueError: negative"

    broken = run_tests_in_sandbox("def add_one(x) return x", ADD_ONE_TESTS, "add_one")
    assert broken.passed == 0 and broken.error is not None and "SyntaxError" in broken.error
    missing = run_tests_in_sandbox("def other(x):\n    return x", ADD_ONE_TESTS, "add_one")
    assert missing.error == "the code does not define add_one"


def test_setup_helpers_and_plain_data_cross_the_boundary() -> None:
    setup = "def shout(text):\n    return text.upper() + '!'\n"
    code = "def describe(items, sep=', '):\n    return (shout(sep.join(items)), {1: (2.5, None)})"
    tests = [
        "assert describe(['a', 'b']) == ('A, B!', {1: (2.5, None)})",
        "assert describe(('x',), sep='-')[0] == shout('x')",
    ]
    report = run_tests_in_sandbox(code, tests, "describe", setup=setup)
    assert (report.passed, report.error) == (2, None), report


def test_timeout_inside_a_call_keeps_earlier_results() -> None:
    code = "def add_one(x):\n    while x == 2:\n        pass\n    return x + 1"
    report = run_tests_in_sandbox(
        code, ADD_ONE_TESTS, "add_one", limits=SandboxLimits(wall_timeout_s=1.5)
    )
    assert report.passed == 1
    assert report.error is not None
    assert report.first_failure is not None and report.first_failure.startswith("assert add_one(2)")


def test_test_groups_in_one_run_report_as_separate_runs_would() -> None:
    hidden = ["assert add_one(0) == 1", "assert add_one(2) == 3", "assert add_one(9) == 10"]
    for code in (
        ADD_ONE,
        "def add_one(x):\n    return 2 if x == 1 else 0",
        "def add_one(x):\n    raise ValueError('negative')",
        "def add_one(x) return x",
    ):
        together = run_test_groups_in_sandbox(code, [ADD_ONE_TESTS, hidden], "add_one")
        apart = [run_tests_in_sandbox(code, tests, "add_one") for tests in (ADD_ONE_TESTS, hidden)]
        assert together == apart, code
    assert together[1].first_failure is None and together[1].error is not None  # the load error

    # A limit that stops the run in the second group leaves the first group's report whole.
    # (3 s: the first group, two interpreters' start-up included, must finish within it on a
    # loaded machine.)
    looping = "def add_one(x):\n    while x == 9:\n        pass\n    return x + 1"
    visible, stopped = run_test_groups_in_sandbox(
        looping, [ADD_ONE_TESTS, hidden], "add_one", limits=SandboxLimits(wall_timeout_s=3.0)
    )
    assert (visible.passed, visible.first_failure, visible.error) == (3, None, None)
    assert stopped.passed == 2 and "time limit of 3 s exceeded" in str(stopped.error)
    assert str(stopped.first_failure).startswith("assert add_one(9) == 10 -> ")
    assert visible.stopped_by_limit and stopped.stopped_by_limit
    with pytest.raises(SandboxConfigError, match="at least one test"):
        run_test_groups_in_sandbox(ADD_ONE, [ADD_ONE_TESTS, []], "add_one")


FORGERIES = {
    "writes fake records on every descriptor": (
        "import os\n"
        "for fd in range(1, 64):\n"
        "    for token in ('0' * 32, 'f' * 32):\n"
        "        fake = token + ' [\"pass\", 0]\\n' + token + ' [\"done\"]\\n'\n"
        "        try:\n"
        "            os.write(fd, fake.encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "def add_one(x):\n"
        "    return 0\n"
    ),
    "returns an object equal to everything": (
        "class Equal:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "def add_one(x):\n"
        "    return Equal()\n"
    ),
    "returns an int subclass equal to everything": (
        "class Equal(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add_one(x):\n"
        "    return Equal(0)\n"
    ),
    "patches builtins and exits": (
        "import builtins, os\n"
        "builtins.AssertionError = type('Quiet', (Exception,), {})\n"
        "def add_one(x):\n"
        "    os._exit(0)\n"
    ),
    "reads the tests from the runner": (
        "import os\n"
        "found = []\n"
        "try:\n"
        "    for pid in os.listdir('/proc'):\n"
        "        found.append(open(f'/proc/{pid}/cmdline').read())\n"
        "except Exception:\n"
        "    pass\n"
        "def add_one(x):\n"
        "    return len(found)\n"
    ),
}


@pytest.mark.parametrize("code", FORGERIES.values(), ids=FORGERIES.keys())
def test_forged_reports_are_not_accepted(code: str) -> None:
    report = run_tests_in_sandbox(code, ADD_ONE_TESTS, "add_one")
    assert report.passed == 0, report


def test_concurrent_runs_stay_separate_and_release_everything(tmp_path, monkeypatch) -> None:
    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    # This process's sandboxes make their folders in a temp dir of their own, so that another
    # test process's sandboxes running meanwhile are not counted.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def sandbox_dirs() -> set[str]:
        return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("sandbox-")}

    run_python("pass")  # the one-off namespace probe is done before counting
    # Earlier tests' unreferenced sockets and files would otherwise be closed by the collector
    # while this test runs and make the count drop.
    gc.collect()
    descriptors_before, dirs_before = open_descriptors(), sandbox_dirs()
    codes = [f"def add_one(x):\n    return x + {offset}" for offset in (1, 2, 1, 0) * 3]
    with ThreadPoolExecutor(3) as pool:
        reports = list(
            pool.map(lambda code: run_tests_in_sandbox(code, ADD_ONE_TESTS, "add_one"), codes)
        )
    assert [report.passed for report in reports] == [3, 0, 3, 0] * 3
    assert open_descriptors() == descriptors_before
    assert sandbox_dirs() <= dirs_before
