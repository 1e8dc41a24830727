"""A stage: the layers [lb, le) of a model on one device, with its sessions: ids or hidden rows
in, hidden rows (on the last stage, logits) out, apart from any transport. Sessions hold KV only
for the stage's own layers, keeping global layer ordinals (the session carve)."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from protocol import ProtocolError, ProtocolTimeout

from ..experts.adapt import (RoutingCounts, WindowRoutes, coverage, layer_blob_sizes,
                             pick_swaps, pinned_pairs)
from ..backends import get_backend
from ..ops.expert_addresses import Unsupported
from ..backends.kv_cache import DeviceRing, kv_host_nbytes
from ..checkpoints import CheckpointStore, bound_bytes, is_recurrent
from .conversation_cache import ConversationCache
from ..experts.stores import BlobArena
from ..plan.lend import loan_slots
from ..plan.workspace import STREAMED
from .prompt_workspace import PromptWorkspace
from ..models import architecture_for, load_model, open_checked
from ..experts.host_pinning import pin_room_error, reads_host_in_place
from ..sampling.speculative import WindowRecord
from ..experts.tiers import ExpertTiers, HelperClient, offer_missed


log = logging.getLogger("strata.stage")

LOGIT_BLOCK = 64    # rows of prompt logits computed at once when every row's are asked for


@dataclass
class StageConfig:
    model_path: str
    device: str
    lb: int
    le: int
    first: bool
    last: bool
    max_context: int
    weight_slice: bool = True
    cache_pairs: list = field(default_factory=list)      # the plan's pairs for this stage's cache
    helpers: list = field(default_factory=list)          # (rank, endpoint, pairs, ipc) of helper tiers
    local_helper: object = None                          # this card's own helper tier (an arena)
    loan_slots: int = 0                                  # cache tail lent to each prompt (plan_lend)
    link_seal: object = None                             # the launch's seal for TCP data links
    kv_type: str | None = None                           # --kv-type (None: the device's default)
    kv_resident: int = 0      # --kv-resident: cells of each K/V on the device (0: every cell)
    prompt_chunk: int = 0                                # the plan's prompt chunk (0: not known)
    # pairs of this stage's layers that this card's own helper tier will hold (opened after the
    # stage: it is the part that fails soft); they decide the default for host misses as a
    # helper elsewhere does
    local_helper_pairs: list = field(default_factory=list)
    adapt_every: int = 0      # --adapt-every: tokens between the adaptive cache's rounds (0: off)
    adapt_swaps: int = 0      # --adapt-swaps: the most pairs a round swaps
    # --conversation-cache-mib: this stage's budget for kept conversations (the plan's
    # conversation_bytes) and whether the plan put them in pinned host memory
    conversation_bytes: int = 0
    conversation_host: bool = False
    count_routing: bool = False   # --expert-profile-out: count routing totals (a live profile)


class Stage:
    def __init__(self, cfg: StageConfig):
        self.cfg = cfg
        self.gguf = open_checked(cfg.model_path)
        self.backend = get_backend(cfg.device)
        if cfg.kv_type:
            self.backend.kv_type = cfg.kv_type            # how this stage's sessions keep K/V
        self.backend.kv_resident = cfg.kv_resident        # the rest in host memory (RingKV)
        arch = architecture_for(self.gguf)
        kv = (arch.ARCH, self.backend.kv_type)       # what the GPU ring kernels must take
        if cfg.kv_resident and self.backend.on_gpu and not (kv[0] in DeviceRing.ARCHS and kv[1] in DeviceRing.KV_TYPES):
            raise ValueError(f"--kv-resident {cfg.kv_resident} on {cfg.device}: the GPU ring "
                             f"kernels take {DeviceRing.ARCHS} with {DeviceRing.KV_TYPES}, not {kv}")
        g = arch.read_geometry(self.gguf)
        own = [(l, e) for l, e in cfg.cache_pairs if cfg.lb <= l < cfg.le]
        if len(own) != len(cfg.cache_pairs):
            raise ValueError(f"the plan gives stage [{cfg.lb}, {cfg.le}) pairs of other layers")
        self.cache = BlobArena(self.backend, self.gguf, own, g.n_layers, g.n_expert)
        helpers = [HelperClient(rank, ep, [p for p in pairs if cfg.lb <= p[0] < cfg.le],
                                backend=self.backend, ipc=ipc, hidden=g.n_embd, top_k=g.n_expert_used,
                                seal=cfg.link_seal)
                   for rank, ep, pairs, ipc in cfg.helpers]
        # with the adaptive cache on, a helper holding none of this stage's pairs yet may take
        # some when it re-ranks (helper_server.py): the stage keeps its link
        adapting = cfg.adapt_every > 0 and cfg.adapt_swaps > 0
        self.tiers = ExpertTiers(self.backend, self.gguf, self.cache,
                                 [h for h in helpers if h.pairs or adapting],
                                 local_helper=cfg.local_helper)
        self.local_tier = None   # this card's own HelperServer, set by the rank (re-ranked here)
        self._rerank_refused: set[int] = set()   # helpers whose refusal to re-rank was said
        # missed pairs offered to a helper tier whose answer to that round has not come yet:
        # (layer, expert) -> (helper rank, the seq of the round's TierCounts)
        self._offers: dict[tuple[int, int], tuple[int, int]] = {}
        # pairs of this stage's layers that this card's own helper tier will hold: read in place
        # by the decode graph once the tier opens (attach_local_helper), so never pinned
        self.own_helper_pairs = {(int(l), int(e)) for l, e in cfg.local_helper_pairs
                                 if cfg.lb <= l < cfg.le}
        self.tiers.local_helper_pairs = len(self.own_helper_pairs)
        # the adaptive cache (strata_dist/experts/adapt.py): off unless both flags are > 0
        self.routing = RoutingCounts((g.n_layers, g.n_expert), cfg.adapt_every, cfg.adapt_swaps)
        self._adapt_due = False
        self._adapt_stuck_said = False   # said once: no pair can leave the cache (none pinned)
        if self.routing.on or cfg.count_routing:
            self.tiers.routing = self.routing
        self.pin_error = ""     # why the experts the cache lacks could not be pinned, if so
        if self.backend.on_gpu and reads_host_in_place(self.tiers, once_opened=True):
            self._pin(skip=self.own_helper_pairs)
        self.model = load_model(self.gguf, self.backend, cfg.lb, cfg.le, first=cfg.first,
                                last=cfg.last, weight_slice=cfg.weight_slice, experts=self.tiers)
        # decode steps as one device graph when every expert of the range is in the cache, this
        # card's helper tier or pinned host memory (CuPy); with pairs in this card's helper tier,
        # once that tier has opened (it opens after the stage)
        self.decode_graph = None
        if not (self.own_helper_pairs and cfg.local_helper is None):
            self._rebuild_graph()
        # a GPU prompt chunk's buffers: the layout the plan priced, carved from the loan while a
        # prompt borrows it, else from the stage's own prompt buffers, allocated here once
        self.prompt_layout = self.model.prompt_layout() if self.backend.on_gpu else None
        if (self.prompt_layout is not None and not cfg.loan_slots
                and len(own) == (cfg.le - cfg.lb) * g.n_expert):
            # every pair of its layers cached, none lent: no miss to stream (plan/lend.py `own`)
            self.prompt_layout = self.prompt_layout.without(STREAMED)
        self._workspace = self._own_workspace = None
        if self.prompt_layout is not None and cfg.prompt_chunk and not cfg.loan_slots:
            self._own_workspace = PromptWorkspace.allocate(self.prompt_layout, cfg.prompt_chunk,
                                                           self.backend.xp)
        self.sessions: dict[int, object] = {}
        self.checkpoints: dict[int, CheckpointStore] = {}   # per session (strata_dist/checkpoints.py)
        self.conversations = ConversationCache(self.backend, cfg.conversation_bytes,
                                               host=cfg.conversation_host)
        self.windows: dict[int, WindowRecord] = {}   # a recurrent session's last verify window
        self.window_rerun_rows = 0    # rows run again to roll recurrent state back in a window
        # a session's last verify window's routes, counted until its next step says which stand
        self.window_routes: dict[int, WindowRoutes] = {}
        self._released_counts = {"checkpoint_saves": 0, "checkpoint_restores": 0,
                                 "checkpoint_failed": 0}
        # last stage, --draft mtp: called (session_id, pos, rows) with every run's final hidden
        # rows (sampling/mtp_draft.py); its steps then take the general path (the graph gives logits only)
        self.hidden_sink = None

    def attach_local_helper(self, arena) -> None:
        """This card's own helper tier has opened (`arena`), or failed to (None): its pairs are
        computed in place from now on, the decode graph reading them where they are. A tier that
        did not open leaves them to host memory: pinned where the stage pins, else the file."""
        self.tiers.local_helper = arena
        if not self.backend.on_gpu or not self.own_helper_pairs:
            return
        if arena is None and reads_host_in_place(self.tiers, once_opened=True):
            old = self.tiers.pinned
            self._pin()
            if old is not None:
                old.close()
        self._rebuild_graph()

    def _pin(self, skip=()) -> None:
        """Pin the blobs of this stage's layers its cache lacks, less `skip` (_pin_missing)."""
        cfg = self.cfg
        n_expert = self.cache.slot_of.shape[1]
        args = (self.gguf, self.cache, cfg.lb, cfg.le, n_expert, cfg.loan_slots)
        # the adaptive cache pins every pair of its layers where the host has room, else only the
        # misses, as without it (a cached pair then leaves a decode graph's cache only once it
        # has a pinned copy, Stage._adapt)
        every = self.routing.on and not pin_room_error(
            sum(self.gguf.blob_bytes(l) * n_expert for l in range(cfg.lb, cfg.le)))
        self.tiers.pinned, self.pin_error = _pin_missing(*args, skip=skip, every=every)
        if self.tiers.pinned is None and every:
            self.tiers.pinned, self.pin_error = _pin_missing(*args, skip=skip)

    def _rebuild_graph(self) -> None:
        """The decode graph for the tiers as they are now (a helper tier opened here or on
        another card, or one that stopped): its table of addresses is taken when it is built."""
        if self.decode_graph is not None:
            self.decode_graph.settle()
        self.decode_graph = self.backend.decode_graph(self.model, self.cfg.max_context)
        if self.decode_graph is not None and self.cfg.count_routing:
            self.decode_graph.keep_routes = True    # a profile counts every step's routes

    @property
    def weights_bytes(self) -> int:
        return self.model.loaded_bytes

    @property
    def own_prompt_bytes(self) -> int:
        """The prompt layout this stage allocated for itself (it does not lend), else 0."""
        return self._own_workspace.nbytes if self._own_workspace is not None else 0

    def session(self, session_id: int):
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = self.model.new_session(self.cfg.max_context)
        return s

    def session_bytes(self) -> int:
        return sum(s.nbytes for s in self.sessions.values())

    def kv_host_bytes(self) -> int:
        """What the sessions keep of K/V in host memory beyond the device (--kv-resident)."""
        return sum(kv_host_nbytes(s.kv_rows()) for s in self.sessions.values())

    def release(self, session_id: int) -> None:
        if self.decode_graph is not None:
            self.decode_graph.settle()      # a step ahead may still write this session's KV
        self.sessions.pop(session_id, None)
        self.windows.pop(session_id, None)
        self.window_routes.pop(session_id, None)
        gone = self.checkpoints.pop(session_id, None)
        if gone is not None:   # its counts stay in the rank's totals
            self._released_counts = _add_counts(self._released_counts, gone)

    # ---- checkpoints: this stage's part only (its own linear layers) ------------------------------
    def checkpoint_store(self, session_id: int) -> CheckpointStore:
        c = self.checkpoints.get(session_id)
        if c is None:
            c = self.checkpoints[session_id] = CheckpointStore()
        return c

    def checkpoint_positions(self, session_id: int) -> list[int] | None:
        """Positions this stage holds its part of a checkpoint at; None: its state is positional
        (no linear layer), so it can resume anywhere."""
        return self.checkpoint_store(session_id).held(self.session(session_id))

    def checkpoint_bound_bytes(self) -> int:
        """The most checkpoints may take on this stage per session (allocated on demand)."""
        return bound_bytes(self.session(0))

    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints.values())

    def checkpoint_counters(self) -> dict[str, int]:
        """Saves, restores and skipped saves since the stage started (released sessions too)."""
        out = dict(self._released_counts)
        for c in self.checkpoints.values():
            out = _add_counts(out, c)
        return out

    def switch_conversation(self, session_id: int, step) -> None:
        """A request's ConversationStep, before its first chunk (strata_dist/rank/conversation_cache.py):
        keep the serving session as a conversation, drop some, restore one into it."""
        s = self.session(session_id)
        if self.decode_graph is not None:
            self.decode_graph.settle()      # a step ahead may still write the session
        if step.keep:
            # a request that stopped inside a verify window (a stop token before its last row)
            # left the recurrent state past its tokens: back to them before it is kept
            self._rewind_window(session_id, s, step.keep_n)
        if step.keep or step.restore:
            self.windows.pop(session_id, None)   # the window was of the conversation it leaves
        if step.keep:
            self.conversations.keep(s, step.keep, step.keep_n, protect=step.restore,
                                    prefix=self.checkpoint_store(session_id).before(step.keep_n))
        self.conversations.forget(step.forget)
        if step.restore:
            self.conversations.restore(s, step.restore, step.restore_n)
            # its checkpoints were of the conversation it left
            self.checkpoint_store(session_id).clear()
        if step.keep or step.restore:
            self.backend.synchronize()      # the copies, before a decode graph's own stream reads

    def begin_prompt(self, rows: int | None = None) -> None:
        """The prompt path borrows the tail of this stage's own cache (its loan). On a GPU the
        chunk's buffers are carved from it by the priced layout (strata_dist/rank/prompt_workspace.py).
        `rows`: the prompt's one chunk has this many (None: chunks up to the plan's): a GPU stage
        then borrows only the slots that layout takes, so a short prompt evicts, streams and
        refills fewer pairs."""
        self.tiers.begin_prompt()
        if self.cfg.loan_slots > 0 and not self.cache.lent:
            prompt_chunk, slots = self.cfg.prompt_chunk, self.cfg.loan_slots
            if self.prompt_layout is not None and prompt_chunk and rows is not None and 0 < rows < prompt_chunk:
                prompt_chunk = rows
                slot_bytes = min(self.gguf.blob_bytes(l) for l in range(self.cfg.lb, self.cfg.le))
                slots = min(slots, loan_slots(prompt_chunk, self.prompt_layout.nbytes, slot_bytes))
            self.cache.lend_tail(slots)
            self.tiers.counters["loans"] += 1
            if self.prompt_layout is not None and prompt_chunk:
                try:
                    self._workspace = PromptWorkspace(self.prompt_layout, prompt_chunk,
                                                      self.cache.loan_region())
                except ValueError as e:   # a plan priced for another file: said, not hidden
                    log.error("the loan cannot hold the prompt buffers (%s); they come from the "
                              "pool", e)
        elif self._own_workspace is not None:
            self._workspace = self._own_workspace

    def end_prompt(self) -> None:
        """After the prompt, the lent slots get their own pairs back: outside a prompt the whole
        cache is expert cache."""
        self.tiers.settle_prompt_counts()   # before the refill: the tiers the prompt saw
        ws, self._workspace = self._workspace, None
        if ws is not None:
            c = self.tiers.counters
            c["loan_peak_bytes"] = max(c["loan_peak_bytes"], ws.nbytes)   # carved, as priced
            c["loan_overflow_bytes"] += ws.overflow_bytes
            ws.overflow_bytes = 0
        if self.cache.lent:
            self.tiers.counters["refilled_slots"] += self.cache.refill(self.tiers.pinned)

    def _prompt_buffers(self, prompt: bool):
        ws = self._workspace if prompt else None
        return ws.active(self.backend) if ws is not None else nullcontext()

    def run(self, session_id: int, pos: int, ids=None, hidden=None, prompt: bool = False,
            checkpoint_at=(), ahead: bool = False, all_rows: bool = False):
        """Process rows at positions pos.. of a session. The first stage takes token ids, the
        others hidden rows (float32 [n, n_embd], host or device). Returns the hidden rows as a
        backend array, or on the last stage the logits of the last row [vocab]: host float32, or
        a graph step's StepLogits (the sampler reads both).
        `checkpoint_at`: positions to checkpoint this stage's part at, each the rows' start or end.
        `ahead`: the next greedy step of this session follows (DecodeGraph.step may launch it now).
        `all_rows` (last stage, prompt rows or a verify window): the logits of every row, host
        float32 [n, vocab]. A decode step of more than one row is a verify window
        (strata_dist/sampling/speculative.py): it takes the many-row path, and on a session with recurrent
        state the stage keeps what it needs to roll back inside it at the next step."""
        s = self.session(session_id)
        self.tiers.prompt = prompt   # prompt chunks never ask helpers (tiers.py)
        store = self.checkpoint_store(session_id)
        n = len(ids) if self.cfg.first else int(hidden.shape[0])
        bad = [p for p in checkpoint_at if p not in (pos, pos + n)]
        if bad:
            raise ValueError(f"checkpoint position {bad[0]} is not a boundary of rows "
                             f"[{pos}, {pos + n})")
        verify = not prompt and n > 1
        counting = self.tiers.routing is not None
        self._rewind_window(session_id, s, pos)
        # an earlier position rewinds (KV is positional; recurrent state comes from a checkpoint)
        store.enter(s, pos)
        if verify and is_recurrent(s):
            rows = list(ids) if self.cfg.first else self.backend.asarray(hidden).copy()
            self.windows[session_id] = WindowRecord(pos, n, rows, s.save(pos))
        if pos in checkpoint_at:
            store.save(s, pos)
        if (not prompt and self.tiers.helpers and self.backend.on_gpu
                and self.tiers.tiers_changed()):
            self._rebuild_graph()       # another card's tier opened (read in place), or stopped
        graph = self.decode_graph
        graph_step = (not prompt and not verify and graph is not None and graph.usable(n)
                      and self.hidden_sink is None)
        if graph_step:
            out = graph.step(s, pos, ids=ids, hidden=hidden, ahead=ahead)
            # its tiers and routes (the general path counts its own as it computes them)
            graph.report_step(self.tiers.counters, self.tiers.routing)
        else:
            if graph is not None:
                # a step ahead still in flight reads the cache (a prompt writes its lent slots)
                # and writes the session: it finishes before the general path starts
                graph.settle()
            if verify and counting:   # counted row by row until the next step settles them
                self.tiers.routing = self.window_routes[session_id] = WindowRoutes(
                    self.routing, pos, n)
            try:
                sink = self.hidden_sink if self.cfg.last else None
                out = self._run_general(s, prompt, ids, hidden, all_rows,
                                        sink and (lambda rows: sink(session_id, pos, rows)))
            finally:
                if counting:
                    self.tiers.routing = self.routing
        s.n_past = pos + n
        if s.n_past in checkpoint_at:
            store.save(s, s.n_past)
        if self.tiers.routing is not None:
            # a window's first row always stands (its token was the last one drawn); the rest
            # tick when the next step settles them
            self._adapt_due |= self.routing.tick(1 if verify else n)
            if self._adapt_due and not self.cache.lent:   # never while a prompt borrows slots
                self._adapt()
        return out

    def settle_window(self, session_id: int, pos: int) -> None:
        """A speculating request ended at `pos` (protocol Settle): its session's last window's
        rows before `pos` stand (its first always), the rest leave the routing counts now, not at
        a next step that may never come; the recurrent state is left to `_rewind_window`."""
        routes = self.window_routes.pop(session_id, None)
        if routes is not None:
            self._adapt_due |= self.routing.tick(routes.settle(max(pos, routes.start + 1)) - 1)

    def _rewind_window(self, session_id: int, s, pos: int) -> None:
        """A step (batched too) inside the session's last verify window: the state at its start
        back, the accepted rows run again (as one-row steps leave it), its routes settled at pos."""
        routes = self.window_routes.pop(session_id, None)
        if routes is not None:
            self._adapt_due |= self.routing.tick(routes.settle(pos) - 1)
        w = self.windows.pop(session_id, None)
        if w is None or not w.covers(pos, s.n_past):
            return
        if self.decode_graph is not None:
            self.decode_graph.settle()
        s.restore(w.state)
        self.window_rerun_rows += pos - w.start
        if pos > w.start:
            h = (self.model.embed(w.rows[:pos - w.start]) if self.cfg.first
                 else w.rows[:pos - w.start])
            reading, self.tiers.prompt = self.tiers.prompt, False   # the window's own tiers
            # rows counted once already (their routes stood when the window settled)
            counting, self.tiers.routing = self.tiers.routing, None
            try:
                self.model.forward_layers(h, s)
            finally:
                self.tiers.prompt, self.tiers.routing = reading, counting
            s.n_past = pos

    def run_batch(self, session_ids: list[int], positions: list[int], ids=None, hidden=None):
        """A batched decode step (protocol/batch.py): row i is the next token of session_ids[i] at
        positions[i] (ids first, hidden rows after), by the decode graph where it takes it, else
        the general path: hidden rows, or last every row's logits (host f32; a graph's on the card)."""
        sessions = [self.session(sid) for sid in session_ids]
        for sid, s, pos in zip(session_ids, sessions, positions):
            self._rewind_window(sid, s, pos)   # inside its last verify window (--spec): rolled back
            self.checkpoint_store(sid).enter(s, pos)   # as a one-row step enters its position
        self.tiers.prompt = False
        graph = self.decode_graph
        replays = (graph.batch_replays(sessions, positions)
                   if graph is not None and self.hidden_sink is None else None)
        if by_graph := replays is not None:
            out = graph.step_rows(replays, ids=ids, hidden=hidden)   # BatchLogits on the last
            graph.report_step(self.tiers.counters, self.tiers.routing)
        else:
            if graph is not None:
                graph.settle()    # a step ahead may still write a session's KV
            h = self.model.embed(ids) if self.cfg.first else self.backend.asarray(hidden)
            out = self.model.forward_rows(h, sessions, positions)
        for i, (sid, s, pos) in enumerate(zip(session_ids, sessions, positions)):
            s.n_past = pos + 1
            if not by_graph and self.cfg.last and self.hidden_sink is not None:   # --draft mtp
                self.hidden_sink(sid, pos, out[i:i + 1])
        if self.routing.on:
            self._adapt_due |= self.routing.tick(len(sessions))
            if self._adapt_due and not self.cache.lent:
                self._adapt()
        if self.cfg.last and not by_graph:
            out = self.backend.to_host(self.model.output_logits(out)).astype(np.float32)
        return out

    def _adapt(self) -> None:
        """One round of the adaptive cache, between steps: the coldest cached pairs swapped for
        the hottest missed ones (adapt.pick_swaps), the blobs copied, then the tables pointed at
        them; the coverage of the counted routing goes to the counters and the log."""
        self._adapt_due = False
        r, cache, lb, le = self.routing, self.cache, self.cfg.lb, self.cfg.le
        cached = cache.slot_of >= 0
        sizes = layer_blob_sizes(self.gguf.blob_bytes, lb, le, cached.shape[0])
        graph, evictable = self.decode_graph, None
        if graph is not None and self.backend.on_gpu:
            # a pair leaving the cache stays readable by the graph only from its pinned copy
            evictable = pinned_pairs(cache.pairs, self.tiers.pinned, cached.shape)
            if not evictable.any() and not self._adapt_stuck_said:
                self._adapt_stuck_said = True
                log.warning("stage [%d, %d): the adaptive cache can swap nothing: no cached pair "
                            "has a pinned host copy for the decode graph to read after it leaves "
                            "(the host had no room to pin this stage's experts)", lb, le)
        before = coverage(r.counts[lb:le], cached[lb:le])
        swaps = pick_swaps(r.counts, cached, r.swaps, size_class=sizes, evictable=evictable)
        if swaps:
            if graph is not None:
                graph.settle()        # no step in flight reads a slot being rewritten
            cache.swap(swaps, self.tiers.pinned)
            if graph is not None:     # the graph's address table, after the copies (same stream)
                try:
                    graph.repoint(self.model.expert_addresses(like=graph.addresses))
                except Unsupported:   # its old table reads slots that now hold other pairs
                    self._rebuild_graph()    # afresh (it pins what it reads), or the general path
        after = coverage(r.counts[lb:le], (cache.slot_of >= 0)[lb:le])
        self._rerank_helpers(cache.slot_of >= 0)
        c = self.tiers.counters
        c["adapt_rounds"] += 1
        c["adapt_swaps"] += len(swaps)
        # a level, not a total: the share of the recent routing the cache holds now
        c["adapt_coverage_ppm"] = int(round(after * 1e6))
        if swaps:
            log.info("stage [%d, %d): adaptive cache swapped %d pairs; it holds %.1f%% of the "
                     "recent routing (was %.1f%%)", lb, le, len(swaps), 100 * after, 100 * before)
        r.decay()

    def _rerank_helpers(self, cached: np.ndarray) -> None:
        """The helper tiers re-rank on this stage's counts too (helper_server.py): each gets the
        counts of its layers' pairs, less those held elsewhere (this stage's cache, the other
        tiers: a tier takes only what none holds), and answers the pairs of those layers it
        holds then, taken here at the next round (HelperClient.rerank); until then a pair that
        left is still answered, from the model file. A pair no tier holds is offered to one
        tier only, chosen by heat (tiers.offer_missed: the hottest to the tier whose coldest
        slot is coldest), and to that tier again until it answers the round it went out in: two
        tiers never take it in one round, nor one in the round after the other took it unheard."""
        lb, le = self.cfg.lb, self.cfg.le
        # a tier read in place never swaps; the others' answers since the last round come first
        asked = [h for h in self.tiers.helpers if h.alive and h.tier is None]
        changed = any([self._tier_call(h, h.take_pairs) for h in asked])
        asked = [h for h in asked if h.alive]
        local = self.local_tier.arena if self.local_tier is not None else None
        # this card's own tier read in place (a GPU stage's) never swaps: it is offered nothing
        local_takes = local is not None and not self.local_tier.read_in_place
        own = [local.slot_of >= 0] if local is not None else []
        held = (own if local_takes else []) + [h.pairs_mask(cached.shape) for h in asked]
        first = int(local_takes)             # held[first + j] is asked[j]'s
        index = {h.rank: first + j for j, h in enumerate(asked)}
        # a helper that refused to re-rank answers no round: no offer waits on it
        answered = {h.rank: h.answered_seq for h in asked if h.rank not in self._rerank_refused}
        self._offers = {p: (rank, seq) for p, (rank, seq) in self._offers.items()
                        if rank in answered and answered[rank] < seq}
        pending = np.full(cached.shape, -1, dtype=np.int64)
        for (l, e), (rank, _) in self._offers.items():
            pending[l, e] = index[rank]
        counts = self.routing.counts
        layers = np.zeros(cached.shape, dtype=bool)
        layers[lb:le] = True
        # every tier's pairs, a tier read in place or lost included: a pair no tier holds
        in_a_tier = np.logical_or.reduce(own + held + [h.pairs_mask(cached.shape)
                                                       for h in self.tiers.helpers if h not in asked])
        missed = layers & ~cached & ~in_a_tier & ((counts > 0) | (pending >= 0))
        sizes = layer_blob_sizes(self.gguf.blob_bytes, lb, le, cached.shape[0])
        to = offer_missed(counts, missed, held, sizes, pending)

        def offered(i: int) -> np.ndarray:
            return np.where((~cached & (held[i] | (to == i)))[lb:le], counts[lb:le], 0.0)
        if local is not None:   # this card's own tier, read here as it is
            self.local_tier.rerank(lb, le, offered(0) if local_takes else np.where(
                (~cached & own[0])[lb:le], counts[lb:le], 0.0))
        for h in asked:
            i = index[h.rank]
            changed |= self._tier_call(h, lambda: h.rerank(lb, le, offered(i)))
            if h.alive and h.rank in answered:
                self._offers.update(((int(l), int(e)), (h.rank, h.counts_seq))
                                    for l, e in np.argwhere(to == i))
        if changed and self.backend.on_gpu:
            self._rebuild_graph()    # the graph's tiers are taken when it is built

    def _tier_call(self, h: HelperClient, call) -> bool:
        """One re-rank exchange with helper `h` (`call`: its rerank or take_pairs); whether the
        pairs it holds of this stage's layers changed. A helper that does not answer is lost;
        one that refuses keeps its pairs (said once)."""
        try:
            held = call()
            return held is not None and self.tiers.set_helper_pairs(h, held)
        except ProtocolTimeout as e:
            self.tiers._helper_lost(h, e)
        except ProtocolError as e:
            if h.rank not in self._rerank_refused:   # said once: it answers so every round
                self._rerank_refused.add(h.rank)
                log.warning("helper rank %d did not re-rank (%s); its pairs stay as they "
                            "were", h.rank, e)
        return False

    def _run_general(self, s, prompt: bool, ids, hidden, all_rows: bool = False, sink=None):
        """The general path: any rows, any tiers (prompt chunks, partial caches). `sink`: given
        every final hidden row (Stage.hidden_sink)."""
        with self._prompt_buffers(prompt):
            h = self.model.embed(ids) if self.cfg.first else self.backend.asarray(hidden)
            h = self.model.forward_layers(h, s)
            out = h[-1:] if self.cfg.last and not all_rows else h
        if sink is not None:   # past the chunk's buffers: its allocations are not their overflow
            sink(h)
        if self._workspace is not None and prompt:
            out = out.copy()        # out of the workspace: the rows outlive the chunk's buffers
        del h
        if self.cfg.last and all_rows:
            # a block of rows at a time: the device holds at most LOGIT_BLOCK rows of logits
            return np.concatenate([
                self.backend.to_host(self.model.output_logits(out[i:i + LOGIT_BLOCK]))
                .astype(np.float32) for i in range(0, int(out.shape[0]), LOGIT_BLOCK)])
        if self.cfg.last:
            return self.backend.to_host(self.model.output_logits(out))[0].astype(np.float32)
        return out


def _add_counts(counts: dict[str, int], store: CheckpointStore) -> dict[str, int]:
    return {"checkpoint_saves": counts["checkpoint_saves"] + store.saves,
            "checkpoint_restores": counts["checkpoint_restores"] + store.restores,
            "checkpoint_failed": counts["checkpoint_failed"] + store.failed}


def _pin_missing(gguf, cache, lb: int, le: int, n_expert: int, loan_slots: int, skip=(),
                 every: bool = False):
    """The blobs of the stage's layers its cache lacks, pinned in host memory: read in place by
    the decode graph and streamed by DMA into a prompt's loan (with the pairs of the slots a prompt
    borrows, which are missing while it runs); and why not, if not. Fail-soft:
    (None, reason) when the host will not pin them (memlock limit, host memory); the stage then
    reads its misses from the file. `skip`: pairs this card's helper tier holds (read there).
    `every` (the adaptive cache): every pair of the stage's layers, cached ones too: a pair the
    cache evicts is read from its pinned copy from then on."""
    from ..backends.host_mapped import MappedHostBlobs
    missing = [(l, e) for l in range(lb, le) for e in range(n_expert)
               if (every or not cache.holds(l, e)) and (l, e) not in skip]
    if not every:
        missing += cache.pairs[len(cache.pairs) - min(loan_slots, len(cache.pairs)):]
    if not missing:
        return None, ""
    no_room = pin_room_error(sum(gguf.blob_bytes(l) for l, _ in missing))
    if no_room:
        log.warning("the experts the cache lacks are not pinned: %s; they are read from the file",
                    no_room)
        return None, no_room
    try:
        return MappedHostBlobs(gguf, missing), ""
    except Exception as e:
        reason = f"pinning the {len(missing)} experts the cache lacks failed: {e}"
        log.warning("%s; they are read from the file", reason)
        return None, reason
