"""The decode step of a qwen3next stage on a GPU, as one CUDA graph: cuda_decode.py's runner (static
buffers, one captured graph per row count, the router picking the top-k on the device, the same
expert kernels, the step launched ahead) with qwen3next's layers: models/qwen3next.py's
`layer_step` (the layer sequence, written there once) captured through backends/graph_ops.py
NextGraphOps, whose launches are these.

Per layer, after the layer's RMSNorm fused into its input matvecs:
- a linear layer: attn_qkv, attn_gate and ssm_ba in one matvec launch (per type);
  `gdn_conv_step` (the causal conv over the session's conv state, SiLU, the q/k L2 norms) and
  `gdn_delta_step` (the gated delta rule on the session's recurrent state, the gated RMSNorm),
  both reading and writing the state in place (kernels/gated_delta.cuh); ssm_out + residual;
- an attention layer: attn_q ([q | gate] per head), attn_k, attn_v; `next_qk_norm_rope_kv` (q and
  k normed per head, the first 64 dims rotated, K/V written into the session);
  `attn_decode_256_g*`; `next_attn_gate`; attn_output + residual (kernels/next_attention.cuh;
  with --kv-type q8_0 their `_q8` builds; with --kv-resident their `_ring` builds (`_q8_ring`
  with q8_0), which keep the sinks and a ring of the newest cells on the card and read the rest
  in place from the pinned host copy, backends/kv_cache.py RingKV);
- the MoE: the router's matvec (post_attention_norm fused, its last block picking the top-k of up
  to 512 experts) and the routed experts' two launches as qwen3moe's; the shared expert's gate and
  up rows and its one-row gate logit in one matvec launch over the same normed rows,
  `next_shexp_act` (SwiGLU times the sigmoid of that logit), ffn_down_shexp + residual.

The pointer table holds two entries per layer slot, K and V of an attention layer or the conv
and recurrent state of a linear one, so one graph serves every session. The arithmetic is
models/qwen3next.py's, the reference tests/test_gpu_next_decode.py checks it against."""
from __future__ import annotations

import cupy as cp

from ..kernels.abi import MAX_ROWS, NEXT_HEAD_DIM, NEXT_ROT
from ..ops.gdn import decode_launch as gdn_decode_launch, gdn_spec
from ..ops.linear import _mat, mat_launches, norm_vector, weight_of
from .cuda_decode import DecodeGraph
from .graph_ops import NextGraphOps
from .graph_tables import Unsupported


def _mat_into(w, y, column: int, y_stride: int) -> dict:
    """A MatSpec row writing W's outputs into columns [column, column + W rows) of y [n, y_stride]
    (gate and up of the shared expert side by side in one buffer)."""
    spec = _mat(w, y)
    spec.update(y=int(y.data.ptr) + 4 * column, y_stride=y_stride)
    return spec


class NextDecodeGraph(DecodeGraph):
    """Decode steps of the layers [model.lb, model.le) of a qwen3next model whose experts are all
    read in place (the cache, a helper tier or pinned host memory, as DecodeGraph), for sessions
    of `max_cells` cells: models/qwen3next.py's layer_step through NextGraphOps."""

    layer_ops = NextGraphOps

    # ---- what the kernels support ---------------------------------------------------------------
    def _check_geometry(self, g) -> None:
        if g.arch != "qwen3next":
            raise Unsupported(f"{g.arch} is not qwen3next")
        if self.model.backend.kv_type not in ("f16", "q8_0"):
            raise Unsupported(f"K/V kept as {self.model.backend.kv_type} (qwen3next's attention "
                              f"kernels read f16 or q8_0)")
        if g.head_dim != NEXT_HEAD_DIM or g.n_rot != NEXT_ROT:
            raise Unsupported(f"attention heads of {g.head_dim} with {g.n_rot} rotated dims (the "
                              f"kernels are built for {NEXT_HEAD_DIM} with {NEXT_ROT})")
        if g.n_head % g.n_head_kv or g.n_head // g.n_head_kv > 16:
            raise Unsupported(f"{g.n_head} query heads over {g.n_head_kv} kv heads")
        if g.n_expert > 512 or g.n_expert_used > 16:
            raise Unsupported(f"{g.n_expert} experts, top-{g.n_expert_used} (the router kernel "
                              f"takes <= 512, top <= 16)")
        if g.n_embd % 32 or g.n_ff_exp % 32 or g.n_ff_shexp % 32:
            raise Unsupported("widths that are not whole groups of 32")
        if g.fused_qkvz:
            raise Unsupported("the fused ssm_in of older files (the kernels read attn_qkv and "
                              "attn_gate)")
        self.gdn = gdn_decode_launch(g)
        self.attention_layers = [l for l in range(self.lb, self.le) if not g.is_linear(l)]
        self.linear_layers = [l for l in range(self.lb, self.le) if g.is_linear(l)]

    # ---- static buffers and kernel argument tables ----------------------------------------------
    def _allocate(self, g) -> None:
        super()._allocate(g)
        f32, R = cp.float32, MAX_ROWS
        if self.attention_layers:
            self.qg = cp.zeros((R, 2 * g.n_head * g.head_dim), f32)   # attn_q: [q | gate] a head
        if self.linear_layers:
            self.qkv = cp.zeros((R, g.conv_dim), f32)
            self.z = cp.zeros((R, g.value_dim), f32)
            self.ba = cp.zeros((R, 2 * g.n_v_heads), f32)
            self.mixed = cp.zeros((R, g.conv_dim), f32)
            self.gdn_out = cp.zeros((R, g.value_dim), f32)
        self.shexp_gu = cp.zeros((R, 2 * g.n_ff_shexp), f32)          # gate | up
        self.shexp_logit = cp.zeros((R, 1), f32)
        self.shexp_act = cp.zeros((R, g.n_ff_shexp), f32)

    def _layer_spec(self, layer: int) -> dict:
        g, w = self.g, self.model.layers[layer]
        name = f"blk.{layer}"

        def W(part):
            return weight_of(w[part], f"{name}.{part}")

        spec = dict(attn_norm=norm_vector(w["attn_norm"], f"{name}.attn_norm"),
                    linear=g.is_linear(layer))
        if spec["linear"]:
            qkv, gate, ba, out = W("attn_qkv"), W("attn_gate"), W("ssm_ba"), W("ssm_out")
            spec.update(
                mix_in=mat_launches([(qkv, _mat(qkv, self.qkv)), (gate, _mat(gate, self.z)),
                                     (ba, _mat(ba, self.ba))]),
                mix_out=mat_launches([(out, _mat(out, self.h, add=self.h))]),
                gdn=gdn_spec(g, w, name, self.qkv, self.z, self.ba, self.mixed, self.gdn_out,
                             self.sess_table, layer - self.lb))
            mats = spec["mix_in"] + spec["mix_out"]
        else:
            q, k, v, o = W("attn_q"), W("attn_k"), W("attn_v"), W("attn_output")
            spec.update(
                qkv=mat_launches([(q, _mat(q, self.qg)), (k, _mat(k, self.k)),
                                  (v, _mat(v, self.v))]),
                o=mat_launches([(o, _mat(o, self.h, add=self.h))]),
                q_norm=norm_vector(w["attn_q_norm"], f"{name}.attn_q_norm"),
                k_norm=norm_vector(w["attn_k_norm"], f"{name}.attn_k_norm"))
            mats = spec["qkv"] + spec["o"]
        ffn_norm = norm_vector(w["post_attention_norm"], f"{name}.post_attention_norm")
        spec.update(self._experts_spec(layer, w["ffn_gate_inp"], ffn_norm,
                                       normalize=g.norm_topk_prob))
        sh = g.n_ff_shexp
        sh_gate, sh_up, sh_down = W("ffn_gate_shexp"), W("ffn_up_shexp"), W("ffn_down_shexp")
        sh_logit = W("ffn_gate_inp_shexp")
        spec.update(
            shexp_in=mat_launches([(sh_gate, _mat_into(sh_gate, self.shexp_gu, 0, 2 * sh)),
                                   (sh_up, _mat_into(sh_up, self.shexp_gu, sh, 2 * sh)),
                                   (sh_logit, _mat(sh_logit, self.shexp_logit))]),
            shexp_down=mat_launches([(sh_down, _mat(sh_down, self.h, add=self.h))]))
        spec["mats"] = mats + spec["router"] + spec["shexp_in"] + spec["shexp_down"]
        return spec

    def _layer_kernel_names(self) -> set[str]:
        names = {"next_shexp_act"}
        if self.attention_layers:
            names |= {"next_qk_norm_rope_kv" + self.kv_suffix + self.ring.suffix, self.attn_kernel,
                      "next_attn_gate"}
        if self.linear_layers:
            names |= {"gdn_conv_step", "gdn_delta_step"}
        return names

    def _session_pointers(self, session) -> list[int]:
        """Two entries a layer slot, then the RoPE tables; with q8_0 the attention layers' K and V
        are their int8 values and their scales follow the RoPE tables (0 for a linear layer's
        slot); with --kv-resident, the ring's words (DeviceRing.table_tail: the host copies of
        the attention layers' K and V, 0 for a linear layer's slot, and the ring's geometry)."""
        ptrs, kv = [], []
        q8 = bool(self.kv_suffix)
        for layer in range(self.lb, self.le):
            linear = self.g.is_linear(layer)
            pair = ((session.conv_state(layer), session.recurrent_state(layer))
                    if linear else (session.k(layer), session.v(layer)))
            ptrs += [int((a.q if q8 and not linear else a).data.ptr) for a in pair]
            kv += [None, None] if linear else list(pair)
        ptrs += [int(session.rope_cos.data.ptr), int(session.rope_sin.data.ptr)]
        if q8:
            ptrs += [int(a.scale.data.ptr) if a is not None else 0 for a in kv]
        return ptrs + self.ring.table_tail(kv)
