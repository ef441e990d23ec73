"""The program every sandboxed process runs (`python -I -S -B`); `skillswarm.agent.sandbox` sends
it compiled, ahead of its payload.

It reads its payload (marshal
data from the trusted parent) from stdin, sets its rlimits, installs the audit hook and then
plays one role: "run" (execute a script), "candidate" (load untrusted code and answer calls to
its function) or "tests" (run the tests, calling the candidate over pipes, and write
token-prefixed results to the report pipe). Calls go to the candidate as marshal data; its
replies come back as the text of Python literals, which the runner reads with a strict literal
parser (never eval, never unmarshal). It imports only built-in modules, to start fast.
"""

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


def drop_privileges(drop_to):
    if drop_to is not None:
        uid, gid = drop_to
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


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
    denied_modules = frozenset(
        {
            "ctypes",
            "_ctypes",
            "_ctypes_test",
            "_posixsubprocess",
            "multiprocessing",
            "_multiprocessing",
            "_posixshmem",
            "_xxsubinterpreters",
            "_xxinterpchannels",
            "_testcapi",
            "_testinternalcapi",
            "_testbuffer",
            "_testmultiphase",
            "_testimportmultiple",
            "_testclinic",
            "_sqlite3",
            "_dbm",
            "_gdbm",
            "_tkinter",
            "_curses",
            "_curses_panel",
            "readline",
        }
    )
    denied_events = frozenset(
        {
            "os.fork",
            "os.forkpty",
            "os.system",
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "os.kill",
            "os.killpg",
            "os.startfile",
            "os.link",
            "os.symlink",
            "os.chmod",
            "os.chown",
            "os.chflags",
            "os.lchflags",
            "os.setxattr",
            "os.removexattr",
            "subprocess.Popen",
            "signal.pthread_kill",
            "resource.setrlimit",
            "resource.prlimit",
            "sys.addaudithook",
            "syslog.openlog",
            "syslog.syslog",
        }
    )
    denied_prefixes = (
        "ctypes.",
        "socket.",
        "sqlite3.",
        "dbm.",
        "http.",
        "urllib.",
        "ftplib.",
        "smtplib.",
        "poplib.",
        "imaplib.",
        "nntplib.",
        "telnetlib.",
        "webbrowser.",
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
        data = data[os.write(fd, data) :]


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
    drop_privileges(payload.get("drop_to"))
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


if __name__ == "__main__":
    main()
