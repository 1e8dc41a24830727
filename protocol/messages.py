"""Every message that crosses a process boundary, as typed dataclasses: here, and the expert plane's in
expert_plane.py (re-exported from here, so every message is importable from this module).

A message class carries a stable wire tag ``TYPE`` and plain typed fields. The codec (``protocol.codec``) turns
fields into a msgpack map and validates them strictly against these annotations on the way in, so the annotations
*are* the schema: only ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``X | None``, ``list[X]``,
``dict[str, X]``, ``Literal[...]``, nested ``@struct`` classes and ``Any`` (JSON-able values) are allowed.

Rules (see PROTOCOL.md): a TYPE tag never changes meaning; fields are only *added*, and only together with a bump
of ``PROTOCOL_VERSION``. Numpy arrays never go into fields: they travel as raw frames after the header
(``arrays=``), or in a CUDA IPC buffer named by a ``RowSlot``.
"""

from __future__ import annotations

from dataclasses import field
from functools import lru_cache
from typing import Any, Literal

from .compute_options import ComputeOptions
from .batch import MAX_BATCH_ROWS, MAX_WINDOW_ROWS, BatchRows
from .conversations import ConversationStep
from .expert_plane import (ExpertReply, ExpertRequest, ExpertTier, ExpertTierAsk, IpcHandle, RowSlot, SlotFree,
                           TierCounts, TierPairs)
from .structs import MESSAGE_TYPES, STRUCT_TYPES, Message, Struct, _nonneg, message, struct

# Bump on any change of a message's fields or meaning. Peers with different versions refuse each other.
PROTOCOL_VERSION = 24

DeviceKind = Literal["cuda", "cpu"]
Role = Literal["stage", "helper", "stage+helper"]
GrammarKind = Literal["", "json_schema", "lark"]
# the largest grammar a request carries: it rides in a data message's header (protocol/limits.py)
MAX_GRAMMAR_BYTES = 1 << 16

# Error.code values (free-form strings on the wire; these are the ones this repo emits).
ERR_AUTH = "auth"                # wrong secret / handshake out of order
ERR_VERSION = "version"          # protocol version mismatch (message names both numbers)
ERR_FINGERPRINT = "fingerprint"  # model fingerprint mismatch (message names both values)
ERR_PROTOCOL = "protocol"        # undecodable or invalid frames
ERR_TIMEOUT = "timeout"          # a peer did not answer in time
ERR_PEER = "peer"                # a peer died or became unreachable
ERR_INTERNAL = "internal"        # anything else raised while serving a request


class ProtocolError(ValueError):
    """Bytes or messages that break the contract. ``peer`` is the ROUTER identity when known."""

    def __init__(self, message: str, *, peer: bytes | None = None):
        super().__init__(message)
        self.peer = peer


class VersionMismatch(ProtocolError):
    """A peer speaks another PROTOCOL_VERSION. The message names both numbers."""

    def __init__(self, theirs: Any, ours: int = PROTOCOL_VERSION, *, what: str = "", peer: bytes | None = None):
        tail = f" ({what!r})" if what else ""
        super().__init__(
            f"protocol version mismatch: peer speaks v{theirs}{tail}, this build speaks v{ours}; "
            "run the same strata-dist version on every host",
            peer=peer,
        )
        self.theirs = theirs
        self.ours = ours


@lru_cache(maxsize=64)
def _dtype_name(dt: Any) -> str:
    return dt.name  # numpy computes the name on every access; cached because Hidden is on the hot path


# ---------------------------------------------------------------- nested records


@struct
class DeviceInfo(Struct):
    """One device a rank can use. CPU ranks report their --vram-budget as total/free bytes.
    ``uuid``: the physical card (NVML's UUID; "" for CPUs): two ranks of one host with the same
    uuid share one card, and the planner prices them so."""

    name: str
    kind: DeviceKind
    index: int
    total_bytes: int
    free_bytes: int
    mem_bandwidth_gbs: float | None = None
    uuid: str = ""


@struct
class PeerInfo(Struct):
    """Where to reach another rank. ``host`` is the host identity used to decide whether CUDA IPC is possible.
    In an Assign's ``helpers``, ``pairs`` are the [layer, expert] pairs of the stage's layers that helper serves."""

    rank: int
    endpoint: str
    host: str = ""
    pairs: list[list[int]] = field(default_factory=list)


@struct
class Sampling(Struct):
    """How the last stage picks tokens. Each prompt chunk carries it (with its own share of
    prompt_ids; the grammar on the final chunk only); the last stage keeps it per request."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new: int = 0
    stop_ids: list[int] = field(default_factory=list)
    # structured output (v12): the last stage draws only tokens this grammar allows
    # (strata_dist/sampling/structured.py); "" = no grammar; on a prompt's final chunk only (v14)
    grammar_kind: GrammarKind = ""
    grammar: str = ""
    # v14: what a request may ask beyond a token (strata_dist/sampling/sampler.py says how each applies)
    logprobs: bool = False           # each sampled Token carries its logprob
    top_logprobs: int = 0            # ... and the N most likely tokens' (Token.top_ids/top_logprobs)
    prompt_logprobs: bool = False    # PromptProgress carries each prompt row's logprob of the next
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias_ids: list[int] = field(default_factory=list)      # with logit_bias_values, pairwise
    logit_bias_values: list[float] = field(default_factory=list)
    # a prompt chunk's share of the prompt's ids: its rows' and the one after its last row, the
    # first chunk's from position 0; only when prompt_logprobs or a repetition penalty needs them
    # on the last stage (each row's next token; the tokens the penalty counts), else empty
    prompt_ids: list[int] = field(default_factory=list)
    # v15: speculative decoding (strata_dist/sampling/speculative.py): up to spec_tokens n-gram drafts a
    # step, drafting stopped below spec_min_p; the last stage then needs prompt_ids
    spec_tokens: int = 0
    spec_min_p: float = 0.0
    head_steps: bool = False    # v16: the head sends each decode step (batched, protocol/batch.py)

    def check(self, arrays: list) -> None:
        _nonneg(spec_tokens=self.spec_tokens)
        if bool(self.grammar_kind) != bool(self.grammar):
            raise ValueError(f"grammar_kind {self.grammar_kind!r} and grammar come together "
                             f"(grammar has {len(self.grammar)} characters)")
        n = len(self.grammar.encode("utf-8", "surrogatepass"))
        if n > MAX_GRAMMAR_BYTES:
            raise ValueError(f"grammar is {n} bytes; at most {MAX_GRAMMAR_BYTES}")
        _nonneg(top_logprobs=self.top_logprobs)
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise ValueError(f"logit_bias_ids has {len(self.logit_bias_ids)} entries, "
                             f"logit_bias_values {len(self.logit_bias_values)}")


# ---------------------------------------------------------------- handshake (see auth.py)


@message
class Hello(Message):
    """Client → server, first message on a control connection. ``nonce`` lets the client verify the server."""

    TYPE = "hello"
    client_id: str
    protocol_version: int
    nonce: bytes


@message
class Challenge(Message):
    """Server → client: prove you hold the secret by answering HMAC(secret, nonce || client_id)."""

    TYPE = "challenge"
    nonce: bytes
    protocol_version: int
    server_id: str = ""


@message
class Auth(Message):
    """Client → server: ``mac`` answers the Challenge, whose nonce comes back in ``challenge`` (v11): the
    server keeps no state per half-open handshake, so strangers cannot crowd out a rank's."""

    TYPE = "auth"
    client_id: str
    mac: bytes
    challenge: bytes = b""


@message
class AuthOk(Message):
    """Server → client: accepted. ``mac`` proves the server holds the secret too (mutual authentication)."""

    TYPE = "auth_ok"
    mac: bytes


# ---------------------------------------------------------------- control plane


@message
class Register(Message):
    """Rank → coordinator after AuthOk. ``rank`` is None to let the coordinator choose."""

    TYPE = "register"
    rank: int | None
    host: str
    pid: int
    devices: list[DeviceInfo]
    model_fingerprint: str
    protocol_version: int
    endpoints: dict[str, str] = field(default_factory=dict)  # endpoints this rank has bound (e.g. "data")


@message
class Assign(Message):
    """Coordinator → rank: what to load and whom to talk to. ``plan`` is the planner's JSON value, verbatim."""

    TYPE = "assign"
    rank: int
    role: Role
    lb: int
    le: int
    first: bool
    last: bool
    device: str  # "cuda:0", "cpu"
    plan: dict[str, Any]
    bind_endpoint: str | None = None      # data endpoint this rank binds (None: keep the one it registered)
    next_endpoint: str | None = None      # next stage's data endpoint (None on the last stage)
    first_endpoint: str | None = None     # where the last stage sends sampled tokens
    head_endpoint: str | None = None      # where Token/Error for the head go
    helpers: list[PeerInfo] = field(default_factory=list)
    prompt_chunk: int = 0
    max_context: int = 0
    cache_slots: int = 0   # stage expert-cache slot budget
    helper_slots: int = 0  # helper-tier slot budget on this rank
    loan_slots: int = 0    # prompt-loan slots borrowed from the cache tail
    helper_pairs: list[list[int]] = field(default_factory=list)  # [[layer, expert], ...] this rank serves
    link_nonce: str = ""   # the launch's data-link nonce: TCP data links are sealed (protocol/seal.py)
    stage: int = -1        # this rank's stage (-1: a helper tier only)
    host: str = ""         # this rank's host identity, as it registered
    weight_slice: bool = True   # load only the stage's own layers' dense weights
    cache_pairs: list[list[int]] = field(default_factory=list)   # [[layer, expert], ...] the stage cache holds
    prev_endpoint: str | None = None      # previous stage's data endpoint (slot acknowledgements)
    next_host: str = ""    # the next stage's host identity and device kind: CUDA IPC when both match
    next_kind: str = ""
    ipc: bool = True       # False: every hand-off as frames (a launch whose ranks may be replaced)
    helper_bind: str | None = None        # with bind_endpoint: the helper endpoint of the rank replaced
    min_request_id: int = 0  # a replacement drops rows and tokens of older requests (lost with the rank it replaces)
    kv_type: str = ""      # how sessions keep K/V: f32 | f16 | q8_0 ("" : the device's default)
    # the epoch of each data/helper endpoint whose rank was replaced (absent: 0): the links to it
    # are keyed by it (protocol/seal.py). Sent again to the ranks already running when a
    # replacement is admitted; they answer Ready once they key those links by it.
    link_epochs: dict[str, int] = field(default_factory=dict)
    # every compute switch of the launch (v13), read once by the launcher: the rank runs this
    # record, never its own environment's STRATA_* variables (protocol/compute_options.py)
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    # the adaptive cache: every adapt_every tokens a stage swaps up to adapt_swaps pairs
    # (strata_dist/experts/adapt.py); 0: the cache stays as the plan filled it
    adapt_every: int = 0
    adapt_swaps: int = 0
    # --expert-profile-out: a stage counts its layers' routing and sends the totals in StatsReply
    count_routing: bool = False
    # v17, last stage with --spec K --draft-model: the draft model's file (strata_dist/
    # draft_model.py), loaded whole beside the stage; "" : none (the n-gram drafter)
    draft_model: str = ""
    # v18, last stage with --spec K --draft mtp: draft with the model file's own multi-token-
    # prediction block (strata_dist/sampling/mtp_draft.py), loaded beside the stage
    draft_mtp: bool = False

    def check(self, arrays: list) -> None:
        _nonneg(rank=self.rank, lb=self.lb, le=self.le, prompt_chunk=self.prompt_chunk,
                max_context=self.max_context, cache_slots=self.cache_slots,
                helper_slots=self.helper_slots, loan_slots=self.loan_slots,
                adapt_every=self.adapt_every, adapt_swaps=self.adapt_swaps)
        if self.lb > self.le:
            raise ValueError(f"layer range [{self.lb}, {self.le}) is reversed")
        if self.role != "helper" and self.lb == self.le:
            raise ValueError(f"role {self.role!r} needs a non-empty layer range, got [{self.lb}, {self.le})")
        if self.kv_type not in ("", "f32", "f16", "q8_0"):
            raise ValueError(f"kv_type {self.kv_type!r}: expected f32, f16 or q8_0")
        bad = [ep for ep, e in self.link_epochs.items() if e < 0]
        if bad:
            raise ValueError(f"link_epochs[{bad[0]!r}] = {self.link_epochs[bad[0]]}: expected >= 0")


@message
class Ready(Message):
    """Rank → coordinator once loaded: what it actually allocated, by kind (weights/session/cache/helper/loan/...)."""

    TYPE = "ready"
    rank: int
    allocated: dict[str, int]
    elapsed_ms: float


@message
class Stats(Message):
    """Ask a rank for its counters. ``request_id`` is echoed in the reply."""

    TYPE = "stats"
    request_id: int | None = None


@message
class StatsReply(Message):
    """Counters as totals since the rank started (hits, remote, host, ...): any number of readers can
    take their own deltas between two replies, which per-rank deltas since the last reply would not allow."""

    TYPE = "stats_reply"
    rank: int
    counters: dict[str, int]
    gauges: dict[str, float] = field(default_factory=dict)  # point-in-time values (free bytes, ...)
    request_id: int | None = None
    # with Assign.count_routing, a stage's routing totals since it started: routing[i][e] is how many
    # rows layer routing_lb + i routed to expert e (the counts of a profile, strata_dist/tools/profile_io.py)
    routing_lb: int = 0
    routing: list[list[int]] = field(default_factory=list)


@message
class Heartbeat(Message):
    TYPE = "heartbeat"
    rank: int
    seq: int
    pid: int = 0           # the sender's process: a replaced rank's pulse is not its replacement's (v5)


@message
class Error(Message):
    """Any failure that the receiver must see. ``fatal``: the conversation is over (a refusal, or the sender is
    going away); otherwise only ``request_id`` failed. ``code`` is one of the ERR_* values."""

    TYPE = "error"
    rank: int | None
    request_id: int | None
    message: str
    fatal: bool = False
    code: str = ""


@message
class Shutdown(Message):
    TYPE = "shutdown"
    reason: str = ""


@message
class Release(Message):
    """Free a session's state (KV cache, recurrent state) on every stage."""

    TYPE = "release"
    session_id: int


@message
class Cancel(Message):
    """Head → every stage: stop ``request_id`` (its client went away). Each stage ends its prompt
    between two chunks and drops its rows still to come; the last stage answers with a final Token
    (done, reason "cancelled") unless the request already finished."""

    TYPE = "cancel"
    request_id: int


@message
class HandBack(Message):
    """Head → last stage (v23, --parallel): the head takes back the decode steps of
    ``request_id``, a lone request the last stage has been stepping itself (its one-request loop,
    protocol/batch.py). At that request's next plain decode step the last stage sends no next
    step: it answers the Token with ``handed_back`` set (and, speculating, the next drafts), and
    the head carries the request in its batched steps from there. Nothing is answered for a
    request that has ended or is not looping."""

    TYPE = "hand_back"
    request_id: int


@message
class Settle(Message):
    """Last stage → first stage → … → last (v18): a speculating request ended (stop, length,
    cancel) and no next step of it will come; each stage settles its session's last verify window
    at ``pos``: the window's rows before ``pos`` stand (its first row always: its token was drawn),
    the later ones held rejected or unverified drafts and leave the routing counts. The last stage
    holds the request's final Token until its Settle has come round."""

    TYPE = "settle"
    request_id: int
    session_id: int
    pos: int

    def check(self, arrays: list) -> None:
        _nonneg(pos=self.pos)


# ---------------------------------------------------------------- data plane


@message
class Tokens(Message):
    """Head or last stage → first stage: a prompt chunk or the sampled token to run next."""

    TYPE = "tokens"
    request_id: int
    session_id: int
    pos: int  # position of ids[0] in the session
    ids: list[int]
    chunk_index: int = 0
    chunk_total: int = 1
    sampling: Sampling | None = None
    checkpoint_at: list[int] = field(default_factory=list)  # checkpoint each stage's part here
    conversation: ConversationStep | None = None  # v15: first chunk only, kept conversations
    batch: BatchRows | None = None  # v16: a batched decode step, one row per id (protocol/batch.py)

    def check(self, arrays: list) -> None:
        _nonneg(pos=self.pos, chunk_index=self.chunk_index)
        if not 0 <= self.chunk_index < self.chunk_total:
            raise ValueError(f"chunk_index {self.chunk_index} outside [0, {self.chunk_total})")
        _boundaries(self.checkpoint_at, self.pos, len(self.ids))
        if self.batch is not None and self.batch.total_rows != len(self.ids):
            raise ValueError(f"a batched step of {self.batch.total_rows} rows carries "
                             f"{len(self.ids)} ids")


@message
class Hidden(Message):
    """Stage → next stage: hidden rows for positions [pos, pos + n). Rows are one raw frame, or in the sender's
    CUDA IPC buffer at ``slot`` (then no frame follows)."""

    TYPE = "hidden"
    MAX_ARRAYS = 1
    request_id: int
    session_id: int
    pos: int
    n: int
    dtype: str
    shape: list[int]
    slot: RowSlot | None = None
    chunk_index: int = 0
    chunk_total: int = 1
    sampling: Sampling | None = None
    checkpoint_at: list[int] = field(default_factory=list)  # as Tokens.checkpoint_at
    checkpoints: list[int] = field(default_factory=list)    # held by every stage so far (see PROTOCOL.md)
    resume_any: bool = False                                # no stage so far holds recurrent state
    conversation: ConversationStep | None = None            # v15: as Tokens.conversation
    conversations: list[int] = field(default_factory=list)  # v15: kept by every stage so far
    batch: BatchRows | None = None                          # v16: as Tokens.batch, a row each

    def check(self, arrays: list) -> None:
        _nonneg(pos=self.pos, n=self.n)
        if self.batch is not None and self.batch.total_rows != self.n:
            raise ValueError(f"a batched step of {self.batch.total_rows} rows carries n={self.n}")
        _boundaries(self.checkpoint_at, self.pos, self.n)
        if not self.shape or self.shape[0] != self.n:
            raise ValueError(f"shape {self.shape} does not start with n={self.n}")
        if not 0 <= self.chunk_index < self.chunk_total:
            raise ValueError(f"chunk_index {self.chunk_index} outside [0, {self.chunk_total})")
        want = 0 if self.slot is not None else 1
        if len(arrays) != want:
            raise ValueError(f"hidden rows: expected {want} frame(s) (slot={self.slot}), got {len(arrays)}")
        if arrays:
            a = arrays[0]
            if list(a.shape) != self.shape or _dtype_name(a.dtype) != self.dtype:
                raise ValueError(f"rows frame is {a.dtype.name}{list(a.shape)}, header says {self.dtype}{self.shape}")


@message
class PromptProgress(Message):
    """Last stage → head: prompt chunk ``chunk_index`` of ``chunk_total`` has passed every stage; positions up
    to ``pos`` are read. ``ms`` is the last stage's own time for the chunk. ``checkpoints``: the positions at which
    every stage holding recurrent state holds its part of a checkpoint of the session (an incomplete set is no
    checkpoint); ``resume_any``: no stage holds recurrent state, any position is resumable."""

    TYPE = "prompt_progress"
    request_id: int
    session_id: int
    pos: int
    chunk_index: int
    chunk_total: int
    ms: float = 0.0
    checkpoints: list[int] = field(default_factory=list)  # positions every stage holds its part at
    resume_any: bool = False                              # no stage holds recurrent state
    conversations: list[int] = field(default_factory=list)  # v15: kept by every stage
    # v14, when the request's sampling asks for prompt_logprobs: per row of the chunk whose next
    # token is in the prompt, in order, that token's logprob and the N most likely tokens' there
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@message
class Token(Message):
    """Last stage → first stage and head: one sampled token."""

    TYPE = "token"
    request_id: int
    session_id: int
    token_id: int
    pos: int
    logprob: float | None = None
    done: bool = False
    reason: str = ""  # "stop" | "length" when done
    top_ids: list[int] = field(default_factory=list)        # v14: the N most likely tokens here
    top_logprobs: list[float] = field(default_factory=list)  # and their logprobs, most likely first
    drafted: int = 0    # v15, on the final Token: the request's draft tokens, and those accepted
    accepted: int = 0
    # v20, a batched step's (head_steps) last Token of a request's window: the drafts of its next
    # verify window, which the head sends after this token (protocol/batch.py)
    drafts: list[int] = field(default_factory=list)
    # v23: the Token after which the last stage stopped stepping this request itself (it got a
    # HandBack): the head sends its next step, this token (and `drafts`) in it
    handed_back: bool = False


# the most Tokens one batched step makes: every entry's whole verify window accepted
MAX_STEP_TOKENS = MAX_BATCH_ROWS * MAX_WINDOW_ROWS


@message
class StepTokens(Message):
    """Last stage → head (v24, --parallel): every Token a batched decode step made (protocol/
    batch.py), in the order they were drawn, as one message: one send and one receive a step
    instead of one a row. ``request_id`` is the step's; each Token names its own request. A
    request's Error, or a Token held for a Settle, still travels on its own."""

    TYPE = "step_tokens"
    request_id: int
    tokens: list[Token] = field(default_factory=list)

    def check(self, arrays: list) -> None:
        if not 0 < len(self.tokens) <= MAX_STEP_TOKENS:
            raise ValueError(f"a step's tokens number 1 to {MAX_STEP_TOKENS}, not "
                             f"{len(self.tokens)}")


def _boundaries(positions: list[int], pos: int, n: int) -> None:
    for p in positions:
        if p != pos and p != pos + n:
            raise ValueError(f"checkpoint_at {p} is not a boundary of rows [{pos}, {pos + n})")


# ---------------------------------------------------------------- calibration


@message
class LinkProbe(Message):
    """`strata-dist calibrate --peer`: a probe of the link to another host (its frame, if any, is
    payload the peer discards) and the peer's answer (the same seq, no frame). seq -1 stops the
    peer."""

    TYPE = "link_probe"
    MAX_ARRAYS = 1
    seq: int


__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "VersionMismatch", "Struct", "Message", "MESSAGE_TYPES",
    "STRUCT_TYPES", "DeviceInfo", "PeerInfo", "RowSlot", "Sampling", "Hello", "Challenge", "Auth", "AuthOk",
    "Register", "Assign", "Ready", "Stats", "StatsReply", "Heartbeat", "Error", "Shutdown", "Release", "Cancel",
    "Settle", "HandBack",
    "Tokens", "Hidden", "PromptProgress", "Token", "StepTokens", "ExpertRequest", "ExpertReply", "IpcHandle", "SlotFree",
    "ExpertTierAsk", "ExpertTier", "TierCounts", "TierPairs", "LinkProbe",
    "ERR_AUTH", "ERR_VERSION", "ERR_FINGERPRINT", "ERR_PROTOCOL", "ERR_TIMEOUT", "ERR_PEER", "ERR_INTERNAL",
]
