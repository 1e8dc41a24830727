"""Expert tiers of a stage: its own cache, the helper tiers of other cards, host memory.

For every (row, top-k rank) a layer routes, one tier computes the expert:
  hit     the pair is resident in this stage's cache (a slot of its arena)
  remote  a helper tier holds it: sent as an ExpertRequest and answered with the unweighted
          outputs, or, where the tier's buffer is opened here through CUDA IPC, read in place
          by the stage's own kernels (the decode graph; a prompt chunk grouped on the device).
          Prompt chunks never send requests
  host    nobody holds it: computed from the model file (a GPU rank streams the stored blob to the
          device and runs the same kernel as a hit)
Outputs land in y[row, rank] and the caller combines them in rank order, so a token's output
does not depend on which tier computed which expert. A helper that does not answer in time is
marked dead and its experts are computed from host memory: the tokens stay the same."""
from __future__ import annotations

import logging
import os
import time
from collections import Counter

import numpy as np

from protocol import (Channel, Error, ExpertReply, ExpertRequest, ExpertTier, ExpertTierAsk,
                      ProtocolError, ProtocolTimeout, SlotFree, TierCounts, TierPairs)
from protocol.messages import RowSlot

from .addresses import device_table
from .stores import BlobArena, ExpertStore, HostTier, stored_rows_jobs

log = logging.getLogger("strata.tiers")

REMOTE_TIMEOUT_MS = 2000
IPC_NAME = "expert_rows"
IPC_MAX_ROWS = 64   # decode rows per request that fit a link's IPC buffer; more go in frames


class HelperClient:
    """This stage's link to one helper tier (a DEALER to the helper's ROUTER).

    On a GPU rank whose helper is on the same host the link also offers a CUDA IPC buffer this
    stage owns (PROTOCOL.md §6, expert links): once the helper has opened it, a request's rows
    and the helper's outputs stay in device memory and the messages carry only ids, weights and
    slots. Until then, for requests larger than the buffer, and after a refusal: frames."""

    def __init__(self, rank: int, endpoint: str, pairs, backend=None, ipc: bool = False,
                 host: str = "", hidden: int = 0, top_k: int = 0, max_rows: int = IPC_MAX_ROWS,
                 seal=None):
        self.rank, self.endpoint = rank, endpoint
        self.pairs = {(int(l), int(e)) for l, e in pairs}
        self.ch = Channel("dealer", peer=f"helper rank {rank}").connect(endpoint).seal_tcp(seal)
        self.alive = True
        self._seq = 0
        self.backend = backend
        self.export = None
        self.ipc_ready = False
        self.sent_ipc = self.sent_frames = 0
        if ipc and self.pairs and backend is not None and backend.on_gpu:
            from protocol.cuda_ipc import SLOT_ALIGN, IpcExport
            self.max_rows, self.hidden, self.top_k = max_rows, hidden, top_k
            rows_bytes = max_rows * hidden * 4
            self.out_offset = -(-rows_bytes // SLOT_ALIGN) * SLOT_ALIGN
            self.export = IpcExport(self.out_offset + max_rows * top_k * hidden * 4, backend.index,
                                    IPC_NAME, "float32")
            self.ch.send(self.export.message(host=host), timeout_ms=REMOTE_TIMEOUT_MS)
            # and the helper's own tier buffer, for the decode graph to read in place
            self.ch.send(ExpertTierAsk(), timeout_ms=REMOTE_TIMEOUT_MS)
        self.tier = None               # the helper's tier buffer opened here (IpcMapping)
        self.tier_pid = 0              # the helper's process, watched while its tier is read
        self.tier_addresses: dict[tuple[int, int], int] = {}   # this stage's pairs -> address
        self.tier_changed = False      # opened (or lost) since the stage last looked
        self.tier_pairs = None         # the tier's newest TierPairs answer, not yet taken (rerank)
        self.tier_pairs_seq = 0        # ... the TierCounts it answers
        self.answered_seq = 0          # the TierCounts the newest answer taken answers
        self.counts_seq = 0            # the TierCounts sent last

    def pairs_mask(self, shape: tuple[int, int]) -> np.ndarray:
        """The pairs it holds as a [layers, experts] mask."""
        mine = np.zeros(shape, dtype=bool)
        for l, e in self.pairs:
            mine[l, e] = True
        return mine

    @property
    def nbytes(self) -> int:
        return self.export.nbytes if self.export is not None else 0

    def request(self, layer: int, x, ids: np.ndarray, wts: np.ndarray) -> int:
        """Ask for the outputs of the pairs in ``ids`` (-1 = not asked) for rows ``x`` (a backend
        array of this rank)."""
        self._seq += 1
        n = int(x.shape[0])
        ids, wts = ids.astype(np.int32), wts.astype(np.float32)
        if self.ipc_ready and n <= self.max_rows:
            d, k = self.hidden, ids.shape[1]
            slot, out = RowSlot(offset=0, nbytes=n * d * 4), RowSlot(offset=self.out_offset,
                                                                     nbytes=n * k * d * 4)
            self.export.view(slot, np.float32, (n, d))[...] = x
            self.backend.synchronize()      # the rows are in place before the doorbell rings
            self.ch.send(ExpertRequest(seq=self._seq, layer=layer, n=n, slot=slot, out=out),
                         [ids, wts], timeout_ms=REMOTE_TIMEOUT_MS)
            self.sent_ipc += 1
            return self._seq
        rows = np.ascontiguousarray(self.backend.to_host(x) if self.backend else x, dtype=np.float32)
        self.ch.send(ExpertRequest(seq=self._seq, layer=layer, n=n), [rows, ids, wts],
                     timeout_ms=REMOTE_TIMEOUT_MS)
        self.sent_frames += 1
        return self._seq

    def reply(self, seq: int, deadline: float):
        """The outputs (n, k, d) of request ``seq``: a view of this link's buffer (IPC) or a host
        array (frames)."""
        msg, arrays = self._await(ExpertReply, seq, deadline, "an expert reply")
        if msg.slot is not None:
            return self.export.view(msg.slot, np.float32, (msg.n, self.top_k, self.hidden))
        return np.asarray(arrays[0], dtype=np.float32)

    def rerank(self, lb: int, le: int, counts: np.ndarray) -> list[tuple[int, int]] | None:
        """The adaptive cache's round reaches this helper's tier (helper_server.py): this stage's
        counts of layers [lb, le) go out, not waited for. A rank that holds a stage and a tier is
        inside its own round when it would answer (a prompt's chunks run on the stages at once),
        so each waiting on the other would stall both: the answer (TierPairs, the pairs of those
        layers the tier holds after its round) is taken at the next round, or with any reply
        before. Returns the newest answer taken since the last call (take_pairs's included), or
        None; `counts_seq` is then this round's."""
        held = self.take_pairs()
        self._seq += 1
        self.counts_seq = self._seq
        self.ch.send(TierCounts(seq=self._seq, lb=lb, le=le),
                     [np.ascontiguousarray(counts, dtype=np.float64)], timeout_ms=REMOTE_TIMEOUT_MS)
        return held

    def take_pairs(self) -> list[tuple[int, int]] | None:
        """The tier's newest answer (TierPairs) that arrived since the last one taken, without
        waiting, or None; `answered_seq` is then the round it answers."""
        while True:
            try:
                msg, arrays = self.ch.recv(timeout_ms=0, what="the helper tier's pairs")
            except ProtocolTimeout:
                break
            self._side_message(msg, arrays)
        held, self.tier_pairs = self.tier_pairs, None
        if held is not None:
            self.answered_seq = max(self.answered_seq, self.tier_pairs_seq)
        return held

    def _await(self, kind: type, seq: int, deadline: float, what: str):
        """The `kind` message of `seq` from the helper, handling what else the link carries."""
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise ProtocolTimeout(self.ch.peer, what, REMOTE_TIMEOUT_MS)
            msg, arrays = self.ch.recv(timeout_ms=left, what=what)
            if isinstance(msg, kind) and msg.seq == seq:
                return msg, arrays
            self._side_message(msg, arrays)

    def _side_message(self, msg, arrays) -> None:
        """Anything the link carries besides the awaited reply."""
        if isinstance(msg, TierPairs):
            self.tier_pairs = [(int(l), int(e)) for l, e in msg.pairs]
            self.tier_pairs_seq = int(msg.seq)
        elif isinstance(msg, SlotFree) and msg.name == IPC_NAME:
            self.ipc_ready = self.export is not None    # the helper opened the buffer
        elif isinstance(msg, ExpertTier):
            self._open_tier(msg, arrays)
        elif isinstance(msg, Error) and msg.code == "ipc_tier":
            log.info("helper rank %d's tier is not read in place (%s); it is asked",
                     self.rank, msg.message)
        elif isinstance(msg, Error) and msg.code == "ipc":
            log.warning("helper rank %d cannot open this stage's CUDA IPC buffer (%s); its "
                        "requests go in frames", self.rank, msg.message)
            self.ipc_ready = False
        elif isinstance(msg, Error):
            raise ProtocolError(f"helper rank {self.rank}: {msg.message}")
        # else a late reply to an earlier, timed-out request: skipped

    def _open_tier(self, msg: ExpertTier, arrays) -> None:
        """Open the helper's tier buffer: from now on the stage's decode graph may read this
        link's pairs there. Any doubt (a pair missing, an offset outside the buffer, a GPU this
        process cannot map) leaves the link asked as before."""
        try:
            from protocol.cuda_ipc import IpcMapping
            pairs, offsets = arrays
            at = {(int(l), int(e)): int(o) for (l, e), o in zip(pairs, offsets)}
            lacking = sorted(self.pairs - at.keys())
            if lacking:
                raise ValueError(f"its tier lacks {len(lacking)} of the pairs the plan gave it "
                                 f"(first {lacking[0]})")
            bad = [p for p in self.pairs if not 0 <= at[p] < msg.nbytes]
            if bad:
                raise ValueError(f"pair {bad[0]} at offset {at[bad[0]]}, outside its "
                                 f"{msg.nbytes}-byte buffer")
            if not _process_alive(msg.pid):
                raise ValueError(f"its process {msg.pid} is not visible from here")
            mapping = IpcMapping(msg.ipc_handle(), device=self.backend.index)
        except Exception as e:
            log.warning("helper rank %d's tier cannot be read in place (%s); it is asked",
                        self.rank, e)
            return
        self.tier, self.tier_pid = mapping, msg.pid
        self.tier_addresses = {p: mapping.ptr + at[p] for p in self.pairs}
        self.tier_changed = True
        log.info("helper rank %d: %d pairs read in place from its tier", self.rank, len(self.pairs))

    def tier_alive(self) -> bool:
        """Whether the helper whose tier is read in place still runs (a process on this host)."""
        return self.tier is not None and _process_alive(self.tier_pid)


def offer_missed(counts: np.ndarray, missed: np.ndarray, held: list[np.ndarray],
                 size_class: np.ndarray | None = None, pending: np.ndarray | None = None
                 ) -> np.ndarray:
    """Which tier a stage offers each pair it misses in the helper tiers' re-rank
    (stage.py `_rerank_helpers`): [L, E], the index into `held` of the one tier offered the pair,
    -1 where it is not missed. One tier only, so two tiers never take the same pair in one round.

    `counts` [L, E]: the stage's routing counts; `missed` [L, E] bool: the counted pairs no tier
    and not the stage's cache holds; `held`: per tier, the pairs of the stage's layers it holds
    (its slots the stage can see); `size_class` [L]: a pair moves only into a slot of a pair of the
    same class (adapt.pick_swaps); `pending` [L, E]: the tier an earlier offer of a pair went to
    and that has not answered that round yet (-1 none): it is offered there again, as the tier may
    have taken it unheard.

    The others are matched by heat, as pick_swaps matches within one tier: the k-th hottest missed
    pair of a class goes to the tier of the k-th coldest visible slot of the class over every tier,
    so the hottest goes to the tier whose coldest slot is coldest (the one that gains most by taking
    it); one past the visible slots goes to the tier of the coldest. A class of which no tier
    holds a visible slot is spread by position (pair index modulo the tiers), the same every
    round."""
    counts = np.asarray(counts, dtype=np.float64)
    missed = np.asarray(missed, dtype=bool)
    to = np.full(counts.shape, -1, dtype=np.int64)
    if not held:
        return to
    free = missed if pending is None else missed & (np.asarray(pending) < 0)
    classes = (np.zeros(counts.shape[0], dtype=np.int64) if size_class is None
               else np.asarray(size_class))
    for c in np.unique(classes):
        rows = (classes == c)[:, None]
        want = np.argwhere(rows & free)
        if not len(want):
            continue
        # hottest first, ties by (layer, expert): a stable order round after round
        want = want[np.lexsort((want[:, 1], want[:, 0], -counts[want[:, 0], want[:, 1]]))]
        visible = [np.argwhere(rows & mine) for mine in held]
        if not any(len(v) for v in visible):
            to[want[:, 0], want[:, 1]] = (want[:, 0] * counts.shape[1] + want[:, 1]) % len(held)
            continue
        tier = np.concatenate([np.full(len(v), t) for t, v in enumerate(visible)])
        pairs = np.concatenate(visible)
        # coldest first, ties by tier, then (layer, expert)
        order = np.lexsort((pairs[:, 1], pairs[:, 0], tier, counts[pairs[:, 0], pairs[:, 1]]))
        by_cold = tier[order]
        k = np.minimum(np.arange(len(want)), len(by_cold))
        to[want[:, 0], want[:, 1]] = np.append(by_cold, by_cold[0])[k]
    if pending is not None:
        to = np.where(missed & (np.asarray(pending) >= 0), pending, to)
    return to


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's process: it exists
        return True
    return True


class ExpertTiers(ExpertStore):
    """The expert store a stage's model computes through."""

    def __init__(self, backend, gguf, cache: BlobArena, helpers: list[HelperClient],
                 local_helper: BlobArena | None = None):
        self.backend, self.gguf, self.cache = backend, gguf, cache
        self.local_helper = local_helper   # the helper tier on this stage's own card
        self.host = HostTier(backend, gguf)
        self.helpers = helpers
        self.remote_of = {pair: h for h in helpers for pair in h.pairs}
        # per layer: each expert's helper (its index in `helpers`), -1 where none holds it
        self._helper_of: dict[int, np.ndarray] = {}
        self.prompt = False          # set by the stage: prompt chunks never ask helpers
        self.local_helper_pairs = 0  # pairs this card's helper tier will hold (set by the stage)
        self.pinned = None           # MappedHostBlobs of the pairs the cache lacks (GPU, opt-in)
        self._streamer = None
        self.counters: Counter = Counter()
        # `_prompt_on_device`'s pairs per (layer, expert), on the device until the prompt ends,
        # and the tier of each expert of the layers counted there
        self._pair_counts = None
        self._counted_tiers: dict[int, np.ndarray] = {}
        # the routing counts (strata_dist/experts/adapt.py), set by the stage when it adapts or profiles
        self.routing = None

    @property
    def asks_helpers(self) -> bool:
        """Whether a live helper tier of another card holds pairs for this stage that are not read
        in place: the general path asks it, a decode graph cannot read it."""
        return any(h.alive and h.tier is None and h.pairs for h in self.helpers)

    @property
    def may_read_helpers(self) -> bool:
        """Whether every other card's helper tier of this stage was asked for its buffer (CUDA IPC
        on this host): once they answer, no helper is asked (see asks_helpers)."""
        # a link kept for re-ranking only (no pair of this stage yet) is not asked
        return all(h.export is not None for h in self.helpers if h.pairs)

    def set_helper_pairs(self, h: HelperClient, pairs) -> bool:
        """A helper tier re-ranked (HelperClient.rerank): `pairs` of this stage's layers are
        where it holds them now. Whether they changed."""
        pairs = {(int(l), int(e)) for l, e in pairs}
        if pairs == h.pairs:
            return False
        h.pairs = pairs
        self.remote_of = {pair: x for x in self.helpers for pair in x.pairs}
        self._helper_of.clear()
        return True

    def tiers_changed(self) -> bool:
        """Whether a helper's tier was opened, or a helper read in place stopped, since the last
        call (the stage then rebuilds its decode graph's address table)."""
        changed = False
        for h in self.helpers:
            if h.tier is not None and h.alive and not h.tier_alive():
                self._helper_lost(h, RuntimeError(f"its process {h.tier_pid} has exited"))
                h.tier_changed = True
            changed |= h.tier_changed
            h.tier_changed = False
        return changed

    def outputs_device(self, layer: int, x, idx):
        """The outputs of device-routed ids idx [n, k], computed on the device: every expert of
        `layer` in this stage's cache (all hits), or a prompt chunk's experts through
        `_prompt_on_device`. None: the ids go to the host (`outputs`)."""
        y = self.cache.outputs_device(layer, x, idx)
        if y is not None:
            self.counters["hits"] += int(idx.size)
            if self.routing is not None:   # a read of the routes, only when they are counted
                self.routing.add(layer, self.backend.to_host(idx))
            return y
        return self._prompt_on_device(layer, x, idx) if self.prompt else None

    # ---- a prompt chunk's experts on the device, whatever the cache holds --------------------
    def begin_prompt(self) -> None:
        """Before a prompt's first chunk (the stage's loan is lent): the streamer forgets which
        kernels read its region (a loan's region was cache slots the decode graph read), and the
        device's pair counts exist before the chunk's workspace is active (no pool allocation
        inside it)."""
        if self._streamer is not None:
            self._streamer.reset()
        if self.backend.on_gpu and self._pair_counts is None:
            self._pair_counts = self.backend.xp.zeros(self.cache.slot_of.shape, dtype=np.int32)

    def _prompt_on_device(self, layer: int, x, idx):
        """A prompt chunk's experts of a layer the cache holds in part, with no host round trip:
        the pairs grouped once on the device; the experts in device memory (the cache, this
        card's helper tier, another card's tier opened here through CUDA IPC) in one launch pair; every other expert of the layer streamed from
        its pinned host copy through the workspace's `stream` buffer and computed a batch at a
        time (backends/host_mapped.py BlobStreamer: the copy stream fills the buffer with the
        next layer's first batch while this layer computes). A chunk reads nearly all of a
        layer's experts, so every miss streams, without the routing going to the host first.
        None (the host path): a chunk too short for that, a miss not pinned, no workspace, or
        a layer the row kernels do not read."""
        be, n_expert = self.backend, self.cache.slot_of.shape[1]
        n, k = (int(v) for v in idx.shape)
        spec = be.row_layout(self.gguf, layer)
        if be.workspace is None or spec is None or n * k < 2 * n_expert:
            return None
        table, tier = self._device_blobs(layer)
        misses = [int(e) for e in np.flatnonzero(table == 0)]
        size = self.gguf.blob_bytes(layer)
        stride = -(-size // spec.align) * spec.align
        if misses and (self.pinned is None or be.workspace.capacity("stream") < stride
                       or not all(self.pinned.holds(layer, e) for e in misses)):
            return None
        if (table % np.uint64(spec.align)).any():
            return None
        pairs = be.routed_pairs(self.gguf, layer, x, idx, n_expert)
        if pairs is None:
            return None
        if len(misses) < n_expert:
            be.compute_routed(pairs, table)
        if misses:
            streamer = self._streamer_of_pinned()

            def compute(batch, blob_of):
                only = np.zeros(n_expert, dtype=np.uint64)
                for e, blob in blob_of.items():
                    only[e] = int(blob.data.ptr)
                be.compute_routed(pairs, only)
            region = be.buffer("stream", (be.workspace.capacity("stream"),), np.uint8)
            self.counters["streamed"] += streamer.run(layer, misses, region, size, compute,
                                                      stride)
        # the pairs each tier computed, counted on the device and read after the prompt
        if self._pair_counts is None:
            self.begin_prompt()
        counts = self._pair_counts[layer]
        be.xp.add(counts, pairs.counts, out=counts)
        self._counted_tiers[layer] = tier
        self.counters["prompt_layers_on_device"] += 1
        return pairs.y

    def _streamer_of_pinned(self):
        """The streamer of the pinned copies as they are now (the stage pins anew when this
        card's helper tier does not open)."""
        if self._streamer is None or self._streamer.blobs is not self.pinned:
            from ..backends.host_mapped import BlobStreamer
            self._streamer = BlobStreamer(self.pinned)
        return self._streamer

    def _device_blobs(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Per expert of `layer`: the device address of its blob (host uint64, 0 for the host) and
        its tier (1 hit, 3 this card's helper tier, 2 another card's tier opened here through CUDA
        IPC whose process still runs, 0 host): the device part of the stage's address table
        (addresses.device_table, which the decode graph's table is built from too). A chunk
        reads such a tier in place, as the decode graph does, rather than streaming those blobs
        from host memory."""
        table, tier = device_table(self.cache, self.local_helper, self.helpers, layer, layer + 1)
        return table[0], tier[0]

    def settle_prompt_counts(self) -> None:
        """The pairs `_prompt_on_device` computed, by tier, into the counters: one read of the
        device's counts after a prompt (a read per layer would stop the launches running ahead)."""
        if not self._counted_tiers:
            return
        counts = self.backend.to_host(self._pair_counts)
        self._pair_counts.fill(0)
        for layer, tier in self._counted_tiers.items():
            c = counts[layer]
            if self.routing is not None:
                self.routing.add_counts(layer, c)
            self.counters["hits"] += int(c[tier == 1].sum())
            self.counters["remote"] += int(c[(tier == 2) | (tier == 3)].sum())
            self.counters["host"] += int(c[tier == 0].sum())
        self._counted_tiers.clear()

    def outputs(self, layer: int, x, idx: np.ndarray):
        be = self.backend
        n, k = idx.shape
        y = be.buffer("y", (n, k, x.shape[1]), np.float32)
        y.fill(0)
        # one decision per expert, then looked up for every (row, rank): a prompt chunk routes
        # thousands of rows to most of a layer's experts
        tier_of, helper_of = self._tiers_of(layer)
        tier = tier_of[idx]               # 0 host, 1 hit, 2 remote, 3 own card's helper tier
        if self.routing is not None:
            self.routing.add(layer, idx)
        asked: dict[HelperClient, np.ndarray] = {}
        if (tier == 2).any():
            by_helper = helper_of[idx]
            for i in np.unique(by_helper[tier == 2]):
                asked[self.helpers[int(i)]] = (tier == 2) & (by_helper == i)
        pending = []
        for h, mask in asked.items():
            try:
                pending.append((h, mask, h.request(layer, x, np.where(mask, idx, -1),
                                                   np.zeros((n, k), np.float32))))
            except ProtocolTimeout as e:
                self._helper_lost(h, e)
                tier[mask] = 0
        # local work overlaps with the helpers'
        self._run(self.cache, layer, x, idx, tier == 1, y)
        if self.local_helper is not None:
            self._run(self.local_helper, layer, x, idx, tier == 3, y)
        for h, mask, seq in pending:
            try:
                out = h.reply(seq, time.monotonic() + REMOTE_TIMEOUT_MS / 1000)
                rows, ranks = np.nonzero(mask)
                sel_rows, sel_ranks = be.asarray(rows), be.asarray(ranks)
                y[sel_rows, sel_ranks] = be.asarray(out)[sel_rows, sel_ranks]
            except (ProtocolTimeout, ProtocolError) as e:
                self._helper_lost(h, e)
                tier[mask] = 0
        if self.prompt and (self.cache.lent or be.workspace is not None):
            self._run_streamed(layer, x, idx, tier == 0, y)
        else:
            self._run(self.host, layer, x, idx, tier == 0, y)
        self.counters["hits"] += int((tier == 1).sum())
        self.counters["remote"] += int((tier >= 2).sum())   # served by a helper tier
        self.counters["host"] += int((tier == 0).sum())
        return y

    def _tiers_of(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Per expert of `layer`: its tier (0 host, 1 hit, 2 a live helper tier elsewhere, 3 this
        card's helper tier, computed in place) and, for tier 2, its helper's index. A prompt chunk
        never asks a helper: no 2 here (`_device_blobs` adds the tiers it reads in place)."""
        n_expert = self.cache.slot_of.shape[1]
        tier_of = np.zeros(n_expert, dtype=np.int8)
        tier_of[_held(self.cache, layer, n_expert)] = 1
        if self.local_helper is not None:
            tier_of[(tier_of == 0) & _held(self.local_helper, layer, n_expert)] = 3
        if self.prompt:                   # prompt chunks never ask other cards' helpers
            return tier_of, np.full(n_expert, -1, dtype=np.int64)
        helper_of = self._helper_of.get(layer)
        if helper_of is None:
            helper_of = np.full(n_expert, -1, dtype=np.int64)
            index = {id(h): i for i, h in enumerate(self.helpers)}
            for (l, e), h in self.remote_of.items():   # a pair two helpers list: remote_of's
                if l == layer:
                    helper_of[e] = index[id(h)]
            self._helper_of[layer] = helper_of
        # the index -1 (no helper) reads the False appended last
        alive = np.array([h.alive for h in self.helpers] + [False], dtype=bool)
        tier_of[(tier_of == 0) & alive[helper_of]] = 2
        return tier_of, helper_of

    def _run(self, store: ExpertStore, layer: int, x, idx, mask, y) -> None:
        if isinstance(store, BlobArena):       # resident blobs: every expert in one call
            store.compute_into(layer, x, idx, mask, y)
            return
        be = self.backend
        for expert in np.unique(idx[mask]):
            rows, ranks = np.nonzero(mask & (idx == expert))
            sel = be.asarray(rows)
            y[sel, be.asarray(ranks)] = store.compute(layer, int(expert), x[sel])

    def _run_streamed(self, layer: int, x, idx, mask, y) -> None:
        """A prompt chunk's misses, streamed a batch at a time into the prompt workspace's
        `stream` buffer on a GPU (the loaned tail of the cache on a CPU rank) and computed there
        with the same kernel as a hit (no allocation per expert)."""
        be, gguf = self.backend, self.gguf
        size = gguf.blob_bytes(layer)
        experts = [int(e) for e in np.unique(idx[mask])]
        if not experts:
            return
        if be.workspace is not None:
            per_batch = min(len(experts), be.workspace.capacity("stream") // size)
            region = be.buffer("stream", (per_batch * size,), np.uint8)
        else:
            region = self.cache.loan_region()
            per_batch = int(region.nbytes) // size
        if per_batch == 0:   # a loan smaller than one of this layer's blobs: plain host path
            self._run(self.host, layer, x, idx, mask, y)
            return
        n, k, d = y.shape
        if self.pinned is not None and all(self.pinned.holds(layer, e) for e in experts):
            # pinned copies: DMA on a copy stream, double-buffered against the kernels
            streamer = self._streamer_of_pinned()

            def compute(batch, blob_of):
                jobs = stored_rows_jobs(idx, mask & np.isin(idx, batch), blob_of.__getitem__)
                be.experts_swiglu(gguf, layer, x, jobs, y.reshape(n * k, d))
            self.counters["streamed"] += streamer.run(layer, experts, region, size, compute)
            return
        for start in range(0, len(experts), per_batch):
            batch = experts[start:start + per_batch]
            slot = {e: region[i * size:(i + 1) * size] for i, e in enumerate(batch)}
            for e, blob in slot.items():      # stream the batch in, then compute it
                be.stage_blob(gguf.expert_blob(layer, e), out=blob)
            in_batch = mask & np.isin(idx, batch)
            be.experts_swiglu(gguf, layer, x, stored_rows_jobs(idx, in_batch, slot.__getitem__),
                              y.reshape(n * k, d))
            self.counters["streamed"] += len(batch)

    def _helper_lost(self, h: HelperClient, err: Exception) -> None:
        if h.alive:
            log.error("helper rank %d stopped answering (%s); its experts are computed from host "
                      "memory from now on", h.rank, err)
        h.alive = False
        self.counters["remote_lost"] += 1


def _held(arena: BlobArena, layer: int, n_expert: int) -> np.ndarray:
    """Which experts of `layer` an arena holds (none for a layer beyond its table)."""
    if layer >= arena.slot_of.shape[0]:
        return np.zeros(n_expert, dtype=bool)
    return arena.slot_of[layer] >= 0
