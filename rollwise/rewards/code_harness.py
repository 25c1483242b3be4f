"""The `code_tests` harness: the program that runs INSIDE the sandbox as `main.py`, under the system Python.

Never imported by rollwise itself (`rollwise.rewards.code` passes its source to the sandbox); standard library
only, any Python 3.8+. Input: stdin holds the 64-hex-digit key on its first line, then the JSON list of test
items `{"kind": "test" | "setup", "src"}`; the code under test is `solution.py` beside it.

Two processes, so that the code under test never shares an interpreter with the tests:

- The SOLVER is forked first, before anything secret is read, and waits. It then runs `solution.py` and
  answers requests over a pipe: a global name's value, a call, an attribute, an item, iteration, len, bool,
  str. An answer is plain data in a tagged form (`encode`); any other value stays in the solver as a handle.
  Its stdin is /dev/null and its stdout goes to stderr: stdout carries only the judge's signed records.
- The JUDGE (this process) makes itself non-dumpable (no process of the sandbox uid can then read its memory,
  ptrace it or open its /proc fds), reads stdin and empties it (`ftruncate`: the stdin memfd, which the
  sandbox's wrapper also holds, no longer has the key or the tests), then lets the solver load the code. It
  runs every test itself, in its own namespace where names resolve to the test's own definitions, then
  Python's builtins, then the solution's globals (as fresh builtin objects decoded by `decode`, which accepts
  only None, bool, int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict and range, or
  as `Remote` handles). A test's `==` therefore compares genuine builtin values; the expected side never leaves
  the judge; a value that is not plain data cannot be compared or hashed (`NotPlainData`: the test fails and
  says why). A solution's function that shadows a builtin name (say `max`) is not what the tests call.
The value format and the framing are `code_wire.py` (rollwise.rewards.code_wire), shipped beside this file and
imported before the fork.

Output: one line per record on stdout, `MARK HMAC JSON`, HMAC-SHA256 of JSON under the key; the host keeps only
lines whose HMAC checks. Records: `{"i", "ok", "error"}` per test, `{"load_error"}`, `{"harness_error"}` (the
judge cannot protect itself: a sandbox failure), `{"done": true}`. When the solver dies (a CPU limit,
`os._exit`), the tests not yet reported stay unreported and the judge ends the same way (same signal or exit
code), so the sandbox names the cause as it does for a one-process program.
"""

import ast
import builtins
import json
import operator
import os
import signal
import stat
import sys
import time
import traceback
import types

from code_wire import PLAIN, Malformed, NotPlainData, PipeClosed, decode, encode, receive, send, write_all

MARK = "ROLLWISE-TEST"
MAX_SHOWN_CHARS = 200  # of a value in a failure message
MAX_ERROR_CHARS = 300  # of an error text (a record stays under PIPE_BUF, so it is written in one piece)
MAX_ITEMS = 100000  # of one iteration over a solution's value
SOLVER_EXIT_WAIT_S = 1.0
HMAC_BLOCK_BYTES = 64  # SHA-256's block size
# exceptions of the solution re-raised as themselves in the judge (so `except ValueError:` in a test works)
KNOWN_ERRORS = {cls.__name__: cls for cls in (
    ArithmeticError, AssertionError, AttributeError, EOFError, Exception, ImportError, IndexError, KeyError,
    LookupError, MemoryError, ModuleNotFoundError, NameError, NotImplementedError, OverflowError, RecursionError,
    RuntimeError, TypeError, UnboundLocalError, UnicodeError, ValueError, ZeroDivisionError)}
COMPARE = {ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne), ast.Lt: ("<", operator.lt),
           ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge),
           ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not),
           ast.In: ("in", lambda a, b: a in b), ast.NotIn: ("not in", lambda a, b: a not in b)}


class SolutionError(Exception):
    """The solution raised an exception the judge does not re-create by type (its text is the message)."""


# ------------------------------------------------------------------------------------------------ the solver

def where(exc):
    """'line N of your code: Type: message' of an exception of the solution."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "solution.py"]
    line = "line %d of your code: " % frames[-1].lineno if frames else ""
    return (line + "".join(traceback.format_exception_only(type(exc), exc)).strip())[:MAX_ERROR_CHARS]


def isolate_solver(request_fd, reply_fd):
    """The solver's descriptors: stdin /dev/null, stdout to stderr, nothing else but its two pipe ends."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    keep = sorted((request_fd, reply_fd))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 4096)


def solver(request_fd, reply_fd):
    """Wait for the judge's go, run solution.py, then answer requests until the pipe closes."""
    isolate_solver(request_fd, reply_fd)
    handles = {}

    def keep(value):
        handles[len(handles) + 1] = value
        try:
            name = str(type(value).__name__)
        except BaseException:
            name = "object"
        return ["handle", len(handles), name[:80]]

    def handle_of(number, _type_name):
        return handles[number]

    def argument(data):
        return decode(data, handle_of, builtin_names=True)

    namespace = {"__name__": "__main__"}
    operations = {
        "call": lambda r: handles[r["h"]](*[argument(a) for a in r["args"]],
                                         **{k: argument(v) for k, v in r["kwargs"]}),
        "attr": lambda r: getattr(handles[r["h"]], r["name"]),
        "setattr": lambda r: setattr(handles[r["h"]], r["name"], argument(r["value"])),
        "item": lambda r: handles[r["h"]][argument(r["key"])],
        "iter": lambda r: bounded_list(handles[r["h"]]),
        "len": lambda r: len(handles[r["h"]]),
        "bool": lambda r: bool(handles[r["h"]]),
        "str": lambda r: str(handles[r["h"]]),
        "names": lambda r: sorted(name for name in namespace if not name.startswith("_")),
    }
    receive(request_fd)  # the go: sent once the judge has read and erased its input
    try:
        with open("solution.py", encoding="utf-8") as handle:
            exec(compile(handle.read(), "solution.py", "exec"), namespace)
        reply = {"value": ["none"]}
    except BaseException as exc:
        reply = {"error": where(exc), "type": type(exc).__name__}
    while True:
        try:
            send(reply_fd, reply)
        except BaseException as exc:  # too large, or a value that broke json
            send(reply_fd, {"error": "%s: %s" % (type(exc).__name__, str(exc)[:MAX_ERROR_CHARS]),
                            "type": "ValueError"})
        request = receive(request_fd)
        try:
            if request["op"] == "name":
                name = request["name"]
                reply = {"value": encode(namespace[name], keep)} if name in namespace else {"undefined": True}
            else:
                reply = {"value": encode(operations[request["op"]](request), keep)}
        except BaseException as exc:
            reply = {"error": where(exc), "type": type(exc).__name__}


def bounded_list(value):
    items = []
    for item in value:
        items.append(item)
        if len(items) > MAX_ITEMS:
            raise ValueError("iterating the value gave over %d items" % MAX_ITEMS)
    return items


# ------------------------------------------------------------------------------------------------- the judge

class Judge:
    """Asks the solver for values; runs the tests; writes signed records."""

    def __init__(self, solver_pid, request_fd, reply_fd, key):
        self.solver_pid, self.request_fd, self.reply_fd, self.key = solver_pid, request_fd, reply_fd, key

    def report(self, record):
        payload = json.dumps(record)
        mac = hmac_sha256(self.key, payload.encode("ascii"))
        write_all(1, ("\n%s %s %s\n" % (MARK, mac, payload)).encode("ascii"))

    def ask(self, request):
        """The solver's reply to `request` (a dict); raises PipeClosed, Malformed."""
        try:
            send(self.request_fd, request)
        except OSError:
            raise PipeClosed("the pipe to the solver is closed") from None
        reply = receive(self.reply_fd)
        if type(reply) is not dict:
            raise Malformed("a reply that is not an object")
        return reply

    def value(self, request):
        """The solver's answer as a value of the judge's own making; the solution's exception re-raised."""
        reply = self.ask(request)
        if "error" in reply:
            raise solution_error(reply)
        if "value" not in reply:
            raise Malformed("a reply without a value")
        return decode(reply["value"], self.remote)

    def remote(self, number, type_name):
        return Remote(self, number, type_name)

    def argument(self, value):
        def other(v):
            if type(v) is Remote:
                return ["handle", v._number, v._type_name]
            if getattr(builtins, str(getattr(v, "__name__", "")), None) is v:  # abs, len, int, ...
                return ["builtin", v.__name__]
            raise NotPlainData("the test passes a %s to the solution; only plain data (%s) or the solution's own "
                               "values can be passed" % (type(v).__name__, PLAIN))
        return encode(value, other)

    def bind_names(self, tree, names, bound):
        """Bind the solution's globals that `tree` names, unless the test or builtins define them."""
        for name in sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}):
            if (name in names and not (name in bound and names[name] is bound[name])) or hasattr(builtins, name):
                continue
            reply = self.ask({"op": "name", "name": name})
            if reply.get("undefined") is True:
                if name in bound:
                    del names[name], bound[name]
                continue
            if "error" in reply:
                raise solution_error(reply)
            names[name] = bound[name] = decode(reply.get("value"), self.remote)

    def run(self, items):
        load = self.ask({"op": "go"})
        if "error" in load:
            self.report({"load_error": str(load["error"])[:MAX_ERROR_CHARS]})
            return
        names, bound, setup_error = {"__name__": "__test__", "__builtins__": builtins}, {}, None
        for i, item in enumerate(items):
            is_test = item["kind"] == "test"
            if setup_error is not None:
                if is_test:
                    self.report({"i": i, "ok": False, "error": "setup failed: " + setup_error})
                continue
            try:
                self.run_item(i, item["src"], names, bound)
            except PipeClosed:
                raise
            except BaseException as exc:
                if is_test:
                    self.report({"i": i, "ok": False, "error": describe(exc)})
                else:
                    setup_error = describe(exc)
                continue
            if is_test:
                self.report({"i": i, "ok": True})
        self.report({"done": True})

    def run_item(self, i, src, names, bound):
        filename = "<test %d>" % i
        tree = ast.parse(src, filename)
        self.bind_names(tree, names, bound)
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
            check_assert(tree.body[0], names, filename)
        else:
            exec(compile(tree, filename, "exec"), names)


class SolutionModule(types.ModuleType):
    """`sys.modules["solution"]` in the judge: `import solution` / `from solution import f` in a test read the
    solver's globals (never run solution.py in the judge)."""

    def __init__(self, judge):
        super().__init__("solution")
        self._judge = judge

    def __getattr__(self, name):
        if name == "__all__":
            return self._judge.value({"op": "names"})
        if name.startswith("__"):
            raise AttributeError(name)
        reply = self._judge.ask({"op": "name", "name": name})
        if reply.get("undefined") is True:
            raise AttributeError("module 'solution' has no attribute %r" % name)
        if "error" in reply:
            raise solution_error(reply)
        return decode(reply.get("value"), self._judge.remote)


class Remote(object):
    """A value that stays in the solver (not plain data): attributes, calls, items, iteration, len, bool and
    str are asked of the solver and come back decoded; `==`, `<`, `hash` ... raise NotPlainData."""

    __slots__ = ("_judge", "_number", "_type_name")

    def __init__(self, judge, number, type_name):
        object.__setattr__(self, "_judge", judge)
        object.__setattr__(self, "_number", number)
        object.__setattr__(self, "_type_name", type_name)

    def _ask(self, op, **fields):
        fields.update(op=op, h=self._number)
        return self._judge.value(fields)

    def __getattr__(self, name):
        return self._ask("attr", name=name)

    def __setattr__(self, name, value):
        self._ask("setattr", name=name, value=self._judge.argument(value))

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=[self._judge.argument(a) for a in args],
                         kwargs=[[k, self._judge.argument(v)] for k, v in kwargs.items()])

    def __getitem__(self, key):
        return self._ask("item", key=self._judge.argument(key))

    def __iter__(self):
        return iter(self._ask("iter"))

    def __len__(self):
        return checked(self._ask("len"), int, "len()")

    def __bool__(self):
        return checked(self._ask("bool"), bool, "bool()")

    def __str__(self):
        return checked(self._ask("str"), str, "str()")

    def __repr__(self):
        return "<%s object of the solution>" % self._type_name

    def _refuse(self, *other):
        raise NotPlainData("the solution's value of type %s is not plain data (%s), so the test cannot compare or "
                           "hash it" % (self._type_name, PLAIN))

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _refuse


def checked(value, kind, what):
    if type(value) is not kind:
        raise NotPlainData("%s of the solution's value gave a %s, not a %s" % (what, type(value).__name__,
                                                                             kind.__name__))
    return value


def solution_error(reply):
    """The solution's exception as the judge's own: the builtin type when known, else SolutionError."""
    text = str(reply.get("error"))[:MAX_ERROR_CHARS]
    kind = KNOWN_ERRORS.get(reply.get("type") if type(reply.get("type")) is str else "", SolutionError)
    try:
        exc = kind(text)
    except Exception:
        exc = SolutionError(text)
    exc.solution_text = text
    return exc


def describe(exc):
    """A failed test's error text: the solution's own for its exceptions, else 'Type: message'."""
    text = getattr(exc, "solution_text", None)
    if text is None and isinstance(exc, AssertionError):
        text = str(exc) or "assertion failed"
    if text is None and isinstance(exc, NotPlainData):
        text = str(exc)
    if text is None and isinstance(exc, Malformed):
        text = "the solution's process sent a reply that cannot be read (%s)" % exc
    if text is None:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[:MAX_ERROR_CHARS]


def shown(value):
    """`repr(value)` cut to MAX_SHOWN_CHARS (an int too long for `repr` is shown by its size)."""
    try:
        text = repr(value)
    except ValueError:
        text = "<an int of %d bits>" % value.bit_length() if isinstance(value, int) else "<a value>"
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def evaluate(node, names, filename):
    return eval(compile(ast.Expression(node), filename, "eval"), names)


def check_assert(node, names, filename):
    """Run `assert TEST[, MSG]` in the judge; a single comparison is evaluated side by side for the message."""
    test = node.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in COMPARE:
        left = evaluate(test.left, names, filename)
        right = evaluate(test.comparators[0], names, filename)
        symbol, compare = COMPARE[type(test.ops[0])]
        holds = compare(left, right)
        detail = lambda: ("got %s, expected %s" % (shown(left), shown(right)) if symbol == "==" else
                          "%s %s %s is false" % (shown(left), symbol, shown(right)))
    else:
        holds, detail = evaluate(test, names, filename), lambda: "assertion failed"
    if not holds:
        message = None
        if node.msg is not None:
            try:
                message = str(evaluate(node.msg, names, filename))
            except PipeClosed:
                raise
            except BaseException:
                message = None
        raise AssertionError(message or detail())


# ------------------------------------------------------------------------------------------------------ main

def sha256_function():
    """SHA-256 without loading OpenSSL (`hashlib` costs about 3 ms of start-up per scoring)."""
    for module in ("_sha2", "_sha256"):  # Python 3.12+, then 3.8-3.11
        try:
            return __import__(module).sha256
        except (ImportError, AttributeError):
            continue
    import hashlib

    return hashlib.sha256


def hmac_sha256(key, data):
    """HMAC-SHA256 (RFC 2104) of `data` under `key` (at most 64 bytes), as hex: what `hmac.new(key, data,
    'sha256').hexdigest()` gives, without the `hmac` module's OpenSSL import."""
    sha256 = sha256_function()
    padded = key.ljust(HMAC_BLOCK_BYTES, b"\0")
    inner = sha256(bytes(b ^ 0x36 for b in padded) + data).digest()
    return sha256(bytes(b ^ 0x5C for b in padded) + inner).hexdigest()


def make_undumpable():
    """PR_SET_DUMPABLE 0 on this process; True when it holds."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        return libc.prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE
    except Exception:
        return False


def read_input():
    """All of stdin, then erase it where it can be erased (a memfd or file: `ftruncate`); (data, erased)."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    erased = not stat.S_ISREG(os.fstat(0).st_mode)  # a pipe is emptied by reading it
    try:
        os.ftruncate(0, 0)
        erased = True
    except OSError:
        pass
    return b"".join(chunks), erased


def seal_imports(judge):
    """Import only from the standard library from now on: drop the work dir (where the solver can write, say,
    `statistics.py`) from `sys.path`, import now what the judge would load later, and make `solution` the
    solver's module (`SolutionModule`), so no code of the solution ever runs in the judge."""
    here = os.path.dirname(os.path.abspath(__file__))
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) not in (here, cwd)]
    sys.path_importer_cache.clear()
    import collections  # noqa: F401  (namedtuples)

    sha256_function()
    sys.modules["solution"] = SolutionModule(judge)


def end_like_solver(pid):
    """Reap the solver (killing it if it is still alive after a short wait) and end with its status."""
    deadline = time.monotonic() + SOLVER_EXIT_WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main():
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the solver: forked before the judge read its input, so its memory holds none of it
        try:
            os.close(request_w)
            os.close(reply_r)
            solver(request_r, reply_w)
        except PipeClosed:
            os._exit(0)
        except BaseException:
            os._exit(1)
        os._exit(0)
    os.close(request_r)
    os.close(reply_w)
    sys.stdout = sys.stderr  # a test's print() must not reach the record channel
    protected = make_undumpable()
    data, erased = read_input()
    key_hex, _, body = data.partition(b"\n")
    judge = Judge(pid, request_w, reply_r, bytes.fromhex(key_hex.decode("ascii")))
    if not (protected and erased):
        judge.report({"harness_error": "cannot make the judge non-dumpable (prctl via ctypes)" if not protected
                      else "cannot erase the judge's input (stdin is a read-only file)"})
        os.kill(pid, signal.SIGKILL)
        os._exit(0)
    items = json.loads(body.decode("utf-8"))
    seal_imports(judge)
    try:
        judge.run(items)
    except PipeClosed:
        end_like_solver(pid)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
