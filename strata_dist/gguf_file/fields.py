"""Reading a GGUF header through bounds: every length, count and nesting depth is checked against
the bytes the file actually has before anything is allocated or looped over, so a file of a few
bytes that declares an array of 2^62 elements (or 5,000 arrays nested in each other) is refused at
once instead of hanging. Then the tensor table: each tensor's type and shape give its size, and the
offsets must be aligned, inside the file and packed one after the other the way a writer lays them
out (overlap, or a gap a declared type leaves, means the offsets or the types are wrong).

Problems are `HeaderProblem`s naming the key or the tensor; gguf_file/reader.py turns them into a
GGUFError naming the file too.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                     # a tensor has at most 4 dimensions (the format's limit)
MAX_ARRAY_NESTING = 2            # an array of arrays at most; no model key nests deeper
# Caps far above any model's (a vocabulary of ~2.6e5 tokens and ~5e5 merges, ~50 keys, ~2,000
# tensors), so a file of legal size cannot make the reader build millions of objects either
MAX_STRING_ARRAY = 1 << 22       # entries of one string array
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
HEADER_BYTES = 4 + 4 + 8 + 8     # magic, version, tensor count, key count
MIN_KV_BYTES = 8 + 4 + 1         # an empty key, its type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8   # an empty name, n_dims 0, its type, its offset

VT = GGUFValueType
# fixed-size value types: their struct format (little-endian)
_SCALAR_FORMAT = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
_SCALAR_DTYPE = {
    VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
    VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "<u1", VT.UINT64: "<u8", VT.INT64: "<i8",
    VT.FLOAT64: "<f8",
}
# the fewest bytes one element of an array of this type can take
_MIN_ELEMENT_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR_FORMAT.items()},
                      VT.STRING: 8, VT.ARRAY: 4 + 8}


class HeaderProblem(Exception):
    """What is wrong, and the key or tensor it is wrong in (or neither: the fixed header)."""

    def __init__(self, message: str, key: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.key, self.tensor = key, tensor


@dataclass(frozen=True)
class Field:
    """One metadata value. Strings stay bytes until asked for (a bad one is named then);
    numeric arrays are numpy arrays, string arrays lists of bytes, nested arrays lists of Fields."""
    type: GGUFValueType
    value: object
    element_type: GGUFValueType | None = None     # for arrays


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]        # GGUF order (ne): the row length first
    relative_offset: int         # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    version: int
    fields: dict[str, Field]
    tensors: list[TensorEntry]
    alignment: int
    data_offset: int             # where the data section starts: the header's end, aligned


class _Cursor:
    """Reads little-endian values from a buffer, never past its end."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0
        self.key: str | None = None       # the key being read, for the message

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise HeaderProblem(f"{what} needs {n} bytes at offset {self.pos} but the file has "
                                f"only {self.left()} left (truncated or corrupt)", key=self.key)

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", f"the length of {what}")
        if n > self.left():
            raise HeaderProblem(f"{what} declares {n} bytes but the file has only {self.left()} "
                                f"left", key=self.key)
        out = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return out


def _value_type(raw: int, cur: _Cursor, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise HeaderProblem(f"{what} has unknown value type {raw}", key=cur.key) from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, depth: int) -> Field:
    if vtype in _SCALAR_FORMAT:
        return Field(vtype, cur.unpack(_SCALAR_FORMAT[vtype], "the value"))
    if vtype == VT.STRING:
        return Field(vtype, cur.string("the string"))
    # an array: its element type, its length, then the elements
    if depth >= MAX_ARRAY_NESTING:
        raise HeaderProblem(f"arrays nested more than {MAX_ARRAY_NESTING} deep", key=cur.key)
    etype = _value_type(cur.unpack("<I", "the array's element type"), cur, "the array")
    count = cur.unpack("<Q", "the array's length")
    least = count * _MIN_ELEMENT_BYTES[etype]
    if least > cur.left():
        raise HeaderProblem(f"an array of {count} {etype.name} elements needs at least {least} "
                            f"bytes but the file has only {cur.left()} left", key=cur.key)
    if etype in _SCALAR_DTYPE:
        values = np.frombuffer(cur.buf, dtype=_SCALAR_DTYPE[etype], count=count, offset=cur.pos)
        cur.pos += least
        return Field(vtype, values.astype(bool) if etype == VT.BOOL else values.copy(), etype)
    if etype == VT.STRING:
        if count > MAX_STRING_ARRAY:
            raise HeaderProblem(f"an array of {count} strings is more than the "
                                f"{MAX_STRING_ARRAY} this reader takes", key=cur.key)
        return Field(vtype, [cur.string("a string of the array") for _ in range(count)], etype)
    return Field(vtype, [_read_value(cur, VT.ARRAY, depth + 1) for _ in range(count)], etype)


def _decode_name(raw: bytes, what: str, **where) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderProblem(f"{what} is not valid UTF-8 (byte {e.start})", **where) from None


def parse_header(path: str) -> tuple[Header, int]:
    """(the header, the file's size) of a GGUF file, every part read through bounds."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < HEADER_BYTES:
            raise HeaderProblem(f"{size} bytes is shorter than a GGUF header ({HEADER_BYTES})")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size), size


def _parse(buf, size: int) -> Header:
    cur = _Cursor(buf, size)
    magic = bytes(buf[:4])
    cur.pos = 4
    if magic != MAGIC:
        raise HeaderProblem(f"bad magic {magic!r} (a GGUF file starts with {MAGIC!r})")
    version = cur.unpack("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        swapped = version & 0xFFFF == 0
        raise HeaderProblem("a big-endian GGUF file is not supported" if swapped else
                            f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the key count")
    if n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > cur.left():
        raise HeaderProblem(f"the header declares {n_kv} keys and {n_tensors} tensors, more than "
                            f"a file of {size} bytes can hold")
    if n_kv > MAX_KEYS or n_tensors > MAX_TENSORS:
        raise HeaderProblem(f"the header declares {n_kv} keys and {n_tensors} tensors; this "
                            f"reader takes at most {MAX_KEYS} keys and {MAX_TENSORS} tensors")

    fields: dict[str, Field] = {}
    for i in range(n_kv):
        cur.key = None
        key = _decode_name(cur.string(f"key #{i}"), f"key #{i}'s name")
        cur.key = key
        if key in fields:
            raise HeaderProblem("appears twice", key=key)
        vtype = _value_type(cur.unpack("<I", "the value type"), cur, "the value")
        fields[key] = _read_value(cur, vtype, 0)
    cur.key = None

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        field = fields["general.alignment"]
        alignment = int(field.value) if field.type == VT.UINT32 else 0
        if alignment <= 0 or alignment & (alignment - 1):
            raise HeaderProblem(f"is {field.value!r} ({field.type.name}); it must be a power of "
                                f"two (UINT32)", key="general.alignment")

    entries, seen = [], set()
    for i in range(n_tensors):
        name = _decode_name(cur.string(f"tensor #{i}'s name"), f"tensor #{i}'s name")
        if name in seen:
            raise HeaderProblem("appears twice in the tensor table", tensor=name)
        seen.add(name)
        entries.append(_tensor_entry(cur, name))
    data_offset = -(-cur.pos // alignment) * alignment
    return Header(version, fields, entries, alignment, data_offset)


def _tensor_entry(cur: _Cursor, name: str) -> TensorEntry:
    def problem(message: str) -> HeaderProblem:
        return HeaderProblem(message, tensor=name)

    n_dims = cur.unpack("<I", f"tensor '{name}''s dimension count")
    if n_dims > MAX_DIMS:
        raise problem(f"has {n_dims} dimensions; at most {MAX_DIMS}")
    dims = tuple(cur.unpack("<q", f"tensor '{name}''s dimensions") for _ in range(n_dims))
    raw_type = cur.unpack("<I", f"tensor '{name}''s type")
    offset = cur.unpack("<Q", f"tensor '{name}''s offset")
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise problem(f"unknown GGML type {raw_type}") from None
    if any(d < 0 for d in dims):
        raise problem(f"has a negative dimension {list(dims)}")
    n_elems = 1
    for d in dims:
        n_elems *= d
    if n_elems >= 1 << 63:
        raise problem(f"dimensions {list(dims)} overflow")
    row = dims[0] if dims else 1
    if row % block:
        raise problem(f"rows of {row} elements are not a whole number of {ggml_type.name} "
                      f"blocks of {block}")
    return TensorEntry(name, ggml_type, dims, offset, n_elems // block * type_size)


def check_layout(header: Header, file_size: int) -> None:
    """Each tensor's data is aligned, inside the file, and the tensors are packed one after the
    other in offset order with only alignment padding between them: an overlap or a gap means an
    offset or a declared type (its size) is wrong, and the weights read would be garbage."""
    a = header.alignment
    data_bytes = file_size - header.data_offset
    if header.tensors and data_bytes < 0:
        raise HeaderProblem(f"the data section would start at byte {header.data_offset} but the "
                            f"file has only {file_size} bytes (truncated)")
    previous, expected = None, 0
    for t in sorted(header.tensors, key=lambda t: (t.relative_offset, t.n_bytes)):
        start = t.relative_offset
        if start % a:
            raise HeaderProblem(f"data offset {start} is not a multiple of the alignment {a}",
                                tensor=t.name)
        if start < expected and previous is not None:
            raise HeaderProblem(
                f"data at [{start}, {start + t.n_bytes}) overlaps tensor '{previous.name}' at "
                f"[{previous.relative_offset}, {previous.relative_offset + previous.n_bytes}) "
                f"(offsets or declared types are wrong)", tensor=t.name)
        if start > expected:
            after = f"tensor '{previous.name}' ({previous.ggml_type.name}, {previous.n_bytes} " \
                    f"bytes) ends" if previous else "the data section starts"
            raise HeaderProblem(
                f"data starts at {start} but {after} at {expected}: a gap of {start - expected} "
                f"bytes (offsets or declared types are wrong)", tensor=t.name)
        end = start + t.n_bytes
        if end > data_bytes:
            raise HeaderProblem(f"data ends at byte {header.data_offset + end} but the file has "
                                f"only {file_size} bytes (truncated)", tensor=t.name)
        previous, expected = t, -(-end // a) * a
