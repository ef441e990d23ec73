"""Run untrusted Python in a sandboxed subprocess and check a candidate function against tests.

Layers, outermost first: bubblewrap (new mount, PID, network, IPC and UTS namespaces, no
capabilities, only /usr, the interpreter and a private tmpfs mounted, an unprivileged user), or a
weaker isolation where the operator accepts one (see `Isolation`); rlimits the child sets on
itself before any untrusted code runs (CPU, memory, file size, no new processes, no core files);
a fresh session killed whole on the wall-clock limit; and an audit hook, installed before the
untrusted code runs, that refuses network access, process creation, native-code loading and file
access outside the run's own temp dir (a tripwire: code that walks the interpreter's objects can
switch it off, which is why the kernel holds the line).

Tests run in a separate trusted runner process; the candidate function lives in its own sandboxed
process and answers calls over a pipe with plain data only, so the untrusted code never sees the
tests, the report channel or the per-run token, and cannot forge a passing report.
"""

from __future__ import annotations

import functools
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
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

from skillswarm.agent import pyast

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
    code writes; `max_open_files` caps its file descriptors; `max_disk_bytes` is the size of the
    private temp dir (a tmpfs) each process gets under bubblewrap.
    """

    wall_timeout_s: float = 5.0
    cpu_seconds: int | None = None
    memory_bytes: int = 512 * MiB
    max_output_bytes: int = 64 * 1024
    max_file_bytes: int = 16 * MiB
    max_open_files: int = 64
    max_disk_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if not self.wall_timeout_s > 0:
            raise SandboxConfigError(f"wall_timeout_s must be positive, got {self.wall_timeout_s}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise SandboxConfigError(f"cpu_seconds must be at least 1, got {self.cpu_seconds}")
        if self.memory_bytes < 64 * MiB:
            raise SandboxConfigError(
                f"memory_bytes must be at least 64 MiB for Python to start, got {self.memory_bytes}"
            )
        if self.max_output_bytes < 1 or self.max_file_bytes < 1 or self.max_disk_bytes < MiB:
            raise SandboxConfigError(
                "max_output_bytes and max_file_bytes must be positive, max_disk_bytes 1 MiB or more"
            )
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


# The child program, a module of its own (`sandbox_child.py`), read as text: it is never
# imported here, only compiled and sent to each sandboxed process.
_CHILD_SOURCE = (resources.files(__package__) / "sandbox_child.py").read_text(encoding="utf-8")

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
    """One process of a sandboxed run: its payload and the extra fds it inherits. A `trusted`
    child (the test runner: it runs only the environment's own tests and setup, and reads the
    candidate's replies with a strict literal parser) gets the rlimits and the audit hook but no
    kernel sandbox, which would double the start-up cost of every run."""

    payload: dict[str, Any]
    pass_fds: tuple[int, ...] = ()
    trusted: bool = False


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


ISOLATION_ENV = "SKILLSWARM_SANDBOX"
SANDBOX_UID = SANDBOX_GID = 65534  # "nobody": what the child of a root parent switches to


class Isolation(StrEnum):
    """How sandboxed processes are walled off from the host, strongest first."""

    BUBBLEWRAP = "bubblewrap"  # kernel: every namespace unshared, only the interpreter mounted
    NAMESPACES = "namespaces"  # a user and network namespace (`unshare -rn`); host files visible
    AUDIT_HOOK = "audit-hook"  # the in-process audit hook alone

    @property
    def kernel(self) -> bool:
        """Whether the kernel keeps the host's files, keys and network out of reach."""
        return self is Isolation.BUBBLEWRAP


class SandboxUnavailable(RuntimeError):
    """The isolation asked for (in $SKILLSWARM_SANDBOX) does not work on this host."""


_probe_lock = threading.Lock()
_isolation: Isolation | None = None


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


@functools.cache
def _interpreter() -> str:
    """The real interpreter binary (a virtual environment's `python` is a link to it): the
    sandboxed child runs with `-I -S`, so it needs the standard library and nothing of the venv."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _drop_to(isolation: Isolation) -> tuple[int, int] | None:
    """(uid, gid) the child switches to before anything else when this process is root: the
    kernel does not enforce RLIMIT_NPROC on root, so a candidate that got past the audit hook
    could fork without bound. Only under bubblewrap, which gives the child just the capabilities
    to switch and makes the interpreter reachable for that user."""
    if isolation is not Isolation.BUBBLEWRAP or os.geteuid() != 0:
        return None
    return SANDBOX_UID, SANDBOX_GID


@functools.cache
def _bwrap_setup() -> tuple[str, ...]:
    """bubblewrap with the mount, PID, network, IPC, UTS and cgroup namespaces unshared (and the
    user namespace, with no nested ones, unless this process is root: then the child drops to an
    unprivileged user itself), no capabilities, a new session, and a filesystem of just /usr, the
    interpreter's prefix (read-only) and a minimal /dev: no home, no work dir, no keys, no
    network. The same for every run, so worked out once."""
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net"]
    argv += ["--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    argv += ["--cap-drop", "ALL"]
    if os.geteuid() == 0:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr", "--dev", "/dev"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefixes = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(_interpreter()))}
    made: set[str] = set()
    for prefix in sorted(prefixes):
        if prefix == "/usr" or prefix.startswith("/usr/"):
            continue
        parents = [str(parent) for parent in reversed(Path(prefix).parents) if str(parent) != "/"]
        for parent in parents:  # traversable by the unprivileged child, whatever the host's modes
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        argv += ["--ro-bind", prefix, prefix]
    return tuple(argv)


def _bwrap_argv(workdir: str, disk_bytes: int) -> list[str]:
    """`_bwrap_setup()` plus the run's private tmpfs of `disk_bytes` at `workdir`,
    world-writable: the child may have switched user, and no one else sees it."""
    return [
        *_bwrap_setup(),
        *("--size", str(disk_bytes), "--perms", "0777", "--tmpfs", workdir),
        *("--chdir", workdir, "--"),
    ]


def _child_argv(isolation: Isolation, workdir: str, limits: SandboxLimits) -> list[str]:
    prefix: list[str] = []
    if isolation is Isolation.BUBBLEWRAP:
        prefix = _bwrap_argv(workdir, limits.max_disk_bytes)
    elif isolation is Isolation.NAMESPACES:
        prefix = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net"]
    return [*prefix, _interpreter(), "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD_LOADER]


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


def _as_signal_death(returncode: int, isolation: Isolation) -> int:
    """bubblewrap exits 128 + n when signal n ended its child: read that as `subprocess` would
    (-n), so SIGXCPU reads the same under every isolation (a script's `sys.exit(128 + n)` too)."""
    if isolation is Isolation.BUBBLEWRAP and 128 < returncode < 128 + signal.NSIG:
        return -(returncode - 128)
    return returncode


def _supervise(
    specs: Sequence[_ChildSpec],
    limits: SandboxLimits,
    isolation: Isolation,
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
            walls = Isolation.AUDIT_HOOK if spec.trusted else isolation
            payload = {
                **spec.payload,
                "workdir": workdir,
                "max_writes": MAX_FILES_WRITTEN,
                "limits": _rlimits(limits),
                "drop_to": _drop_to(walls),
            }
            process = subprocess.Popen(
                _child_argv(walls, workdir, limits),
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
        returncodes = [
            _as_signal_death(_kill_group_and_reap(process), isolation) for process in processes
        ]
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


def sandbox_isolation() -> Isolation:
    """The isolation sandboxed runs get here: $SKILLSWARM_SANDBOX if set (an isolation that does
    not work raises SandboxUnavailable), else the strongest that works (probed once a process)."""
    global _isolation
    with _probe_lock:
        if _isolation is None:
            _isolation = _choose_isolation(os.environ.get(ISOLATION_ENV, "").strip())
        return _isolation


def _choose_isolation(wanted: str) -> Isolation:
    if wanted and wanted != "auto":
        try:
            isolation = Isolation(wanted)
        except ValueError:
            names = ", ".join(["auto", *(level.value for level in Isolation)])
            raise SandboxUnavailable(
                f"${ISOLATION_ENV}={wanted!r}: choose one of {names}"
            ) from None
        if isolation is not Isolation.AUDIT_HOOK and not _works(isolation):
            raise SandboxUnavailable(f"${ISOLATION_ENV}={wanted}: {_HOW_TO[isolation]}")
        return isolation
    for isolation in (Isolation.BUBBLEWRAP, Isolation.NAMESPACES):
        if _works(isolation):
            return isolation
    return Isolation.AUDIT_HOOK


def require_isolation(accept_weak: bool) -> Isolation:
    """The isolation runs get here, refusing anything short of kernel isolation unless
    `accept_weak` (then the caller is expected to say so where the operator sees it)."""
    isolation = sandbox_isolation()
    if not isolation.kernel and not accept_weak:
        raise SandboxUnavailable(
            f"model-written code would run with only the {isolation} sandbox here: "
            f"{_HOW_TO[Isolation.BUBBLEWRAP]}; or accept the weaker sandbox explicitly "
            "(allow_weak_sandbox = true in the node's config)"
        )
    return isolation


_HOW_TO = {
    Isolation.BUBBLEWRAP: "bwrap is missing or cannot create namespaces here (install "
    "bubblewrap; in a container, allow user namespaces: see docs/security.md)",
    Isolation.NAMESPACES: "`unshare --user --map-root-user --net` is refused here",
}


def _works(isolation: Isolation) -> bool:
    tool = "bwrap" if isolation is Isolation.BUBBLEWRAP else "unshare"
    if shutil.which(tool) is None:
        return False
    limits = SandboxLimits(wall_timeout_s=_PROBE_TIMEOUT_S)
    spec = _ChildSpec({"role": "run", "source": "print('sandbox-ok')"})
    try:
        outcome = _supervise([spec], limits, isolation)
    except OSError:
        return False
    child = outcome.children[0]
    return child.returncode == 0 and child.stdout.text().strip() == "sandbox-ok"


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
    outcome = _supervise([spec], limits, sandbox_isolation())
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
        trusted=True,
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
        sandbox_isolation(),
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
