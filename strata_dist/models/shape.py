"""The planner's ModelShape, built from a GGUF header with the loader's own allocation rules, so the
priced bytes and the loaded bytes come from one rule (docs/DEVELOPING.md, "Conventions")."""
from __future__ import annotations


from ..backends.kv_cache import default_kv_type, kv_cell_bytes
from ..backends.layout import dense_nbytes
from ..gguf_file.reader import GGUFModel
from . import architecture_for, check_device_kind
from .common import prompt_layout
from ..plan.shape import ModelShape

# What a rank keeps of dense tensors and of its KV cache: backends/layout.py. The linear layers'
# conv + recurrent state is float32.
STATE_ITEMSIZE = 4


def _tensor_loaded_bytes(gguf: GGUFModel, arch, name: str, device_kind: str) -> int:
    info = gguf.tensor(name)
    return dense_nbytes(info, device_kind, arch.keeps_f32(name, info.shape))


def model_shape(gguf: GGUFModel, device_kind: str = "cpu", kv_type: str | None = None) -> ModelShape:
    """ModelShape of `gguf` as a rank of `device_kind` ("cpu" or "cuda") would load it, its
    sessions keeping K/V as `kv_type` (default: the device kind's, backends/kv_cache.py)."""
    kv_type = kv_type or default_kv_type(device_kind)
    arch = architecture_for(gguf)
    check_device_kind(gguf, device_kind)
    g = arch.read_geometry(gguf)
    size = lambda name: _tensor_loaded_bytes(gguf, arch, name, device_kind)  # noqa: E731

    layer_dense, routers = [], []
    for layer in range(g.n_layers):
        names = arch.dense_tensor_names(g, layer, layer + 1, False, False)
        layer_dense.append(sum(size(n) for n in names))
        routers.append(sum(size(n) for n in names if n.split(".")[-2] == arch.ROUTER_PART))
    # the embedding and the head as the first / last stage load them (dense_tensor_names decides)
    first_only = set(arch.dense_tensor_names(g, 0, 1, True, False)) - set(
        arch.dense_tensor_names(g, 0, 1, False, False))
    last_only = set(arch.dense_tensor_names(g, 0, 1, False, True)) - set(
        arch.dense_tensor_names(g, 0, 1, False, False))
    kinds = arch.layer_kinds(g)
    layout = prompt_layout(arch, gguf, g)   # what a GPU stage carves for a chunk (plan/workspace.py)
    return ModelShape(
        arch=g.arch, n_layers=g.n_layers, n_experts=g.n_expert, top_k=g.n_expert_used,
        hidden=g.n_embd, n_head=g.n_head,
        layer_kind=kinds,
        layer_dense_bytes=tuple(layer_dense), router_bytes=tuple(routers),
        blob_bytes=tuple(gguf.blob_bytes(layer) for layer in range(g.n_layers)),
        # the session's own rule (the arch module's shapes), in its dtype: KV only for attention
        # layers, conv + recurrent state only for linear layers, one RoPE table per stage
        kv_bytes_per_cell=tuple(kv_cell_bytes(arch.kv_elems_per_cell(g, l), kv_type, g.head_dim)
                                if kinds[l] == "attention" else 0 for l in range(g.n_layers)),
        recurrent_bytes=tuple(arch.recurrent_elems(g, l) * STATE_ITEMSIZE if kinds[l] == "linear"
                              else 0 for l in range(g.n_layers)),
        rope_bytes_per_cell=arch.rope_dim(g) * 4,
        embed_bytes=sum(size(n) for n in first_only),
        head_bytes=sum(size(n) for n in last_only),
        head_shares_embedding=bool(first_only & last_only),
        prompt_bytes_per_token=layout.per_token(),
        prompt_layout=tuple(tuple(r) for r in layout.to_list()),
    )
