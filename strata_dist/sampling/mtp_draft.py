"""The multi-token-prediction drafter of speculative decoding (`--spec K --draft mtp`).

A qwen3next file may carry, after its stack of N layers, one multi-token-prediction (MTP) block
(`<arch>.nextn_predict_layers` = 1, `<arch>.block_count` = N + 1; models/common.py
`stack_layers`): blk.N holds a full-attention layer with its MoE and shared expert, as any of the
stack's attention layers, and the nextn parts eh_proj [n_embd, 2 n_embd], enorm, hnorm and
optionally shared_head_norm, shared_head_head and embed_tokens. It predicts the token after next.
One step at position q:
  h = the stack's final hidden row of position q - 1, output_norm applied (the row the head reads);
  e = the embedding of token q (nextn.embed_tokens, else the model's);
  x = eh_proj [enorm(e) | hnorm(h)];
  x = x + attention(attn_norm(x)) at position q (gated q, q/k norms, RoPE; the block's own KV);
  x = x + moe(post_attention_norm(x));
  m = shared_head_norm(x) (else output_norm), and the head (shared_head_head, else the model's)
  gives the logits of token q + 1.
Drafts chain: draft i + 1 reads draft i as its token and the previous step's `m` as its h.

It runs on the last stage, which has the final hidden rows: the stage hands every row it computes
to `take_hidden` (Stage.hidden_sink). Before a window the drafter reads what the conversation
added (its KV at each new position q from token q and the stage's row q - 1), then drafts up to K
tokens, greedily: each draft is the argmax of its logits, handed on as a point mass (the verifier's
acceptance rule, speculative.draw_against, keeps sampled requests exact), and `--spec-min-p P`
stops where the softmax of that argmax falls below P. Its KV is positional: drafts write past the
conversation and the next window's rows overwrite them. A position whose previous row the drafter
never saw (position 0; a prompt resumed from a kept conversation; rows beyond PENDING_ROWS kept
before a draft) reads a zero row, as llama.cpp's own MTP reads position 0: its drafts may be
weaker there; the tokens are the verifier's either way.

The arithmetic is the backend's general ops (the stack's attention and MoE code, Qwen3Next
`_attention` / `_moe`), so the block runs on the stage's device; a GPU stage that drafts with it
takes the general path for its one-row steps too (no decode graph: every row's hidden is read).
The planner reserves `plan_bytes` on the last stage: the block's dense tensors, every routed
expert of it resident, its session (KV, RoPE table, score scratch) for the context, and on a
CPU rank the pending rows (host memory, which a GPU's reserve never holds); the embedding rows are
read from the file as needed and the model's head is the stage's own."""
from __future__ import annotations

import numpy as np

from ..backends import get_backend
from ..backends.kv_cache import default_kv_type, kv_cell_bytes, new_kv
from ..backends.layout import dense_nbytes
from ..experts.stores import BlobArena
from ..gguf_file.reader import GGUFError, dequantize_bytes
from ..models.shape import model_shape
from ..models import architecture_for, open_checked
from ..models.common import MTP_ARCHS
from ..models.qwen3next import (ATTENTION_PARTS, COMMON_PARTS, ROUTER_PART, Qwen3Next, keeps_f32,
                               kv_shape, rope_tables, tensor_name)
from ..plan.pricing import DECODE_ROWS

NEXTN_PARTS = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")
NEXTN_OPTIONAL = ("nextn.shared_head_norm", "nextn.shared_head_head")
EMBED_PART = "nextn.embed_tokens"     # optional too: read row by row from the file, as the model's
PENDING_ROWS = 8192    # the most final hidden rows a session keeps before its next draft reads them
CATCH_UP_ROWS = 256    # the most positions one call of the block reads when it catches up


class MtpError(ValueError):
    """A file `--draft mtp` cannot draft with: said with the file and the key or tensor named."""


def mtp_layer(path: str) -> int:
    """The index of the file's MTP block (its stack's layer count), refused (MtpError) for a file
    without one, of an architecture this build does not draft with, or with more than one block
    (one block drafts every step, chained)."""
    gguf = open_checked(path)
    key = f"{gguf.arch}.nextn_predict_layers"
    if gguf.arch not in MTP_ARCHS:
        raise MtpError(f"--draft mtp: {path} is a {gguf.arch} model; the MTP drafter runs the "
                       f"multi-token-prediction block of {', '.join(MTP_ARCHS)} files")
    try:
        g = architecture_for(gguf).read_geometry(gguf)
        if g.n_nextn == 0:
            raise MtpError(f"--draft mtp: {path} has no multi-token-prediction block (metadata "
                           f"key '{key}' is absent or 0); draft with --draft ngram or "
                           "--draft-model FILE.gguf")
        if g.n_nextn > 1:
            raise MtpError(f"--draft mtp: {path}: key '{key}' is {g.n_nextn}; the drafter runs "
                           "one block, chained")
        for name, shape in block_shapes(g).items():
            if name in gguf.tensors or not _optional(name):
                gguf.require(name, shape)
    except GGUFError as e:
        raise MtpError(f"--draft mtp: {e}") from None
    return g.n_layers


def _optional(name: str) -> bool:
    return any(name.endswith(f".{p}.weight") for p in (*NEXTN_OPTIONAL, EMBED_PART))


def block_shapes(g) -> dict[str, tuple[int, ...]]:
    """numpy shapes of the MTP block's tensors (blk.{n_layers}): its attention layer's parts,
    norms, router, shared expert and experts, and the nextn parts (the optional ones included)."""
    layer, d, E = g.n_layers, g.n_embd, g.n_expert
    q, kv, sh = g.n_head * g.head_dim, g.n_head_kv * g.head_dim, g.n_ff_shexp
    parts = {"attn_q": (2 * q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
             "attn_q_norm": (g.head_dim,), "attn_k_norm": (g.head_dim,),
             "attn_norm": (d,), "post_attention_norm": (d,), ROUTER_PART: (E, d),
             "ffn_gate_shexp": (sh, d), "ffn_up_shexp": (sh, d), "ffn_down_shexp": (d, sh),
             "ffn_gate_exps": (E, g.n_ff_exp, d), "ffn_up_exps": (E, g.n_ff_exp, d),
             "ffn_down_exps": (E, d, g.n_ff_exp),
             "nextn.eh_proj": (d, 2 * d), "nextn.enorm": (d,), "nextn.hnorm": (d,),
             "nextn.shared_head_norm": (d,), "nextn.shared_head_head": (g.n_vocab, d),
             EMBED_PART: (g.n_vocab, d)}
    return {tensor_name(layer, p): s for p, s in parts.items()}


def dense_names(gguf, g) -> list[str]:
    """The block's dense tensors the drafter loads: its layer's parts (the shared-expert gate
    included) and the nextn parts the file has, less the embedding (read row by row)."""
    layer = g.n_layers
    parts = (*ATTENTION_PARTS, *COMMON_PARTS, ROUTER_PART, *NEXTN_PARTS, *NEXTN_OPTIONAL)
    return [n for n in (tensor_name(layer, p) for p in parts)
            if n in gguf.tensors or not _optional(n)]


def session_nbytes(g, cells: int, kv_type: str, device_kind: str = "cpu") -> int:
    """An MTP session of `cells` cells on a device of `device_kind`: K and V of its one attention
    layer, its RoPE table (cos + sin), the decode score scratch (DECODE_ROWS rows), and on a CPU
    rank the pending hidden rows, which live in host memory (a GPU's reserve never holds them)."""
    kv = kv_cell_bytes(2 * g.n_head_kv * g.head_dim, kv_type, g.head_dim) * cells
    pending = PENDING_ROWS * g.n_embd * 4 if device_kind == "cpu" else 0
    return kv + cells * g.n_rot * 4 + DECODE_ROWS * g.n_head * cells * 4 + pending


def plan_bytes(path: str, device_kind: str, kv_type: str | None, cells: int,
               sessions: int = 1) -> int:
    """What the MTP drafter takes on the last stage (PlanParams.draft_bytes): the block's dense
    tensors as `device_kind` keeps them, every routed expert of the block resident, a session
    of `cells` cells (`session_nbytes`) for each of the `sessions` serving sessions (--parallel
    B): what MtpDrafter carves (weights_bytes + session_bytes);
    and the buffers of one catch-up call (a reserve, as a prompt chunk's)."""
    gguf = open_checked(path)
    g = architecture_for(gguf).read_geometry(gguf)
    dense = 0
    for name in dense_names(gguf, g):
        info = gguf.tensor(name)
        dense += dense_nbytes(info, device_kind, keeps_f32(name, info.shape))
    experts = g.n_expert * gguf.blob_bytes(g.n_layers)
    kv_type = kv_type or default_kv_type(device_kind)
    # a catch-up call's rows through a layer: the stage's prompt buffers at CATCH_UP_ROWS rows
    work = model_shape(gguf, device_kind, kv_type).prompt_bytes(CATCH_UP_ROWS)
    return dense + experts + sessions * session_nbytes(g, cells, kv_type, device_kind) + work


def step_bytes(path: str, device_kind: str, kv_type: str | None, cells: int,
               kv_fill: float) -> float:
    """What one one-row step of the block reads on a device of `device_kind` (the tok/s
    prediction's drafting time, plan/speculation.py): its dense tensors as that device keeps them,
    the head it projects with (its own shared_head_head, else the model's: MtpBlock's), the
    top_k routed experts a row routes to, and its K/V filled `kv_fill` of `cells`."""
    gguf = open_checked(path)
    g = architecture_for(gguf).read_geometry(gguf)

    def kept(name: str) -> int:
        info = gguf.tensor(name)
        return dense_nbytes(info, device_kind, keeps_f32(name, info.shape))
    read = sum(kept(name) for name in dense_names(gguf, g))
    if tensor_name(g.n_layers, "nextn.shared_head_head") not in gguf.tensors:
        read += kept("token_embd.weight" if g.tied_embeddings else "output.weight")
    read += g.n_expert_used * gguf.blob_bytes(g.n_layers)
    kv_type = kv_type or default_kv_type(device_kind)
    kv = kv_cell_bytes(2 * g.n_head_kv * g.head_dim, kv_type, g.head_dim)
    return read + kv_fill * cells * kv


class MtpSession:
    """One conversation's MTP state: the block's KV [cells, n_head_kv, head_dim] (positional),
    the RoPE table and score scratch the backend's attention reads (the session interface of
    Backend.qk_norm_rope_kv / attend), what the KV was computed from (`tokens`: the conversation
    through position `fed` - 1), and the stage's final hidden rows not yet read (`pending`,
    host, positions pending_start..)."""

    def __init__(self, backend, g, max_cells: int):
        xp = backend.xp
        self.layer, self.max_cells = g.n_layers, max_cells
        self._k = new_kv(xp, kv_shape(g, max_cells), backend.kv_type)
        self._v = new_kv(xp, kv_shape(g, max_cells), backend.kv_type)
        cos, sin = rope_tables(np.arange(max_cells), g.n_rot, g.rope_base, g.rope_scaling)
        self.rope_cos, self.rope_sin = backend.asarray(cos), backend.asarray(sin)
        self.scores = xp.empty(DECODE_ROWS * g.n_head * max_cells, dtype=np.float32)
        self.pending = np.zeros((PENDING_ROWS, g.n_embd), dtype=np.float32)   # host memory
        self._pending_on_device = not backend.on_gpu     # a CPU rank's device is the host
        self.pending_start, self.pending_n = 0, 0
        self.tokens: list[int] = []
        self.fed = 0
        # the tokens the rows kept before the last draft were computed from (its history, then
        # its drafts: the window the stage runs next), and the lowest position kept since: a
        # later request's history that differs from them before a position makes that row stale
        self.ran: list[int] = []
        self.fresh_from = 0

    @property
    def nbytes(self) -> int:
        """The device memory it takes (session_nbytes): the pending rows only on a CPU rank."""
        return (int(self._k.nbytes + self._v.nbytes) + int(self.rope_cos.nbytes + self.rope_sin.nbytes)
                + int(self.scores.nbytes) + int(self.pending.nbytes) * self._pending_on_device)

    def k(self, layer: int):
        return self._k

    def v(self, layer: int):
        return self._v

    def score_buffer(self, shape):
        size = int(np.prod(shape))
        return self.scores[:size].reshape(shape) if size <= self.scores.size else None

    def keep(self, pos: int, rows: np.ndarray) -> None:
        """The stage's final hidden rows of positions pos..: kept where they continue (or
        overwrite the tail of) the rows kept, else in their place; the latest PENDING_ROWS."""
        n = len(rows)
        self.fresh_from = min(self.fresh_from, pos)
        if not self.pending_start <= pos <= self.pending_start + self.pending_n:
            self.pending_start, self.pending_n = pos, 0
        at = pos - self.pending_start
        if at + n > PENDING_ROWS:          # the oldest rows go: their positions read zeros
            drop = at + n - PENDING_ROWS
            if drop >= at:
                self.pending_start, at, rows = pos + max(0, n - PENDING_ROWS), 0, \
                    rows[max(0, n - PENDING_ROWS):]
            else:
                self.pending[:at - drop] = self.pending[drop:at]
                self.pending_start, at = self.pending_start + drop, at - drop
        self.pending[at:at + len(rows)] = rows
        self.pending_n = at + len(rows)

    def rows_before(self, q0: int, q1: int) -> np.ndarray:
        """The hidden rows of positions q0 - 1 .. q1 - 2 (what MTP positions q0..q1-1 read), a
        zero row where none is kept."""
        out = np.zeros((q1 - q0, self.pending.shape[1]), dtype=np.float32)
        for i, p in enumerate(range(q0 - 1, q1 - 1)):
            if self.pending_start <= p < self.pending_start + self.pending_n:
                out[i] = self.pending[p - self.pending_start]
        return out

    def drop_stale(self, history: list[int]) -> None:
        """Before a draft reads the rows: a row kept before the last draft whose position's
        tokens (through it) differ from `history`'s (another conversation restored into the
        session, --conversation-cache-mib) was computed from other tokens: it reads as a zero
        row, as one never kept. Rows kept since the last draft are this history's."""
        same = 0
        limit = min(len(self.ran), len(history))
        while same < limit and self.ran[same] == history[same]:
            same += 1
        lo = max(same, self.pending_start)
        hi = min(self.fresh_from, self.pending_start + self.pending_n)
        if lo < hi:
            self.pending[lo - self.pending_start:hi - self.pending_start] = 0.0

    def drafted(self, history: list[int], drafts: list[int]) -> None:
        """A draft read the rows: what the next window's rows are computed from."""
        self.ran = list(history) + list(drafts)
        self.fresh_from = self.max_cells

    def forget_before(self, pos: int) -> None:
        """Rows of positions before `pos` are read: dropped, the later ones moved to the front."""
        drop = min(max(0, pos - self.pending_start), self.pending_n)
        if drop:
            self.pending[:self.pending_n - drop] = self.pending[drop:self.pending_n]
            self.pending_start += drop
            self.pending_n -= drop


class MtpBlock(Qwen3Next):
    """The MTP block's weights on a backend and its forward, the stack's attention and MoE code
    run at layer index n_layers. `head_of`: the last stage's model, whose output norm and head
    the block shares where the file has no shared_head_* of its own."""

    def __init__(self, gguf, backend, head_of):
        self.gguf, self.backend = gguf, backend
        self.g = g = self.arch.read_geometry(gguf)
        self.layer = L = g.n_layers
        self.loaded_bytes = 0
        self._tensors = {name: self._load(name) for name in dense_names(gguf, g)}
        parts = (*ATTENTION_PARTS, *COMMON_PARTS, ROUTER_PART)
        self.layers = {L: {p: self._tensors[tensor_name(L, p)] for p in parts}}
        self.experts = BlobArena(backend, gguf, [(L, e) for e in range(g.n_expert)], L + 1,
                                 g.n_expert)
        self.on_route = None
        own = lambda part: self._tensors.get(tensor_name(L, part))   # noqa: E731
        self.head_norm = own("nextn.shared_head_norm")
        if self.head_norm is None:
            self.head_norm = head_of._tensors["output_norm.weight"]
        self.head = own("nextn.shared_head_head")
        if self.head is None:
            self.head = head_of._tensors["token_embd.weight" if g.tied_embeddings
                                         else "output.weight"]
        embed = tensor_name(L, EMBED_PART)
        self.embed_name = embed if embed in gguf.tensors else "token_embd.weight"
        self.output_norm = head_of._tensors["output_norm.weight"]   # the stack's, for its rows

    @property
    def nbytes(self) -> int:
        return self.loaded_bytes + self.experts.nbytes

    def embed(self, token_ids):
        """Embedding rows read from the file, row by row (a draft step reads one or a few)."""
        info = self.gguf.tensor(self.embed_name)
        raw = self.gguf.raw(self.embed_name)
        per = info.n_bytes // info.shape[0]
        rows = [dequantize_bytes(raw[t * per:(t + 1) * per], info.ggml_type, (1, info.shape[1]),
                                 self.gguf.path, self.embed_name) for t in token_ids]
        return self.backend.asarray(np.concatenate(rows).astype(np.float32))

    def step(self, token_ids, hidden, session: MtpSession, pos0: int):
        """Rows at positions pos0..: token_ids [n] with the stack's final hidden rows of the
        positions before them, hidden [n, n_embd] -> (the last row's logits [1, vocab], its
        normed row [1, n_embd]: the h of the next chained step). Every row writes its KV."""
        be, g, L = self.backend, self.g, self.layer
        w = self._tensors
        e = be.rms_norm(self.embed(token_ids), w[tensor_name(L, "nextn.enorm")], g.rms_eps)
        h = be.rms_norm(be.asarray(hidden), w[tensor_name(L, "nextn.hnorm")], g.rms_eps)
        x = be.linear(be.xp.concatenate([e, h], axis=1), w[tensor_name(L, "nextn.eh_proj")])
        a = be.rms_norm(x, self.layers[L]["attn_norm"], g.rms_eps)
        x = be.add(x, self._attention(L, a, session, pos0))
        m = be.rms_norm(x, self.layers[L]["post_attention_norm"], g.rms_eps)
        x = be.add(x, self._moe(L, m))
        normed = be.rms_norm(x[-1:], self.head_norm, g.rms_eps)
        return be.linear(normed, self.head), normed


class MtpDrafter:
    """The drafter on the last stage: `draft(session_id, history, k, min_p, ...)` as the draft
    model's (strata_dist/rank/draft_model.py), fed by `take_hidden` (Stage.hidden_sink)."""

    def __init__(self, path: str, device: str, max_context: int, head_of, kv_type: str | None = None):
        mtp_layer(path)                       # refuses a file without a block it can run
        self.backend = get_backend(device)
        if kv_type:
            self.backend.kv_type = kv_type
        self.block = MtpBlock(open_checked(path), self.backend, head_of)
        self.max_context = max_context
        self.sessions: dict[int, MtpSession] = {}
        self.session(0)           # the serving session's, carved up front as priced
        self.rerun_rows = 0       # rows the block read again (a conversation that changed)

    @property
    def weights_bytes(self) -> int:
        return self.block.nbytes

    def session_bytes(self) -> int:
        return sum(s.nbytes for s in self.sessions.values())

    def session(self, session_id: int) -> MtpSession:
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = MtpSession(self.backend, self.block.g, self.max_context)
        return s

    def release(self, session_id: int) -> None:
        self.sessions.pop(session_id, None)

    def take_hidden(self, session_id: int, pos: int, rows) -> None:
        """The last stage's final hidden rows of positions pos.. (before output_norm), as it
        computed them: kept normed, the rows the head reads."""
        be, block = self.backend, self.block
        normed = be.rms_norm(rows, block.output_norm, block.g.rms_eps)
        self.session(session_id).keep(pos, be.to_host(normed).astype(np.float32))

    def draft(self, session_id: int, history: list[int], k: int, min_p: float,
              params=None, rng=None) -> tuple[list[int], list]:
        """Up to k greedy drafts after `history` (prompt and tokens so far, its last token the
        one the next window starts with), each a point mass (q None). `params`, `rng`: the draft
        model's interface; a sampled request takes these same drafts (the verifier's acceptance
        rule keeps its distribution the model's)."""
        n = len(history)
        k = min(k, self.max_context - n)
        if k <= 0 or n == 0:
            return [], []
        s = self.session(session_id)
        s.drop_stale(history)
        same = 0
        limit = min(s.fed, len(s.tokens), n)
        while same < limit and s.tokens[same] == history[same]:
            same += 1
        same = min(same, n - 1)       # the last position's row is always read: its logits
        self.rerun_rows += max(0, min(s.fed, n) - same)
        # the block's KV of positions same..n-1, from the tokens there and the rows before them,
        # CATCH_UP_ROWS at a time
        for q in range(same, n, CATCH_UP_ROWS):
            end = min(n, q + CATCH_UP_ROWS)
            logits, h = self.block.step(history[q:end], s.rows_before(q, end), s, q)
        s.tokens, s.fed = list(history), n
        s.forget_before(n - 1)
        drafts: list[int] = []
        while True:
            row = self.backend.to_host(logits).astype(np.float64).reshape(-1)
            tok = int(np.argmax(row))
            if min_p > 0.0 and 1.0 / float(np.exp(row - row[tok]).sum()) < min_p:
                break
            drafts.append(tok)
            if len(drafts) == k:
                break
            logits, h = self.block.step([tok], h, s, n - 1 + len(drafts))
        s.drafted(history, drafts)
        return drafts, [None] * len(drafts)
