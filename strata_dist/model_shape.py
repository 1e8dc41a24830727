"""The planner's ModelShape, built from a GGUF header with the loader's own allocation rules, so the
priced bytes and the loaded bytes come from one rule (DESIGN.md §4)."""
from __future__ import annotations

import numpy as np

from .gguf_model import GGUFModel
from .models import architecture_for
from .plan.shape import ModelShape, estimate_prompt_bytes_per_token

# What a rank keeps, by backend: CPU ranks hold everything in float32; GPU ranks keep dense
# matrices in f16. The KV cache is float32 on both for now.
DENSE_ITEMSIZE = {"cpu": 4, "cuda": 2}
KV_ITEMSIZE = 4


def _tensor_loaded_bytes(gguf: GGUFModel, arch, name: str, dense_itemsize: int) -> int:
    info = gguf.tensor(name)
    return int(np.prod(info.shape)) * arch.loaded_itemsize(name, info.shape, dense_itemsize)


def model_shape(gguf: GGUFModel, device_kind: str = "cpu") -> ModelShape:
    """ModelShape of `gguf` as a rank of `device_kind` ("cpu" or "cuda") would load it."""
    arch = architecture_for(gguf)
    g = arch.read_geometry(gguf)
    item = DENSE_ITEMSIZE[device_kind]
    size = lambda name: _tensor_loaded_bytes(gguf, arch, name, item)  # noqa: E731

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
    kv_cell = 2 * g.n_head_kv * g.head_dim * KV_ITEMSIZE
    return ModelShape(
        arch=g.arch, n_layers=g.n_layers, n_experts=g.n_expert, top_k=g.n_expert_used,
        hidden=g.n_embd, n_head=g.n_head,
        layer_kind=("attention",) * g.n_layers,
        layer_dense_bytes=tuple(layer_dense), router_bytes=tuple(routers),
        blob_bytes=tuple(gguf.blob_bytes(layer) for layer in range(g.n_layers)),
        kv_bytes_per_cell=(kv_cell,) * g.n_layers,
        recurrent_bytes=(0,) * g.n_layers,
        rope_bytes_per_cell=g.head_dim * 4,
        embed_bytes=sum(size(n) for n in first_only),
        head_bytes=sum(size(n) for n in last_only),
        prompt_bytes_per_token=estimate_prompt_bytes_per_token(
            g.n_embd, g.n_ff_exp, g.n_expert_used, g.n_expert,
            mixer_width=(g.n_head + 2 * g.n_head_kv) * g.head_dim),
    )
