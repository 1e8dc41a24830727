"""The decode step of a qwen3moe stage on a GPU, as one CUDA graph.

The kernels of `kernels/decode.cu` read the weights in their stored blocks (no float copies),
route on the device (the router's last block picks the top-k) and run all k experts of a layer in
two launches: one token through a stage is 7 launches per layer, and nothing in between touches
the host. Those launches are the model module's `layer_step` (models/qwen3moe.py, where the layer
sequence is written once) run with backends/graph_ops.py's GraphLayerOps (`layer_ops`) while a
step is captured: this runner writes no architecture's sequence. The runner owns static buffers
(hidden rows, q/k/v, attention partials, router output, expert activations, logits); the
sessions own their KV outside it. A small descriptor (position,
rows and each row's session and position: backends/decode_rows.py) and the sessions' pointer
tables are copied in before the graph runs, so one captured graph per row count replays for every
position and every mix of sessions: a batched step of several users' rows (`step_rows`) is one
replay, as is a one-session step of n rows. Only the greedy token id
comes back to the host; the full logits stay on the device until a sampler asks for them
(`StepLogits`). A single-stage pipeline's next greedy step is launched before the host reads this
one's token (backends/step_slots.py; measured faster, docs/BENCHMARKS.md; STRATA_DECODE_AHEAD=0
turns it off).

Used when every expert of the stage's layers is resident in its cache arena (the single-process
runner, or a stage whose cache holds its whole range), or when the experts the cache lacks are
pinned in host memory and read in place by the same kernels (backends/host_mapped.py; the
default for a stage without helper-tier pairs, host_pinning.py); and when nothing needs routing
decisions on the host (profile recording). Otherwise the general path of cupy_backend.py runs.
backends/next_decode.py builds the same runner with qwen3next's layers."""
from __future__ import annotations

import logging
import weakref

import numpy as np
import cupy as cp

from ..compute_options import compute_options
from ..kernels import function
from ..kernels.abi import (DESC_TOKENS, DESC_WORDS, EXPERT_SPEC, MAX_ROWS, TYPE_NAMES,
                           KernelShape, matvec_kernel)
from ..kernels.pdl import ProgrammaticLauncher
from ..ops import attention, moe
from ..ops.linear import (NULL, MatLaunch, _mat, graph_matvec, mat_launches,  # noqa: F401
                          norm_vector, weight_of)     # (NULL: the GPU tests' null pointer)
from ..ops.route import route_spec
from ..ops.sample import ARGMAX_BLOCKS, graph_argmax
from ..ops.tables import spec_array as _spec_array
from ..plan.pricing import DECODE_ROWS
from .batched_decode import BatchedSteps
from .decode_rows import SessionSlots, StepRows, pack_descriptor, session_pointers
from .graph_ops import GraphLayerOps
from .kv_cache import DeviceRing
from .graph_tables import Unsupported, count_tiers, repoint_experts
from .kernel_timing import time_step
from .step_slots import Ahead, HostSlot, StepLogits

log = logging.getLogger("strata.decode")

KERNELS = "decode.cu"
assert MAX_ROWS == DECODE_ROWS


class DecodeGraph(BatchedSteps):
    """Decode steps of the layers [model.lb, model.le) of a qwen3moe model whose experts are all
    read in place where the model's expert-address table says (ops/expert_addresses.py),
    for sessions of `max_cells` cells."""

    layer_ops = GraphLayerOps      # the launches the model's layer_step is captured through

    def __init__(self, model, max_cells: int, use_graph: bool | None = None,
                 shape: KernelShape | None = None, host_misses: bool | None = None,
                 attn_heads: int | None = None):
        """`shape`: the expert kernels' compile-time shape (default: ComputeOptions.kernel_shape,
        else decode.cu's own). `host_misses`: experts missing from the cache are pinned in host
        memory and read there (default: what the model's store says, misses_read_in_place); else
        a missing expert makes the stage take the general path (model.expert_addresses decides
        both: experts/addresses.py). `attn_heads`: query heads of one
        attention block (default: ComputeOptions.attn_heads, else kernels/abi.py
        default_attn_heads)."""
        g = model.g
        options = compute_options()   # the record in force (strata_dist/compute_options.py)
        self.shape = shape or KernelShape.parse(options.kernel_shape)
        self.model, self.g = model, g
        self.lb, self.le, self.first, self.last = model.lb, model.le, model.first, model.last
        self.use_graph = options.decode_graph if use_graph is None else use_graph
        self.ring = DeviceRing(model, max_cells)   # --kv-resident's `_ring` builds, if any
        # q8_0 K/V: the _q8 kernels, and the session's scales after its values in the pointer table
        self.kv_suffix = "_q8" if model.backend.kv_type == "q8_0" else ""
        self._check_geometry(g)        # what the ops and kernels support of the geometry
        # the layer sequence is the model module's own (models/<arch>.py layer_step), run by the
        # model's `run_layers` with `layer_ops`' launches
        self.layer_step = getattr(model.arch, "layer_step", None)
        if self.layer_step is None:
            raise Unsupported(f"models/{g.arch}.py writes no layer_step for a decode graph")
        # the attention's splits and query heads a block (ComputeOptions.attn_heads overrides the
        # heads; 0: by the geometry)
        if not attn_heads and options.attn_heads:
            attn_heads = options.attn_heads
        a = attention.decode_launch(g, max_cells, model.backend.kv_type, attn_heads)
        self.attn_kernel, self.attn_heads, self.attn_chunk = a.kernel + self.ring.suffix, a.heads, \
            a.chunk
        self.n_split, self.max_rows = a.n_split, a.max_rows
        with cp.cuda.Device(model.backend.index):
            # every expert of the stage's layers in the cache, a helper tier read in place or
            # (host_misses) pinned host memory, else Unsupported; taken after the geometry checks
            # (pinning the misses is not free)
            self.addresses = model.expert_addresses(host_misses)
            self._allocate(g)
            self._build_specs(g)
            self._fns = {}
            for name in self._kernel_names():     # compiled (or loaded from disk) once, here
                self._fns[name] = function(KERNELS, name, model.backend.index,
                                           self.shape.defines())
            if self.last:    # a batched step's greedy tokens (batched_decode._greedy_rows)
                self._fns["greedy_rows"] = function("sample_rows.cu", "greedy_rows",
                                                    model.backend.index)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(disable_timing=True)
        self.graphs: dict[tuple[int, bool], object] = {}   # (rows, every row's logits)
        self._timing = None            # kernel_timing.KernelTimer while kernel_times runs
        # programmatic dependent launches (kernels/pdl.py; docs/BENCHMARKS.md: 3-4% off a step,
        # the same logits), a Hopper feature; STRATA_PDL=0 launches plainly
        hopper = int(cp.cuda.Device(model.backend.index).compute_capability) >= 90
        self._pdl = ProgrammaticLauncher() if hopper and options.pdl else None
        self._pdl_armed = False
        self._refused: set[str] = set()   # why batched steps took the general path (said once)
        # the next greedy step of a single-stage pipeline launched before the host reads this
        # one's token (step_slots.py; STRATA_DECODE_AHEAD=0: off)
        self.ahead_enabled = options.decode_ahead and self.first and self.last
        self._ahead: Ahead | None = None
        self.launches = 0              # steps launched (StepLogits checks it is still current)
        self.ahead_taken = 0           # steps launched ahead and then asked for
        self.steps = 0
        self.last_tiers: dict[str, int] = {}   # the last step's expert computations per tier
        self.last_routes = None        # its routes [stage layers, n, k] where they came back
        self.keep_routes = False       # routes back on every step (a stage counting for a profile)

    # ---- what the kernels support ---------------------------------------------------------------
    def _check_geometry(self, g) -> None:
        if g.arch != "qwen3moe":
            raise Unsupported(f"no decode graph for {g.arch} yet")
        if self.model.backend.kv_type not in ("f16", "q8_0"):
            raise Unsupported(f"K/V kept as {self.model.backend.kv_type} (the attention kernels "
                              f"read f16 or q8_0)")
        if g.head_dim != 128:
            raise Unsupported(f"head_dim {g.head_dim} (the attention kernel is built for 128)")
        if g.n_head % g.n_head_kv or g.n_head // g.n_head_kv > 16:
            raise Unsupported(f"{g.n_head} query heads over {g.n_head_kv} kv heads")
        if g.n_expert > 512 or g.n_expert_used > 16:
            raise Unsupported(f"{g.n_expert} experts, top-{g.n_expert_used} (the router kernel "
                              f"takes <= 512, top <= 16)")
        if g.n_embd % 32 or g.n_ff_exp % 32:
            raise Unsupported("widths that are not whole groups of 32")

    def usable(self, n: int) -> bool:
        """Whether a step of n rows can run here now (the cache may be lent to a prompt, or a
        profile may be recording routes)."""
        return (n <= self.max_rows and not self.addresses.cache_lent()
                and getattr(self.model, "on_route", None) is None)

    # ---- static buffers and kernel argument tables ----------------------------------------------
    def _allocate(self, g) -> None:
        # every row buffer holds MAX_ROWS rows: a matvec built for 4 or 8 rows reads (and drops)
        # the rows past n
        f32, R = cp.float32, MAX_ROWS
        q_w, kv_w = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
        self.h = cp.zeros((R, g.n_embd), f32)          # the residual stream, in place
        self.xn = cp.zeros((R, g.n_embd), f32)         # normed input of the experts
        self.q = cp.zeros((R, q_w), f32)
        self.k = cp.zeros((R, kv_w), f32)
        self.v = cp.zeros((R, kv_w), f32)
        self.attn = cp.zeros((R, q_w), f32)
        # the attention partials grow with the context: only the rows a step may take (the
        # budget that chose max_rows); no kernel reads rows past n of them
        self.part = cp.zeros(self.max_rows * g.n_head * self.n_split * g.head_dim, f32)
        self.ml = cp.zeros(self.max_rows * g.n_head * self.n_split * 2, f32)
        self.router_logits = cp.zeros((R, g.n_expert), f32)
        # each layer's chosen experts (its own rows: the tiers of a step are counted from them)
        self.ids = cp.zeros((self.le - self.lb, R, g.n_expert_used), cp.int32)
        self.wts = cp.zeros((R, g.n_expert_used), f32)
        self.blobs = cp.zeros((R, g.n_expert_used), cp.uint64)   # each chosen expert's address
        # blocks finished of the launches whose last block finishes the job (the router's top-k,
        # the argmax); 0 between launches
        self.done = cp.zeros(1, cp.uint32)
        self.post_v = cp.zeros(ARGMAX_BLOCKS, f32)     # each argmax block's best value and index
        self.post_i = cp.zeros(ARGMAX_BLOCKS, cp.int32)
        self.act = cp.zeros((R, g.n_expert_used, g.n_ff_exp), f32)
        # every row's logits for a batched step; a one-session step's last row's in row 0
        self.logits_rows = cp.zeros((R if self.last else 1, g.n_vocab if self.last else 1), f32)
        self.logits = self.logits_rows[0]
        self.token = cp.zeros(1, cp.int32)
        self.desc = cp.zeros(DESC_WORDS, cp.int32)
        # the pinned buffers of a step in flight; two: a step ahead may be queued behind another
        self.slots = [HostSlot.allocate(DESC_WORDS, self.ids.shape) for _ in range(2)]
        nl = self.le - self.lb
        # a pointer table a slot, one slot a session of the step (decode_rows.SessionSlots)
        self.session_slots = SessionSlots(2 * nl + 2 + self.ring.words(nl, self.kv_suffix),
                                          self._session_pointers)
        self.sess_table = cp.zeros(self.session_slots.host.shape, cp.uint64)
        # each expert's blob address, [n_layer, n_expert] (self.addresses: its cache slot, else
        # a helper tier's slot, else its pinned host copy, else 0: not this stage's). A lent
        # cache leaves slots where they are (steps wait while it lends; a helper tier never
        # lends); only the adaptive cache's swaps move pairs, and `repoint` then takes the table
        # the stage builds again (rank/stage.py Stage._adapt).
        self.in_cache = self.addresses.in_cache()      # [stage layers, n_expert], for counting
        self.in_helper = self.addresses.in_helper()
        self.blob_of = cp.asarray(self.addresses.blob_of)
        # blocks finished of each (row, head group)'s attention splits (attn_decode_128_g*)
        self.attn_done = cp.zeros(R * (g.n_head // self.attn_heads), cp.uint32)

    def _build_specs(self, g) -> None:
        self.blob_align: dict[int, int] = {}   # each layer's blob alignment (moe.expert_spec)
        self.layer_specs = [self._layer_spec(layer) for layer in range(self.lb, self.le)]
        m = self.model
        if self.last:
            t = m._tensors
            output_w = weight_of(t["token_embd.weight" if g.tied_embeddings else "output.weight"],
                                 "output.weight")
            self.output_projection = mat_launches([(output_w, _mat(output_w, self.logits))])
            self.output_norm = norm_vector(t["output_norm.weight"], "output_norm.weight")
        if self.first:
            self.embedding = weight_of(m._tensors["token_embd.weight"], "token_embd.weight")

    def _layer_spec(self, layer: int) -> dict:
        """One layer's launches and argument tables. Every layer spec holds `mats` (all of its
        matvec launches, for the kernel names) and what graph_ops.GraphLayerOps reads."""
        g, w = self.g, self.model.layers[layer]
        name = f"blk.{layer}"
        q, k, v = (weight_of(x, f"{name}.attn_{p}") for x, p in ((w.q, "q"), (w.k, "k"),
                                                                  (w.v, "v")))
        o = weight_of(w.o, f"{name}.attn_output")
        for vec, part in ((w.attn_norm, "attn_norm"), (w.ffn_norm, "ffn_norm"),
                          (w.q_norm, "attn_q_norm"), (w.k_norm, "attn_k_norm")):
            norm_vector(vec, f"{name}.{part}")
        spec = dict(
            qkv=mat_launches([(q, _mat(q, self.q)), (k, _mat(k, self.k)), (v, _mat(v, self.v))]),
            o=mat_launches([(o, _mat(o, self.h, add=self.h))]),
            w=w)
        spec.update(self._experts_spec(layer, w.router, w.ffn_norm, normalize=True))
        spec["mats"] = spec["qkv"] + spec["o"] + spec["router"]
        return spec

    def _experts_spec(self, layer: int, router_w, ffn_norm, normalize: bool) -> dict:
        """The routed experts' part of a layer spec: the router's matvec (its fused RMSNorm by
        `ffn_norm`, its last block picking the top-k) and the expert kernels' tables."""
        router = weight_of(router_w, f"blk.{layer}.ffn_gate_inp")
        experts = moe.expert_spec(self, layer)
        expert_table = _spec_array(EXPERT_SPEC, [experts])
        return dict(
            ffn_norm=ffn_norm,
            router=mat_launches([(router, _mat(router, self.router_logits))]),
            experts=expert_table,
            route=route_spec(self, layer, expert_table, normalize),
            expert_types=(TYPE_NAMES[experts["gate_type"]], TYPE_NAMES[experts["down_type"]]),
            expert_codes=(experts["gate_type"], experts["down_type"]))

    def _kernel_names(self) -> set[str]:
        names = self._layer_kernel_names()
        names |= {"embed_tokens"} if self.first else set()
        names |= {"argmax_row"} if self.last else set()
        launches = [x for L in self.layer_specs for x in L["mats"]]
        launches += self.output_projection if self.last else []
        for n in range(1, self.max_rows + 1):
            names |= {matvec_kernel(x.type, n) for x in launches}
        for L in self.layer_specs:
            gate_up, down = L["expert_types"]
            names |= {f"moe_gate_up_{gate_up}", f"moe_down_{down}"}
        return names

    def _layer_kernel_names(self) -> set[str]:
        """The layers' kernels other than the matvecs and the experts'."""
        return {"qk_norm_rope_kv" + self.kv_suffix + self.ring.suffix, self.attn_kernel}

    # ---- the step -------------------------------------------------------------------------------
    def _launch(self, name: str):
        """The kernel `name`; while `kernel_times` runs, wrapped to time each launch; with
        programmatic launches (the default; STRATA_PDL=0: off) every launch of a step but its
        first is a programmatic dependent launch."""
        fn = self._fns[name]
        if self._timing is None:
            if self._pdl is None or not self._pdl_armed:
                self._pdl_armed = True          # the step's first kernel follows a copy
                return fn
            return lambda grid, block, args, shared_mem=0: self._pdl.launch(
                fn, grid, block, args, cp.cuda.get_current_stream().ptr, shared_mem)
        return self._timing.wrap(name, fn)

    def kernel_times(self, session, pos: int, ids=None, hidden=None,
                     repeat: int = 1) -> dict[str, float]:
        """One eager step with every launch timed: microseconds per kernel name, summed over the
        layers (what benchmarks/profile_decode.py prints; backends/kernel_timing.py). With
        `repeat` > 1 each launch runs that many times in a row (the mean is reported): its
        time alone, warm, without its neighbours. The step is a real one: it advances nothing but
        writes the KV of position `pos` (with repeat > 1 the residual rows are added to several
        times: a profile's last step)."""
        return time_step(self, lambda: self.step(session, pos, ids=ids, hidden=hidden), repeat)

    def replay_kernel_times(self, rows: StepRows, ids=None, hidden=None,
                            repeat: int = 1) -> dict[str, float]:
        """`kernel_times` for one replay of a batched step (`step_rows`' launch of `rows`, every
        row's logits): its rows' ids on the first stage, else their hidden rows. Like a
        replay it writes each row's KV at its position and advances nothing."""
        if not self.usable(rows.n):
            raise ValueError(f"a replay of {rows.n} rows cannot run on this graph now (at most "
                             f"{self.max_rows} rows, the cache not lent, no routes recorded)")
        given = None if ids is None else len(ids)
        if self.first and given != rows.n:
            raise ValueError(f"a replay of {rows.n} rows on the first stage takes {rows.n} "
                             f"token ids, got {given}")
        ids = self._checked_ids(ids)

        def queue_step():
            self._launch_step(rows, ids, None if self.first else hidden, 0, every_row=True)
            self._wait(0, rows.n)
        return time_step(self, queue_step, repeat)

    def _enqueue(self, n: int, every_row: bool = False) -> None:
        """Every kernel of one step of n rows, on self.stream (captured or run eagerly);
        `every_row`: the last stage's logits of every row (a batched step), not the last row's."""
        self._pdl_armed = False
        eps = np.float32(self.g.rms_eps)
        self._embed(n)
        self._enqueue_layers(n, eps)
        self._output(n, eps, every_row)

    def _enqueue_layers(self, n: int, eps) -> None:
        """The layers' kernels of one step: the model's own forward over its layers
        (`run_layers`: models/<arch>.py `layer_step`, the only place the layer sequence is
        written) with the graph's launches as its ops."""
        self.model.run_layers(self.layer_ops(self, n, eps), self.h)

    def _embed(self, n: int) -> None:
        """The first stage's rows: the embeddings of the descriptor's token ids, into h."""
        if self.first:
            e = self.embedding
            self._launch("embed_tokens")(
                (1, n), (128,), (np.uint64(e.ptr), np.int32(e.type), np.int64(e.row_bytes),
                                 np.int32(e.ncols), np.int32(e.nrows), self.desc, self.h))

    def _output(self, n: int, eps, every_row: bool) -> None:
        """The last stage's logits of the last row and its greedy token, or (`every_row`) the
        logits of rows 0..n-1 into logits_rows (a row's sums do not depend on the rows sharing
        the matvec: tests/test_gpu_decode.py), so a batched row's are the ones it has alone."""
        if self.last and every_row:
            self._matvec(self.output_projection, self.h, self.g.n_embd, n, self.output_norm, eps)
        elif self.last:
            g = self.g
            self._matvec(self.output_projection, self.h[n - 1:n], g.n_embd, 1, self.output_norm,
                         eps)
            graph_argmax(self)

    def _matvec(self, launches: list[MatLaunch], x, x_stride: int, n: int, norm_w=None,
                eps=np.float32(0), normed=None, route=None) -> None:
        """y = W . (rms_norm(x) * norm_w | x) [+ add] for each matrix of `launches`; `route`: the
        router's RouteSpec (one matrix) (ops/linear.py graph_matvec)."""
        graph_matvec(self, launches, x, x_stride, n, norm_w, eps, normed, route)

    def _graph(self, n: int, every_row: bool = False):
        """The captured step of n rows (one a row count and output kind: the descriptor, not the
        graph, says which sessions and positions the rows are)."""
        graph = self.graphs.get((n, every_row))
        if graph is None:
            with self.stream:
                self.stream.begin_capture()
                try:
                    self._enqueue(n, every_row)
                finally:
                    graph = self.stream.end_capture()
            self.graphs[(n, every_row)] = graph
        return graph

    def _session_pointers(self, session) -> list[int]:
        """A session's pointer table (decode_rows.session_pointers)."""
        return session_pointers(session, self.lb, self.le, bool(self.kv_suffix), self.ring)

    def step(self, session, pos: int, ids=None, hidden=None, ahead: bool = False):
        """Rows at positions pos.. of `session`: token ids on the first stage, else hidden rows
        [n, n_embd]. Returns StepLogits on the last stage, else the hidden rows (a new device
        array). The caller advances session.n_past. `ahead`: the caller will ask for the next
        greedy step of this session (it takes this step's greedy token only); unless
        STRATA_DECODE_AHEAD=0, that step is launched now, before this one's token is read."""
        n = len(ids) if self.first else int(hidden.shape[0])
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"a graph step takes 1..{self.max_rows} rows, got {n}")
        if pos + n > session.max_cells:
            raise ValueError(f"context full: {pos} + {n} tokens > {session.max_cells} cells")
        ids = self._checked_ids(ids)
        queued, out = self._ahead, None
        if queued is not None and queued.is_for(session, pos, ids):
            self._ahead, slot = None, queued.slot        # launched by the call before
            self.ahead_taken += 1
        else:
            self.settle()
            slot = 0
            out = self._launch_step(StepRows.window(session, pos, n), ids, hidden, slot)
        if ahead and self.ahead_enabled and n == 1 and pos + 2 <= session.max_cells:
            self._launch_step(StepRows.window(session, pos + 1, 1), None, None, 1 - slot,
                              token_on_device=True)
            self._ahead = Ahead(weakref.ref(session), pos + 1, 1 - slot)
        return self._finish(slot, pos, n, out)

    def _checked_ids(self, ids):
        if not self.first:
            return ids
        ids = np.asarray(ids, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.g.n_vocab:
            raise ValueError(f"token id out of range [0, {self.g.n_vocab})")
        return ids

    def settle(self) -> None:
        """Wait for a step launched ahead and drop it (before anything else uses the session,
        the cache or the runner's buffers)."""
        if self._ahead is not None:
            self._ahead = None
            self.stream.synchronize()

    def _launch_step(self, rows: StepRows, ids, hidden, slot: int,
                     token_on_device: bool = False, every_row: bool = False):
        """Queue one step of `rows` on self.stream; `token_on_device`: its one token id is the
        greedy token the step queued before it leaves on the device; `every_row`: every row's
        logits, no greedy token (a batched step). Returns the hidden rows (not last)."""
        hs, n = self.slots[slot], rows.n
        for run in rows.runs():       # a rewind first refills the ring
            self.ring.step(run.session, self.lb, self.le, run.first, run.count)
        # whatever the default stream still has in flight (a prompt chunk writing a session's
        # KV) comes first
        self._ready.record(cp.cuda.Stream.null)
        self.stream.wait_event(self._ready)
        table_slots, changed = self.session_slots.assign(rows)
        if changed:       # stream-ordered: a step still in flight reads the tables it was given
            self.sess_table.set(self.session_slots.host, stream=self.stream)
        pack_descriptor(hs.desc, rows, table_slots, self.session_slots.words,
                        ids if self.first and not token_on_device else None)
        cp.cuda.runtime.memcpyAsync(self.desc.data.ptr, hs.desc.ctypes.data, hs.desc.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        if token_on_device:
            cp.cuda.runtime.memcpyAsync(self.desc.data.ptr + 4 * DESC_TOKENS, self.token.data.ptr,
                                        4, cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
        with self.stream:
            if not self.first:
                cp.copyto(self.h[:n], cp.asarray(hidden, dtype=cp.float32))
            if self.use_graph:
                self._graph(n, every_row).launch(self.stream)
            else:
                self._enqueue(n, every_row)
            out = None if self.last else self.h[:n].copy()
        if self.last and not every_row:
            cp.cuda.runtime.memcpyAsync(hs.token.ctypes.data, self.token.data.ptr, 4,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        if self.counts_routes:   # the routes, to count the step's hits, helper and host reads
            cp.cuda.runtime.memcpyAsync(hs.ids.ctypes.data, self.ids.data.ptr, self.ids.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        hs.done.record(self.stream)
        self.launches += 1
        hs.launch_no = self.launches
        return out

    def _wait(self, slot: int, n: int):
        """Wait for the step of `slot` (its pinned descriptor may be rewritten only after it has
        been read) and count its experts."""
        hs = self.slots[slot]
        hs.done.synchronize()
        self.steps += 1
        self.last_tiers = count_tiers(self, n, hs.ids)
        self.last_routes = hs.ids[:, :n].copy() if self.counts_routes else None
        return hs

    def _finish(self, slot: int, pos: int, n: int, out):
        """Wait for the one-session step of `slot` and hand its result back."""
        hs = self._wait(slot, n)
        if not self.last:
            return out
        token = int(hs.token[0])
        if self._ahead is not None:
            self._ahead.token = token                    # what the step ahead reads
        if not 0 <= token < self.g.n_vocab:     # argmax_row found no finite logit
            self.settle()
            raise FloatingPointError(f"decode step at position {pos}: no finite logit (the "
                                     f"model's activations overflowed or are NaN)")
        launched = hs.launch_no
        return StepLogits(token, self.logits, lambda: self.launches == launched)

    def repoint(self, addresses) -> None:
        """The stage's expert-address table built again after the adaptive cache's swaps (blobs
        moved): graph_tables.repoint_experts writes the entries that changed."""
        self.settle()
        repoint_experts(self, addresses)

    @property
    def counts_routes(self) -> bool:
        """Whether some expert is outside the cache, or the stage counts every route (the step's
        routes come back to count)."""
        return self.addresses.off_card or self.keep_routes
