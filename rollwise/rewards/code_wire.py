"""The wire format between the two processes of the `code_tests` harness (`rollwise.rewards.code_harness`).

Shipped into the sandbox beside the harness as `code_wire.py` and imported there by the harness before it
forks (never imported by rollwise itself); standard library only, any Python 3.8+.

- Values: `encode` writes a value as tagged JSON data; `decode` builds it again from scratch out of builtin
  types, accepting only the tags below (anything else is `Malformed`). What the judge decodes is therefore a
  genuine `int`, `str`, `list`, ... whatever object the code under test returned, never an object of its
  making: a subclass is sent as its base type, by content, and any other object stays behind as a handle.
- Messages: `send` / `receive` frame one JSON message as an 8-byte big-endian length and the bytes, capped at
  `MAX_MESSAGE_BYTES`.
"""

import builtins
import json
import os
import re
import struct

MAX_MESSAGE_BYTES = 4 << 20
MAX_DEPTH = 100
MAX_NUMBER_CHARS = 1 << 20  # hex digits of an int (Python's 4300-digit limit is for decimal only)
HEADER = struct.Struct(">Q")
PLAIN = "None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict, range"
HEX_INT = re.compile(r"-?[0-9a-f]+\Z")
CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class PipeClosed(BaseException):
    """The other process closed its pipe (it exited or was killed) or broke the framing. BaseException: a
    test's `except Exception:` cannot swallow it."""


class NotPlainData(Exception):
    """A value that is not plain data was compared, hashed or passed to the code under test."""


class Malformed(Exception):
    """A message or value that is not in the format."""


# ------------------------------------------------------------------------------------------ the value format

def encode(value, on_other, depth=0):
    """`value` as tagged JSON data: ["none"], ["bool", b], ["int", hex], ["float", repr], ["complex", re, im],
    ["str", s], ["bytes" | "bytearray", hex], ["list" | "tuple" | "set" | "frozenset", [items]],
    ["dict", [[key, value], ...]], ["range", start, stop, step], ["namedtuple", name, fields, [items]]; a
    subclass as its base type, by content; anything else `on_other(value)`."""
    if depth > MAX_DEPTH:
        raise ValueError("the value nests deeper than %d levels" % MAX_DEPTH)
    down = depth + 1
    if value is None:
        return ["none"]
    if value is True or value is False:
        return ["bool", value]
    if isinstance(value, int):
        return ["int", int.__format__(value, "x")]
    if isinstance(value, float):
        return ["float", float.__repr__(value)]
    if isinstance(value, complex):
        return ["complex", float.__repr__(value.real), float.__repr__(value.imag)]
    if isinstance(value, str):
        return ["str", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes" if isinstance(value, bytes) else "bytearray", bytes(value).hex()]
    fields = getattr(type(value), "_fields", None) if isinstance(value, tuple) else None
    if type(fields) is tuple and all(type(name) is str for name in fields):  # a namedtuple
        return ["namedtuple", str(type(value).__name__), list(fields), [encode(item, on_other, down) for item in value]]
    for tag, kind in CONTAINERS.items():
        if isinstance(value, kind):
            return [tag, [encode(item, on_other, down) for item in value]]
    if isinstance(value, dict):
        return ["dict", [[encode(k, on_other, down), encode(v, on_other, down)] for k, v in value.items()]]
    if isinstance(value, range):
        return ["range"] + [int.__format__(n, "x") for n in (value.start, value.stop, value.step)]
    return on_other(value)


def parse_number(text, kind):
    if type(text) is not str or len(text) > MAX_NUMBER_CHARS:
        raise Malformed("a number that is not text")
    if kind is int:
        if not HEX_INT.match(text):
            raise Malformed("an int that is not hex digits")
        return int(text, 16)
    try:
        return float(text)
    except ValueError:
        raise Malformed("a float that does not parse") from None


def decode(data, on_handle, depth=0, builtin_names=False):
    """The value `encode` wrote, built from scratch of builtin types (handles through `on_handle(id, type
    name)`; ["builtin", name] only with `builtin_names`: the solver reads the judge's, never the other way);
    Malformed for anything else. A set or dict key that is not hashable raises NotPlainData."""
    if depth > MAX_DEPTH:
        raise Malformed("a value nested deeper than %d levels" % MAX_DEPTH)
    if type(data) is not list or not data or type(data[0]) is not str:
        raise Malformed("not a tagged value")
    tag, size, down = data[0], len(data), depth + 1
    if tag == "none" and size == 1:
        return None
    if tag == "bool" and size == 2 and type(data[1]) is bool:
        return data[1]
    if tag == "int" and size == 2:
        return parse_number(data[1], int)
    if tag == "float" and size == 2:
        return parse_number(data[1], float)
    if tag == "complex" and size == 3:
        return complex(parse_number(data[1], float), parse_number(data[2], float))
    if tag == "str" and size == 2 and type(data[1]) is str:
        return data[1]
    if tag in ("bytes", "bytearray") and size == 2 and type(data[1]) is str:
        try:
            raw = bytes.fromhex(data[1])
        except ValueError:
            raise Malformed("bytes that are not hex digits") from None
        return raw if tag == "bytes" else bytearray(raw)
    if tag in CONTAINERS and size == 2 and type(data[1]) is list:
        items = [decode(item, on_handle, down, builtin_names) for item in data[1]]
        try:
            return CONTAINERS[tag](items)
        except TypeError as exc:  # a set of unhashable values
            raise NotPlainData("the solution's %s holds a value that cannot be hashed (%s)" % (tag, exc)) from None
    if tag == "dict" and size == 2 and type(data[1]) is list:
        if not all(type(pair) is list and len(pair) == 2 for pair in data[1]):
            raise Malformed("a dict that is not a list of pairs")
        pairs = [(decode(k, on_handle, down, builtin_names), decode(v, on_handle, down, builtin_names))
                 for k, v in data[1]]
        try:
            return dict(pairs)
        except TypeError as exc:
            raise NotPlainData("the solution's dict has a key that cannot be hashed (%s)" % exc) from None
    if tag == "range" and size == 4:
        try:
            return range(*[parse_number(n, int) for n in data[1:]])
        except ValueError:
            raise Malformed("a range with step 0") from None
    if tag == "namedtuple" and size == 4 and type(data[3]) is list:
        items = [decode(item, on_handle, down, builtin_names) for item in data[3]]
        return namedtuple_type(data[1], data[2], len(items))(*items)
    if tag == "builtin" and builtin_names and size == 2 and type(data[1]) is str and data[1] in dir(builtins):
        return getattr(builtins, data[1])
    if tag == "handle" and size == 3 and type(data[1]) is int and type(data[2]) is str:
        return on_handle(data[1], data[2][:80])
    raise Malformed("an unknown tag %r" % tag[:40])


_NAMEDTUPLES = {}


def namedtuple_type(name, fields, length):
    """A namedtuple class of the judge's own making (tuple's `==`), cached by name and fields."""
    if type(name) is not str or type(fields) is not list or not all(type(f) is str for f in fields):
        raise Malformed("a namedtuple without a name and field names")
    if len(fields) != length:
        raise Malformed("a namedtuple with %d fields and %d items" % (len(fields), length))
    key = (name, tuple(fields))
    if key not in _NAMEDTUPLES:
        from collections import namedtuple

        try:
            _NAMEDTUPLES[key] = namedtuple(name, fields)
        except (ValueError, TypeError) as exc:
            raise Malformed("a namedtuple that cannot be built: %s" % exc) from None
    return _NAMEDTUPLES[key]


# ------------------------------------------------------------------------------------------------ the pipes

def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd, size):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise PipeClosed("end of pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError("the value is over %d MB as data" % (MAX_MESSAGE_BYTES >> 20))
    write_all(fd, HEADER.pack(len(data)) + data)


def receive(fd):
    """The next message; PipeClosed at the end of the pipe or on a size over the cap; Malformed on bad JSON."""
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise PipeClosed("a message of %d bytes" % size)
    data = read_exact(fd, size)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        raise Malformed("a message that is not JSON") from None
