"""What several architectures share: the geometry every one reads the same way, the RoPE tables,
the tensor lists a stage loads, and `LayerRangeModel` (a layer range's weights, embedding, output
logits and routed experts). The arithmetic is the backend's (backends/ops.py)."""
from __future__ import annotations

import logging
import math

import numpy as np

from ..experts.addresses import stage_addresses
from ..experts.stores import resident_store
from ..gguf_file.reader import NO_ROPE_SCALING, ROPE_SCALING_KINDS, GGUFError, RopeScaling
from ..kernels.abi import DESC_WORDS, ROWS_TILE_M
from ..plan.workspace import STREAM_BLOBS, STREAM_TOKENS_PER_BLOB, STREAMED, Buffer, PromptLayout

log = logging.getLogger("strata.models")

# architectures whose multi-token-prediction block `--draft mtp` drafts with (strata_dist/sampling/mtp_draft.py)
MTP_ARCHS = ("qwen3next",)
_UNUSED_MTP_SAID: set[str] = set()   # files whose unused MTP block was said (once per process)


def stack_layers(gguf) -> tuple[int, int]:
    """(layers of the model's stack, multi-token-prediction layers after it). llama.cpp's converter
    counts the MTP blocks in `<arch>.block_count` and says how many with
    `<arch>.nextn_predict_layers`: they are the last indices, blk.{stack}.. , and never part of
    the stack a stage runs."""
    blocks = gguf.arch_int("block_count", required=True, minimum=1)
    nextn = gguf.arch_int("nextn_predict_layers", default=0, minimum=0)
    if nextn >= blocks:
        raise GGUFError(gguf.path, f"is {nextn}, not below block_count ({blocks}): no layer would "
                                   "be left for the model's stack",
                        key=f"{gguf.arch}.nextn_predict_layers")
    if nextn and gguf.arch not in MTP_ARCHS and gguf.path not in _UNUSED_MTP_SAID:
        _UNUSED_MTP_SAID.add(gguf.path)
        log.warning("%s: its %d multi-token-prediction layer(s) (blk.%d..) are unused: --draft "
                    "mtp drafts with %s files only; the model's %d layers load", gguf.path, nextn,
                    blocks - nextn, ", ".join(MTP_ARCHS), blocks - nextn)
    return blocks - nextn, nextn


def check_recurrent_layers(gguf, is_linear, n_layers: int, nextn: int) -> None:
    """`<arch>.attention.recurrent_layers` (a bool per block, MTP blocks included), where the file
    has it, must say what the architecture's own rule `is_linear(layer)` computes for the stack,
    and False for the MTP blocks (full attention): a file that says otherwise is refused naming
    the key, not run with another stack than it describes."""
    key = f"{gguf.arch}.attention.recurrent_layers"
    flags = gguf.metadata_array(key)
    if flags is None:
        return
    want = [is_linear(layer) for layer in range(n_layers)] + [False] * nextn
    if len(flags) != len(want):
        raise GGUFError(gguf.path, f"has {len(flags)} entries for {len(want)} blocks", key=key)
    bad = next((i for i, (a, b) in enumerate(zip(flags, want)) if bool(a) != b), None)
    if bad is not None:
        raise GGUFError(gguf.path, f"says block {bad} is {'' if flags[bad] else 'not '}recurrent; "
                                   f"this build runs it as {'linear' if want[bad] else 'full'} "
                                   "attention (the full_attention_interval rule, MTP blocks full)",
                        key=key)


def transformer_geometry(gguf, rope_base: float, context_length: int) -> dict:
    """The Geometry fields every architecture reads the same way (llama.cpp's metadata keys),
    with the embedding's shape as the vocabulary's size; arch-specific defaults passed in."""
    n_embd = gguf.arch_int("embedding_length", required=True, minimum=1)
    n_head = gguf.arch_int("attention.head_count", required=True, minimum=1)
    n_expert = gguf.arch_int("expert_count", required=True, minimum=1)
    n_used = gguf.arch_int("expert_used_count", required=True, minimum=1)
    if n_used > n_expert:
        raise GGUFError(gguf.path, f"metadata key '{gguf.arch}.expert_used_count' is {n_used}, "
                                   f"more than the {n_expert} experts of expert_count")
    emb = gguf.tensor("token_embd.weight")
    if len(emb.shape) != 2 or emb.shape[1] != n_embd:
        raise GGUFError(gguf.path, f"has shape {list(emb.shape)}, expected [n_vocab, {n_embd}]",
                        tensor=emb.name)
    n_head_kv = gguf.arch_int("attention.head_count_kv", default=n_head, minimum=1)
    if n_head % n_head_kv:
        raise GGUFError(gguf.path, f"metadata: {n_head} attention heads cannot be shared by "
                                   f"{n_head_kv} kv heads ('{gguf.arch}.attention.head_count_kv')")
    return dict(
        arch=gguf.arch,
        n_layers=stack_layers(gguf)[0],
        n_embd=n_embd,
        n_vocab=emb.shape[0],
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=gguf.arch_int("attention.key_length", default=n_embd // n_head, minimum=1),
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=gguf.arch_int("expert_feed_forward_length", required=True, minimum=1),
        rms_eps=gguf.arch_float("attention.layer_norm_rms_epsilon", default=1e-6, positive=True),
        rope_base=gguf.arch_float("rope.freq_base", default=rope_base, positive=True),
        context_length=(ctx := gguf.arch_int("context_length", default=context_length, minimum=1)),
        tied_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=read_rope_scaling(gguf, ctx),
    )


def read_rope_scaling(gguf, context_length: int) -> RopeScaling:
    """The file's `<arch>.rope.scaling.*` keys (llama.cpp's names). No type, or "none", is plain
    RoPE; a type this code does not compute is refused naming the key rather than run with the
    wrong positions. Without original_context_length, yarn's original is the context_length (as
    llama.cpp reads such a file)."""
    key = f"{gguf.arch}.rope.scaling.type"
    kind = gguf.metadata(key)
    if kind is None:
        return NO_ROPE_SCALING
    if kind not in ROPE_SCALING_KINDS:
        raise GGUFError(gguf.path, f"is {kind!r}; the RoPE scalings computed here are "
                                   f"{', '.join(ROPE_SCALING_KINDS)}", key=key)
    if kind == "none":
        return NO_ROPE_SCALING
    num = gguf.arch_float
    factor = num("rope.scaling.factor", default=1.0, positive=True)
    if kind == "linear":
        return RopeScaling(kind=kind, factor=factor)
    original = gguf.arch_int("rope.scaling.original_context_length", minimum=1)
    beta_fast = num("rope.scaling.yarn_beta_fast", default=32.0, positive=True)
    beta_slow = num("rope.scaling.yarn_beta_slow", default=1.0, positive=True)
    if beta_slow >= beta_fast:
        raise GGUFError(gguf.path, f"is {beta_slow}, not below yarn_beta_fast ({beta_fast})",
                        key=f"{gguf.arch}.rope.scaling.yarn_beta_slow")
    ext = num("rope.scaling.yarn_ext_factor", default=1.0)
    if ext < 0:     # llama.cpp's "unset" (-1): the whole ramp, as for a file without the key
        ext = 1.0
    if ext > 1:
        raise GGUFError(gguf.path, f"is {ext}; it must be between 0 and 1 (or -1: unset)",
                        key=f"{gguf.arch}.rope.scaling.yarn_ext_factor")
    return RopeScaling(kind=kind, factor=factor, original_context=original or context_length,
                       stretched_context=int(round(factor * original)) if original else 0,
                       beta_fast=beta_fast, beta_slow=beta_slow, ext_factor=ext,
                       attn_factor=num("rope.scaling.yarn_attn_factor", default=1.0,
                                       positive=True))


def rope_inv_freq(rot_dim: int, base: float,
                  scaling: RopeScaling = NO_ROPE_SCALING) -> tuple[np.ndarray, float]:
    """(radians per position of each rotated pair [rot_dim/2], float64; the factor on cos/sin).

    Plain RoPE: base^(-2i/rot_dim). Linear: each divided by the factor. YaRN: pair i keeps its
    frequency where it turns more than beta_fast times over the original context, is divided by
    the factor where it turns fewer than beta_slow times, and between the two (the correction
    dims, rounded outwards) mixes both along a linear ramp; cos/sin are scaled by
    attn_factor * (1 + 0.1 ln factor), which keeps attention's entropy as the context grows."""
    inv = 1.0 / (base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    if scaling.kind == "linear":
        return inv / scaling.factor, 1.0
    if scaling.kind != "yarn":
        return inv, 1.0
    f = scaling.factor

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times into the original context
        return (rot_dim * math.log(scaling.original_context / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rot_dim - 1)
    ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float64) - low) / max(high - low, 0.001),
                   0.0, 1.0)
    keep = (1.0 - ramp) * scaling.ext_factor        # 1: the pair's own frequency (extrapolated)
    inv = inv / f * (1.0 - keep) + inv * keep
    mscale = 1.0 + 0.1 * math.log(f) if f > 1 and scaling.ext_factor else 1.0
    return inv, scaling.attn_factor * mscale


def rope_tables(positions: np.ndarray, rot_dim: int, base: float,
                scaling: RopeScaling = NO_ROPE_SCALING):
    """cos/sin [n, rot_dim/2] for NEOX-style RoPE over the first `rot_dim` dims of a head, with the
    file's scaling (`rope_inv_freq`): every backend rotates by these tables (the GPU kernels read
    them from the session), so the scaling lives here alone."""
    inv, scale = rope_inv_freq(rot_dim, base, scaling)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    return (scale * np.cos(ang)).astype(np.float32), (scale * np.sin(ang)).astype(np.float32)


def stage_tensor_names(g, lb: int, le: int, first: bool, last: bool, layer_names) -> list[str]:
    """The dense tensors a stage running [lb, le) loads: the embedding on the first stage (and on
    the last when the head is tied to it), `layer_names(layer)` for each of its layers, the final
    norm and head on the last. The planner prices exactly this list."""
    names = []
    if first or (last and g.tied_embeddings):
        names.append("token_embd.weight")
    for layer in range(lb, le):
        names += layer_names(layer)
    if last:
        names.append("output_norm.weight")
        if not g.tied_embeddings:
            names.append("output.weight")
    return names


def model_level_shapes(g) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and (unless tied to the embedding) the output head."""
    shapes = {"token_embd.weight": (g.n_vocab, g.n_embd), "output_norm.weight": (g.n_embd,)}
    if not g.tied_embeddings:
        shapes["output.weight"] = (g.n_vocab, g.n_embd)
    return shapes


# ---- a prompt chunk's buffers on a GPU (plan/workspace.py) ---------------------------------------

def routed_expert_buffers(g, blob_bytes: int) -> list[Buffer]:
    """The routed experts' part of a layer (both architectures): the normed input, router logits,
    the top-k, the pairs grouped by expert (ops/moe.py: on the device, or tables
    built on the host where the routing went there: a short chunk of a partial cache, or
    STRATA_DEVICE_ROUTING=0), the SwiGLU rows and their f16 copies for the tensor
    cores, the unweighted outputs, the rank-ordered sum, and the misses streamed in a batch (live
    through the chunk)."""
    d, ff, k, n_exp = g.n_embd, g.n_ff_exp, g.n_expert_used, g.n_expert
    items = -(-16 * k // ROWS_TILE_M)          # 4 int32 per work item of ROWS_TILE_M pairs
    return [
        Buffer("moe_x", "experts", 4 * d),
        Buffer("logits", "experts", 4 * n_exp),
        Buffer("ids", "experts", 4 * k), Buffer("wts", "experts", 4 * k),
        Buffer("pair_rank", "experts", 4 * k), Buffer("pair_rows", "experts", 4 * k),
        Buffer("pair_dest", "experts", 4 * k),
        Buffer("group_counts", "experts", 0, 4 * n_exp),
        Buffer("group_starts", "experts", 0, 4 * n_exp),
        Buffer("items", "experts", items, 16 * (n_exp + 1)),
        Buffer("blob_table", "experts", 0, 8 * n_exp),
        # a host-built grouping (a partial cache): items, each pair's input and output row
        Buffer("pack", "experts", items + 8 * k, 16 * (n_exp + 1)),
        Buffer("pack_blobs", "experts", 0, 8 * n_exp),
        Buffer("x16", "experts", 2 * d), Buffer("x_unscale", "experts", 4),
        Buffer("act", "experts", 4 * k * ff), Buffer("act16", "experts", 2 * k * ff),
        Buffer("act_unscale", "experts", 4 * k),
        Buffer("y", "experts", 4 * k * d),
        Buffer("moe_out", "experts", 4 * d),
        # the copy stream fills it with the next layer's misses while this layer's attention
        # runs (tiers.py `_prompt_on_device`): it cannot share room with that phase. Two halves:
        # with half the experts in host memory a 4,096-token chunk read 15,067 tok/s through 32
        # blobs, 16,647 through 64, 19,584 through a layer's 128, 19,339 through 256
        # (docs/BENCHMARKS.md, issue 16). A shorter chunk computes less while a layer's misses
        # copy, so it takes less: 32 blobs and one more per 32 tokens, at most a layer's. A stage
        # whose cache holds every pair and lends nothing streams nothing and carves none
        Buffer(STREAMED, "residual", -(-blob_bytes // STREAM_TOKENS_PER_BLOB),
               STREAM_BLOBS * blob_bytes, most=n_exp * blob_bytes),
    ]


def residual_buffers(g) -> list[Buffer]:
    """What lives through the whole chunk: the residual stream before and after a layer's mixer
    (each layer reads "h" and writes "h_mid", then "h" again), and the token ids."""
    return [Buffer("h", "residual", 4 * g.n_embd), Buffer("h_mid", "residual", 4 * g.n_embd),
            Buffer("tok_ids", "residual", 8)]


def gemm_buffers(phase: str, widths_in, widths_out, dense16_bytes: int) -> list[Buffer]:
    """The f16 GEMMs (cupy_backend.linear): the input rows rounded to f16, the f16 product, and
    one quantized dense matrix decoded to f16 (dense16_bytes: 0 for F16 files). `phase`: where
    every GEMM of the layer runs ("residual" when both a mixer and the experts phase have GEMMs)."""
    return [Buffer("in16", phase, 2 * max(widths_in)), Buffer("out16", phase, 2 * max(widths_out)),
            Buffer("dense16", phase, 0, dense16_bytes)]


def rope_buffers() -> list[Buffer]:
    """The pointer table and descriptor of an attention layer's q/k norm + RoPE launch."""
    return [Buffer("rope_ptrs", "attention", 0, 32),
            Buffer("rope_desc", "attention", 0, 4 * DESC_WORDS)]


def prompt_layout(arch, gguf, g) -> PromptLayout:
    """The layout of `arch`'s prompt buffers for the file: its `prompt_buffers` with the file's
    largest expert blob (the streamed batch) and largest quantized dense matrix of a layer (decoded
    to f16 for its GEMM; the embedding and head are read outside a chunk's layers)."""
    from ..backends.layout import GPU_NATIVE_QUANTS
    dense16 = 0
    for name in arch.dense_tensor_names(g, 0, g.n_layers, False, False):
        info = gguf.tensor(name)
        if info.ggml_type in GPU_NATIVE_QUANTS and not arch.keeps_f32(name, info.shape):
            dense16 = max(dense16, 2 * int(np.prod(info.shape)))
    blob = max(gguf.blob_bytes(layer) for layer in range(g.n_layers))
    return PromptLayout.of(arch.prompt_buffers(g, blob_bytes=blob, dense16_bytes=dense16))


class LayerRangeModel:
    """What every architecture's forward object shares: the layers [lb, le) of a file on a backend,
    the dense tensors `arch.dense_tensor_names` lists (the planner prices exactly those), an expert
    store, the embedding and the head. A subclass sets `arch` (its module) and builds
    `self.layers` in `_build_layers`; the forward itself is the subclass's."""

    arch = None   # the architecture module: read_geometry, validate, dense_tensor_names, keeps_f32

    def __init__(self, gguf, backend, lb: int = 0, le: int | None = None,
                 first: bool | None = None, last: bool | None = None, weight_slice: bool = True,
                 experts=None):
        self.gguf, self.backend = gguf, backend
        self.g = g = self.arch.read_geometry(gguf)
        self.arch.validate(gguf, g)
        self.lb, self.le = lb, g.n_layers if le is None else le
        if not 0 <= self.lb < self.le <= g.n_layers:
            raise ValueError(f"layer range [{self.lb}, {self.le}) is not inside [0, {g.n_layers})")
        self.first = self.lb == 0 if first is None else first
        self.last = self.le == g.n_layers if last is None else last
        self.loaded_bytes = 0
        # weight_slice=False (STRATA_WEIGHT_SLICE=0) is the A/B arm where every stage loads all
        # dense weights, as before the carve; it still runs only [lb, le).
        names = (self.arch.dense_tensor_names(g, self.lb, self.le, self.first, self.last)
                 if weight_slice else self.arch.dense_tensor_names(g, 0, g.n_layers, True, True))
        self._tensors = {name: self._load(name) for name in names}
        self.layers = self._build_layers()
        # a stage rank passes its tiered store; alone, every expert of [lb, le) resident
        self.experts = experts if experts is not None else resident_store(
            backend, gguf, range(self.lb, self.le))
        # Called as on_route(layer, expert_ids [n, k]) for every routed batch (profile recording).
        self.on_route = None

    def _build_layers(self) -> dict:
        raise NotImplementedError

    # ---- the forward: the architecture's `layer_step` (models/<arch>.py) on the backend ---------
    # its eager ops classes: one session's rows (a prompt chunk or a decode row), and a batched
    # decode step's rows, each of its own session
    eager_ops: type
    rows_ops: type

    def forward_layers(self, h, session) -> object:
        """Run layers [lb, le) over hidden rows h [n, n_embd] at positions session.n_past..+n
        (a recurrent layer's state carried across calls, so a prompt read in chunks gives the
        result of one read whole). The caller advances session.n_past after every stage of the
        pipeline has run."""
        n = h.shape[0]
        pos0 = session.n_past
        if pos0 + n > session.max_cells:
            raise ValueError(f"context full: {pos0} + {n} tokens > {session.max_cells} cells")
        return self.run_layers(self.eager_ops(self, session, pos0), h)

    def forward_rows(self, h, sessions: list, positions: list[int]):
        """A batched decode step (protocol/batch.py): row i of h [n, n_embd] is the next token of
        sessions[i] at positions[i]; the dense and expert layers run over all rows at once, each
        row's attention (or recurrent step) alone over its own session, as its one-row step."""
        for s, pos in zip(sessions, positions):
            if pos + 1 > s.max_cells:
                raise ValueError(f"context full: {pos} + 1 tokens > {s.max_cells} cells")
        return self.run_layers(self.rows_ops(self, sessions, positions), h)

    def run_layers(self, ops, h):
        """h through layers [lb, le): the module's `layer_step` with `ops` (eager ops here, a
        decode graph's launches there: backends/cuda_decode.py)."""
        for layer in range(self.lb, self.le):
            h = self.arch.layer_step(ops, self.g, layer, h)
        return h

    def _host_f32(self, name: str) -> np.ndarray:
        """A tensor kept in float32, as the backend receives it (a subclass may reshape)."""
        return self.gguf.dequantize(name)

    def _load(self, name: str):
        info = self.gguf.tensor(name)
        if self.arch.keeps_f32(name, info.shape):
            arr = self.backend.f32(self._host_f32(name))
        else:
            arr = self.backend.dense_tensor(self.gguf, info)   # the rule of backends/layout.py
        self.loaded_bytes += int(arr.nbytes)
        return arr

    def embed(self, token_ids):
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.g.n_vocab):
            raise ValueError(f"token id out of range [0, {self.g.n_vocab})")
        return self.backend.rows(self._tensors["token_embd.weight"], ids, out="h")

    def prompt_layout(self) -> PromptLayout:
        """This architecture's prompt buffers for the file (what a stage carves from its loan)."""
        return prompt_layout(self.arch, self.gguf, self.g)

    def output_logits(self, h):
        """Final norm and output projection -> float32 logits [n, vocab]."""
        h = self.backend.rms_norm(h, self._tensors["output_norm.weight"], self.g.rms_eps)
        w = self._tensors["token_embd.weight" if self.g.tied_embeddings else "output.weight"]
        return self.backend.linear(h, w)

    def _route(self, layer: int, x, router, normalize: bool):
        """The top-k of the normed rows x (ids, weights), reported to `on_route`."""
        idx, wts = self.backend.route(x, router, self.g.n_expert_used, normalize)
        if self.on_route is not None:
            self.on_route(layer, self.backend.to_host(idx))   # routed on the device, maybe
        return idx, wts

    def _combine_routed(self, layer: int, x, idx, wts):
        """The chosen experts' outputs of x summed in rank order with their weights."""
        return self.backend.combine_ranked(self._expert_outputs(layer, x, idx),
                                           self.backend.asarray(wts))

    def _expert_outputs(self, layer: int, x, idx):
        """y[row, rank] = expert idx[row, rank] of x[row], unweighted ([n, k, d]), whichever tier
        computed each. `idx` on the device (routed there): the store computes it there when it
        can, else it comes to the host (the backend only computes; the tiers are the store's)."""
        be = self.backend
        if be.xp is not np and isinstance(idx, be.xp.ndarray):
            y = self.experts.outputs_device(layer, x, idx)
            if y is not None:
                return y
            # a row that picked nothing has -1 and a NaN weight: any expert computes it to NaN
            idx = np.maximum(be.to_host(idx).astype(np.int64), 0)
        return self.experts.outputs(layer, x, idx)

    def expert_addresses(self, host_misses: bool | None = None, like=None):
        """The blob-address table of this range's experts (ops/expert_addresses.py) that a
        decode graph reads, built from the expert store (experts/addresses.py stage_addresses;
        `host_misses` and `like` as there: `like` is the table a graph holds, after the adaptive
        cache moved blobs)."""
        return stage_addresses(self.experts, self.gguf, self.lb, self.le, host_misses, like)
