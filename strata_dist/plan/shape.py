"""ModelShape: the model geometry the planner prices, in the bytes the loader allocates.

The planner never opens a file. The coordinator builds one ModelShape from the GGUF reader and the
loader's own allocation rules, and every number below must be what the loader/session will actually
allocate on a GPU rank (dense tensors as f16, expert blobs in their stored block format). That is the
contract that lets the priced size and the loaded layout agree (DESIGN §4): if the loader allocates
something the shape does not count, every plan is silently optimistic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

LAYER_KINDS = ("attention", "linear")


@dataclass(frozen=True)
class ModelShape:
    """Geometry of a MoE model, per layer, in exact bytes.

    Per-layer sequences have length ``n_layers`` and are indexed by the GLOBAL layer ordinal.

    arch                 GGUF architecture name ("qwen3moe", "qwen3next"); informational.
    n_layers             number of transformer blocks.
    n_experts            routed experts per layer (all layers equal).
    top_k                experts used per token per layer.
    hidden               model width (n_embd); sizes the hidden-row hand-off buffers.
    n_head               attention query heads; sizes the decode attention-score scratch.
    layer_kind[l]        "attention" (KV cache) or "linear" (recurrent state; qwen3next Gated
                         DeltaNet). qwen3moe: all "attention". qwen3next: "linear" except every
                         full_attention_interval-th layer (l % 4 == 3).
    layer_dense_bytes[l] every tensor of layer l that is NOT a routed expert, as the loader allocates
                         it on the device: norms, attention/linear-attention projections, router
                         (ffn_gate_inp), shared expert and its gate (qwen3next). Includes router_bytes[l].
    router_bytes[l]      the part of layer_dense_bytes[l] that is the router (reported; a stage
                         loads only its own layers' routers).
    blob_bytes[l]        ONE routed expert of layer l: gate + up + down in their stored (quantised)
                         format, i.e. the bytes one expert-cache slot copy moves. Varies per layer in
                         mixed-quant files.
    kv_bytes_per_cell[l] attention layers: K + V bytes per context cell (all KV heads, in the
                         session's KV dtype). 0 for linear layers.
    recurrent_bytes[l]   linear layers: recurrent state + conv state bytes (context independent).
                         0 for attention layers.
    rope_bytes_per_cell  the primary state: the shared RoPE table (cos+sin) per cell. Every stage
                         carves exactly one, even a range with no attention layer, because
                         model-level uses (RoPE, prefill staging identity) read it.
    embed_bytes          token embedding as loaded by the first stage.
    head_bytes           output norm + output head as loaded by the last stage (count the tied
                         embedding again if the head reuses it on another card).
    head_shares_embedding  the head is the tied token embedding: a stage that is first AND last
                         loads that tensor once, so it is counted once.
    prompt_bytes_per_token  bytes of prompt-path buffers per token of a prompt chunk (activations,
                         routing, expert rows). With a prompt_layout, its slope (for reports);
                         without one (shapes built from a geometry), the price: N * this for a
                         chunk of N tokens (estimate_prompt_bytes_per_token).
    prompt_layout        the architecture's fixed layout of a chunk's buffers (plan/workspace.py
                         PromptLayout.to_list), the one a GPU stage carves from its loan: a chunk
                         of N tokens is priced at exactly what it carves (`prompt_bytes`).
    """

    arch: str
    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    n_head: int
    layer_kind: tuple[str, ...]
    layer_dense_bytes: tuple[int, ...]
    router_bytes: tuple[int, ...]
    blob_bytes: tuple[int, ...]
    kv_bytes_per_cell: tuple[int, ...]
    recurrent_bytes: tuple[int, ...]
    rope_bytes_per_cell: int
    embed_bytes: int
    head_bytes: int
    prompt_bytes_per_token: int
    head_shares_embedding: bool = False
    prompt_layout: tuple = ()

    def prompt_bytes(self, prompt_chunk: int) -> int:
        """A prompt chunk's buffers for prompt_chunk tokens: the layout's, else the per-token estimate."""
        if self.prompt_layout:
            from .workspace import PromptLayout
            return PromptLayout.from_list(self.prompt_layout).nbytes(prompt_chunk)
        return self.prompt_bytes_per_token * prompt_chunk

    def resident_prompt_bytes(self, prompt_chunk: int) -> int:
        """The same for a stage that never streams a miss (its cache holds every pair of its
        layers and lends nothing): the layout less its STREAMED buffer."""
        if self.prompt_layout:
            from .workspace import STREAMED, PromptLayout
            return PromptLayout.from_list(self.prompt_layout).without(STREAMED).nbytes(prompt_chunk)
        return self.prompt_bytes(prompt_chunk)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_layout", tuple(tuple(r) for r in self.prompt_layout))
        L = self.n_layers
        if L < 1 or self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"ModelShape: bad n_layers={L} n_experts={self.n_experts} top_k={self.top_k}")
        for name in ("layer_kind", "layer_dense_bytes", "router_bytes", "blob_bytes",
                     "kv_bytes_per_cell", "recurrent_bytes"):
            seq = tuple(getattr(self, name))
            if len(seq) != L:
                raise ValueError(f"ModelShape.{name} has {len(seq)} entries, n_layers is {L}")
            object.__setattr__(self, name, seq if name == "layer_kind" else tuple(int(x) for x in seq))
        for l, kind in enumerate(self.layer_kind):
            if kind not in LAYER_KINDS:
                raise ValueError(f"ModelShape.layer_kind[{l}] = {kind!r}, expected one of {LAYER_KINDS}")
            if self.router_bytes[l] > self.layer_dense_bytes[l]:
                raise ValueError(f"ModelShape.router_bytes[{l}] = {self.router_bytes[l]} exceeds "
                                 f"layer_dense_bytes[{l}] = {self.layer_dense_bytes[l]} (routers are part of dense)")
            if self.blob_bytes[l] <= 0:
                raise ValueError(f"ModelShape.blob_bytes[{l}] = {self.blob_bytes[l]} must be > 0")
        for name in ("hidden", "n_head", "rope_bytes_per_cell", "embed_bytes", "head_bytes",
                     "prompt_bytes_per_token"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"ModelShape.{name} = {getattr(self, name)} must be >= 0")
        for seq_name in ("layer_dense_bytes", "kv_bytes_per_cell", "recurrent_bytes"):
            if min(getattr(self, seq_name)) < 0:
                raise ValueError(f"ModelShape.{seq_name} has a negative entry")

    @property
    def n_pairs(self) -> int:
        return self.n_layers * self.n_experts

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        return cls(**d)


def estimate_prompt_bytes_per_token(hidden: int, expert_ff: int, top_k: int, n_experts: int,
                                    mixer_width: int, dtype_bytes: int = 4) -> int:
    """A documented estimate of prompt buffers per token, for shapes built without a prompt path.

    Per token of a chunk the prompt path holds (f32): the residual, the normed input, the mixer's
    output and the MoE output (4 * hidden); the widest mixer input projection (mixer_width: q+k+v
    (+gate) for attention, qkvz+ba for linear attention); router logits (n_experts); and for each of
    its top_k expert rows the gathered input (hidden), gate and up (2 * expert_ff) and the output
    (hidden). Attention scores are tiled into the per-stage work reserve, not sized per token.
    """
    elems = 4 * hidden + mixer_width + n_experts + top_k * (2 * hidden + 2 * expert_ff)
    return elems * dtype_bytes


def shape_from_geometry(*, n_layers: int, n_experts: int, top_k: int, hidden: int, expert_ff: int,
                        n_head: int, n_head_kv: int, head_dim: int, vocab: int,
                        expert_bytes_per_elem: float = 34 / 32, dense_bytes_per_elem: int = 2,
                        kv_bytes_per_elem: int = 2, arch: str = "qwen3moe",
                        layer_kind: Sequence[str] | None = None,
                        recurrent_bytes: int = 0) -> ModelShape:
    """A qwen3moe-style ModelShape from its dimensions (for tests, benchmarks, what-if plans).

    Real runs build the shape from the GGUF reader; this estimates the same quantities from the
    geometry: dense = q/k/v/o projections + q/k norms + two RMSNorms + router at dense_bytes_per_elem;
    blob = 3 * hidden * expert_ff elements at expert_bytes_per_elem (Q8_0: 34 bytes per 32).
    Linear layers (if layer_kind says so) get the same dense bytes and `recurrent_bytes` of state.
    """
    kinds = tuple(layer_kind) if layer_kind is not None else ("attention",) * n_layers
    q, kv = n_head * head_dim, n_head_kv * head_dim
    router = hidden * n_experts * dense_bytes_per_elem
    dense = (hidden * q * 2 + hidden * kv * 2 + 2 * head_dim + 2 * hidden) * dense_bytes_per_elem + router
    blob = int(round(3 * hidden * expert_ff * expert_bytes_per_elem))
    kv_cell = 2 * kv * kv_bytes_per_elem
    return ModelShape(
        arch=arch, n_layers=n_layers, n_experts=n_experts, top_k=top_k, hidden=hidden, n_head=n_head,
        layer_kind=kinds,
        layer_dense_bytes=(dense,) * n_layers,
        router_bytes=(router,) * n_layers,
        blob_bytes=(blob,) * n_layers,
        kv_bytes_per_cell=tuple(kv_cell if k == "attention" else 0 for k in kinds),
        recurrent_bytes=tuple(recurrent_bytes if k == "linear" else 0 for k in kinds),
        rope_bytes_per_cell=head_dim * 4,  # cos + sin, head_dim/2 each, f32
        embed_bytes=vocab * hidden * dense_bytes_per_elem,
        head_bytes=vocab * hidden * dense_bytes_per_elem + hidden * 4,
        prompt_bytes_per_token=estimate_prompt_bytes_per_token(
            hidden, expert_ff, top_k, n_experts, mixer_width=q + 2 * kv),
    )


def qwen3_30b_a3b_shape(**overrides) -> ModelShape:
    """Qwen3-30B-A3B geometry with Q8_0 experts: 48 layers, 128 experts top-8, hidden 2048,
    expert ff 768, 32 q / 4 kv heads of 128. One expert blob = 3*2048*768 * 34/32 = 5,013,504 bytes."""
    geo = dict(n_layers=48, n_experts=128, top_k=8, hidden=2048, expert_ff=768, n_head=32,
               n_head_kv=4, head_dim=128, vocab=151936)
    geo.update(overrides)
    return shape_from_geometry(**geo)
