"""qwen35moe: Qwen3.5 MoE (Qwen3.5-35B-A3B and its family), run by the qwen3next forward.

The trunk is qwen3next's (models/qwen3next.py): Gated DeltaNet linear layers and gated full
attention layers, every layer ending in a routed MoE with a gated shared expert, the same norms
(stored +1 but the gated ssm_norm) and the same ssm_a / ssm_dt / conv conventions. What the file
holds differently is mapped here, at load, onto the geometry and weights qwen3next reads:

- beta and alpha are two tensors, blk.N.ssm_beta and blk.N.ssm_alpha ([n_v, n_embd] each), where
  qwen3next reads one ssm_ba (per key head: its r beta rows, then its r alpha rows). Rows of a
  matrix are independent, so stacking them in that order is exact.
- the value heads are stored tiled, not grouped: the converter orders a linear layer's value heads
  so that value head j reads key head j % n_k (position j = t * n_k + i for the t-th value head
  of key head i), where qwen3next's value head h reads key head h // r (h = i * r + t). Every
  tensor indexed by value head (the v rows of attn_qkv and of ssm_conv1d, attn_gate, beta, alpha,
  ssm_a, ssm_dt, and ssm_out's input columns) is put back in grouped order. A value head's
  arithmetic does not depend on its position, so the result is the same model.
- the attention's RoPE is multi-section (`rope.dimension_sections`): each rotated pair takes the
  position of its section. A text token has the same position in its time, height and width
  sections, so a pair in one of those rotates exactly as plain NEOX RoPE; a pair in the fourth
  section (or in none) would stay at position 0 for text. Files whose sections leave a pair there
  are refused naming the key; the others run on qwen3next's RoPE tables.
- recurrent layers may be flagged by `attention.recurrent_layers`; the flags must agree with the
  full_attention_interval rule (common.check_recurrent_layers refuses a file naming the key).
- there is no legacy ssm_in; an optional multi-token-prediction block after the stack is left
  unused (common.stack_layers says so).

The regrouping needs the weights as float32 on the host side, which is how the CPU backend keeps
them; a GPU backend keeps quantized blocks that span value heads (ssm_out's columns), so a
qwen35moe stage on a GPU is refused at start (`Qwen35Moe`).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np

from ..gguf_file.reader import GGUFError, GGUFModel
from . import qwen3next as _next
from .common import model_level_shapes, stage_tensor_names
# what this architecture shares with qwen3next as is (interface.Architecture's names)
from .qwen3next import (ATTENTION_PARTS, COMMON_PARTS, QKVZ_SPLIT_PARTS, ROUTER_PART,  # noqa: F401
                        SHEXP_GATE_PART, NextGeometry, gdn_mixer, keeps_f32, kv_elems_per_cell,
                        layer_kinds, layer_step, prompt_buffers, recurrent_elems, rope_dim,
                        tensor_name)

ARCH = "qwen35moe"

BETA_ALPHA_PARTS = ("ssm_beta", "ssm_alpha")
LINEAR_PARTS = ("ssm_conv1d", "ssm_dt", "ssm_a", *BETA_ALPHA_PARTS, "ssm_norm", "ssm_out")
SECTIONS_KEY = "rope.dimension_sections"
N_SECTIONS = 4      # time, height, width, extra (llama.cpp's multi-section RoPE)


# why a GPU rank does not run these files (models/__init__.py refuses a plan that would)
GPU_REFUSAL = ("qwen35moe runs on CPU ranks only so far: its value heads are regrouped from "
               "float32 weights at load, and a GPU keeps them quantized in blocks that span "
               "heads; run it with CPU ranks (--cpu-ranks, or --device cpu)")


def text_pairs(sections: list[int], n_pairs: int) -> list[bool]:
    """For each rotated pair of a head, whether it takes the token's own position for text input
    (one of the time / height / width sections, interleaved by pair index modulo 3 as llama.cpp's
    multi-section RoPE assigns them) rather than the extra section's, which is 0 for text."""
    s = list(sections) + [0] * (N_SECTIONS - len(sections))
    total = sum(s)
    out = []
    for pair in range(n_pairs):
        sector = pair % total
        out.append(any(sector % 3 == k and sector < 3 * s[k] for k in range(3)))
    return out


def _check_rope_sections(gguf: GGUFModel, n_rot: int) -> None:
    key = f"{gguf.arch}.{SECTIONS_KEY}"
    sections = gguf.metadata_array(key)
    if sections is None:
        raise GGUFError(gguf.path, "is missing: a qwen35moe file says how its rotated pairs are "
                                   "split into RoPE sections", key=key)
    if not 1 <= len(sections) <= N_SECTIONS or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in sections):
        raise GGUFError(gguf.path, f"is {list(sections)}; expected up to {N_SECTIONS} whole "
                                   "numbers >= 0", key=key)
    if not 0 < sum(sections) <= n_rot // 2:
        raise GGUFError(gguf.path, f"is {list(sections)}: their sum must be between 1 and the "
                                   f"{n_rot // 2} rotated pairs of a head", key=key)
    flags = text_pairs([int(v) for v in sections], n_rot // 2)
    if not all(flags):
        raise GGUFError(gguf.path, f"is {list(sections)}: rotated pair {flags.index(False)} falls "
                                   "in the extra section, which this build does not rotate for "
                                   "text (it runs the time/height/width sections only)", key=key)


def read_geometry(gguf: GGUFModel) -> NextGeometry:
    """qwen3next's geometry from the same metadata keys (under qwen35moe.), the RoPE sections
    checked; never the legacy fused layout."""
    g = _next.read_geometry(gguf)
    _check_rope_sections(gguf, g.n_rot)
    return dataclasses.replace(g, fused_qkvz=False)


def layer_parts(g: NextGeometry, layer: int) -> tuple[str, ...]:
    """The dense parts of one layer as the file holds them (the router included), in load order."""
    mixer = QKVZ_SPLIT_PARTS + LINEAR_PARTS if g.is_linear(layer) else ATTENTION_PARTS
    return mixer + COMMON_PARTS + (ROUTER_PART,)


def expected_shapes(g: NextGeometry, layer: int) -> dict[str, tuple[int, ...]]:
    shapes = _next.expected_shapes(g, layer)
    fused = shapes.pop(tensor_name(layer, "ssm_ba"), None)
    if fused is not None:
        for part in BETA_ALPHA_PARTS:
            shapes[tensor_name(layer, part)] = (g.n_v_heads, g.n_embd)
    return shapes


def validate(gguf: GGUFModel, g: NextGeometry) -> None:
    """Every tensor the architecture needs exists with its shape; raises GGUFError naming it."""
    for name, shape in model_level_shapes(g).items():
        gguf.require(name, shape)
    for layer in range(g.n_layers):
        for name, shape in expected_shapes(g, layer).items():
            if name.endswith(f".{SHEXP_GATE_PART}.weight") and \
                    gguf.tensor(name).shape == (g.n_embd,):
                continue
            gguf.require(name, shape)


def dense_tensor_names(g: NextGeometry, lb: int, le: int, first: bool, last: bool) -> list[str]:
    """The file's dense tensors a stage running [lb, le) loads (the planner prices these)."""
    return stage_tensor_names(g, lb, le, first, last,
                              lambda layer: [tensor_name(layer, p) for p in layer_parts(g, layer)])


def grouped_value_heads(g: NextGeometry) -> np.ndarray:
    """order[h] = the file's (tiled) position of qwen3next's (grouped) value head h: grouped head
    h = i * r + t (the t-th value head of key head i) is stored at t * n_k + i."""
    r = g.n_v_heads // g.n_k_heads
    return np.arange(g.n_v_heads).reshape(r, g.n_k_heads).T.reshape(-1)


def qwen3next_linear_weights(g: NextGeometry, w: dict, xp=np) -> dict:
    """A linear layer's weights as the file holds them -> the weights qwen3next's mixer reads:
    value heads in grouped order and beta / alpha stacked as ssm_ba. Float32 arrays in, new
    arrays out (the file's stay as they are)."""
    nk, nv, hv, d = g.n_k_heads, g.n_v_heads, g.head_v_dim, g.n_embd
    r, kd = nv // nk, 2 * g.key_dim
    order = grouped_value_heads(g)
    out = dict(w)
    qkv = w["attn_qkv"]
    out["attn_qkv"] = xp.concatenate([qkv[:kd], qkv[kd:].reshape(nv, hv, d)[order].reshape(-1, d)])
    out["attn_gate"] = w["attn_gate"].reshape(nv, hv, d)[order].reshape(-1, d)
    conv = w["ssm_conv1d"]
    K = conv.shape[1]
    out["ssm_conv1d"] = xp.concatenate([conv[:kd], conv[kd:].reshape(nv, hv, K)[order]
                                        .reshape(-1, K)])
    out["ssm_a"], out["ssm_dt"] = w["ssm_a"][order], w["ssm_dt"][order]
    out["ssm_out"] = w["ssm_out"].reshape(d, nv, hv)[:, order].reshape(d, nv * hv)
    beta = out.pop("ssm_beta")[order].reshape(nk, r, d)
    alpha = out.pop("ssm_alpha")[order].reshape(nk, r, d)
    out["ssm_ba"] = xp.concatenate([beta, alpha], axis=1).reshape(2 * nv, d)   # per key head
    return {k: xp.ascontiguousarray(v) for k, v in out.items()}


class Qwen35Moe(_next.Qwen3Next):
    """The qwen3next forward over a qwen35moe file's layers [lb, le), its linear layers' weights
    mapped at load (`qwen3next_linear_weights`)."""

    arch = sys.modules[__name__]

    def __init__(self, gguf, backend, *args, **kw):
        if backend.xp is not np:
            raise GGUFError(gguf.path, GPU_REFUSAL)
        super().__init__(gguf, backend, *args, **kw)

    def _build_layers(self) -> dict:
        layers = {}
        for layer in range(self.lb, self.le):
            w = {p: self._tensors[tensor_name(layer, p)] for p in layer_parts(self.g, layer)}
            if self.g.is_linear(layer):
                w = qwen3next_linear_weights(self.g, w)
                for part in layer_parts(self.g, layer):   # the file's copies go: one copy each
                    self._tensors.pop(tensor_name(layer, part))
            layers[layer] = w
        return layers


MODEL_CLASS = Qwen35Moe
