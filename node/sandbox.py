"""Run untrusted Python in a sandboxed subprocess and check a candidate function against tests.

Layers: rlimits the child sets on itself before any untrusted code runs (CPU, memory, file size,
no new processes, no core files); a fresh session killed whole on the wall-clock limit; a
user+network namespace when `unshare -rn` works here; and an audit hook, installed before the
untrusted code runs, that refuses network access, process creation, native-code loading and file
access outside the run's own temp dir.

Tests run in a separate trusted runner process; the candidate function lives in its own sandboxed
process and answers calls over a pipe with plain data only, so the untrusted code never sees the
tests, the report channel or the per-run token, and cannot forge a passing report.
"""

from __future__ import annotations

import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from node import pyast

MiB = 1024 * 1024
# Largest message either side of the candidate pipe accepts (arguments in, return value out).
MAX_CALL_MESSAGE_BYTES = 4 * MiB
# Files the sandboxed code may open for writing in one run (each capped by `max_file_bytes`).
MAX_FILES_WRITTEN = 32
MAX_MESSAGE_CHARS = 200
_READ_CHUNK_BYTES = 64 * 1024
_DRAIN_AFTER_KILL_S = 1.0
_PROBE_TIMEOUT_S = 10.0


class SandboxConfigError(ValueError):
    """Raised when sandbox limits or test-run arguments are out of range."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (each process of it gets its own copy).

    `cpu_seconds` defaults to the wall limit rounded up; `max_output_bytes` bounds what is kept
    of stdout and of stderr (the rest is read and dropped); `max_file_bytes` caps every file the
    code writes; `max_open_files` caps its file descriptors.
    """

    wall_timeout_s: float = 5.0
    cpu_seconds: int | None = None
    memory_bytes: int = 512 * MiB
    max_output_bytes: int = 64 * 1024
    max_file_bytes: int = 16 * MiB
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if not self.wall_timeout_s > 0:
            raise SandboxConfigError(f"wall_timeout_s must be positive, got {self.wall_timeout_s}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise SandboxConfigError(f"cpu_seconds must be at least 1, got {self.cpu_seconds}")
        if self.memory_bytes < 64 * MiB:
            raise SandboxConfigError(
                f"memory_bytes must be at least 64 MiB for Python to start, got {self.memory_bytes}"
            )
        if self.max_output_bytes < 1 or self.max_file_bytes < 1:
            raise SandboxConfigError("max_output_bytes and max_file_bytes must be positive")
        if self.max_open_files < 16:
            raise SandboxConfigError(
                f"max_open_files must be at least 16, got {self.max_open_files}"
            )

    @property
    def effective_cpu_seconds(self) -> int:
        """The CPU-time limit in whole seconds."""
        if self.cpu_seconds is not None:
            return self.cpu_seconds
        return max(1, math.ceil(self.wall_timeout_s))


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended. `returncode` is negative when a signal ended it;
    `killed_reason` says why in words (wall or CPU limit, signal); outputs are truncated to the
    limit with a marker."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit status 0."""
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class TestRunReport:
    """Outcome of checking a candidate against tests. `error` is set when the run did not get
    through the tests normally (the code failed to load, timed out or was killed)."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    first_failure: str | None
    error: str | None
    # True when a limit or a signal stopped the run (wall or CPU time, file size, a kill): the
    # same code may report otherwise on a less loaded machine.
    stopped_by_limit: bool = False

    @property
    def fraction(self) -> float:
        """Share of the tests that passed."""
        return self.passed / self.total if self.total else 0.0


# The program every sandboxed process runs (`python -I -S -B`). It reads its payload (marshal
# data from the trusted parent) from stdin, sets its rlimits, installs the audit hook and then
# plays one role: "run" (execute a script), "candidate" (load untrusted code and answer calls to
# its function) or "tests" (run the tests, calling the candidate over pipes, and write
# token-prefixed results to the report pipe). Calls go to the candidate as marshal data; its
# replies come back as the text of Python literals, which the runner reads with a strict literal
# parser (never eval, never unmarshal). It imports only built-in modules, to start fast.
_CHILD_SOURCE = r'''
import _ast
import builtins
import marshal
import os
import stat
import sys

MAX_MESSAGE_CHARS = 200


def read_payload():
    chunks = []
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return marshal.loads(b"".join(chunks))


class HarnessMessage(Exception):
    """An error whose text is reported as is."""


class CandidateGone(HarnessMessage):
    """The candidate's process ended or stopped answering."""


class CandidateError(HarnessMessage):
    """The candidate raised an exception that is not a built-in exception type."""


def message_of(error):
    try:
        return "".join([str(error)])[:MAX_MESSAGE_CHARS]
    except BaseException:
        return "<unprintable message>"


def describe(error):
    text = message_of(error)
    if isinstance(error, HarnessMessage):
        return text
    name = type(error).__name__
    return (name + ": " + text if text else name)[:MAX_MESSAGE_CHARS]


def apply_limits(limits):
    import resource

    for name, soft, hard in limits:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def install_guard(workdir, max_writes):
    realpath = os.path.realpath
    workdir = realpath(workdir)
    writable = (workdir,)
    library = tuple(sorted({realpath(entry) for entry in sys.path if entry}))
    readable = (workdir,) + library
    devices = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    writes_left = [max_writes]
    denied_modules = frozenset({
        "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "multiprocessing",
        "_multiprocessing", "_posixshmem", "_xxsubinterpreters", "_xxinterpchannels",
        "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
        "_testimportmultiple", "_testclinic", "_sqlite3", "_dbm", "_gdbm", "_tkinter",
        "_curses", "_curses_panel", "readline",
    })
    denied_events = frozenset({
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
        "os.kill", "os.killpg", "os.startfile", "os.link", "os.symlink", "os.chmod",
        "os.chown", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
        "subprocess.Popen", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
        "sys.addaudithook", "syslog.openlog", "syslog.syslog",
    })
    denied_prefixes = (
        "ctypes.", "socket.", "sqlite3.", "dbm.", "http.", "urllib.", "ftplib.", "smtplib.",
        "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.",
    )

    def deny(what):
        raise PermissionError("sandbox: " + what + " is not allowed")

    def resolve(value):
        try:
            return realpath(os.fsdecode(value))
        except Exception:
            deny("this path")

    def within(path, roots):
        for root in roots:
            if path == root or path.startswith(root + os.sep):
                return True
        return False

    def check_open(args):
        target, mode, flags = args[0], args[1], args[2]
        if isinstance(target, int):
            return
        path = resolve(target)
        if path in devices:
            return
        if isinstance(flags, int) and flags >= 0:
            writing = bool(flags & write_flags)
        else:
            writing = any(letter in str(mode or "") for letter in "wax+")
        try:
            info = os.stat(path)
        except OSError:
            info = None
        if info is not None and not stat.S_ISREG(info.st_mode):
            deny("opening " + path + " (not a regular file)")
        if writing:
            if not within(path, writable):
                deny("writing " + path)
            if writes_left[0] <= 0:
                deny(f"opening more than {max_writes} files for writing")
            writes_left[0] -= 1
        elif not within(path, readable):
            deny("reading " + path)

    def check_writable(*paths):
        for value in paths:
            if isinstance(value, int) or value is None:
                continue
            path = resolve(value)
            if not within(path, writable):
                deny("changing " + path)

    def check_listable(value):
        if isinstance(value, int) or value is None:
            return
        path = resolve(value)
        if not within(path, readable):
            deny("listing " + path)

    def check_import(args):
        name, filename = str(args[0]), args[1]
        if name in denied_modules or name.partition(".")[0] in denied_modules:
            deny("importing " + name)
        if filename is not None:  # an extension module: native code only from the library
            path = resolve(filename)
            if not within(path, library):
                deny("loading native code from " + path)

    def check_socket(args):
        if args[1] != 1:  # AF_UNIX
            deny("creating network sockets")

    handlers = {
        "open": check_open,
        "import": check_import,
        "socket.__new__": check_socket,
        "os.mkdir": lambda args: check_writable(args[0]),
        "os.rmdir": lambda args: check_writable(args[0]),
        "os.remove": lambda args: check_writable(args[0]),
        "os.rename": lambda args: check_writable(args[0], args[1]),
        "os.truncate": lambda args: check_writable(args[0]),
        "os.utime": lambda args: check_writable(args[0]),
        "os.chdir": lambda args: check_writable(args[0]),
        "os.listdir": lambda args: check_listable(args[0]),
        "os.scandir": lambda args: check_listable(args[0]),
    }

    def audit(event, args):
        handler = handlers.get(event)
        if handler is not None:
            handler(args)
        elif event in denied_events or event.startswith(denied_prefixes):
            deny(event)

    sys.addaudithook(audit)


def send(fd, data):
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def read_exactly(fd, size):
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 65536))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive(fd, limit):
    header = read_exactly(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > limit:
        raise ValueError(f"a message of {size} bytes is over the {limit} byte limit")
    return read_exactly(fd, size)


def to_plain(value, depth=0):
    """`value` rebuilt from built-in types only, so that its repr is a Python literal."""
    if depth > 100:
        raise ValueError("a value nested too deeply")
    if value is None or value is True or value is False:
        return value
    if type(value) in (int, float, complex, str, bytes):
        return value
    for kind in (int, float, complex, str, bytes, bytearray):
        if isinstance(value, kind):
            return bytes(value) if kind is bytearray else kind(value)
    depth += 1
    if isinstance(value, list):
        return [to_plain(item, depth) for item in value]
    if isinstance(value, tuple):
        return tuple(to_plain(item, depth) for item in value)
    if isinstance(value, dict):
        return {to_plain(key, depth): to_plain(item, depth) for key, item in value.items()}
    if isinstance(value, frozenset):
        return frozenset(to_plain(item, depth) for item in value)
    if isinstance(value, set):
        return {to_plain(item, depth) for item in value}
    raise TypeError(f"a value of type {type(value).__name__}, which is not plain data")


def literal(node):
    """The value of a Python literal's syntax tree; anything else is refused."""
    kind = type(node)
    if kind is _ast.Constant:
        return node.value
    if kind is _ast.List:
        return [literal(item) for item in node.elts]
    if kind is _ast.Tuple:
        return tuple(literal(item) for item in node.elts)
    if kind is _ast.Set:
        return {literal(item) for item in node.elts}
    if kind is _ast.Dict and None not in node.keys:
        pairs = zip(node.keys, node.values, strict=True)
        return {literal(key): literal(item) for key, item in pairs}
    if kind is _ast.UnaryOp and type(node.op) is _ast.USub:
        value = literal(node.operand)
        if type(value) in (int, float, complex):
            return -value
    if kind is _ast.Name and node.id in ("inf", "nan"):
        return float(node.id)
    if (
        kind is _ast.Call
        and type(node.func) is _ast.Name
        and node.func.id in ("set", "frozenset")
        and not node.keywords
        and len(node.args) <= 1
    ):
        items = literal(node.args[0]) if node.args else ()
        if type(items) in (set, list, tuple):
            return set(items) if node.func.id == "set" else frozenset(items)
    raise ValueError("not a literal")


def parse_literal(data):
    tree = compile(data.decode("utf-8"), "<reply>", "eval", _ast.PyCF_ONLY_AST)
    return literal(tree.body)


def run_script(payload):
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(payload["source"], "<sandbox>", "exec"), namespace)


def serve_candidate(payload):
    request_fd, response_fd = payload["request_fd"], payload["response_fd"]
    limit, entry_point = payload["max_message_bytes"], payload["entry_point"]

    def reply(*fields):
        send(response_fd, repr(fields).encode("utf-8", "backslashreplace"))

    namespace = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        if payload["setup"]:
            exec(compile(payload["setup"], "<setup>", "exec"), namespace)
        stub = namespace.get(entry_point)
        exec(compile(payload["code"], "<answer>", "exec"), namespace)
        candidate = namespace.get(entry_point)
        if candidate is None or candidate is stub:
            raise HarnessMessage("the code does not define " + entry_point)
        if not callable(candidate):
            raise HarnessMessage(entry_point + " is not a function")
    except BaseException as error:
        reply("load_error", describe(error))
        return
    reply("ready")
    while True:
        request = receive(request_fd, limit)
        if request is None:
            return
        args, kwargs = marshal.loads(request)
        try:
            value = candidate(*args, **kwargs)
        except BaseException as error:
            reply("raised", "".join([str(type(error).__name__)]), message_of(error))
            continue
        try:
            text = repr(to_plain(value)).encode("utf-8", "backslashreplace")
            if len(text) > limit - 64:
                raise ValueError("a value that is too large")
        except (TypeError, ValueError, RecursionError, MemoryError) as error:
            reply("unsupported", "the function returned " + message_of(error))
            continue
        send(response_fd, b"('value', " + text + b")")


def run_tests(payload):
    token, report_fd = payload["token"], payload["report_fd"]
    request_fd, response_fd = payload["request_fd"], payload["response_fd"]
    limit, entry_point = payload["max_message_bytes"], payload["entry_point"]
    tests = payload["tests"]

    def report(*fields):
        os.write(report_fd, (token + " " + repr(fields) + "\n").encode())

    def receive_reply():
        data = receive(response_fd, limit)
        if data is None:
            return None
        try:
            reply = parse_literal(data)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            reply = None
        if type(reply) is not tuple or not reply or type(reply[0]) is not str:
            raise CandidateGone("the function's process sent a malformed reply")
        return reply

    try:
        hello = receive_reply()
    except (OSError, ValueError, CandidateGone):
        hello = None
    if hello is None:
        report("load_error", "the code's process ended or garbled its pipe while loading")
        return
    if hello[0] != "ready":
        message = str(hello[1]) if len(hello) > 1 else "the code failed to load"
        report("load_error", message[:MAX_MESSAGE_CHARS])
        return

    def candidate(*args, **kwargs):
        try:
            request = marshal.dumps((args, kwargs))
        except ValueError:
            raise TypeError("the test passes a value that is not plain data") from None
        try:
            send(request_fd, request)
            reply = receive_reply()
        except (OSError, ValueError) as error:
            raise CandidateGone("the function's process failed: " + describe(error)) from None
        if reply is None:
            raise CandidateGone("the function's process ended")
        kind, fields = reply[0], reply[1:]
        if kind == "value" and len(fields) == 1:
            return fields[0]
        if kind == "raised" and len(fields) == 2:
            name, message = str(fields[0]), str(fields[1])[:MAX_MESSAGE_CHARS]
            exception_type = getattr(builtins, name, None)
            if (
                isinstance(exception_type, type)
                and issubclass(exception_type, Exception)
                and not issubclass(exception_type, (StopIteration, StopAsyncIteration))
            ):
                try:
                    error = exception_type(message)
                except Exception:
                    error = None
                if error is not None:
                    raise error
            raise CandidateError(name + ": " + message if message else name)
        if kind == "unsupported" and len(fields) == 1:
            raise TypeError(str(fields[0])[:MAX_MESSAGE_CHARS])
        raise CandidateGone("the function's process sent a malformed reply")

    candidate.__name__ = candidate.__qualname__ = entry_point

    def explain_assertion(source, namespace):
        try:
            body = compile(source, "<test>", "exec", _ast.PyCF_ONLY_AST).body
            check = body[0].test if len(body) == 1 and type(body[0]) is _ast.Assert else None
            if (
                type(check) is _ast.Compare
                and len(check.ops) == 1
                and type(check.ops[0]) is _ast.Eq
            ):
                expression = compile(_ast.Expression(check.left), "<test>", "eval")
                got = repr(eval(expression, namespace))
                return ("AssertionError: got " + got)[:MAX_MESSAGE_CHARS]
        except Exception:
            pass
        return "AssertionError"

    setup = compile(payload["setup"], "<setup>", "exec") if payload["setup"] else None
    for index, source in enumerate(tests):
        namespace = {"__name__": "__test__", "__builtins__": builtins}
        try:
            if setup is not None:
                exec(setup, namespace)
            namespace[entry_point] = candidate
            exec(compile(source, f"<test {index}>", "exec"), namespace)
        except CandidateGone as error:
            for rest in range(index, len(tests)):
                report("fail", rest, describe(error))
            break
        except AssertionError as error:
            message = describe(error) if str(error) else explain_assertion(source, namespace)
            report("fail", index, message)
        except Exception as error:
            report("fail", index, describe(error))
        else:
            report("pass", index)
    report("done")


def main():
    payload = read_payload()
    apply_limits(payload["limits"])
    install_guard(payload["workdir"], payload["max_writes"])
    role = payload["role"]
    if role == "run":
        run_script(payload)
        return
    if role == "candidate":
        serve_candidate(payload)
    else:
        run_tests(payload)
    os._exit(0)


main()
'''

# Compiled once here and sent ahead of the payload: compiling the program in every child would
# cost a few milliseconds per process. The `-c` loader reads the code object (marshal data from
# this trusted process, same interpreter) from stdin and runs it.
_CHILD_CODE = marshal.dumps(compile(_CHILD_SOURCE, "<sandbox-child>", "exec"))
_CHILD_LOADER = (
    "import marshal, os\n"
    "def read(size):\n"
    "    data = b''\n"
    "    while len(data) < size:\n"
    "        chunk = os.read(0, size - len(data))\n"
    "        if not chunk:\n"
    "            raise SystemExit('sandbox: the program did not arrive')\n"
    "        data += chunk\n"
    "    return data\n"
    "exec(marshal.loads(read(int.from_bytes(read(4), 'big'))))\n"
)


@dataclass
class _BoundedBuffer:
    """Bytes read from a pipe, keeping at most `limit` of them."""

    limit: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            self.data += chunk[:room]

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.truncated:
            text += f"\n…[truncated: output over {self.limit} bytes was dropped]"
        return text


@dataclass
class _ChildSpec:
    """One process of a sandboxed run: its payload and the extra fds it inherits."""

    payload: dict[str, Any]
    pass_fds: tuple[int, ...] = ()


@dataclass
class _ChildOutcome:
    """How one process of a run ended and what it printed."""

    returncode: int
    stdout: _BoundedBuffer
    stderr: _BoundedBuffer


@dataclass
class _RunOutcome:
    """All processes of one run, whether the wall limit cut it short, and its duration."""

    children: list[_ChildOutcome]
    timed_out: bool
    duration_s: float


_probe_lock = threading.Lock()
_unshare_prefix: list[str] | None = None
_probe_done = False


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """(resource name, soft, hard) the child sets on itself before it reads untrusted code.
    Set there rather than in a `preexec_fn`, which is unsafe in threaded parents and rules out
    the fast vfork spawn path. RLIMIT_NPROC does not bind root; the audit hook still refuses
    process creation."""
    cpu = limits.effective_cpu_seconds
    return [
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_NPROC", 0, 0),
    ]


def _child_argv(unshare_prefix: Sequence[str]) -> list[str]:
    return [*unshare_prefix, sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD_LOADER]


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
    }


def _exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the process has exited, without reaping it (its group id stays reserved)."""
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group_and_reap(process: subprocess.Popen[bytes]) -> int:
    """SIGKILL the process's whole group (the leader is not yet reaped, so the group id cannot
    have been reused), then reap the leader."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return process.wait()


def _supervise(
    specs: Sequence[_ChildSpec],
    limits: SandboxLimits,
    unshare_prefix: Sequence[str],
    extra_reads: dict[int, _BoundedBuffer] | None = None,
    close_after_spawn: Sequence[int] = (),
) -> _RunOutcome:
    """Start every child in its own temp dir and session, feed it its payload and read its
    outputs (bounded) until the first child (the primary) has exited and closed its pipes, or the
    wall limit passes; then kill every child's process group. Takes ownership of the fds in
    `extra_reads` (read until EOF, part of the primary) and closes `close_after_spawn`."""
    extra_reads = dict(extra_reads or {})
    unregistered_extra = set(extra_reads)
    to_close = list(close_after_spawn)
    workdirs: list[str] = []
    processes: list[subprocess.Popen[bytes]] = []
    selector = selectors.DefaultSelector()
    try:
        for spec in specs:
            workdir = tempfile.mkdtemp(prefix="sandbox-")
            workdirs.append(workdir)
            payload = {
                **spec.payload,
                "workdir": workdir,
                "max_writes": MAX_FILES_WRITTEN,
                "limits": _rlimits(limits),
            }
            process = subprocess.Popen(
                _child_argv(unshare_prefix),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=_child_env(workdir),
                close_fds=True,
                pass_fds=spec.pass_fds,
                start_new_session=True,
            )
            processes.append(process)
            assert process.stdin and process.stdout and process.stderr
            os.set_blocking(process.stdin.fileno(), False)
            stdin_data = len(_CHILD_CODE).to_bytes(4, "big") + _CHILD_CODE + marshal.dumps(payload)
            pending_payload = memoryview(stdin_data)
            selector.register(process.stdin, selectors.EVENT_WRITE, pending_payload)
            for stream in (process.stdout, process.stderr):
                selector.register(
                    stream, selectors.EVENT_READ, _BoundedBuffer(limits.max_output_bytes)
                )
        for descriptor in to_close:
            os.close(descriptor)
        to_close = []
        for descriptor, buffer in extra_reads.items():
            selector.register(descriptor, selectors.EVENT_READ, buffer)
            unregistered_extra.discard(descriptor)
        buffers = {key.fileobj: key.data for key in selector.get_map().values()}
        primary = processes[0]
        primary_pipes = {primary.stdout, primary.stderr, *extra_reads}

        started = time.monotonic()
        timed_out = _pump(selector, started + limits.wall_timeout_s, primary, primary_pipes)
        returncodes = [_kill_group_and_reap(process) for process in processes]
        _pump(selector, time.monotonic() + _DRAIN_AFTER_KILL_S, None, set())
        children = [
            _ChildOutcome(code, buffers[process.stdout], buffers[process.stderr])
            for code, process in zip(returncodes, processes, strict=True)
        ]
        return _RunOutcome(children, timed_out, time.monotonic() - started)
    finally:
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
            _close(key.fileobj)
        selector.close()
        for process in processes:
            if process.returncode is None:
                _kill_group_and_reap(process)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        for descriptor in [*to_close, *unregistered_extra]:
            _close(descriptor)
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def _close(target: Any) -> None:
    try:
        if isinstance(target, int):
            os.close(target)
        else:
            target.close()
    except OSError:
        pass


def _pump(
    selector: selectors.BaseSelector,
    deadline: float,
    primary: subprocess.Popen[bytes] | None,
    primary_pipes: set[Any],
) -> bool:
    """Move data through the pipes until `primary` has exited and closed `primary_pipes` (with
    no primary: until every pipe is closed), or until `deadline`. Pipes reaching EOF are closed
    and unregistered. Returns True when the deadline came before the primary finished."""
    while True:
        registered = {key.fileobj for key in selector.get_map().values()}
        remaining = deadline - time.monotonic()
        if primary is None:
            if not registered or remaining <= 0:
                return False
        elif not registered & primary_pipes:
            if _exited(primary):
                return False
            if remaining <= 0:
                return True
        elif remaining <= 0:
            return not _exited(primary)
        # Once the primary's pipes are closed, poll briefly for its exit.
        waiting_for_exit = primary is not None and not registered & primary_pipes
        timeout = min(remaining, 0.005) if waiting_for_exit else remaining
        if not registered:
            time.sleep(timeout)
            continue
        for key, _ in selector.select(timeout=timeout):
            descriptor = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
            if isinstance(key.data, memoryview):
                _write_some(selector, key, descriptor)
                continue
            try:
                chunk = os.read(descriptor, _READ_CHUNK_BYTES)
            except OSError:
                chunk = b""
            if chunk:
                key.data.add(chunk)
            else:
                selector.unregister(key.fileobj)
                _close(key.fileobj)


def _write_some(selector: selectors.BaseSelector, key: selectors.SelectorKey, fd: int) -> None:
    pending: memoryview = key.data
    try:
        written = os.write(fd, pending[:_READ_CHUNK_BYTES])
    except BlockingIOError:
        return
    except OSError:  # the child closed its stdin or died
        written = len(pending)
    pending = pending[written:]
    if pending:
        selector.modify(key.fileobj, selectors.EVENT_WRITE, pending)
    else:
        selector.unregister(key.fileobj)
        _close(key.fileobj)


def _network_namespace_prefix() -> list[str]:
    """`unshare -rn` when it works on this machine (probed once per process), else nothing."""
    global _unshare_prefix, _probe_done
    with _probe_lock:
        if not _probe_done:
            _unshare_prefix = _probe_unshare()
            _probe_done = True
        return list(_unshare_prefix or [])


def _probe_unshare() -> list[str] | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--user", "--map-root-user", "--net"]
    limits = SandboxLimits(wall_timeout_s=_PROBE_TIMEOUT_S)
    spec = _ChildSpec({"role": "run", "source": "print('sandbox-ok')"})
    try:
        outcome = _supervise([spec], limits, prefix)
    except OSError:
        return None
    child = outcome.children[0]
    if child.returncode == 0 and child.stdout.text().strip() == "sandbox-ok":
        return prefix
    return None


def network_namespace_available() -> bool:
    """Whether runs here get their own user and network namespace (no network interfaces) on
    top of the in-process guard."""
    return bool(_network_namespace_prefix())


def _killed_reason(returncode: int, timed_out: bool, limits: SandboxLimits) -> str | None:
    if timed_out:
        return f"wall time limit of {limits.wall_timeout_s:g} s exceeded"
    if returncode >= 0:
        return None
    number = -returncode
    if number == signal.SIGXCPU:
        return f"CPU time limit of {limits.effective_cpu_seconds} s exceeded"
    if number == signal.SIGXFSZ:
        return f"file size limit of {limits.max_file_bytes} bytes exceeded"
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"killed by {name}"


def run_python(
    source: str,
    *,
    wall_timeout_s: float = DEFAULT_LIMITS.wall_timeout_s,
    cpu_seconds: int | None = None,
    memory_bytes: int = DEFAULT_LIMITS.memory_bytes,
    max_output_bytes: int = DEFAULT_LIMITS.max_output_bytes,
    max_file_bytes: int = DEFAULT_LIMITS.max_file_bytes,
) -> SandboxResult:
    """Run `source` as a script in a fresh sandboxed Python process and return how it ended."""
    limits = SandboxLimits(
        wall_timeout_s=wall_timeout_s,
        cpu_seconds=cpu_seconds,
        memory_bytes=memory_bytes,
        max_output_bytes=max_output_bytes,
        max_file_bytes=max_file_bytes,
    )
    spec = _ChildSpec({"role": "run", "source": source})
    outcome = _supervise([spec], limits, _network_namespace_prefix())
    child = outcome.children[0]
    return SandboxResult(
        returncode=child.returncode,
        stdout=child.stdout.text(),
        stderr=child.stderr.text(),
        timed_out=outcome.timed_out,
        killed_reason=_killed_reason(child.returncode, outcome.timed_out, limits),
        duration_s=outcome.duration_s,
    )


def _test_label(tests: Sequence[str], index: int) -> str:
    test = tests[index].strip()
    if "\n" not in test and len(test) <= 120:
        return test
    return f"test {index + 1}"


def run_tests_in_sandbox(
    code: str,
    tests: Sequence[str],
    entry_point: str,
    *,
    setup: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
) -> TestRunReport:
    """Check the function `entry_point` defined by `code` against `tests` (each an assert
    statement or a small block that calls `entry_point`). `setup` is trusted code (helpers the
    tests or the function need) run before `code` in the function's namespace and before each
    test in the test's namespace. All tests run in one runner process; `code` runs in its own
    sandboxed process and is called with plain data (None, bool, int, float, complex, str,
    bytes, list, tuple, dict, set, frozenset) both ways; its return value is rebuilt from those
    types before the tests see it."""
    if not tests:
        raise SandboxConfigError("at least one test is needed")
    (report,) = run_test_groups_in_sandbox(code, [tests], entry_point, setup=setup, limits=limits)
    return report


def run_test_groups_in_sandbox(
    code: str,
    groups: Sequence[Sequence[str]],
    entry_point: str,
    *,
    setup: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
) -> list[TestRunReport]:
    """`run_tests_in_sandbox` for several groups of tests in one run, one report per group: the
    cost of a run is mostly starting its two processes, whatever the number of tests. The groups'
    tests run in order, and each group's report is the one a run of that group alone gives,
    unless a limit stops the run: then the tests it did not reach fail with the reason, in
    whichever group they are, and every report says `stopped_by_limit`."""
    if not groups or any(not group for group in groups):
        raise SandboxConfigError("every group needs at least one test")
    if not entry_point.isidentifier():
        raise SandboxConfigError(f"entry_point {entry_point!r} is not a Python identifier")
    tests = [test for group in groups for test in group]
    token = secrets.token_hex(16)
    request_read, request_write = os.pipe()
    response_read, response_write = os.pipe()
    report_read, report_write = os.pipe()
    common = {
        "entry_point": entry_point,
        "setup": setup,
        "max_message_bytes": MAX_CALL_MESSAGE_BYTES,
    }
    runner = _ChildSpec(
        {
            "role": "tests",
            "token": token,
            "tests": tests,
            "request_fd": request_write,
            "response_fd": response_read,
            "report_fd": report_write,
            **common,
        },
        (request_write, response_read, report_write),
    )
    candidate = _ChildSpec(
        {
            "role": "candidate",
            "code": code,
            "request_fd": request_read,
            "response_fd": response_write,
            **common,
        },
        (request_read, response_write),
    )
    report = _BoundedBuffer(8192 + 1024 * len(tests))
    outcome = _supervise(
        [runner, candidate],
        limits,
        _network_namespace_prefix(),
        extra_reads={report_read: report},
        close_after_spawn=(
            request_read,
            request_write,
            response_read,
            response_write,
            report_write,
        ),
    )
    return _read_reports(bytes(report.data), token, groups, outcome, limits)


def _read_reports(
    report: bytes,
    token: str,
    groups: Sequence[Sequence[str]],
    outcome: _RunOutcome,
    limits: SandboxLimits,
) -> list[TestRunReport]:
    """Turn the runner's token-prefixed records (tests numbered across all groups) into one
    TestRunReport per group; anything without the token is ignored."""
    count = sum(len(group) for group in groups)
    failures: dict[int, str] = {}
    passed: set[int] = set()
    load_error: str | None = None
    done = False
    for piece in report.split(token.encode())[1:]:
        try:
            record = pyast.literal_eval(piece.split(b"\n", 1)[0].decode("utf-8", "replace"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if not isinstance(record, tuple) or not record:
            continue
        kind = record[0]
        if kind == "done":
            done = True
        elif kind == "load_error" and len(record) == 2:
            load_error = str(record[1])
        elif (
            kind in ("pass", "fail")
            and len(record) >= 2
            and isinstance(record[1], int)
            and 0 <= record[1] < count
        ):
            if kind == "pass":
                passed.add(record[1])
            else:
                failures[record[1]] = str(record[2]) if len(record) > 2 else "failed"
    if load_error is not None:
        return [TestRunReport(0, len(group), None, load_error) for group in groups]
    runner, candidate = outcome.children
    run_error: str | None = None
    unfinished: set[int] = set()
    stopped = outcome.timed_out
    if not done:
        stopped = stopped or _killed_reason(runner.returncode, False, limits) is not None
        run_error = _unfinished_reason(runner, outcome.timed_out, limits)
        unfinished = {i for i in range(count) if i not in passed and i not in failures}
        failures.update(dict.fromkeys(unfinished, run_error))
    candidate_reason = _killed_reason(candidate.returncode, False, limits)
    candidate_error = None
    if run_error is None and candidate_reason and candidate_reason != "killed by SIGKILL":
        candidate_error = f"the function's process was stopped: {candidate_reason}"
        stopped = True
    reports: list[TestRunReport] = []
    first = 0
    for group in groups:
        indices = range(first, first + len(group))
        first += len(group)
        failed = [i for i in indices if i in failures]
        first_failure = None
        if failed:
            local = failed[0] - indices.start
            first_failure = f"{_test_label(group, local)} -> {failures[failed[0]]}"
        error = run_error if unfinished & set(indices) else candidate_error if failed else None
        passes = sum(i in passed for i in indices)
        reports.append(TestRunReport(passes, len(group), first_failure, error, stopped))
    return reports


def _unfinished_reason(runner: _ChildOutcome, timed_out: bool, limits: SandboxLimits) -> str:
    reason = _killed_reason(runner.returncode, timed_out, limits)
    if reason is not None:
        return reason
    tail = runner.stderr.text().strip().splitlines()[-1:] or ["no output"]
    return f"the test runner exited with status {runner.returncode}: {tail[0][:MAX_MESSAGE_CHARS]}"
