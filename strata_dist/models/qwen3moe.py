"""qwen3moe: Qwen3-30B-A3B / Qwen3-235B-A22B.

Per layer: RMSNorm → attention (q/k RMSNorm per head, NEOX RoPE, grouped-query, causal) →
residual → RMSNorm → MoE (softmax router, top-k, renormalised weights, SwiGLU experts combined in
top-k rank order) → residual. A model object holds only the layers [lb, le) it was built for,
plus the embedding when it is the first stage and the final norm and head when it is the last:
the tensors `dense_tensor_names` lists, which is also what the planner prices.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..backends.kv_cache import new_session_kv
from ..gguf_file.reader import Geometry, GGUFModel
from ..plan.pricing import DECODE_ROWS
from ..plan.workspace import Buffer
from .common import (LayerRangeModel, gemm_buffers, model_level_shapes, residual_buffers,
                     rope_buffers, rope_tables, routed_expert_buffers, stage_tensor_names,
                     transformer_geometry)

ARCH = "qwen3moe"

# Per-layer dense tensors, in llama.cpp's naming (blk.N.<part>.weight).
LAYER_DENSE_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                     "attn_q_norm", "attn_k_norm", "ffn_norm")
ROUTER_PART = "ffn_gate_inp"
NORM_PARTS = {"attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm"}


def read_geometry(gguf: GGUFModel) -> Geometry:
    """Geometry from the metadata, with the embedding's shape as the vocabulary's size."""
    return Geometry(**transformer_geometry(gguf, rope_base=1e6, context_length=40960))


def expected_shapes(g: Geometry, layer: int) -> dict[str, tuple[int, ...]]:
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    p = f"blk.{layer}."
    return {
        p + "attn_norm.weight": (g.n_embd,),
        p + "attn_q.weight": (q, g.n_embd),
        p + "attn_k.weight": (kv, g.n_embd),
        p + "attn_v.weight": (kv, g.n_embd),
        p + "attn_output.weight": (g.n_embd, q),
        p + "attn_q_norm.weight": (g.head_dim,),
        p + "attn_k_norm.weight": (g.head_dim,),
        p + "ffn_norm.weight": (g.n_embd,),
        p + "ffn_gate_inp.weight": (g.n_expert, g.n_embd),
        p + "ffn_gate_exps.weight": (g.n_expert, g.n_ff_exp, g.n_embd),
        p + "ffn_up_exps.weight": (g.n_expert, g.n_ff_exp, g.n_embd),
        p + "ffn_down_exps.weight": (g.n_expert, g.n_embd, g.n_ff_exp),
    }


def validate(gguf: GGUFModel, g: Geometry) -> None:
    """Every tensor the architecture needs exists with its shape; raises GGUFError naming it."""
    for name, shape in model_level_shapes(g).items():
        gguf.require(name, shape)
    for layer in range(g.n_layers):
        for name, shape in expected_shapes(g, layer).items():
            gguf.require(name, shape)


def dense_tensor_names(g: Geometry, lb: int, le: int, first: bool, last: bool) -> list[str]:
    """The dense tensors a stage running [lb, le) loads. The planner prices exactly this list,
    each tensor at the bytes backends/layout.py gives it."""
    return stage_tensor_names(g, lb, le, first, last, lambda layer: [
        f"blk.{layer}.{p}.weight" for p in LAYER_DENSE_PARTS + (ROUTER_PART,)])


def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Norm weights and routers stay float32 on every backend (routing decisions are sensitive)."""
    return len(shape) == 1 or name.split(".")[-2] == ROUTER_PART


# ---- session geometry: what KVSession allocates, as model_shape prices it -------------------------

def layer_kinds(g: Geometry) -> tuple[str, ...]:
    return ("attention",) * g.n_layers


def kv_elems_per_cell(g: Geometry, layer: int) -> int:
    """K + V elements per context cell of a layer."""
    return 2 * g.n_head_kv * g.head_dim


def recurrent_elems(g: Geometry, layer: int) -> int:
    return 0


def rope_dim(g: Geometry) -> int:
    """Elements per cell of the session's RoPE table (cos + sin, head_dim/2 each)."""
    return g.head_dim


def prompt_buffers(g: Geometry, blob_bytes: int, dense16_bytes: int) -> list[Buffer]:
    """Every buffer `EagerOps` writes on a GPU (plan/workspace.py): the attention's normed
    rows, q, k and v, its output and the output projection's; then the routed experts'."""
    q, kv, d = g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_embd
    return [*residual_buffers(g),
            Buffer("x", "attention", 4 * d), Buffer("q", "attention", 4 * q),
            Buffer("k", "attention", 4 * kv), Buffer("v", "attention", 4 * kv),
            Buffer("attn", "attention", 4 * q), Buffer("o", "attention", 4 * d),
            *gemm_buffers("attention", (d, q), (q, kv, d), dense16_bytes), *rope_buffers(),
            *routed_expert_buffers(g, blob_bytes)]


# ---- the forward ---------------------------------------------------------------------------------

class KVSession:
    """The session of one conversation for the layers [lb, le) only: K/V rows for those layers
    (global ordinals kept: `k[layer]` is valid for lb <= layer < le), one RoPE table (the primary
    state every stage carves, attention layers or not) and the decode score scratch. It allocates
    exactly the parts `plan.pricing.session_parts` prices. With the backend's `kv_resident` below
    `max_cells` (--kv-resident) each layer's K and V is a RingKV: that many cells on the device,
    every cell in host memory (backends/kv_cache.py kv_host_nbytes)."""

    def __init__(self, backend, g: Geometry, lb: int, le: int, max_cells: int):
        xp = backend.xp
        self.lb, self.le, self.max_cells = lb, le, max_cells
        shape = (max_cells, g.n_head_kv, g.head_dim)
        resident = backend.kv_resident
        self._k = [new_session_kv(xp, shape, backend.kv_type, resident) for _ in range(lb, le)]
        self._v = [new_session_kv(xp, shape, backend.kv_type, resident) for _ in range(lb, le)]
        cos, sin = rope_tables(np.arange(max_cells), g.head_dim, g.rope_base,
                               g.rope_scaling)
        self.rope_cos, self.rope_sin = backend.asarray(cos), backend.asarray(sin)
        self.scores = xp.empty(DECODE_ROWS * g.n_head * max_cells, dtype=np.float32)
        self.n_past = 0

    @property
    def nbytes(self) -> int:
        parts = self._k + self._v + [self.rope_cos, self.rope_sin, self.scores]
        return sum(int(a.nbytes) for a in parts)

    def _row(self, layer: int) -> int:
        if not self.lb <= layer < self.le:
            raise IndexError(f"layer {layer} is not in this session's range [{self.lb}, {self.le})")
        return layer - self.lb

    def k(self, layer: int):
        return self._k[self._row(layer)]

    def v(self, layer: int):
        return self._v[self._row(layer)]

    def score_buffer(self, shape):
        """A view of the scratch for decode scores, or None when the rows do not fit in it."""
        size = int(np.prod(shape))
        return self.scores[:size].reshape(shape) if size <= self.scores.size else None

    def reset(self, n_past: int = 0) -> None:
        self.n_past = n_past

    def kv_rows(self) -> list:
        """Every K/V store of the range, in one fixed order (what a kept conversation copies)."""
        return self._k + self._v


@dataclass
class LayerWeights:
    attn_norm: object
    q: object
    k: object
    v: object
    o: object
    q_norm: object
    k_norm: object
    ffn_norm: object
    router: object


class Qwen3MoeOps(Protocol):
    """What `layer_step` calls: one op per fused launch (or launch pair) of the GPU decode graph.
    The eager implementation is `EagerOps` below (the backend's be.* operations: every CPU path
    and a GPU prompt chunk); the decode graph's is backends/graph_ops.py `GraphLayerOps`. `layer`
    is the global ordinal; arrays are [n, width] rows (a graph passes its static buffers)."""

    def norm_qkv(self, layer: int, h: Any) -> tuple[Any, Any, Any]:
        """q, k, v of RMSNorm(h) * attn_norm (one matvec launch with the norm fused)."""

    def attention(self, layer: int, q: Any, k: Any, v: Any) -> Any:
        """q and k RMSNormed per head and rotated, k and v written into the session's cache, then
        causal grouped-query attention over it -> [n, n_head * head_dim]. One op though two
        launches on a GPU: a batched eager step runs them row by row (each row's attention right
        after its own write, as its one-row step does)."""

    def add_out_projection(self, layer: int, attn: Any, h: Any) -> Any:
        """h + attn_output . attn (the matvec adds into the residual)."""

    def route(self, layer: int, h: Any) -> Any:
        """RMSNorm(h) * ffn_norm through the router and its top-k (the router's matvec with the
        norm fused, its last block picking the experts); returns what `add_experts` reads."""

    def add_experts(self, layer: int, routed: Any, h: Any) -> Any:
        """h + the chosen experts' SwiGLU outputs weighted in rank order (the gate/up launch,
        then the down launch adding into the residual)."""


def layer_step(ops: Qwen3MoeOps, g: Geometry, layer: int, h):
    """One qwen3moe layer over the rows h [n, n_embd]: the only place its sequence is written.
    The eager forward runs it on the backend (`EagerOps`); the GPU decode graph captures it
    through its launches (backends/cuda_decode.py DecodeGraph asks the model's module for it).
    `g`: the geometry (unused here; qwen3next's sequence reads each layer's kind from it)."""
    q, k, v = ops.norm_qkv(layer, h)
    attn = ops.attention(layer, q, k, v)
    h = ops.add_out_projection(layer, attn, h)
    return ops.add_experts(layer, ops.route(layer, h), h)


class EagerOps:
    """Qwen3MoeOps on the model's backend for n rows of one session at positions pos0.. (a prompt
    chunk or a decode step). The `out` names are the buffers a prompt chunk writes on a GPU
    (`prompt_buffers`)."""

    def __init__(self, model, session, pos0: int):
        self.model, self.g, self.be = model, model.g, model.backend
        self.session, self.pos0 = session, pos0

    # the one-session step names its buffers; a batched step (RowsOps) makes new arrays
    def _out(self, name: str) -> str | None:
        return name

    def norm_qkv(self, layer, h):
        g, w, be = self.g, self.model.layers[layer], self.be
        n = h.shape[0]
        x = be.rms_norm(h, w.attn_norm, g.rms_eps, out=self._out("x"))
        q = be.linear(x, w.q, out=self._out("q")).reshape(n, g.n_head, g.head_dim)
        k = be.linear(x, w.k, out=self._out("k")).reshape(n, g.n_head_kv, g.head_dim)
        v = be.linear(x, w.v, out=self._out("v")).reshape(n, g.n_head_kv, g.head_dim)
        return q, k, v

    def attention(self, layer, q, k, v):
        g, w, be, s, pos0 = self.g, self.model.layers[layer], self.be, self.session, self.pos0
        n = q.shape[0]
        q = be.qk_norm_rope_kv(q, k, v, w.q_norm, w.k_norm, g.rms_eps, s, layer, pos0)
        kc, vc = s.k(layer), s.v(layer)
        attn = be.attend(q, kc[:pos0 + n], vc[:pos0 + n], pos0, s, out=self._out("attn"))
        return attn.reshape(n, g.n_head * g.head_dim)

    def add_out_projection(self, layer, attn, h):
        be = self.be
        return be.add(h, be.linear(attn, self.model.layers[layer].o, out=self._out("o")),
                      out=self._out("h_mid"))

    def route(self, layer, h):
        w = self.model.layers[layer]
        x = self.be.rms_norm(h, w.ffn_norm, self.g.rms_eps, out=self._out("moe_x"))
        idx, wts = self.model._route(layer, x, w.router, normalize=True)
        return x, idx, wts

    def add_experts(self, layer, routed, h):
        x, idx, wts = routed
        return self.be.add(h, self.model._combine_routed(layer, x, idx, wts),
                           out=self._out("h"))


class RowsOps(EagerOps):
    """EagerOps for a batched decode step (protocol/batch.py): row i is the next token of
    sessions[i] at positions[i]. The projections, router and experts run over all rows at once;
    each row's q/k norm, RoPE, KV write and attention run alone, over its own session's KV at its
    own position, as its one-row step runs them."""

    def __init__(self, model, sessions: list, positions: list[int]):
        super().__init__(model, None, 0)
        self.sessions, self.positions = sessions, positions

    def _out(self, name: str) -> None:
        return None

    def attention(self, layer, q, k, v):
        g, w, be = self.g, self.model.layers[layer], self.be
        rows = []
        for i, (s, pos) in enumerate(zip(self.sessions, self.positions)):
            qi = be.qk_norm_rope_kv(q[i:i + 1], k[i:i + 1], v[i:i + 1], w.q_norm, w.k_norm,
                                    g.rms_eps, s, layer, pos)
            rows.append(be.attend(qi, s.k(layer)[:pos + 1], s.v(layer)[:pos + 1], pos, s))
        return be.xp.concatenate(rows).reshape(q.shape[0], g.n_head * g.head_dim)


class Qwen3Moe(LayerRangeModel):
    """The qwen3moe forward over the layers [lb, le) of a model file."""

    arch = sys.modules[__name__]

    def _build_layers(self) -> dict:
        def build(layer: int) -> LayerWeights:
            t = lambda part: self._tensors[f"blk.{layer}.{part}.weight"]  # noqa: E731
            return LayerWeights(t("attn_norm"), t("attn_q"), t("attn_k"), t("attn_v"),
                                t("attn_output"), t("attn_q_norm"), t("attn_k_norm"),
                                t("ffn_norm"), t(ROUTER_PART))
        return {layer: build(layer) for layer in range(self.lb, self.le)}

    def new_session(self, max_cells: int) -> KVSession:
        return KVSession(self.backend, self.g, self.lb, self.le, max_cells)

    # the forward: `layer_step` over these ops (common.LayerRangeModel.forward_layers / _rows)
    eager_ops, rows_ops = EagerOps, RowsOps


MODEL_CLASS = Qwen3Moe
