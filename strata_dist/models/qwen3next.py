"""qwen3next: Qwen3-Next-80B-A3B and its family.

A hybrid stack: every `full_attention_interval`-th layer (l % 4 == 3) is gated full attention, the
others are Gated DeltaNet linear attention. Every layer ends in a MoE with a shared expert.

Per layer: RMSNorm → mixer → residual → RMSNorm (post_attention_norm) → MoE → residual.

- Linear layer (GDN): attn_qkv → causal depthwise conv1d (kernel K, state = the last K-1 inputs) →
  SiLU → q, k (L2-normalised, q scaled by 1/sqrt(head_k_dim)), v; ssm_ba → beta = sigmoid(b) and
  g = ssm_a * softplus(a + ssm_dt.bias) with ssm_a = -exp(A_log); the gated delta rule per value
  head, S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = q^T S; gated RMSNorm
  (ssm_norm * norm(o) * SiLU(z), z = attn_gate x); ssm_out.
- Attention layer: attn_q gives per head [q | gate]; q/k RMSNorm per head; NEOX RoPE over the
  first rope.dimension_count dims; causal GQA; output * sigmoid(gate); attn_output.
- MoE: softmax router, top-k (renormalised when expert_weights_norm, default true), SwiGLU experts
  combined in top-k rank order, plus the shared expert gated by sigmoid(ffn_gate_inp_shexp x).

The GGUF conventions are llama.cpp's (convert_hf_to_gguf.py, Qwen3NextModel): RMSNorm weights are
stored already offset by +1 except the gated norm (ssm_norm); ssm_a holds -exp(A_log); HF's
in_proj_qkvz (interleaved per key head) is split into attn_qkv = [q all heads | k | v] and
attn_gate = z; ssm_ba is HF's in_proj_ba as is (per key head: r beta then r alpha, r = v/k heads);
ssm_conv1d is [conv_dim, K]; attn_q is HF's q_proj (per head: head_dim of q then head_dim of gate).
Older files hold the unsplit blk.N.ssm_in instead of attn_qkv + attn_gate; both load.

A model object holds only the layers [lb, le) it was built for (plus the embedding when first, the
output norm and head when last), exactly the tensors `dense_tensor_names` lists; its session holds
conv + recurrent state only for its own linear layers and KV only for its own attention layers.
That recurrent state is not positional: the session moves back only to a checkpoint of its own
range (`HybridSession.save`/`restore`; the rules are in strata_dist/checkpoints.py).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np

from ..backends.kv_cache import kv_host_nbytes, new_session_kv
from ..gguf_file.reader import Geometry, GGUFError, GGUFModel
from ..kernels.abi import GDN_SPEC
from ..plan.pricing import DECODE_ROWS
from ..plan.workspace import Buffer
from .common import (LayerRangeModel, check_recurrent_layers, gemm_buffers, model_level_shapes,
                     residual_buffers, rope_buffers, rope_tables, routed_expert_buffers,
                     stack_layers, stage_tensor_names, transformer_geometry)
from .next_ops import NextEagerOps, NextRowsOps, Qwen3NextOps
from .delta_rule import gdn_mixer  # noqa: F401 (this module's name: tests, qwen35moe)

ARCH = "qwen3next"

ROUTER_PART = "ffn_gate_inp"
SHEXP_GATE_PART = "ffn_gate_inp_shexp"
COMMON_PARTS = ("attn_norm", "post_attention_norm", "ffn_gate_shexp", "ffn_up_shexp",
                "ffn_down_shexp", SHEXP_GATE_PART)
ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
LINEAR_PARTS = ("ssm_conv1d", "ssm_dt", "ssm_a", "ssm_ba", "ssm_norm", "ssm_out")
QKVZ_SPLIT_PARTS = ("attn_qkv", "attn_gate")
QKVZ_FUSED_PARTS = ("ssm_in",)
# Parts llama.cpp names without the usual ".weight".
_SUFFIX = {"ssm_a": "", "ssm_dt": ".bias"}
# Small tensors kept float32 on every backend: routers and gates (routing decisions are sensitive)
# and the conv kernel (used elementwise). 1-D tensors (norms, ssm_a, ssm_dt) are always float32.
_F32_PARTS = {ROUTER_PART, SHEXP_GATE_PART, "ssm_conv1d"}
_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+?)(?:\.(?:weight|bias))?$")
GDN_SPEC_BYTES = GDN_SPEC.itemsize   # a linear layer's kernel argument table (prompt_buffers)
STATE_ITEMSIZE = 4  # session state (conv, recurrent, RoPE, scores) is float32; KV: --kv-type


def tensor_name(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}{_SUFFIX.get(part, '.weight')}"


def _part(name: str) -> str:
    m = _NAME_RE.match(name)
    return m.group(2) if m else name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class NextGeometry(Geometry):
    n_rot: int                      # rope.dimension_count: rotated dims of each head
    full_attention_interval: int
    ssm_conv_kernel: int            # K
    ssm_state_size: int             # head_k_dim
    ssm_group_count: int            # key heads
    ssm_time_step_rank: int         # value heads
    ssm_inner_size: int             # value heads * head_v_dim
    n_ff_shexp: int
    norm_topk_prob: bool
    fused_qkvz: bool                # legacy files: blk.N.ssm_in instead of attn_qkv + attn_gate
    n_nextn: int = 0                # MTP blocks after the stack: blk.{n_layers}.. (mtp_draft.py)

    @property
    def n_k_heads(self) -> int:
        return self.ssm_group_count

    @property
    def n_v_heads(self) -> int:
        return self.ssm_time_step_rank

    @property
    def head_k_dim(self) -> int:
        return self.ssm_state_size

    @property
    def head_v_dim(self) -> int:
        return self.ssm_inner_size // self.ssm_time_step_rank

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.ssm_inner_size

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


def read_geometry(gguf: GGUFModel) -> NextGeometry:
    """Geometry from the metadata keys llama.cpp's converter writes, with the embedding's shape as
    the vocabulary's size."""
    md, num = gguf.arch_metadata, gguf.arch_int
    base = transformer_geometry(gguf, rope_base=10000.0, context_length=262144)
    head_dim, n_layers = base["head_dim"], base["n_layers"]
    interval = num("full_attention_interval", default=4, minimum=1)
    n_rot = num("rope.dimension_count", default=head_dim)
    n_v = num("ssm.time_step_rank", required=True, minimum=1)
    n_k = num("ssm.group_count", required=True, minimum=1)
    inner = num("ssm.inner_size", required=True, minimum=1)
    if interval < 1 or n_rot < 2 or n_rot % 2 or n_rot > head_dim or n_k < 1 or n_v % n_k \
            or inner % n_v:
        raise GGUFError(gguf.path, f"inconsistent qwen3next metadata: full_attention_interval="
                                   f"{interval}, rope.dimension_count={n_rot} (head {head_dim}), "
                                   f"ssm.group_count={n_k}, ssm.time_step_rank={n_v}, "
                                   f"ssm.inner_size={inner}")
    n_ff_shexp = md("expert_shared_feed_forward_length")
    if n_ff_shexp is None:   # llama.cpp falls back to the tensor itself
        n_ff_shexp = gguf.tensor(tensor_name(0, "ffn_up_shexp")).shape[0]
    n_nextn = stack_layers(gguf)[1]
    check_recurrent_layers(gguf, lambda l: (l + 1) % interval != 0, n_layers, n_nextn)
    first_linear = next((l for l in range(n_layers) if (l + 1) % interval), None)
    fused = (first_linear is not None
             and tensor_name(first_linear, "attn_qkv") not in gguf.tensors
             and tensor_name(first_linear, "ssm_in") in gguf.tensors)
    return NextGeometry(
        **base, n_rot=n_rot, full_attention_interval=interval,
        ssm_conv_kernel=num("ssm.conv_kernel", required=True, minimum=1),
        ssm_state_size=num("ssm.state_size", required=True, minimum=1),
        ssm_group_count=n_k, ssm_time_step_rank=n_v, ssm_inner_size=inner,
        n_ff_shexp=int(n_ff_shexp), norm_topk_prob=bool(md("expert_weights_norm", default=True)),
        fused_qkvz=fused, n_nextn=n_nextn)


def layer_parts(g: NextGeometry, layer: int) -> tuple[str, ...]:
    """The dense parts of one layer (the router included), in load order."""
    if g.is_linear(layer):
        mixer = (QKVZ_FUSED_PARTS if g.fused_qkvz else QKVZ_SPLIT_PARTS) + LINEAR_PARTS
    else:
        mixer = ATTENTION_PARTS
    return mixer + COMMON_PARTS + (ROUTER_PART,)


def expected_shapes(g: NextGeometry, layer: int) -> dict[str, tuple[int, ...]]:
    """numpy shapes (GGUF ne reversed) of every tensor of a layer. ffn_gate_inp_shexp may also be
    stored 1-D ([n_embd]); validate accepts both."""
    E, d, ff, sh = g.n_expert, g.n_embd, g.n_ff_exp, g.n_ff_shexp
    parts: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,), "post_attention_norm": (d,),
        ROUTER_PART: (E, d), SHEXP_GATE_PART: (1, d),
        "ffn_gate_shexp": (sh, d), "ffn_up_shexp": (sh, d), "ffn_down_shexp": (d, sh),
        "ffn_gate_exps": (E, ff, d), "ffn_up_exps": (E, ff, d), "ffn_down_exps": (E, d, ff),
    }
    if g.is_linear(layer):
        if g.fused_qkvz:
            parts["ssm_in"] = (2 * g.key_dim + 2 * g.value_dim, d)
        else:
            parts["attn_qkv"] = (g.conv_dim, d)
            parts["attn_gate"] = (g.value_dim, d)
        parts.update({
            "ssm_conv1d": (g.conv_dim, g.ssm_conv_kernel), "ssm_dt": (g.n_v_heads,),
            "ssm_a": (g.n_v_heads,), "ssm_ba": (2 * g.n_v_heads, d),
            "ssm_norm": (g.head_v_dim,), "ssm_out": (d, g.value_dim),
        })
    else:
        q = g.n_head * g.head_dim
        kv = g.n_head_kv * g.head_dim
        parts.update({
            "attn_q": (2 * q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
            "attn_q_norm": (g.head_dim,), "attn_k_norm": (g.head_dim,),
        })
    return {tensor_name(layer, p): s for p, s in parts.items()}


def validate(gguf: GGUFModel, g: NextGeometry) -> None:
    """Every tensor the architecture needs exists with its shape; raises GGUFError naming it."""
    if g.n_head % g.n_head_kv:
        raise GGUFError(gguf.path, f"{g.n_head} attention heads are not a multiple of "
                                   f"{g.n_head_kv} KV heads")
    for name, shape in model_level_shapes(g).items():
        gguf.require(name, shape)
    for layer in range(g.n_layers):
        for name, shape in expected_shapes(g, layer).items():
            if _part(name) == SHEXP_GATE_PART and gguf.tensor(name).shape == (g.n_embd,):
                continue
            gguf.require(name, shape)


def dense_tensor_names(g: NextGeometry, lb: int, le: int, first: bool, last: bool) -> list[str]:
    """The dense tensors a stage running [lb, le) loads: its layers' mixers (attention or GDN),
    norms, routers and shared experts. The planner prices exactly this list, each tensor at the
    bytes backends/layout.py gives it."""
    return stage_tensor_names(g, lb, le, first, last,
                              lambda layer: [tensor_name(layer, p) for p in layer_parts(g, layer)])


def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Kept float32 on every backend; any other dense tensor as backends/layout.py says."""
    return len(shape) == 1 or _part(name) in _F32_PARTS


# ---- session geometry: one rule for what a session allocates and what the planner prices --------

def layer_kinds(g: NextGeometry) -> tuple[str, ...]:
    return tuple("linear" if g.is_linear(l) else "attention" for l in range(g.n_layers))


def kv_shape(g: NextGeometry, cells: int) -> tuple[int, ...]:
    return (cells, g.n_head_kv, g.head_dim)


def conv_state_shape(g: NextGeometry) -> tuple[int, ...]:
    return (g.ssm_conv_kernel - 1, g.conv_dim)


def recurrent_state_shape(g: NextGeometry) -> tuple[int, ...]:
    return (g.n_v_heads, g.head_k_dim, g.head_v_dim)


def kv_elems_per_cell(g: NextGeometry, layer: int) -> int:
    """K + V elements per context cell of an attention layer; 0 for a linear layer."""
    return 0 if g.is_linear(layer) else 2 * g.n_head_kv * g.head_dim


def recurrent_elems(g: NextGeometry, layer: int) -> int:
    """Conv state + recurrent state elements of a linear layer; 0 for an attention layer."""
    if not g.is_linear(layer):
        return 0
    return int(np.prod(conv_state_shape(g))) + int(np.prod(recurrent_state_shape(g)))


def rope_dim(g: NextGeometry) -> int:
    """Elements per cell of the session's RoPE table (cos + sin, n_rot/2 each)."""
    return g.n_rot


def prompt_buffers(g: NextGeometry, blob_bytes: int, dense16_bytes: int) -> list[Buffer]:
    """Every buffer a layer writes on a GPU (plan/workspace.py): a gated-attention layer's q with
    its gate, k, v, q rotated, the attention and its gated product; a linear layer's projections,
    the convolution's output and the delta rule's; the routed experts' and the shared expert's.
    The f16 GEMMs run in every phase, so their buffers live through the chunk."""
    d, q, kv, fs = g.n_embd, g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_ff_shexp
    conv, val = g.conv_dim, g.value_dim
    fused = [Buffer("qkvz", "linear", 4 * (conv + val))] if g.fused_qkvz else []
    return [*residual_buffers(g),
            *gemm_buffers("residual", (d, q, val, fs), (2 * q, kv, conv + val, 2 * g.n_v_heads,
                                                        d, fs), dense16_bytes),
            Buffer("x", "attention", 4 * d), Buffer("qg", "attention", 8 * q),
            Buffer("gate", "attention", 4 * q), Buffer("k", "attention", 4 * kv),
            Buffer("v", "attention", 4 * kv), Buffer("q_rot", "attention", 4 * q),
            Buffer("attn", "attention", 4 * q), Buffer("gated", "attention", 4 * q),
            Buffer("o", "attention", 4 * d), *rope_buffers(),
            Buffer("lx", "linear", 4 * d), *fused,
            Buffer("qkv", "linear", 4 * conv), Buffer("z", "linear", 4 * val),
            Buffer("ba", "linear", 8 * g.n_v_heads), Buffer("mixed", "linear", 4 * conv),
            Buffer("gdn_out", "linear", 4 * val), Buffer("lo", "linear", 4 * d),
            Buffer("gdn_ptrs", "linear", 0, 16), Buffer("gdn_spec", "linear", 0, GDN_SPEC_BYTES),
            *routed_expert_buffers(g, blob_bytes),
            Buffer("shexp_gate", "experts", 4 * fs), Buffer("shexp_up", "experts", 4 * fs),
            Buffer("shexp_hidden", "experts", 4 * fs), Buffer("shexp_out", "experts", 4 * d),
            Buffer("shexp_g", "experts", 4), Buffer("moe_sum", "experts", 4 * d)]


# ---- the session --------------------------------------------------------------------------------

class RecurrentRewindError(ValueError):
    """A session with linear-attention state cannot move back to an earlier position: the state is
    not positional. Resuming there needs a checkpoint."""


@dataclass
class SessionCheckpoint:
    """The non-positional part of a HybridSession at position `pos`: conv and delta-rule state of
    the linear layers of [lb, le) only, copied (KV rows are positional: the session keeps them, and
    they stay valid as long as nothing is read at an earlier position). It carries its range so a
    session of another range refuses it (`HybridSession.restore`)."""
    lb: int
    le: int
    pos: int
    conv: dict
    ssm: dict

    @property
    def layers(self) -> list[int]:
        return sorted(self.conv)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.conv.values(), *self.ssm.values()))


class HybridSession:
    """The session of one conversation for the layers [lb, le) only, global ordinals kept:

    - K/V rows [max_cells, n_head_kv, head_dim] for each attention layer of the range,
    - conv state [K-1, conv_dim] and recurrent state [v_heads, head_k_dim, head_v_dim] for each
      linear layer of the range,
    - one RoPE table (cos + sin, [max_cells, n_rot/2] each), carved even when the range has no
      attention layer (the primary state),
    - the decode score scratch (DECODE_ROWS x n_head x max_cells), only when the range has an
      attention layer.
    All float32 but K/V (the backend's kv_type: f16 on GPUs by default): exactly the parts
    `plan.pricing.session_parts` prices for the ModelShape that
    `model_shape` builds from the same geometry."""

    def __init__(self, backend, g: NextGeometry, lb: int, le: int, max_cells: int):
        xp = backend.xp
        self.g, self.lb, self.le, self.max_cells = g, lb, le, max_cells
        self.attention_layers = [l for l in range(lb, le) if not g.is_linear(l)]
        self.linear_layers = [l for l in range(lb, le) if g.is_linear(l)]
        f32 = np.float32
        kv, resident = backend.kv_type, backend.kv_resident   # --kv-type, --kv-resident
        self._k, self._v = ({l: new_session_kv(xp, kv_shape(g, max_cells), kv, resident)
                             for l in self.attention_layers} for _ in range(2))
        self._conv = {l: xp.zeros(conv_state_shape(g), dtype=f32) for l in self.linear_layers}
        self._ssm = {l: xp.zeros(recurrent_state_shape(g), dtype=f32) for l in self.linear_layers}
        cos, sin = rope_tables(np.arange(max_cells), g.n_rot, g.rope_base, g.rope_scaling)
        self.rope_cos, self.rope_sin = backend.asarray(cos), backend.asarray(sin)
        self.scores = (xp.empty(DECODE_ROWS * g.n_head * max_cells, dtype=f32)
                       if self.attention_layers else None)
        self.n_past = 0

    def _arrays(self) -> list:
        arrays = [*self._k.values(), *self._v.values(), *self._conv.values(), *self._ssm.values(),
                  self.rope_cos, self.rope_sin]
        return arrays + ([self.scores] if self.scores is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self._arrays())

    def parts_nbytes(self) -> dict[str, int]:
        """Bytes by the planner's part names (see plan.pricing.session_parts)."""
        return {
            "primary": int(self.rope_cos.nbytes + self.rope_sin.nbytes),
            "kv": sum(int(a.nbytes) for a in (*self._k.values(), *self._v.values())),
            "recurrent": sum(int(a.nbytes) for a in (*self._conv.values(), *self._ssm.values())),
            "scratch": int(self.scores.nbytes) if self.scores is not None else 0,
            "kv_host": kv_host_nbytes(self.kv_rows()),     # beyond the device: not in nbytes
        }

    def _check(self, layer: int, table: dict, what: str):
        if not self.lb <= layer < self.le:
            raise IndexError(f"layer {layer} is not in this session's range [{self.lb}, {self.le})")
        if layer not in table:
            raise IndexError(f"layer {layer} has no {what} (it is a "
                             f"{'linear' if self.g.is_linear(layer) else 'attention'} layer)")
        return table[layer]

    def k(self, layer: int):
        return self._check(layer, self._k, "KV cache")

    def v(self, layer: int):
        return self._check(layer, self._v, "KV cache")

    def conv_state(self, layer: int):
        return self._check(layer, self._conv, "conv state")

    def recurrent_state(self, layer: int):
        return self._check(layer, self._ssm, "recurrent state")

    def score_buffer(self, shape):
        """A view of the scratch for decode scores, or None when the rows do not fit in it."""
        if self.scores is None:
            return None
        size = int(np.prod(shape))
        return self.scores[:size].reshape(shape) if size <= self.scores.size else None

    def reset(self, n_past: int = 0) -> None:
        """Position the session at n_past. 0 starts a fresh conversation (conv and recurrent state
        zeroed); the current position is a no-op. Any other position is refused when the range
        holds a linear layer (RecurrentRewindError): the recurrent state is not positional."""
        if n_past == 0:
            for a in (*self._conv.values(), *self._ssm.values()):
                a.fill(0)
        elif n_past != self.n_past and self.linear_layers:
            raise RecurrentRewindError(
                f"cannot move a session with linear-attention state from position {self.n_past} "
                f"to {n_past} (layers [{self.lb}, {self.le})); resuming there needs a checkpoint")
        self.n_past = n_past

    def kv_rows(self) -> list:
        """Every K/V store of the range's attention layers, in one fixed order (what a kept
        conversation copies, strata_dist/rank/conversation_cache.py)."""
        return [*self._k.values(), *self._v.values()]

    # ---- checkpoints (strata_dist/checkpoints.py keeps them; this is the session's side) ---------
    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of one checkpoint of this session: its conv + recurrent state (0 with no linear
        layer: such a session is positional, like a KV-only one)."""
        return self.parts_nbytes()["recurrent"]

    def save(self, pos: int) -> SessionCheckpoint:
        """A copy of the conv and recurrent state of this session's own linear layers at `pos`,
        which must be the session's position (the state is of where the session is)."""
        if pos != self.n_past:
            raise ValueError(f"cannot checkpoint position {pos}: the session [{self.lb}, {self.le}) "
                             f"is at {self.n_past}")
        return SessionCheckpoint(lb=self.lb, le=self.le, pos=pos,
                                 conv={l: a.copy() for l, a in self._conv.items()},
                                 ssm={l: a.copy() for l, a in self._ssm.items()})

    def restore(self, ckpt: SessionCheckpoint) -> None:
        """Put a checkpoint of this session's own range back and move to its position. A checkpoint
        of another range (another stage's part) is refused: restoring it would silently mix
        another stage's state into this one."""
        if (ckpt.lb, ckpt.le) != (self.lb, self.le) or ckpt.layers != self.linear_layers:
            raise ValueError(f"a checkpoint of layers [{ckpt.lb}, {ckpt.le}) (linear {ckpt.layers}) "
                             f"cannot be restored into the session of [{self.lb}, {self.le}) "
                             f"(linear {self.linear_layers})")
        if not 0 < ckpt.pos <= self.max_cells:
            raise ValueError(f"checkpoint position {ckpt.pos} is outside (0, {self.max_cells}]")
        for l in self.linear_layers:
            self._conv[l][...] = ckpt.conv[l]
            self._ssm[l][...] = ckpt.ssm[l]
        self.n_past = ckpt.pos


# ---- the model ----------------------------------------------------------------------------------

def layer_step(ops: Qwen3NextOps, g: NextGeometry, layer: int, h):
    """One qwen3next layer over the rows h [n, n_embd]: the only place its sequence is written.
    The eager forward runs it on the backend (models/next_ops.py); the GPU decode graph captures
    it through its launches (backends/graph_ops.py NextGraphOps)."""
    if g.is_linear(layer):
        qkv, z, ba = ops.norm_mix_in(layer, h)
        h = ops.add_mix_out(layer, ops.gated_delta(layer, qkv, z, ba), h)
    else:
        qg, k, v = ops.norm_qkv(layer, h)
        h = ops.add_out_projection(layer, ops.attention(layer, qg, k, v), h)
    return ops.add_moe(layer, ops.route(layer, h), h)


class Qwen3Next(LayerRangeModel):
    """The qwen3next forward over the layers [lb, le) of a model file."""

    arch = sys.modules[__name__]

    def _build_layers(self) -> dict:
        return {layer: {p: self._tensors[tensor_name(layer, p)] for p in layer_parts(self.g, layer)}
                for layer in range(self.lb, self.le)}

    def _host_f32(self, name: str) -> np.ndarray:
        host = self.gguf.dequantize(name)
        # the shared expert's gate: one row [1, n_embd]; the others as stored
        return host.reshape(1, -1) if _part(name) == SHEXP_GATE_PART else host

    def new_session(self, max_cells: int) -> HybridSession:
        return HybridSession(self.backend, self.g, self.lb, self.le, max_cells)

    # ---- the forward: `layer_step` over these ops (models/next_ops.py), run by
    # common.LayerRangeModel.forward_layers / forward_rows
    eager_ops, rows_ops = NextEagerOps, NextRowsOps

    # ---- gated attention (the MTP block, sampling/mtp_draft.py, runs `_attention` whole) -------
    def _attention(self, layer, x, session, pos0):
        qg, k, v = self._attention_qkv(layer, x)
        return self.backend.linear(self._gated_attention(layer, qg, k, v, session, pos0),
                                   self.layers[layer]["attn_output"], out="o")

    def _attention_qkv(self, layer, x):
        """((q, each head's gate half), k, v) of the normed rows x."""
        g, w, be = self.g, self.layers[layer], self.backend
        n, hd = x.shape[0], g.head_dim
        qg = be.linear(x, w["attn_q"], out="qg").reshape(n, g.n_head, 2 * hd)
        q = qg[..., :hd]
        gate = be.buffer("gate", (n, g.n_head, hd))       # each head's gate half, in rows
        gate[...] = qg[..., hd:]
        k = be.linear(x, w["attn_k"], out="k").reshape(n, g.n_head_kv, hd)
        v = be.linear(x, w["attn_v"], out="v").reshape(n, g.n_head_kv, hd)
        return (q, gate), k, v

    def _gated_attention(self, layer, qg, k, v, session, pos0):
        """q/k norm, RoPE, K/V write and attention, times the sigmoid of the gates."""
        g, w, be = self.g, self.layers[layer], self.backend
        (q, gate), n, hd = qg, k.shape[0], g.head_dim
        q = be.qk_norm_rope_kv(q, k, v, w["attn_q_norm"], w["attn_k_norm"], g.rms_eps, session,
                               layer, pos0)
        kc, vc = session.k(layer), session.v(layer)
        attn = be.attend(q, kc[:pos0 + n], vc[:pos0 + n], pos0, session, out="attn")
        gate = be.sigmoid(gate.reshape(n, g.n_head * hd), out="gate")
        return be.mul(attn.reshape(n, g.n_head * hd), gate, out="gated")

    # ---- Gated DeltaNet ------------------------------------------------------------------------
    def _qkvz(self, w, x):
        """(mixed qkv [n, conv_dim] in [q | k | v] order, z [n, value_dim])."""
        g, be = self.g, self.backend
        if not g.fused_qkvz:
            return be.linear(x, w["attn_qkv"], out="qkv"), be.linear(x, w["attn_gate"], out="z")
        n, hk, r = x.shape[0], g.head_k_dim, g.n_v_heads // g.n_k_heads
        nk, rv = g.n_k_heads, r * g.head_v_dim
        per = be.linear(x, w["ssm_in"], out="qkvz").reshape(n, nk, -1)   # per key head: q k v z
        # regrouped as [all q | all k | all v] and z, as the split projections give them, a key
        # head at a time (2-D slices: a reshape of a strided view may be a copy on some backends)
        qkv = be.buffer("qkv", (n, g.conv_dim))
        z = be.buffer("z", (n, nk, g.value_dim // nk))
        z[...] = per[..., 2 * hk + rv:]
        for i in range(nk):
            qkv[:, i * hk:(i + 1) * hk] = per[:, i, :hk]
            qkv[:, (nk + i) * hk:(nk + i + 1) * hk] = per[:, i, hk:2 * hk]
            qkv[:, 2 * nk * hk + i * rv:2 * nk * hk + (i + 1) * rv] = per[:, i, 2 * hk:2 * hk + rv]
        return qkv, z.reshape(n, -1)

    # ---- MoE with the shared expert ------------------------------------------------------------
    def _moe(self, layer, x):
        idx, wts = self._route(layer, x, self.layers[layer][ROUTER_PART], self.g.norm_topk_prob)
        return self._moe_after_route(layer, x, idx, wts)

    def _moe_after_route(self, layer, x, idx, wts):
        """The routed experts (chosen: idx, wts) plus the gated shared expert, of the rows x."""
        w, be = self.layers[layer], self.backend
        routed = self._combine_routed(layer, x, idx, wts)
        hidden = be.silu(be.linear(x, w["ffn_gate_shexp"], out="shexp_gate"), out="shexp_hidden")
        hidden = be.mul(hidden, be.linear(x, w["ffn_up_shexp"], out="shexp_up"),
                        out="shexp_hidden")
        shared = be.linear(hidden, w["ffn_down_shexp"], out="shexp_out")
        gate = be.sigmoid(be.linear(x, w[SHEXP_GATE_PART], out="shexp_g"), out="shexp_g")  # [n, 1]
        return be.add(routed, be.mul(gate, shared, out="shexp_out"), out="moe_sum")


MODEL_CLASS = Qwen3Next
