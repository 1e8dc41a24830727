"""Reading a GGUF MoE model: geometry, a tensor index by layer and kind, per-expert blobs.

The header is read through bounds (gguf_file/fields.py) and the files are memory-mapped, so opening
even a 30 GB model reads only its header; tensor bytes are touched when a caller asks for them.
A model split in shards is one model here: each tensor knows its shard (gguf_file/split.py). Every way
a file can be malformed becomes a `GGUFError` that names the file and, where there is one, the
key or the tensor.
"""
from __future__ import annotations

import enum
import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from .fields import Field
from .finite import find_non_finite
from .split import ShardProblem, open_shards, read_shard


class GGUFError(Exception):
    """A model file that cannot be used; the message names the file and the tensor or key."""

    def __init__(self, path: str | os.PathLike, message: str, tensor: str | None = None,
                 key: str | None = None):
        self.path = str(path)
        self.tensor, self.key = tensor, key
        where = (f"{self.path}: tensor '{tensor}'" if tensor else
                 f"{self.path}: key '{key}'" if key else self.path)
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
    offset: int                # absolute byte offset of the data in its file
    file: str = ""             # the file holding it: the model's, or one of its shards
    shard: int = 0             # that file's place among the model's shards

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


ROPE_SCALING_KINDS = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a file stretches RoPE past the context it was pretrained on (its
    `<arch>.rope.scaling.*` keys; models/common.py `rope_inv_freq` applies them). "linear" divides
    every frequency by `factor`; "yarn" divides only the slow ones, ramping between the dims that
    turn more than `beta_fast` and fewer than `beta_slow` times over `original_context`, and scales
    cos/sin by `attn_factor * (1 + 0.1 ln factor)`."""
    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0      # yarn: rope.scaling.original_context_length, else context_length
    stretched_context: int = 0     # yarn: factor x original_context_length where the file gives it
    beta_fast: float = 32.0        # rope.scaling.yarn_beta_fast
    beta_slow: float = 1.0         # rope.scaling.yarn_beta_slow
    ext_factor: float = 1.0        # rope.scaling.yarn_ext_factor: how much of the ramp applies
    attn_factor: float = 1.0       # rope.scaling.yarn_attn_factor: a factor on yarn's cos/sin scale


NO_ROPE_SCALING = RopeScaling()


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
    rope_scaling: RopeScaling = field(default=NO_ROPE_SCALING, kw_only=True)

    @property
    def trained_context(self) -> int:
        """The longest context the file says the model was trained for: its context_length, or
        under yarn with an original length, factor x that length where it is longer."""
        return max(self.context_length, self.rope_scaling.stretched_context)


# blk.N.<part>.weight, and the few per-layer tensors llama.cpp names otherwise: blk.N.ssm_a (no
# suffix) and blk.N.ssm_dt.bias (qwen3next).
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.(?:weight|bias))?$")
_MODEL_LEVEL = {
    "token_embd.weight": TensorKind.EMBEDDING,
    "output_norm.weight": TensorKind.HEAD,
    "output.weight": TensorKind.HEAD,
}
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _decode(raw: bytes, path: str, key: str, index: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        entry = "" if index is None else f" entry {index}"
        raise GGUFError(path, f"string{entry} is not valid UTF-8 (byte {e.start})",
                        key=key) from None


def _array_values(field: Field, path: str, key: str) -> list:
    if field.element_type == GGUFValueType.STRING:
        return [_decode(v, path, key, i) for i, v in enumerate(field.value)]
    if field.element_type == GGUFValueType.ARRAY:
        return [_array_values(f, path, key) for f in field.value]
    return field.value.tolist()


class GGUFModel:
    """One GGUF model, opened lazily: a single file, or the first of its shards (the others are
    found by name and mapped too: gguf_file/split.py). Architecture modules validate the tensors they
    need. Every tensor is checked for NaN/Inf the first time its bytes are read (gguf_file/finite.py),
    so a process checks exactly the tensors it loads."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isfile(self.path):
            # a folder or a device given as --model is named as such, not as missing
            raise GGUFError(self.path, "is a directory, not a GGUF file" if os.path.isdir(self.path)
                            else "is not a regular file" if os.path.exists(self.path)
                            else "no such file")
        try:
            self.shards = open_shards(read_shard(self.path))
        except ShardProblem as e:
            raise GGUFError(e.path, str(e), tensor=e.tensor, key=e.key) from None
        except OSError as e:   # no read permission, an I/O error
            raise GGUFError(getattr(e, "filename", None) or self.path,
                            f"cannot be read ({e.strerror or e})") from None
        self._fields = self.shards[0].header.fields
        self.tensors: dict[str, TensorInfo] = {}
        for index, shard in enumerate(self.shards):
            for t in shard.header.tensors:
                layer, kind = self._classify(t.name)
                self.tensors[t.name] = TensorInfo(
                    name=t.name, layer=layer, kind=kind, ggml_type=t.ggml_type,
                    shape=tuple(reversed(t.dims)), n_bytes=t.n_bytes,
                    offset=shard.header.data_offset + t.relative_offset,
                    file=shard.path, shard=index)
        self._maps: list[np.memmap | None] = [None] * len(self.shards)
        self._checked: set[str] = set()                      # tensors read through raw()
        self._checked_experts: set[tuple[int, int]] = set()   # (layer, expert) blobs read
        self.arch = self.metadata("general.architecture")
        if not isinstance(self.arch, str):
            raise GGUFError(self.path, "is missing or not a string", key="general.architecture")

    @property
    def shard_paths(self) -> list[str]:
        """The model's files in order: [path] for a single file."""
        return [s.path for s in self.shards]

    @property
    def file_bytes(self) -> int:
        """The bytes of every file of the model together."""
        return sum(s.size for s in self.shards)

    # ---- metadata -------------------------------------------------------------------------------
    def metadata(self, key: str, default=None):
        """A key's value (the first shard's metadata is the model's): str, int, float, bool, or
        a list for an array. A string that is not UTF-8 is a GGUFError naming the key."""
        field = self._fields.get(key)
        if field is None:
            return default
        if field.type == GGUFValueType.STRING:
            return _decode(field.value, self.path, key)
        if field.type == GGUFValueType.ARRAY:
            return _array_values(field, self.path, key)
        return field.value

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
        field = self._fields.get(key)
        if field is None:
            return None
        if field.type != GGUFValueType.ARRAY:
            raise GGUFError(self.path, f"is {field.type.name}, not an array", key=key)
        return _array_values(field, self.path, key)

    def metadata_keys(self) -> list[str]:
        return list(self._fields)

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the headers and tensor tables (every shard's, in order): two ranks agree on
        the model iff this matches."""
        h = hashlib.sha256()
        for shard in self.shards:
            with open(shard.path, "rb") as f:
                h.update(f.read(shard.header.data_offset))
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
            raise GGUFError(info.file or self.path, f"has shape {list(info.shape)}, expected {list(shape)}",
                            tensor=name)
        return info

    def _map(self, shard: int) -> np.memmap:
        mm = self._maps[shard]
        if mm is None:
            try:
                mm = self._maps[shard] = np.memmap(self.shards[shard].path, dtype=np.uint8,
                                                   mode="r")
            except OSError as e:
                raise GGUFError(self.shards[shard].path,
                                f"cannot be read ({e.strerror or e})") from None
        return mm

    def _stored(self, info: TensorInfo) -> np.ndarray:
        return self._map(info.shard)[info.offset: info.offset + info.n_bytes]

    def check_finite(self, info: TensorInfo) -> None:
        """Refuse a tensor holding NaN or Inf (gguf_file/finite.py says how much of it is read), once
        per tensor: the first read of its bytes through raw() calls this (expert blobs are
        checked one expert at a time, as they are read)."""
        if info.name in self._checked:
            return
        problem = find_non_finite(self._stored(info), info.ggml_type,
                                  info.shape[-1] if info.shape else 1)
        if problem:
            raise GGUFError(info.file, problem, tensor=info.name)
        self._checked.add(info.name)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as a uint8 view of the memory map (no copy)."""
        info = self.tensor(name)
        self.check_finite(info)
        return self._stored(info)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy shape, through gguf-py's decoders (every type it knows)."""
        info = self.tensor(name)
        return dequantize_bytes(self.raw(name), info.ggml_type, info.shape, info.file or self.path, name)

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
            start = t.offset + expert * per
            pieces.append(self._map(t.shard)[start: start + per])
        blob = np.concatenate(pieces)
        if (layer, expert) not in self._checked_experts:
            self._check_expert(layer, expert, blob)
        return blob

    def _check_expert(self, layer: int, expert: int, blob: np.ndarray) -> None:
        """An expert's bytes are checked whole the first time they are read, from the copy just
        made: a process reads the experts it holds anyway, so this costs no read of its own."""
        for t, part in self.split_blob(layer, blob):
            problem = find_non_finite(part, t.ggml_type, t.shape[-1])
            if problem:
                raise GGUFError(t.file, f"expert {expert}: {problem}", tensor=t.name)
        self._checked_experts.add((layer, expert))

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
        return tuple(dequantize_bytes(b, t.ggml_type, t.shape[1:], t.file or self.path, t.name)
                     for t, b in self.split_blob(layer, blob))

    def close(self) -> None:
        maps, self._maps = self._maps, [None] * len(self.shards)
        for m in maps:
            mm = getattr(m, "_mmap", None)
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
