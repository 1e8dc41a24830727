"""Test fixtures: tiny random models built with `transformers`, written to GGUF in llama.cpp's
tensor naming (names from gguf-py's own tables), so the reference implementation is the oracle."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, MODEL_TENSOR, TENSOR_NAMES
from gguf import quants as gguf_quants
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

QT = GGMLQuantizationType


def tiny_qwen3moe(seed: int, hidden: int = 64, top_k: int = 2, n_layers: int = 4,
                  n_experts: int = 8, vocab: int = 320, tied: bool = False,
                  head_dim: int = 16) -> Qwen3MoeForCausalLM:
    """A random Qwen3-MoE whose weights are large enough that logits are far from uniform.
    (head_dim=128 with hidden=256 is the smallest model the GPU decode kernels take.)"""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=n_layers,
        num_attention_heads=hidden // head_dim, num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim, num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        tie_word_embeddings=tied, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        initializer_range=1.0 / np.sqrt(hidden), attn_implementation="eager")
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights: not all ones, so a missed norm shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _name(t: MODEL_TENSOR, layer: int | None = None) -> str:
    base = TENSOR_NAMES[t]
    return (base.format(bid=layer) if layer is not None else base) + ".weight"


def gguf_tensors(model: Qwen3MoeForCausalLM) -> dict[str, np.ndarray]:
    """HF state dict -> {gguf name: float32 array in numpy (row-major) order}."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    ff = cfg.moe_intermediate_size
    out = {_name(MODEL_TENSOR.TOKEN_EMBD): sd["model.embed_tokens.weight"],
           _name(MODEL_TENSOR.OUTPUT_NORM): sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out[_name(MODEL_TENSOR.OUTPUT)] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if p + "mlp.experts.gate_up_proj" in sd:   # fused experts (transformers >= 5)
            gate_up = sd[p + "mlp.experts.gate_up_proj"]      # [E, 2ff, hidden]: gate then up
            down = sd[p + "mlp.experts.down_proj"]
        else:                                        # one module per expert (older releases)
            e_ids = range(cfg.num_experts)
            gate_up = np.stack([np.concatenate([sd[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                sd[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in e_ids])
            down = np.stack([sd[f"{p}mlp.experts.{e}.down_proj.weight"] for e in e_ids])
        out.update({
            _name(MODEL_TENSOR.ATTN_NORM, i): sd[p + "input_layernorm.weight"],
            _name(MODEL_TENSOR.ATTN_Q, i): sd[p + "self_attn.q_proj.weight"],
            _name(MODEL_TENSOR.ATTN_K, i): sd[p + "self_attn.k_proj.weight"],
            _name(MODEL_TENSOR.ATTN_V, i): sd[p + "self_attn.v_proj.weight"],
            _name(MODEL_TENSOR.ATTN_OUT, i): sd[p + "self_attn.o_proj.weight"],
            _name(MODEL_TENSOR.ATTN_Q_NORM, i): sd[p + "self_attn.q_norm.weight"],
            _name(MODEL_TENSOR.ATTN_K_NORM, i): sd[p + "self_attn.k_norm.weight"],
            _name(MODEL_TENSOR.FFN_NORM, i): sd[p + "post_attention_layernorm.weight"],
            _name(MODEL_TENSOR.FFN_GATE_INP, i): sd[p + "mlp.gate.weight"],
            _name(MODEL_TENSOR.FFN_GATE_EXP, i): gate_up[:, :ff],
            _name(MODEL_TENSOR.FFN_UP_EXP, i): gate_up[:, ff:],
            _name(MODEL_TENSOR.FFN_DOWN_EXP, i): down,
        })
    return out


# A token's code: its k experts' values in the embedding's routing dims, in rank order. The
# smallest (0.55) stays far above the other dims' random values (the embedding's scale, 1/sqrt
# of the width: ~0.06 at 256), and the steps between them spread the softmax weights.
CODE_LEVELS = (1.0, 0.85, 0.7, 0.55)


def routed_by_token(model: Qwen3MoeForCausalLM, seed: int,
                    router_scale: float = 2.0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """`gguf_tensors(model)` changed so each token picks its experts by a code in its embedding,
    with a margin no rounding can cross, however the kernels round: (tensors, codes [vocab, k],
    each token's experts, the one of the largest code value first; the embedding's own random
    values may reorder the k among themselves, never the set).

    Dims 0 .. n_expert-1 of the residual are routing dims: the embedding adds CODE_LEVELS at its
    token's k experts, no layer writes them (attn_output's and ffn_down_exps' rows there are
    zero: each layer's output lands in the other dims), and each router reads only them (row e:
    router_scale / ffn_norm weight at dim e, undoing the norm's weight). So router logit e of a
    row is router_scale * h[e] / rms(h): the order of the logits is the order of the token's
    code, and the row's RMS (the one thing the layers' arithmetic moves) scales them together.
    The codes are drawn per token (`seed`), so a prompt's rows still spread over the experts
    unevenly, as learned routing does."""
    cfg = model.config
    n_expert, k = cfg.num_experts, cfg.num_experts_per_tok
    if not 0 < k < n_expert or k > len(CODE_LEVELS) or n_expert > cfg.hidden_size:
        raise ValueError(f"routed_by_token takes top-k of 1..{len(CODE_LEVELS)} below n_expert "
                         f"and n_expert <= hidden (got top-{k} of {n_expert}, hidden "
                         f"{cfg.hidden_size})")
    tensors = gguf_tensors(model)
    rng = np.random.default_rng(seed)
    codes = np.stack([rng.permutation(n_expert)[:k] for _ in range(cfg.vocab_size)])
    emb = tensors[_name(MODEL_TENSOR.TOKEN_EMBD)].copy()
    emb[np.arange(cfg.vocab_size)[:, None], codes] += np.asarray(CODE_LEVELS[:k], np.float32)
    tensors[_name(MODEL_TENSOR.TOKEN_EMBD)] = emb
    dims = np.arange(n_expert)
    for i in range(cfg.num_hidden_layers):
        norm = tensors[_name(MODEL_TENSOR.FFN_NORM, i)]
        router = np.zeros((n_expert, cfg.hidden_size), np.float32)
        router[dims, dims] = router_scale / norm[:n_expert]
        tensors[_name(MODEL_TENSOR.FFN_GATE_INP, i)] = router
        for t in (MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_DOWN_EXP):
            w = tensors[_name(t, i)].copy()
            w[..., :n_expert, :] = 0.0        # [hidden, in] or [expert, hidden, ff]
            tensors[_name(t, i)] = w
    return tensors, codes


def _stored(name: str, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, QT]:
    """Norms and routers stay F32 (as llama.cpp's converter keeps them); the rest takes `dtype`."""
    if arr.ndim == 1 or "ffn_gate_inp" in name or dtype == "f32":
        return np.ascontiguousarray(arr, dtype=np.float32), QT.F32
    if dtype == "f16":
        return np.ascontiguousarray(arr, dtype=np.float16), QT.F16
    qtype = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q5_0": QT.Q5_0}[dtype]
    return gguf_quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype), qtype


def write_gguf(model: Qwen3MoeForCausalLM, path, dtype: str = "f32",
               tensors: dict[str, np.ndarray] | None = None, arch: str = "qwen3moe",
               eos_id: int | None = None, metadata: dict | None = None) -> str:
    """`metadata`: {key under the architecture: (value, GGUFValueType)} written over the model's
    own values (hostile-input tests)."""
    cfg = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if eos_id is not None:
        w.add_eos_token_id(eos_id)
    for key, (value, vtype) in (metadata or {}).items():
        w.add_key_value(f"{arch}.{key}", value, vtype)
    for name, arr in (tensors if tensors is not None else gguf_tensors(model)).items():
        data, qtype = _stored(name, arr, dtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def load_gguf_weights_into(model: Qwen3MoeForCausalLM, gguf_model) -> Qwen3MoeForCausalLM:
    """Copy a GGUF file's dequantized weights back into the HF model (for the F16/Q8_0 checks:
    the reference then runs the very weights the file holds)."""
    cfg = model.config
    sd = model.state_dict()
    ff = cfg.moe_intermediate_size
    back = {_name(MODEL_TENSOR.TOKEN_EMBD): "model.embed_tokens.weight",
            _name(MODEL_TENSOR.OUTPUT_NORM): "model.norm.weight",
            _name(MODEL_TENSOR.OUTPUT): "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        back.update({
            _name(MODEL_TENSOR.ATTN_NORM, i): p + "input_layernorm.weight",
            _name(MODEL_TENSOR.ATTN_Q, i): p + "self_attn.q_proj.weight",
            _name(MODEL_TENSOR.ATTN_K, i): p + "self_attn.k_proj.weight",
            _name(MODEL_TENSOR.ATTN_V, i): p + "self_attn.v_proj.weight",
            _name(MODEL_TENSOR.ATTN_OUT, i): p + "self_attn.o_proj.weight",
            _name(MODEL_TENSOR.ATTN_Q_NORM, i): p + "self_attn.q_norm.weight",
            _name(MODEL_TENSOR.ATTN_K_NORM, i): p + "self_attn.k_norm.weight",
            _name(MODEL_TENSOR.FFN_NORM, i): p + "post_attention_layernorm.weight",
            _name(MODEL_TENSOR.FFN_GATE_INP, i): p + "mlp.gate.weight",
            _name(MODEL_TENSOR.FFN_DOWN_EXP, i): p + "mlp.experts.down_proj",
        })
    with torch.no_grad():
        for gname, hname in back.items():
            if gname in gguf_model.tensors and hname in sd:
                sd[hname].copy_(torch.from_numpy(np.array(gguf_model.dequantize(gname))))
        for i in range(cfg.num_hidden_layers):
            gate = gguf_model.dequantize(_name(MODEL_TENSOR.FFN_GATE_EXP, i))
            up = gguf_model.dequantize(_name(MODEL_TENSOR.FFN_UP_EXP, i))
            sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][:, :ff].copy_(torch.from_numpy(gate))
            sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][:, ff:].copy_(torch.from_numpy(up))
    return model


def hf_logits(model: Qwen3MoeForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rope_scaled_twin(model: Qwen3MoeForCausalLM, rope_parameters: dict) -> Qwen3MoeForCausalLM:
    """The same weights under other rope_parameters (a yarn or linear scaling: the rotary tables
    are built when the model is)."""
    cfg = Qwen3MoeConfig.from_dict(model.config.to_dict())
    cfg.rope_parameters = rope_parameters
    twin = Qwen3MoeForCausalLM(cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


# ---- qwen35moe (Qwen3.5 MoE) twins --------------------------------------------------------------
# Written from the rules of llama.cpp's converter for Qwen3.5 MoE (its Qwen3-Next rules plus):
# in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate, in_proj_b -> ssm_beta, in_proj_a -> ssm_alpha;
# every tensor indexed by a linear layer's value head (v rows of in_proj_qkv and of conv1d, z, b,
# a, A_log, dt_bias, out_proj's columns) reordered from grouped (by key head) to tiled order;
# RMSNorm weights +1 but linear_attn.norm; A_log -> ssm_a = -exp; rope.dimension_sections.

def tiny_qwen35moe(seed: int, hidden: int = 64, n_layers: int = 8, n_k_heads: int = 2,
                   n_v_heads: int = 4, head_k_dim: int = 16, head_v_dim: int = 24,
                   head_dim: int = 32, n_experts: int = 8, top_k: int = 2, vocab: int = 320,
                   sections: tuple[int, ...] = (2, 1, 1), init: float = 0.5, head_gain: float = 2.0):
    """A random Qwen3.5-MoE text model (transformers' Qwen3_5MoeForCausalLM) with logits far from
    uniform; body weights at init/sqrt(hidden) so float32 rounding stays far below 1e-4."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=2 * hidden // head_dim, num_key_value_heads=max(1, hidden // head_dim),
        head_dim=head_dim, linear_conv_kernel_dim=4, linear_key_head_dim=head_k_dim,
        linear_value_head_dim=head_v_dim, linear_num_key_heads=n_k_heads,
        linear_num_value_heads=n_v_heads, num_experts=n_experts, num_experts_per_tok=top_k,
        tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-6,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                     for i in range(n_layers)],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "partial_rotary_factor": 0.25, "mrope_section": list(sections)},
        initializer_range=init / np.sqrt(hidden), attn_implementation="eager")
    model = Qwen3_5MoeForCausalLM(cfg).eval()
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
            elif name.endswith("mlp.gate.weight") or name.endswith("experts.gate_up_proj") \
                    or name.endswith("experts.down_proj"):   # zero/empty at init here
                p.copy_(torch.randn_like(p) * init / np.sqrt(hidden))
            elif name == "lm_head.weight":
                p.mul_(head_gain)
    return model


def _tiled(a: np.ndarray, axis: int, n_k: int, n_v: int, head: int) -> np.ndarray:
    """The converter's value-head reorder along `axis`: [n_k, r, head] -> [r, n_k, head]."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_k, n_v // n_k, head, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
    return np.ascontiguousarray(np.moveaxis(a.reshape(n_v * head, *rest), 0, axis))


def qwen35moe_gguf_tensors(model) -> dict[str, np.ndarray]:
    """HF state dict -> {gguf name: float32 array in numpy order}, as the converter writes them."""
    T = MODEL_TENSOR
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    ff, nk, nv = cfg.moe_intermediate_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out = {_name(T.TOKEN_EMBD): sd["model.embed_tokens.weight"],
           _name(T.OUTPUT_NORM): sd["model.norm.weight"] + 1,
           _name(T.OUTPUT): sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        out.update({
            _name(T.ATTN_NORM, i): sd[p + "input_layernorm.weight"] + 1,
            _name(T.ATTN_POST_NORM, i): sd[p + "post_attention_layernorm.weight"] + 1,
            _name(T.FFN_GATE_INP, i): sd[p + "mlp.gate.weight"],
            _name(T.FFN_GATE_EXP, i): gate_up[:, :ff], _name(T.FFN_UP_EXP, i): gate_up[:, ff:],
            _name(T.FFN_DOWN_EXP, i): sd[p + "mlp.experts.down_proj"],
            _name(T.FFN_GATE_SHEXP, i): sd[p + "mlp.shared_expert.gate_proj.weight"],
            _name(T.FFN_UP_SHEXP, i): sd[p + "mlp.shared_expert.up_proj.weight"],
            _name(T.FFN_DOWN_SHEXP, i): sd[p + "mlp.shared_expert.down_proj.weight"],
            _name(T.FFN_GATE_INP_SHEXP, i): sd[p + "mlp.shared_expert_gate.weight"],
        })
        if cfg.layer_types[i] == "linear_attention":
            la = p + "linear_attn."
            qkv, conv = sd[la + "in_proj_qkv.weight"], sd[la + "conv1d.weight"].squeeze()
            kd = 2 * nk * hk
            out.update({
                _name(T.ATTN_QKV, i): np.concatenate([qkv[:kd], _tiled(qkv[kd:], 0, nk, nv, hv)]),
                _name(T.ATTN_GATE, i): _tiled(sd[la + "in_proj_z.weight"], 0, nk, nv, hv),
                _name(T.SSM_BETA, i): _tiled(sd[la + "in_proj_b.weight"], 0, nk, nv, 1),
                _name(T.SSM_ALPHA, i): _tiled(sd[la + "in_proj_a.weight"], 0, nk, nv, 1),
                _name(T.SSM_CONV1D, i): np.concatenate([conv[:kd],
                                                        _tiled(conv[kd:], 0, nk, nv, hv)]),
                TENSOR_NAMES[T.SSM_A].format(bid=i): _tiled(-np.exp(sd[la + "A_log"]), 0, nk, nv, 1),
                TENSOR_NAMES[T.SSM_DT].format(bid=i) + ".bias": _tiled(sd[la + "dt_bias"], 0, nk,
                                                                       nv, 1),
                _name(T.SSM_NORM, i): sd[la + "norm.weight"],                   # no +1
                _name(T.SSM_OUT, i): _tiled(sd[la + "out_proj.weight"], 1, nk, nv, hv),
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


def write_qwen35moe_gguf(model, path, dtype: str = "f32", sections=None, recurrent=None,
                         drop: tuple[str, ...] = (), tokenizer: bool = False) -> str:
    """The metadata the converter writes for Qwen3.5 MoE (Qwen3-Next's keys plus
    rope.dimension_sections and attention.recurrent_layers) under `qwen35moe.`. For hostile
    input: `sections` / `recurrent` written instead of the model's ("omit": no key), `drop`
    leaves those tensors out; `tokenizer`: the synth's tokenizer too."""
    from gguf import GGUFValueType
    from hf_next_fixtures import write_hybrid_metadata
    from strata_dist.synth.tokenizer import add_tokenizer
    cfg, arch = model.config, "qwen35moe"
    w = GGUFWriter(str(path), arch)
    write_hybrid_metadata(w, cfg)
    flags = [t == "linear_attention" for t in cfg.layer_types] if recurrent is None else recurrent
    if flags != "omit":
        w.add_key_value(f"{arch}.attention.recurrent_layers", flags, GGUFValueType.ARRAY)
    secs = list(cfg.rope_parameters["mrope_section"]) + [0] if sections is None else sections
    if secs != "omit":
        w.add_key_value(f"{arch}.rope.dimension_sections", secs, GGUFValueType.ARRAY)
    if tokenizer:     # llama.cpp loads no file without one (the synth's: vocab >= 370)
        add_tokenizer(w, cfg.vocab_size)
    for name, arr in qwen35moe_gguf_tensors(model).items():
        if name in drop:
            continue
        data, qtype = _stored(name, arr, "f32" if ".ssm_conv1d" in name else dtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
