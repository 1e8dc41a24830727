"""Wire format: frame 0 is a msgpack header, frames 1..n are raw array buffers.

    header = {"v": PROTOCOL_VERSION, "t": TYPE tag, "f": {field: value}, "b": [[dtype, [dim, ...]], ...]}

Arrays are never copied on the way out (a memoryview over the array's memory becomes the frame) nor on the way in
(``np.frombuffer`` over the received frame), except to make a non-contiguous array contiguous or an unaligned
received buffer aligned. ``decode`` is the trust boundary: it raises ``ProtocolError`` and nothing else for any
input, and returns only messages whose every field has the annotated type.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import lru_cache
from typing import Any, Callable, Literal, Sequence, Union

import msgpack
import numpy as np

from .messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, ProtocolError, Struct, VersionMismatch

HEADER_KEYS = frozenset({"v", "t", "f", "b"})
MAX_HEADER_BYTES = 64 << 20  # a plan or a prompt chunk is far smaller; bounds what garbage can make us parse
MAX_DEPTH = 32               # nesting bound for JSON-able (Any) values
MAX_NDIM = 32
ARRAY_KINDS = "biufc"        # bool, ints, floats, complex: plain numbers only (never object or structured)

Frames = list  # list[bytes | memoryview]


# ---------------------------------------------------------------- public API


def encode(msg: Message, arrays: Sequence[np.ndarray] = ()) -> Frames:
    """Frames for ``msg`` followed by ``arrays``. Raises ProtocolError if the message breaks its own schema.

    The array frames are memoryviews over the arrays' memory: do not write into an array until it has been sent
    (``Channel.send(copy=True)`` if you must reuse the buffer at once).
    """
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise ProtocolError(f"encode: {cls.__name__} is not a registered message type")
    arrays = [_outgoing_array(a, i, msg.TYPE) for i, a in enumerate(arrays)]
    if len(arrays) > cls.MAX_ARRAYS:
        raise ProtocolError(f"{msg.TYPE}: at most {cls.MAX_ARRAYS} array(s) allowed, got {len(arrays)}")
    fields = _dump_struct(msg, msg.TYPE)
    _semantic_check(msg, arrays)
    header = {
        "v": PROTOCOL_VERSION,
        "t": msg.TYPE,
        "f": fields,
        "b": [[a.dtype.str, list(a.shape)] for a in arrays],
    }
    try:
        head = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"{msg.TYPE}: cannot pack header: {e}") from e
    # A 1-D uint8 view keeps zero-copy and gives every frame the same simple buffer format.
    return [head] + [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]


def decode(frames: Sequence[Any]) -> tuple[Message, list[np.ndarray]]:
    """(message, arrays) from received frames (bytes, memoryviews or zmq.Frame). Only ever raises ProtocolError."""
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as e:  # anything unforeseen in hostile bytes is still just a protocol error
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from e


def peek_type(frames: Sequence[Any]) -> str | None:
    """The TYPE tag of a message without validating it (for logging), or None."""
    try:
        h = msgpack.unpackb(_as_buffer(frames[0]), raw=False)
        return h.get("t") if isinstance(h, dict) and isinstance(h.get("t"), str) else None
    except Exception:
        return None


def to_dict(msg: Struct) -> dict[str, Any]:
    """The wire fields of a message as plain Python values (what goes into header "f")."""
    return _dump_struct(msg, type(msg).__name__)


def from_dict(cls: type[Struct], fields: Any) -> Struct:
    """Inverse of to_dict, with the decoder's strict validation."""
    try:
        return _load_struct(cls, fields, cls.__name__)
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"{cls.__name__}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------- decoding


def _decode(frames: Sequence[Any]) -> tuple[Message, list[np.ndarray]]:
    if isinstance(frames, (bytes, bytearray, memoryview, str)):
        raise ProtocolError("decode expects a list of frames, got a single buffer")
    frames = list(frames)
    if not frames:
        raise ProtocolError("empty message: no header frame")
    head = _as_buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {len(head)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:
        raise ProtocolError(f"header frame is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    # The version is checked before anything else: it is the one header key whose meaning never changes.
    if "v" not in header:
        raise ProtocolError("header has no protocol version 'v'")
    v = header["v"]
    if type(v) is not int or v != PROTOCOL_VERSION:
        t = header.get("t")
        raise VersionMismatch(v if type(v) is int else repr(v), what=t if isinstance(t, str) else "")
    if set(header) != HEADER_KEYS:
        raise ProtocolError(f"header keys {sorted(map(str, header))} != {sorted(HEADER_KEYS)}")
    tag = header["t"]
    if not isinstance(tag, str) or tag not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {tag!r}")
    cls = MESSAGE_TYPES[tag]
    specs = header["b"]
    if not isinstance(specs, list):
        raise ProtocolError(f"{tag}: buffer list 'b' must be a list")
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"{tag}: header announces {len(specs)} buffer(s), {len(frames) - 1} frame(s) follow")
    if len(specs) > cls.MAX_ARRAYS:
        raise ProtocolError(f"{tag}: at most {cls.MAX_ARRAYS} buffer(s) allowed, got {len(specs)}")
    arrays = [_incoming_array(spec, frames[i + 1], i, tag) for i, spec in enumerate(specs)]
    msg = _load_struct(cls, header["f"], tag)
    _semantic_check(msg, arrays)
    return msg, arrays


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes its memory as .buffer
    if isinstance(buf, str):
        raise ProtocolError("frame is a str, expected bytes")
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _parse_dtype(s: Any, where: str) -> np.dtype:
    if not isinstance(s, str) or not 0 < len(s) <= 16:
        raise ProtocolError(f"{where}: dtype must be a short string, got {s!r}")
    dt = _plain_dtype(s)
    if dt is None:
        raise ProtocolError(f"{where}: dtype {s!r} is not a plain numeric type")
    return dt


@lru_cache(maxsize=256)
def _plain_dtype(s: str) -> np.dtype | None:
    try:
        dt = np.dtype(s)
    except Exception:
        return None
    if dt.kind not in ARRAY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        return None
    return dt


def _incoming_array(spec: Any, frame: Any, i: int, tag: str) -> np.ndarray:
    where = f"{tag}: buffer {i}"
    if not (isinstance(spec, list) and len(spec) == 2):
        raise ProtocolError(f"{where}: spec must be [dtype, shape], got {spec!r:.80}")
    dt = _parse_dtype(spec[0], where)
    shape = spec[1]
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"{where}: shape must be a list of <= {MAX_NDIM} ints >= 0, got {shape!r:.80}")
    buf = _as_buffer(frame)
    count = math.prod(shape)
    if count * dt.itemsize != len(buf):
        raise ProtocolError(
            f"{where}: {dt.str}{shape} needs {count * dt.itemsize} bytes, frame has {len(buf)}")
    arr = np.frombuffer(buf, dtype=dt, count=count).reshape(shape)
    if not arr.flags.aligned:  # zmq may hand out frames at odd offsets of its receive buffer
        arr = arr.copy()
    return arr


def _semantic_check(msg: Struct, arrays: list) -> None:
    try:
        msg.check(arrays)
    except ValueError as e:
        raise ProtocolError(f"{getattr(type(msg), 'TYPE', '') or type(msg).__name__}: {e}") from None


# ---------------------------------------------------------------- schema: annotations compiled to checkers once
#
# Each annotation becomes a pair of closures: load(v, path) validates a decoded value, dump(v, path) normalises an
# outgoing one (numpy scalars → Python, tuples → lists) and validates it. Compiled once per type, so a decode
# costs a few µs rather than a walk through typing introspection per field.

Checker = Callable[[Any, str], Any]


@lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[tuple[str, Checker, Checker], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, *_checkers(hints[f.name])) for f in dataclasses.fields(cls))


def _load_struct(cls: type, raw: Any, path: str) -> Any:
    if type(raw) is not dict:
        raise ProtocolError(f"{path}: expected a map of fields, got {type(raw).__name__}")
    schema = _schema(cls)
    if len(raw) != len(schema) or any(n not in raw for n, _, _ in schema):
        missing = [n for n, _, _ in schema if n not in raw]
        extra = [k for k in raw if k not in {n for n, _, _ in schema}]
        raise ProtocolError(f"{path}: missing fields {missing}, unexpected fields {extra}")
    obj = cls(**{n: load(raw[n], path + "." + n) for n, load, _ in schema})
    if not issubclass(cls, Message):  # a message is checked by _decode, together with its arrays
        _semantic_check(obj, [])
    return obj


def _dump_struct(obj: Any, path: str) -> dict[str, Any]:
    return {n: dump(getattr(obj, n), path + "." + n) for n, _, dump in _schema(type(obj))}


def _mistyped(path: str, tp: Any, v: Any) -> ProtocolError:
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    return ProtocolError(f"{path}: expected {name}, got {type(v).__name__}")


@lru_cache(maxsize=None)
def _checkers(tp: Any) -> tuple[Checker, Checker]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return (lambda v, p: _check_json(v, p, 0)), (lambda v, p: _check_json(_plain(v, 0), p, 0))
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is used in messages.py
        il, idump = _checkers(inner)
        return (lambda v, p: None if v is None else il(v, p)), (lambda v, p: None if v is None else idump(v, p))
    if origin is Literal:
        allowed = frozenset(args)

        def lit(v: Any, p: str) -> Any:
            if type(v) is str and v in allowed:
                return v
            raise ProtocolError(f"{p}: expected one of {list(args)}, got {v!r:.80}")
        return lit, lit
    if origin is list:
        il, idump = _checkers(args[0])
        scalar = args[0] if args[0] in (int, str) else None

        def load_list(v: Any, p: str) -> Any:
            if type(v) is not list:
                raise _mistyped(p, tp, v)
            if scalar is not None and all(type(x) is scalar for x in v):
                return v  # fast path: a prompt chunk of token ids
            return [il(x, f"{p}[{i}]") for i, x in enumerate(v)]

        def dump_list(v: Any, p: str) -> Any:
            if type(v) not in (list, tuple):
                raise _mistyped(p, tp, v)
            return [idump(x, f"{p}[{i}]") for i, x in enumerate(v)]
        return load_list, dump_list
    if origin is dict:
        assert args[0] is str, f"message maps are keyed by str, not {args[0]}"
        vl, vdump = _checkers(args[1])

        def mapping(check: Checker) -> Checker:
            def run(v: Any, p: str) -> Any:
                if type(v) is not dict:
                    raise _mistyped(p, tp, v)
                for k in v:
                    if type(k) is not str:
                        raise ProtocolError(f"{p}: map keys must be str, got {type(k).__name__}")
                return {k: check(x, f"{p}[{k!r}]") for k, x in v.items()}
            return run
        return mapping(vl), mapping(vdump)
    if isinstance(tp, type) and issubclass(tp, Struct):
        def dump_struct(v: Any, p: str) -> Any:
            if not isinstance(v, tp):
                raise _mistyped(p, tp, v)
            _semantic_check(v, [])
            return _dump_struct(v, p)
        return (lambda v, p: _load_struct(tp, v, p)), dump_struct
    if tp is float:
        def load_float(v: Any, p: str) -> Any:
            if type(v) is float or type(v) is int:
                return float(v)
            raise _mistyped(p, tp, v)

        def dump_float(v: Any, p: str) -> Any:
            if isinstance(v, (np.floating, np.integer)):
                v = float(v)
            return load_float(v, p)
        return load_float, dump_float
    if tp in (int, str, bool, bytes):
        np_kind = {int: np.integer, bool: np.bool_, str: np.str_, bytes: np.bytes_}[tp]

        def load_exact(v: Any, p: str) -> Any:
            if type(v) is tp:  # exact: a bool is not an int here, and str/bytes never mix
                return v
            raise _mistyped(p, tp, v)

        def dump_exact(v: Any, p: str) -> Any:
            if isinstance(v, np_kind):
                v = v.item()
            elif tp is bytes and isinstance(v, (bytearray, memoryview)):
                v = bytes(v)
            return load_exact(v, p)
        return load_exact, dump_exact
    raise TypeError(f"unsupported schema type {tp!r}")  # a bug in messages.py, caught by the round-trip tests


def _check_json(v: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{path}: nested deeper than {MAX_DEPTH}")
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [_check_json(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if type(v) is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise ProtocolError(f"{path}: JSON keys must be str, got {type(k).__name__}")
            out[k] = _check_json(x, f"{path}[{k!r}]", depth + 1)
        return out
    raise ProtocolError(f"{path}: {type(v).__name__} is not a JSON value")


def _plain(v: Any, depth: int) -> Any:
    """Best-effort conversion of a JSON-ish value built with numpy scalars or tuples into plain Python."""
    if depth > MAX_DEPTH:
        return v
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    return v


# ---------------------------------------------------------------- encoding


def _outgoing_array(a: Any, i: int, tag: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ProtocolError(f"{tag}: array {i} is a {type(a).__name__}, expected numpy.ndarray "
                            "(device arrays travel through CUDA IPC, see cuda_ipc.py)")
    _parse_dtype(a.dtype.str, f"{tag}: array {i}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


__all__ = ["encode", "decode", "peek_type", "to_dict", "from_dict", "ProtocolError", "VersionMismatch",
           "MAX_HEADER_BYTES", "ARRAY_KINDS"]
