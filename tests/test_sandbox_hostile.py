"""Hostile candidates under the shipped sandbox (bubblewrap): code that first switches the audit
hook off through the interpreter's own objects, then tries to read the node's secrets, write
outside, reach the network, load native code, spawn processes and exhaust memory and disk. The
kernel holds each of these; the engine goes on. Skipped where bubblewrap cannot run."""

from __future__ import annotations

import ast
import socket
import threading
from pathlib import Path

import pytest
from skillswarm.agent.sandbox import (
    Isolation,
    SandboxLimits,
    run_python,
    run_tests_in_sandbox,
    sandbox_isolation,
)

pytestmark = pytest.mark.skipif(
    sandbox_isolation() is not Isolation.BUBBLEWRAP,
    reason="bubblewrap is missing or cannot create namespaces here",
)

# Finds the audit hook's function among the interpreter's objects and swaps its code for one
# that allows everything (same number of free variables, as the code setter demands); proves it
# worked by importing ctypes, which the hook refuses.
DISABLE_AUDIT_HOOK = """
import gc
for obj in gc.get_objects():
    code = getattr(obj, "__code__", None)
    if getattr(obj, "__name__", "") == "audit" and code is not None:
        names = ", ".join(f"v{i}" for i in range(len(code.co_freevars)))
        scope = {}
        exec(f"def outer({names}):\\n    def audit(event, args):\\n        ({names},)\\n"
             f"    return audit", scope)
        obj.__code__ = scope["outer"](*range(len(code.co_freevars))).__code__
import ctypes
print("HOOK-OFF")
"""


def hostile(body: str, **limits: object) -> tuple[str, str]:
    result = run_python(DISABLE_AUDIT_HOOK + body, **limits)
    assert "HOOK-OFF" in result.stdout, f"the hook was not switched off: {result.stderr}"
    return result.stdout, result.stderr


def assert_engine_goes_on() -> None:
    report = run_tests_in_sandbox(
        "def add_one(x):\n    return x + 1\n", ["assert add_one(1) == 2"], "add_one"
    )
    assert report.passed == 1 and report.error is None


def test_with_the_hook_off_the_audit_hook_no_longer_refuses_anything() -> None:
    """The premise of this file: in-process guards alone can be switched off."""
    stdout, _ = hostile("import os\nprint(sorted(os.listdir('/')))")
    top = ast.literal_eval(stdout.splitlines()[-1])
    assert "usr" in top and not {"home", "var", "proc", "sys", "work", "opt", "srv"} & set(top)


def test_the_node_key_and_secrets_beside_the_work_dir_cannot_be_read(tmp_path: Path) -> None:
    work = tmp_path / "node-work"
    work.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    key = work / "identity.key"
    key.write_bytes(b"KEY-BYTES")
    key.chmod(0o600)
    body = (
        "import os\n"
        f"for path in [{str(secret)!r}, {str(key)!r}, '/etc/passwd', '/etc/shadow',\n"
        "             os.path.expanduser('~/.ssh/id_ed25519'), '/proc/self/environ']:\n"
        "    try:\n"
        "        print('READ', path, open(path).read())\n"
        "    except OSError as error:\n"
        "        print('NO', path, type(error).__name__)\n"
        "libc = ctypes.CDLL(None)\n"
        f"print('CTYPES-OPEN', libc.open({str(secret).encode()!r}, 0))\n"
    )
    stdout, _ = hostile(body)
    assert "TOP-SECRET" not in stdout and "KEY-BYTES" not in stdout
    assert "READ" not in stdout
    assert stdout.count("NO ") == 6
    assert "CTYPES-OPEN -1" in stdout
    assert_engine_goes_on()


def test_nothing_can_be_written_outside(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    body = (
        f"for path in [{str(target)!r}, '/usr/escaped', '/escaped', '/tmp/escaped']:\n"
        "    try:\n"
        "        open(path, 'w').write('out')\n"
        "        print('WROTE', path)\n"
        "    except OSError as error:\n"
        "        print('NO', path, type(error).__name__)\n"
    )
    stdout, _ = hostile(body)
    assert not target.exists() and not Path("/escaped").exists()
    assert not Path("/usr/escaped").exists()
    for line in stdout.splitlines():  # /tmp/escaped lands in the run's own tmpfs parent at most
        if line.startswith("WROTE"):
            assert line == "WROTE /tmp/escaped", line
    assert not Path("/tmp/escaped").exists()


def test_no_socket_reaches_the_host() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, name="hostile-listener")
    thread.start()
    try:
        body = (
            "import socket\n"
            f"for family, address in [(socket.AF_INET, ('127.0.0.1', {port})),\n"
            "                        (socket.AF_INET, ('10.0.0.1', 80))]:\n"
            "    try:\n"
            "        s = socket.socket(family)\n"
            "        s.settimeout(1)\n"
            "        s.connect(address)\n"
            "        print('CONNECTED', address)\n"
            "    except OSError as error:\n"
            "        print('NO', address, type(error).__name__)\n"
        )
        stdout, _ = hostile(body)
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert "CONNECTED" not in stdout
    assert stdout.count("NO ") == 2
    assert not accepted


def test_processes_cannot_be_spawned_or_multiplied() -> None:
    body = (
        "import os, subprocess\n"
        "made = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os._exit(0)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print('FORKED', made)\n"
        "try:\n"
        "    subprocess.run(['/bin/sh', '-c', 'echo SPAWNED'], check=True)\n"
        "except OSError as error:\n"
        "    print('NO-SPAWN', type(error).__name__)\n"
    )
    stdout, _ = hostile(body)
    assert "FORKED 0" in stdout
    assert "SPAWNED" not in stdout and "NO-SPAWN" in stdout
    assert_engine_goes_on()


def test_memory_and_disk_exhaustion_are_contained() -> None:
    body = (
        "try:\n"
        "    hoard = bytearray(2 << 30)\n"
        "    print('ALLOCATED')\n"
        "except MemoryError:\n"
        "    print('NO-MEMORY')\n"
        "written = 0\n"
        "try:\n"
        "    for index in range(1000):\n"
        "        with open(f'fill{index}', 'wb') as handle:\n"
        "            handle.write(bytes(4 << 20))\n"
        "        written += 4\n"
        "except OSError as error:\n"
        "    print('DISK-FULL', written, type(error).__name__)\n"
    )
    limits = SandboxLimits()
    stdout, _ = hostile(body, max_file_bytes=8 << 20)
    assert "NO-MEMORY" in stdout and "ALLOCATED" not in stdout
    full = [line for line in stdout.splitlines() if line.startswith("DISK-FULL")]
    assert full, stdout
    assert int(full[0].split()[1]) <= limits.max_disk_bytes >> 20
    assert_engine_goes_on()


def test_a_hostile_candidate_under_test_cannot_forge_or_escape(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    code = (
        DISABLE_AUDIT_HOOK.replace('print("HOOK-OFF")', "")
        + "def add_one(x):\n"
        + f"    return open({str(secret)!r}).read()\n"
    )
    report = run_tests_in_sandbox(code, ["assert add_one(1) == 2"], "add_one")
    assert report.passed == 0
    assert "TOP-SECRET" not in str(report)
    assert_engine_goes_on()
