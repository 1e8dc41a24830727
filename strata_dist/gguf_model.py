"""Reading a GGUF MoE model: geometry, a tensor index by layer and kind, per-expert blobs.

The file is memory-mapped through gguf-py's reader, so opening even a 30 GB model reads only its
header; tensor bytes are touched when a caller asks for them. Every way a file can be malformed
becomes a `GGUFError` that names the file and, where there is one, the tensor.
"""
from __future__ import annotations

import enum
import hashlib
import os
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants


class GGUFError(Exception):
    """A model file that cannot be used; the message names the file and the tensor."""

    def __init__(self, path: str | os.PathLike, message: str, tensor: str | None = None):
        self.path = str(path)
        self.tensor = tensor
        where = f"{self.path}: tensor '{tensor}'" if tensor else self.path
        super().__init__(f"{where}: {message}")


class TensorKind(enum.Enum):
    EMBEDDING = "embedding"
    HEAD = "head"          # output norm and output projection
    DENSE = "dense"        # per-layer attention, linear attention, norms, shared expert and its
                           # gate (ffn_*_shexp, ffn_gate_inp_shexp)
    ROUTER = "router"      # per-layer expert router (ffn_gate_inp only)
    EXPERT = "expert"      # per-layer stacked expert tensors (*_exps)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    layer: int | None          # None for model-level tensors
    kind: TensorKind
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]     # numpy (row-major) order: GGUF's ne reversed
    n_bytes: int               # bytes as stored in the file
    offset: int                # absolute byte offset of the data in the file

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass(frozen=True)
class Geometry:
    """The architecture-level numbers a forward pass and the planner need."""
    arch: str
    n_layers: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    rms_eps: float
    rope_base: float
    context_length: int
    tied_embeddings: bool


# blk.N.<part>.weight, and the few per-layer tensors llama.cpp names otherwise: blk.N.ssm_a (no
# suffix) and blk.N.ssm_dt.bias (qwen3next).
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.(?:weight|bias))?$")
_MODEL_LEVEL = {
    "token_embd.weight": TensorKind.EMBEDDING,
    "output_norm.weight": TensorKind.HEAD,
    "output.weight": TensorKind.HEAD,
}
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class _BoundsCheckedReader(GGUFReader):
    """gguf-py's reader, but a tensor whose data runs past the end of the file (or whose type is
    unknown) is reported by name instead of as a bare numpy reshape error."""

    def _build_tensors(self, start_offs, fields):
        file_size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _TensorProblem(name, f"unknown GGML type {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elems = int(np.prod(dims.astype(np.int64)))
            if n_elems % block:
                raise _TensorProblem(name, f"{n_elems} elements is not a whole number of "
                                           f"{ggml_type.name} blocks of {block}")
            end = int(start_offs) + int(offset_tensor[0]) + n_elems // block * type_size
            if end > file_size:
                raise _TensorProblem(name, f"data ends at byte {end} but the file has only "
                                           f"{file_size} bytes (truncated)")
        super()._build_tensors(start_offs, fields)


class _TensorProblem(Exception):
    def __init__(self, tensor: str, message: str):
        super().__init__(message)
        self.tensor = tensor


def _scalar(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


class GGUFModel:
    """One GGUF model file, opened lazily. Architecture modules validate the tensors they need."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise GGUFError(self.path, "no such file")
        try:
            self._reader = _BoundsCheckedReader(self.path)
        except _TensorProblem as e:
            raise GGUFError(self.path, str(e), tensor=e.tensor) from None
        except (ValueError, KeyError, IndexError, UnicodeDecodeError, OverflowError) as e:
            # Bad magic, unsupported version, a header cut short: gguf-py's own words.
            raise GGUFError(self.path, f"not a readable GGUF file ({e})") from None
        except OSError as e:   # no read permission, an I/O error
            raise GGUFError(self.path, f"cannot be read ({e.strerror or e})") from None
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            layer, kind = self._classify(t.name)
            self.tensors[t.name] = TensorInfo(
                name=t.name, layer=layer, kind=kind, ggml_type=t.tensor_type,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                n_bytes=int(t.n_bytes), offset=int(t.data_offset))
        self.arch = self.metadata("general.architecture")
        if not isinstance(self.arch, str):
            raise GGUFError(self.path, "metadata has no general.architecture")

    # ---- metadata -------------------------------------------------------------------------------
    def metadata(self, key: str, default=None):
        value = _scalar(self._reader, key)
        return default if value is None else value

    def arch_metadata(self, key: str, default=None, required: bool = False):
        value = self.metadata(f"{self.arch}.{key}")
        if value is None:
            if required:
                raise GGUFError(self.path, f"metadata key '{self.arch}.{key}' is missing")
            return default
        return value

    def arch_int(self, key: str, default: int | None = None, required: bool = False,
                 minimum: int | None = None) -> int | None:
        """An integer metadata key of the architecture, checked: a value that is not a whole
        number, or is below `minimum`, is a GGUFError naming the file and the key."""
        value = self.arch_metadata(key, default=default, required=required)
        if value is None:
            return None
        name = f"{self.arch}.{key}"
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise GGUFError(self.path, f"metadata key '{name}' is {value!r}, not an integer")
        if minimum is not None and value < minimum:
            raise GGUFError(self.path, f"metadata key '{name}' is {value}; it must be >= {minimum}")
        return int(value)

    def arch_float(self, key: str, default: float | None = None, required: bool = False,
                   positive: bool = False) -> float | None:
        """A float metadata key of the architecture that must be finite (and > 0 when
        `positive`): NaN or a negative epsilon would give NaN logits, not an error."""
        value = self.arch_metadata(key, default=default, required=required)
        if value is None:
            return None
        name = f"{self.arch}.{key}"
        if isinstance(value, (bool, str)) or not isinstance(value, (int, float, np.number)):
            raise GGUFError(self.path, f"metadata key '{name}' is {value!r}, not a number")
        value = float(value)
        if not np.isfinite(value) or (positive and value <= 0):
            raise GGUFError(self.path, f"metadata key '{name}' is {value}; it must be a finite"
                                       f"{' positive' if positive else ''} number")
        return value

    def metadata_array(self, key: str) -> list | None:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]

    def metadata_keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the header and tensor table: two ranks agree on the model iff this matches."""
        h = hashlib.sha256()
        h.update(bytes(self._reader.data[: self._reader.data_offset]))
        return h.hexdigest()[:16]

    # ---- tensor index ---------------------------------------------------------------------------
    @staticmethod
    def _classify(name: str) -> tuple[int | None, TensorKind]:
        if name in _MODEL_LEVEL:
            return None, _MODEL_LEVEL[name]
        m = _LAYER_RE.match(name)
        if not m:
            return None, TensorKind.DENSE
        layer, part = int(m.group(1)), m.group(2)
        if part in EXPERT_PARTS:
            return layer, TensorKind.EXPERT
        if part == "ffn_gate_inp":
            return layer, TensorKind.ROUTER
        return layer, TensorKind.DENSE

    def layer_tensors(self, layer: int) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.layer == layer]

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, "missing from the file", tensor=name)
        return info

    def require(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """The tensor, checked against the shape the architecture expects."""
        info = self.tensor(name)
        if info.shape != tuple(shape):
            raise GGUFError(self.path, f"has shape {list(info.shape)}, expected {list(shape)}",
                            tensor=name)
        return info

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as a uint8 view of the memory map (no copy)."""
        info = self.tensor(name)
        return self._reader.data[info.offset: info.offset + info.n_bytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy shape, through gguf-py's decoders (every type it knows)."""
        info = self.tensor(name)
        return dequantize_bytes(self.raw(name), info.ggml_type, info.shape, self.path, name)

    # ---- experts --------------------------------------------------------------------------------
    def expert_parts(self, layer: int) -> list[TensorInfo]:
        return [self.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS]

    def blob_bytes(self, layer: int) -> int:
        """One expert's gate+up+down in its stored format (types may differ per layer)."""
        return sum(t.n_bytes // t.shape[0] for t in self.expert_parts(layer))

    def expert_blob(self, layer: int, expert: int) -> np.ndarray:
        """Expert `expert` of `layer` as one contiguous blob: its gate, up and down rows as stored.

        The stacked tensors are expert-major, so each expert's rows are one contiguous run."""
        pieces = []
        for t in self.expert_parts(layer):
            if not 0 <= expert < t.shape[0]:
                raise IndexError(f"expert {expert} out of range for {t.name} ({t.shape[0]} experts)")
            per = t.n_bytes // t.shape[0]
            pieces.append(self._reader.data[t.offset + expert * per: t.offset + (expert + 1) * per])
        return np.concatenate(pieces)

    def split_blob(self, layer: int, blob: np.ndarray) -> list[tuple[TensorInfo, np.ndarray]]:
        """The (part, bytes) of a blob made by expert_blob, in gate, up, down order."""
        out, pos = [], 0
        for t in self.expert_parts(layer):
            per = t.n_bytes // t.shape[0]
            out.append((t, blob[pos: pos + per]))
            pos += per
        return out

    def dequantize_expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [ff, embd], up [ff, embd], down [embd, ff]) of one expert, float32."""
        blob = self.expert_blob(layer, expert)
        return tuple(dequantize_bytes(b, t.ggml_type, t.shape[1:], self.path, t.name)
                     for t, b in self.split_blob(layer, blob))

    def close(self) -> None:
        mm = getattr(self._reader.data, "_mmap", None)
        self._reader = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the map closes when it goes


def dequantize_bytes(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...],
                     path: str = "?", name: str = "?") -> np.ndarray:
    """Stored bytes → float32 array of `shape` (numpy order)."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    row = shape[-1]
    if row % block:
        raise GGUFError(path, f"rows of {row} are not whole {ggml_type.name} blocks", tensor=name)
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1, row // block * type_size)
    try:
        values = gguf_quants.dequantize(raw, ggml_type)
    except NotImplementedError:
        raise GGUFError(path, f"type {ggml_type.name} cannot be decoded", tensor=name) from None
    return np.asarray(values, dtype=np.float32).reshape(shape)
