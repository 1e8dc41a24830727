"""Test fixtures for qwen3next: tiny random `Qwen3NextForCausalLM` models written to GGUF the way
llama.cpp's converter writes them (convert_hf_to_gguf.py, class Qwen3NextModel), with tensor names
from gguf-py's own tables. Written from the converter's rules, not from our forward, so the test
checks both the conventions and the forward:

- every RMSNorm weight +1 (HF's Qwen3NextRMSNorm computes x * (1 + w)), except the gated norm
  linear_attn.norm (HF multiplies by w);
- A_log -> ssm_a = -exp(A_log); dt_bias -> ssm_dt.bias; conv1d.weight squeezed to [conv_dim, K];
- in_proj_qkvz (per key head [q | k | v | z]) -> attn_qkv = [all q | all k | all v] and
  attn_gate = z (or, legacy=True, left whole as ssm_in); in_proj_ba -> ssm_ba unchanged;
- self_attn.q_proj -> attn_q unchanged (per head [q | gate]); post_attention_layernorm ->
  post_attention_norm; shared_expert_gate -> ffn_gate_inp_shexp unchanged ([1, n_embd]).
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, MODEL_TENSOR, TENSOR_NAMES
from gguf import quants as gguf_quants
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

QT = GGMLQuantizationType
T = MODEL_TENSOR


def tiny_qwen3next(seed: int, hidden: int = 64, top_k: int = 2, n_layers: int = 8,
                   n_experts: int = 8, vocab: int = 320, tied: bool = False, interval: int = 4,
                   head_dim: int = 32, n_k_heads: int = 2, n_v_heads: int = 4,
                   head_k_dim: int = 16, head_v_dim: int = 24, init: float = 0.5,
                   head_gain: float = 2.0, n_head: int | None = None,
                   n_kv: int | None = None) -> Qwen3NextForCausalLM:
    """A random Qwen3-Next whose logits are far from uniform (std ~1). Its attention has
    2 hidden / head_dim query heads over hidden / head_dim kv heads unless `n_head` / `n_kv` say.

    The body's weights are drawn at init/sqrt(hidden): at 1/sqrt(hidden) the hidden states grow
    ~20x over 8 layers and float32 rounding alone (transformers in float32 against float64) moves
    the logits by up to 1.5e-4, which would make a 1e-4 check flaky. At 0.5/sqrt(hidden) that
    floor is ~1e-5; the output head is scaled by `head_gain` so the logits keep a std of ~1."""
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden,
        num_hidden_layers=n_layers, num_attention_heads=n_head or hidden // head_dim * 2,
        num_key_value_heads=n_kv or max(1, hidden // head_dim), head_dim=head_dim,
        linear_conv_kernel_dim=4, linear_key_head_dim=head_k_dim, linear_value_head_dim=head_v_dim,
        linear_num_key_heads=n_k_heads, linear_num_value_heads=n_v_heads,
        num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        full_attention_interval=interval, tie_word_embeddings=tied, max_position_embeddings=4096,
        rms_norm_eps=1e-6, partial_rotary_factor=0.25,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
        initializer_range=init / np.sqrt(hidden), attn_implementation="eager")
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):      # gated norm: weight used as is
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):                # (1 + w) norms: w around 0
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith("A_log"):                      # A in [0.5, 4]: a visible decay
                p.copy_(torch.empty_like(p).uniform_(0.5, 4.0).log())
            elif name == "lm_head.weight" and not tied:
                p.mul_(head_gain)
    return model


def _name(t: MODEL_TENSOR, layer: int | None = None, suffix: str = ".weight") -> str:
    base = TENSOR_NAMES[t]
    return (base.format(bid=layer) if layer is not None else base) + suffix


def _split_qkvz(w: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """The converter's in_proj_qkvz transform: [n_k * (hk + hk + r hv + r hv), hidden] with the
    parts interleaved per key head -> (qkv [q all | k all | v all], z)."""
    hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nk, nv, hidden = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.hidden_size
    r = nv // nk
    sizes = [hk, hk, r * hv, r * hv]
    per = w.T.reshape(hidden, nk, sum(sizes))                 # (n_embd, head_count, q+k+v+z)
    bounds = np.cumsum(sizes)[:-1]
    q, k, v, z = np.split(per, bounds, axis=-1)
    flat = [a.reshape(hidden, -1) for a in (q, k, v, z)]
    qkv = np.concatenate(flat[:3], axis=-1).T
    return np.ascontiguousarray(qkv), np.ascontiguousarray(flat[3].T)


def gguf_tensors(model: Qwen3NextForCausalLM, legacy: bool = False) -> dict[str, np.ndarray]:
    """HF state dict -> {gguf name: float32 array in numpy (row-major) order}."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    ff = cfg.moe_intermediate_size
    out = {_name(T.TOKEN_EMBD): sd["model.embed_tokens.weight"],
           _name(T.OUTPUT_NORM): sd["model.norm.weight"] + 1}
    if not cfg.tie_word_embeddings:
        out[_name(T.OUTPUT)] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"]          # [E, 2ff, hidden]: gate then up
        out.update({
            _name(T.ATTN_NORM, i): sd[p + "input_layernorm.weight"] + 1,
            _name(T.ATTN_POST_NORM, i): sd[p + "post_attention_layernorm.weight"] + 1,
            _name(T.FFN_GATE_INP, i): sd[p + "mlp.gate.weight"],
            _name(T.FFN_GATE_EXP, i): gate_up[:, :ff],
            _name(T.FFN_UP_EXP, i): gate_up[:, ff:],
            _name(T.FFN_DOWN_EXP, i): sd[p + "mlp.experts.down_proj"],
            _name(T.FFN_GATE_SHEXP, i): sd[p + "mlp.shared_expert.gate_proj.weight"],
            _name(T.FFN_UP_SHEXP, i): sd[p + "mlp.shared_expert.up_proj.weight"],
            _name(T.FFN_DOWN_SHEXP, i): sd[p + "mlp.shared_expert.down_proj.weight"],
            _name(T.FFN_GATE_INP_SHEXP, i): sd[p + "mlp.shared_expert_gate.weight"],
        })
        if cfg.layer_types[i] == "linear_attention":
            la = p + "linear_attn."
            qkvz = sd[la + "in_proj_qkvz.weight"]
            if legacy:
                out[_name(T.SSM_IN, i)] = qkvz
            else:
                qkv, z = _split_qkvz(qkvz, cfg)
                out[_name(T.ATTN_QKV, i)] = qkv
                out[_name(T.ATTN_GATE, i)] = z
            out.update({
                _name(T.SSM_BETA_ALPHA, i): sd[la + "in_proj_ba.weight"],
                _name(T.SSM_CONV1D, i): sd[la + "conv1d.weight"].squeeze(),
                _name(T.SSM_A, i, suffix=""): -np.exp(sd[la + "A_log"]),
                _name(T.SSM_DT, i, suffix=".bias"): sd[la + "dt_bias"],
                _name(T.SSM_NORM, i): sd[la + "norm.weight"],               # no +1
                _name(T.SSM_OUT, i): sd[la + "out_proj.weight"],
            })
        else:
            sa = p + "self_attn."
            out.update({
                _name(T.ATTN_Q, i): sd[sa + "q_proj.weight"],
                _name(T.ATTN_K, i): sd[sa + "k_proj.weight"],
                _name(T.ATTN_V, i): sd[sa + "v_proj.weight"],
                _name(T.ATTN_OUT, i): sd[sa + "o_proj.weight"],
                _name(T.ATTN_Q_NORM, i): sd[sa + "q_norm.weight"] + 1,
                _name(T.ATTN_K_NORM, i): sd[sa + "k_norm.weight"] + 1,
            })
    return out


_F32_PARTS = ("ffn_gate_inp", "ssm_conv1d", "ssm_a")


def _stored(name: str, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, QT]:
    """1-D tensors, routers, the shared-expert gate and the conv kernel stay F32 (as llama.cpp's
    converter keeps them); the rest takes `dtype`."""
    if arr.ndim == 1 or any(f".{p}" in name for p in _F32_PARTS) or dtype == "f32":
        return np.ascontiguousarray(arr, dtype=np.float32), QT.F32
    if dtype == "f16":
        return np.ascontiguousarray(arr, dtype=np.float16), QT.F16
    qtype = {"q8_0": QT.Q8_0}[dtype]
    return gguf_quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), qtype


def write_hybrid_metadata(w: GGUFWriter, cfg) -> None:
    """The hybrid stack's metadata both converters write (Qwen3-Next's and Qwen3.5-MoE's, under
    the writer's architecture): Qwen2Moe's keys + ssm.*, the attention interval and
    rope.dimension_count = head_dim * partial_rotary_factor."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    interval = [t for t in cfg.layer_types].index("full_attention") + 1
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))


def write_gguf(model: Qwen3NextForCausalLM, path, dtype: str = "f32", legacy: bool = False,
               eos_id: int | None = None) -> str:
    """The metadata Qwen3NextModel.set_gguf_parameters writes (Qwen2Moe's + ssm.*, the attention
    interval and rope.dimension_count = head_dim * partial_rotary_factor)."""
    cfg = model.config
    w = GGUFWriter(str(path), "qwen3next")
    w.add_feed_forward_length(cfg.intermediate_size)
    write_hybrid_metadata(w, cfg)
    if eos_id is not None:
        w.add_eos_token_id(eos_id)
    for name, arr in gguf_tensors(model, legacy=legacy).items():
        data, qtype = _stored(name, arr, dtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _join_qkvz(qkv: np.ndarray, z: np.ndarray, cfg) -> np.ndarray:
    """The inverse of _split_qkvz."""
    hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nk, nv, hidden = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.hidden_size
    r = nv // nk
    q, k, v = np.split(qkv.T, [nk * hk, 2 * nk * hk], axis=-1)
    parts = [q.reshape(hidden, nk, hk), k.reshape(hidden, nk, hk), v.reshape(hidden, nk, r * hv),
             z.T.reshape(hidden, nk, r * hv)]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(hidden, -1).T)


def load_gguf_weights_into(model: Qwen3NextForCausalLM, gguf_model) -> Qwen3NextForCausalLM:
    """Copy a GGUF file's dequantized weights back into the HF model, undoing the converter's
    transforms (for the F16/Q8_0 checks: the reference then runs the very weights the file holds)."""
    cfg = model.config
    sd = model.state_dict()
    back = {name: None for name in gguf_tensors(model)}   # every name the file holds
    deq = {n: np.array(gguf_model.dequantize(n)) for n in back if n in gguf_model.tensors}
    ff = cfg.moe_intermediate_size

    def put(hname, arr):
        sd[hname].copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(sd[hname].shape))

    with torch.no_grad():
        put("model.embed_tokens.weight", deq[_name(T.TOKEN_EMBD)])
        put("model.norm.weight", deq[_name(T.OUTPUT_NORM)] - 1)
        if not cfg.tie_word_embeddings:
            put("lm_head.weight", deq[_name(T.OUTPUT)])
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            put(p + "input_layernorm.weight", deq[_name(T.ATTN_NORM, i)] - 1)
            put(p + "post_attention_layernorm.weight", deq[_name(T.ATTN_POST_NORM, i)] - 1)
            put(p + "mlp.gate.weight", deq[_name(T.FFN_GATE_INP, i)])
            gate_up = np.concatenate([deq[_name(T.FFN_GATE_EXP, i)], deq[_name(T.FFN_UP_EXP, i)]], axis=1)
            assert gate_up.shape[1] == 2 * ff
            put(p + "mlp.experts.gate_up_proj", gate_up)
            put(p + "mlp.experts.down_proj", deq[_name(T.FFN_DOWN_EXP, i)])
            put(p + "mlp.shared_expert.gate_proj.weight", deq[_name(T.FFN_GATE_SHEXP, i)])
            put(p + "mlp.shared_expert.up_proj.weight", deq[_name(T.FFN_UP_SHEXP, i)])
            put(p + "mlp.shared_expert.down_proj.weight", deq[_name(T.FFN_DOWN_SHEXP, i)])
            put(p + "mlp.shared_expert_gate.weight", deq[_name(T.FFN_GATE_INP_SHEXP, i)])
            if cfg.layer_types[i] == "linear_attention":
                la = p + "linear_attn."
                if _name(T.SSM_IN, i) in deq:
                    put(la + "in_proj_qkvz.weight", deq[_name(T.SSM_IN, i)])
                else:
                    put(la + "in_proj_qkvz.weight",
                        _join_qkvz(deq[_name(T.ATTN_QKV, i)], deq[_name(T.ATTN_GATE, i)], cfg))
                put(la + "in_proj_ba.weight", deq[_name(T.SSM_BETA_ALPHA, i)])
                put(la + "conv1d.weight", deq[_name(T.SSM_CONV1D, i)])
                put(la + "A_log", np.log(-deq[_name(T.SSM_A, i, suffix="")].astype(np.float64)))
                put(la + "dt_bias", deq[_name(T.SSM_DT, i, suffix=".bias")])
                put(la + "norm.weight", deq[_name(T.SSM_NORM, i)])
                put(la + "out_proj.weight", deq[_name(T.SSM_OUT, i)])
            else:
                sa = p + "self_attn."
                put(sa + "q_proj.weight", deq[_name(T.ATTN_Q, i)])
                put(sa + "k_proj.weight", deq[_name(T.ATTN_K, i)])
                put(sa + "v_proj.weight", deq[_name(T.ATTN_V, i)])
                put(sa + "o_proj.weight", deq[_name(T.ATTN_OUT, i)])
                put(sa + "q_norm.weight", deq[_name(T.ATTN_Q_NORM, i)] - 1)
                put(sa + "k_norm.weight", deq[_name(T.ATTN_K_NORM, i)] - 1)
    return model


def hf_logits(model: Qwen3NextForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
