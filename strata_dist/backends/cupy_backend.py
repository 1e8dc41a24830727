"""CuPy backend: dense weights in f16 on the GPU, activations in float32, experts kept on the device
in the file's stored block format and dequantized by a kernel when computed.

This is the general path (prompt chunks, partial caches, helper tiers): one dequantize + two GEMMs
per (layer, expert). Decode steps whose experts are all resident run through
`backends/cuda_decode.py` instead: the same stored blocks read by fused kernels in one CUDA graph."""
from __future__ import annotations

import logging
import re

import numpy as np

try:
    import cupy as cp
    import cupyx
except ImportError as exc:  # pragma: no cover - exercised only without CuPy
    raise ImportError("the cuda backend needs CuPy: pip install 'strata-dist[cuda13]' "
                      "(or [cuda12])") from exc

from gguf import GGMLQuantizationType

from ..compute_options import compute_options, fall_back
from ..ops import attention, gdn, linear, moe, norm, norm_rope_kv, route
from ..ops.linear import QuantMatrix, dequantize_rows
from .base import Backend, BackendError
from .kv_cache import default_kv_type
from .layout import GPU_NATIVE_QUANTS, dense_type_note, expert_type_notes

log = logging.getLogger("strata.cupy")
_LAYER = re.compile(r"blk\.(\d+)\.")


class CupyBackend(Backend):
    name = "cupy"
    on_gpu = True
    xp = cp
    dense_dtype = np.float16
    kv_type = default_kv_type("cuda")

    def __init__(self, index: int = 0):
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise BackendError(f"no CUDA device is usable: {e}") from None
        if not 0 <= index < n:
            raise BackendError(f"cuda:{index} does not exist ({n} visible device(s))")
        self.index = index
        self.device = f"cuda:{index}"
        self._dev = cp.cuda.Device(index)
        self._dev.use()
        self._pinned = None
        self._pinned_read = None    # recorded after the last copy out of the pinned buffer
        # a prompt's experts through the row kernels (ops/moe.py), its attention by
        # kernels/prefill_attention.cu, and each chunk routed (every placement alike, so the
        # tokens do not depend on it) and, where a layer is all resident, grouped on the device:
        # no host round trip a layer. The row kernels measured 4x the general path at 512 tokens,
        # device routing 2x host routing at 4,096 (docs/BENCHMARKS.md); each switch set to 0
        # gives the general path back.
        # the switches of the record in force (strata_dist/compute_options.py): a rank's Assign's
        options = compute_options()
        self._flash = options.flash_prefill
        self._flash_prompt = attention.FlashPrompt(index)
        self._rows = None
        if options.grouped_experts:
            self._rows = moe.RowsKernels(index, mma=options.rows_mma, backend=self)
        self._device_routing = self._rows is not None and options.device_routing
        # qwen3next's linear layers in prompts: "rows" gdn_prompt.cu's kernels (the rows spread
        # where they are independent), "steps" the decode graph's token loop, "off" the blocked
        # array form
        self._gdn = options.gdn_kernels
        # a chunk's RMSNorms, q/k norm + RoPE + K/V write and rank-ordered combine as one launch
        # each (kernels/prompt_ops.cu, decode.cu) instead of several array operations each
        self._fused_ops = options.fused_prompt_ops
        # quantized dense matrices (llama.cpp's Q4_K_M files keep attention in Q4_K/Q6_K) decoded
        # to f16 and multiplied on tensor cores, as F16 files' are, not in float32 (SGEMM)
        self._f16_gemm = options.f16_prompt_gemm
        self._kernel_shape = options.kernel_shape
        self._staging = None        # PinnedStaging of upload(), made at the first one
        self._noted: set = set()    # (file, layer) checked and (file, line) warned at load

    def dense(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float16))

    def dense_tensor(self, gguf, info):
        self._note_slow_types(gguf, info)
        if info.ggml_type in GPU_NATIVE_QUANTS:
            return QuantMatrix(cp.asarray(np.asarray(gguf.raw(info.name))), info.shape,
                               int(info.ggml_type))
        if info.ggml_type == GGMLQuantizationType.F16:
            return cp.asarray(np.asarray(gguf.raw(info.name)).view(np.float16).reshape(info.shape))
        return self.dense(gguf.dequantize(info.name))

    def _note_slow_types(self, gguf, info) -> None:
        """A warning, once per tensor at load, for each tensor of a type no kernel reads as stored
        (backends/layout.py): this dense matrix, and with a layer's first dense matrix that
        layer's expert tensors (loaded by the expert store, which every layer loaded here has)."""
        seen = self._noted
        notes = [dense_type_note(info)]
        m = _LAYER.match(info.name)
        if m and (gguf.path, int(m.group(1))) not in seen:
            seen.add((gguf.path, int(m.group(1))))
            notes += expert_type_notes(gguf, int(m.group(1)))
        for note in filter(None, notes):
            if (gguf.path, note) not in seen:
                seen.add((gguf.path, note))
                log.warning("%s", note)

    def rows(self, table, ids, out=None):
        n, d = len(ids), int(table.shape[1])
        if isinstance(table, QuantMatrix):
            idx = self.upload("tok_ids", np.asarray(ids, dtype=np.int32))
            return table.rows(idx, out=self.buffer(out, (n, d), cp.float32))
        idx = self.upload("tok_ids", np.asarray(ids, dtype=np.int64))
        if table.dtype != cp.float16:
            return table[idx].astype(cp.float32)
        gathered = self.buffer("in16", (n, d), cp.float16)
        cp.take(table, idx, axis=0, out=gathered)
        res = self.buffer(out, (n, d), cp.float32)
        cp.copyto(res, gathered)
        return res

    def f32(self, host):
        return cp.asarray(np.asarray(host, dtype=np.float32))

    def asarray(self, host):
        return cp.asarray(host)

    def upload(self, name: str, host: np.ndarray):
        """A small host table (kernel arguments, routing tables) on the device: into the
        workspace's buffer `name` while a prompt chunk runs with one, by a copy queued on the
        current stream (so the kernels still reading the last layer's copy run first) out of a
        pinned staging ring: a copy from pageable memory may make the host wait for the device,
        which at every layer would stop the launches from running ahead."""
        host = np.ascontiguousarray(host)
        if self.workspace is None:
            return cp.asarray(host)
        dev = self.workspace.take(name, host.shape, host.dtype)
        if self._staging is None:
            self._staging = PinnedStaging()
        self._staging.copy(dev, host)
        return dev

    def to_host(self, x):
        return cp.asnumpy(x)

    def copy_from_pinned(self, out, host_address: int) -> None:
        """out's bytes from pinned host memory at host_address: a DMA queued on the current
        stream (the decode graph's stream waits on it before its next step)."""
        cp.cuda.runtime.memcpyAsync(int(out.data.ptr), host_address, int(out.nbytes),
                                    cp.cuda.runtime.memcpyHostToDevice,
                                    cp.cuda.get_current_stream().ptr)

    def linear(self, x, w, out=None):
        return linear.prompt_linear(self, self._f16_gemm, x, w, out)

    def stage_blob(self, host_blob, out=None):
        """A host blob on the device (into `out` when given: a loaned cache slot), through a
        pinned staging buffer, so the copy is a DMA at full PCIe speed."""
        n = int(host_blob.nbytes)
        # the copy out of pinned memory is asynchronous: the last one must have run before the
        # buffer is rewritten (or freed by a resize), or a blob would be copied half overwritten
        if self._pinned_read is not None:
            self._pinned_read.synchronize()
        if self._pinned is None or self._pinned.size < n:
            self._pinned = cupyx.empty_pinned(max(n, 1 << 20), dtype=np.uint8)
        self._pinned[:n] = np.asarray(host_blob, dtype=np.uint8)
        if out is None:
            out = cp.empty(n, dtype=cp.uint8)
        out.set(self._pinned[:n])
        if self._pinned_read is None:
            self._pinned_read = cp.cuda.Event(disable_timing=True)
        self._pinned_read.record()
        return out

    def expert_weights(self, gguf, layer, blob):
        """(gate, up, down) float32 on the device from a device blob in its stored format."""
        out = []
        pos = 0
        for t in gguf.expert_parts(layer):
            per = t.n_bytes // t.shape[0]
            raw, pos = blob[pos:pos + per], pos + per
            rows, cols = t.shape[1], t.shape[2]
            if t.ggml_type in GPU_NATIVE_QUANTS:
                out.append(dequantize_rows(raw, int(t.ggml_type), per // rows, rows, cols))
            elif t.ggml_type == GGMLQuantizationType.F32:
                out.append(raw.view(cp.float32).reshape(rows, cols))
            elif t.ggml_type == GGMLQuantizationType.F16:
                out.append(raw.view(cp.float16).astype(cp.float32).reshape(rows, cols))
            else:  # no kernel yet for this type: decode on the host (correct, slower)
                from ..gguf_file.reader import dequantize_bytes
                out.append(cp.asarray(dequantize_bytes(cp.asnumpy(raw), t.ggml_type, (rows, cols),
                                                       gguf.path, t.name)))
        return tuple(out)

    def expert_swiglu(self, gguf, layer, blob, x):
        out = None if self._rows is None else self._rows.swiglu(gguf, layer, blob, x)
        return out if out is not None else super().expert_swiglu(gguf, layer, blob, x)

    def experts_swiglu(self, gguf, layer, x, jobs, out) -> None:
        if self._rows is None or not self._rows.run(gguf, layer, x, jobs, out):
            super().experts_swiglu(gguf, layer, x, jobs, out)

    def route(self, x, router, k: int, normalize: bool):
        if self._device_routing:
            routed = route.prompt_route(self, self._rows, x, router, k, normalize)
            if routed is not None:
                return routed
        return super().route(x, router, k, normalize)

    # ---- the routed experts of a chunk (ops/moe.py RowsKernels; None: the general path) -------
    def experts_routed(self, gguf, layer: int, x, ids, addresses: np.ndarray):
        """y [n, k, n_embd] of the device-routed ids [n, k] when every expert's blob address is in
        `addresses` (host uint64 [n_expert]) and the row kernels read this layer, else None."""
        return None if self._rows is None else self._rows.routed(gguf, layer, x, ids, addresses)

    def row_layout(self, gguf, layer: int):
        """How the row kernels read `layer`'s expert blobs (kernels/abi.py ExpertLayout), or None
        when they do not."""
        return None if self._rows is None else self._rows.layout(gguf, layer)

    def routed_pairs(self, gguf, layer: int, x, ids, n_expert: int):
        """The device-routed pairs of ids [n, k] grouped by expert (ops/moe.py RoutedPairs), or
        None when the row kernels do not read this layer."""
        return None if self._rows is None else self._rows.routed_pairs(gguf, layer, x, ids,
                                                                        n_expert)

    def compute_routed(self, pairs, addresses: np.ndarray) -> None:
        """Compute into pairs.y the pairs whose expert has a blob address in `addresses`."""
        self._rows.compute_routed(pairs, addresses)

    def prompt_attention(self, q, k, v, pos0, out=None):
        """Flash attention on tensor cores (ops/attention.py FlashPrompt; STRATA_FLASH_PREFILL=0:
        off): f16 K/V of 128-wide (qwen3moe) or 256-wide (qwen3next) heads."""
        if not self._flash:
            return None
        return self._flash_prompt.run(self, q, k, v, pos0, out)

    # ---- a chunk's row-wise steps, one launch each ------------------------------------------
    def rms_norm(self, x, w, eps, out=None):
        res = norm.prompt_rms_norm(self, x, w, eps, out) if self._fused_ops else None
        return res if res is not None else super().rms_norm(x, w, eps)

    def combine_ranked(self, y, wts):
        out = moe.combine_ranked(self, y, wts) if self._fused_ops else None
        return out if out is not None else super().combine_ranked(y, wts)

    def qk_norm_rope_kv(self, q, k, v, q_norm, k_norm, eps, session, layer, pos0):
        """The decode step's kernels over the chunk's rows where the cache is f16
        (ops/norm_rope_kv.py); else the array path."""
        if self._fused_ops:
            out = norm_rope_kv.prompt_qk_norm_rope_kv(self, self._kernel_shape, q, k, v, q_norm,
                                                      k_norm, eps, session, layer, pos0)
            if out is not None:
                return out
        return super().qk_norm_rope_kv(q, k, v, q_norm, k_norm, eps, session, layer, pos0)

    def linear_attention(self, g, w, qkv, z, ba, conv, state):
        """gdn_mixer through kernels, the state updated in place (ops/gdn.py prompt_gdn); None
        (the blocked array path) for a geometry the kernels do not take or with
        STRATA_GDN_KERNELS=0."""
        if self._gdn == "off":
            return None
        return gdn.prompt_gdn(self, self._gdn, self._kernel_shape, g, w, qkv, z, ba, conv, state)

    def decode_graph(self, model, max_cells):
        """A DecodeGraph (qwen3moe; next_decode.NextDecodeGraph: qwen3next) runner for the model's
        stage, or None (with the reason logged once) when its layers cannot take the graph path."""
        from .cuda_decode import DecodeGraph
        from .graph_tables import Unsupported
        graph_class = DecodeGraph
        if model.g.arch == "qwen3next":
            from .next_decode import NextDecodeGraph as graph_class
        # where each expert's blob is read the graph takes from the model's address table
        # (model.expert_addresses): the backend never reads the expert tiers themselves
        try:
            return graph_class(model, max_cells)
        except Unsupported as e:
            fall_back(f"the decode graph of layers [{model.lb}, {model.le}) (decode_graph): its "
                      f"steps take the general path", str(e))
            return None

    def keep_rows(self, a, n: int, host: bool = False):
        """The first n rows of a device array: a device copy, or (`host`: the plan put the
        conversation cache in host memory) a copy in pinned host memory."""
        if not host:
            return a[:n].copy()
        buf = cupyx.empty_pinned((n,) + tuple(a.shape[1:]), dtype=a.dtype)
        a[:n].get(out=buf)
        return buf

    def put_rows(self, dst, src) -> None:
        if isinstance(src, np.ndarray):    # a pinned host copy
            dst[:len(src)].set(src)
        else:
            dst[:len(src)] = src

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()

    def memory_info(self):
        free, total = cp.cuda.runtime.memGetInfo()
        return int(free), int(total)


class PinnedStaging:
    """Small host tables on their way to the device through one pinned buffer used as a ring:
    each is written after the last and copied on the current stream. Before the ring starts over
    the host waits for the last copy queued (all of a lap's copies then have run): once every
    `nbytes` of tables, about a chunk's host-built grouping tables at 64 MiB."""

    ALIGN = 256

    def __init__(self, nbytes: int = 64 << 20):
        self.buf = cupyx.empty_pinned(nbytes, dtype=np.uint8)
        self.at = 0
        self.last = None                 # the event after the last copy queued

    def copy(self, dev, host: np.ndarray) -> None:
        n = int(host.nbytes)
        if n > self.buf.size:                   # not a table: a plain (synchronous) copy
            dev.set(host)
            return
        if self.at + n > self.buf.size:
            if self.last is not None:
                self.last.synchronize()
            self.at = 0
        lo = self.at
        self.buf[lo:lo + n] = host.reshape(-1).view(np.uint8)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(int(dev.data.ptr), int(self.buf.ctypes.data) + lo, n,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        if self.last is None:
            self.last = cp.cuda.Event(disable_timing=True)
        self.last.record(stream)
        self.at = -(-(lo + n) // self.ALIGN) * self.ALIGN

