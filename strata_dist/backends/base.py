"""The backend interface shared by the numpy and CuPy implementations."""
from __future__ import annotations

import numpy as np

from ..plan.pricing import DECODE_ROWS
from . import array_ops
from .kv_cache import default_kv_type


class BackendError(RuntimeError):
    pass


class Backend:
    """Array module + the operations a forward pass needs.

    Activations (the residual stream, attention scores, router) are always float32; only the
    storage of dense weights (`dense_dtype`) differs between backends."""

    name = "base"
    device = "cpu"
    # the arrays live in one CUDA card's memory: what CUDA IPC buffers, decode graphs, prompt
    # workspaces and device-side counts need. Code outside backends/ asks this, never the name.
    on_gpu = False
    xp = np
    dense_dtype = np.float32
    kv_type = default_kv_type("cpu")   # how sessions store K/V (backends/kv_cache.py; a stage may
                                       # set --kv-type on its instance)
    kv_resident = 0                    # --kv-resident: cells of each session's K/V kept on the
                                       # device (0: every cell; backends/kv_cache.py RingKV)
    # a prompt chunk's buffers while it runs on a GPU (strata_dist/rank/prompt_workspace.py): the
    # operations write their results into its named buffers instead of new arrays
    workspace = None

    def buffer(self, name: str | None, shape, dtype=np.float32):
        """Where an operation writes a result: the workspace's buffer `name` while a prompt chunk
        runs with one, else a new array."""
        if self.workspace is None or name is None:
            return self.xp.empty(shape, dtype=dtype)
        return self.workspace.take(name, shape, dtype)

    # -- kept conversations (strata_dist/rank/conversation_cache.py) ---------------------------------
    def keep_rows(self, a, n: int, host: bool = False):
        """A copy of the first n rows of `a` (a host copy on this backend, `host` or not)."""
        return np.array(a[:n])

    def put_rows(self, dst, src) -> None:
        """Write `src` (a keep_rows copy, or its first rows) over the first rows of `dst`."""
        dst[:len(src)] = src

    # -- placement -------------------------------------------------------------------------------
    def dense(self, host: np.ndarray):
        """A dense weight matrix as the backend keeps it."""
        raise NotImplementedError

    def dense_tensor(self, gguf, info):
        """A dense weight matrix of the file as the backend keeps it (backends/layout.py)."""
        raise NotImplementedError

    def rows(self, table, ids, out: str | None = None):
        """float32 rows `ids` of an embedding table kept by dense_tensor (`out`: the buffer a
        backend with a workspace writes them into; the others ignore the names)."""
        raise NotImplementedError

    def f32(self, host: np.ndarray):
        """A small float32 tensor (norm weights, routers) on the device."""
        raise NotImplementedError

    def asarray(self, host: np.ndarray):
        raise NotImplementedError

    def to_host(self, x) -> np.ndarray:
        raise NotImplementedError

    def upload(self, name: str, host: np.ndarray):
        """A small host table on the backend (a GPU writes it into the workspace's buffer `name`
        while a prompt chunk runs with one)."""
        return self.asarray(host)

    # -- compute: the layer operations (backends/ops.py LayerOps) ---------------------------------
    def linear(self, x, w, out: str | None = None):
        """x [n, in] (float32) @ w[out, in].T -> [n, out] float32."""
        raise NotImplementedError

    def rms_norm(self, x, w, eps: float, out: str | None = None):
        return array_ops.rms_norm(x, w, eps, self.xp)

    def add(self, a, b, out: str | None = None):
        """a + b (the residual stream's adds)."""
        return self.xp.add(a, b, out=self.buffer(out, a.shape, np.float32))

    def rope(self, x, cos, sin):
        return array_ops.apply_rope(x, cos, sin, self.xp)

    def qk_norm_rope_kv(self, q, k, v, q_norm, k_norm, eps: float, session, layer: int,
                        pos0: int):
        """An attention layer's rows after their projections: q [n, H, D] and k [n, KVH, D]
        RMSNormed per head and rotated at positions pos0.. (the session's RoPE tables), k and v
        written into the session's cache of `layer` there. Returns q (the rows given may be
        overwritten: a backend may normalise them in place)."""
        n = q.shape[0]
        cos, sin = session.rope_cos[pos0:pos0 + n], session.rope_sin[pos0:pos0 + n]
        q = self.rope(self.rms_norm(q, q_norm, eps), cos, sin)
        k = self.rope(self.rms_norm(k, k_norm, eps), cos, sin)
        kc, vc = session.k(layer), session.v(layer)
        kc[pos0:pos0 + n] = k
        vc[pos0:pos0 + n] = v
        return q

    def attend(self, q, k, v, pos0: int, session, out: str | None = None):
        if q.shape[0] > DECODE_ROWS:          # a prompt chunk: the backend's own kernel, if any
            res = self.prompt_attention(q, k, v, pos0, out=out)
            if res is not None:
                return res
        return array_ops.causal_attention(q, k, v, pos0, self.xp, session)

    def route(self, x, router, k: int, normalize: bool):
        return array_ops.softmax_topk(self.to_host(x @ router.T), k, normalize=normalize)

    def combine_ranked(self, y, wts):
        """sum over r of wts[:, r] * y[:, r] (y [n, k, d], wts [n, k]) in rank order."""
        return array_ops.combine_ranked(y, wts, self.xp)

    def swiglu(self, x, gate, up, down):
        g = x @ gate.T
        return (g / (1.0 + self.xp.exp(-g)) * (x @ up.T)) @ down.T

    def sigmoid(self, x, out: str | None = None):
        """0.5 tanh(x / 2) + 0.5, each step rounded as that expression rounds it, into `out`
        (which may be x's own buffer)."""
        xp, half = self.xp, np.float32(0.5)
        t = self.buffer(out, x.shape, np.float32)
        xp.multiply(x, half, out=t)
        xp.tanh(t, out=t)
        xp.multiply(t, half, out=t)
        xp.add(t, half, out=t)
        return t

    def silu(self, x, out: str | None = None):
        """x * sigmoid(x), into `out` (not x's own buffer: x is read after its sigmoid)."""
        return self.xp.multiply(x, self.sigmoid(x, out=out), out=self.buffer(out, x.shape))

    def mul(self, a, b, out: str | None = None):
        """a * b (broadcast), into `out` (which may be one of theirs)."""
        shape = np.broadcast_shapes(a.shape, b.shape)
        return self.xp.multiply(a, b, out=self.buffer(out, shape, np.float32))

    def expert_swiglu(self, gguf, layer: int, blob, x):
        """The expert whose stored bytes are `blob` (on this backend) applied to the rows x: every
        store computes an expert through here (or experts_swiglu), so the bits never depend on
        the store."""
        gate, up, down = self.expert_weights(gguf, layer, blob)
        return self.swiglu(x, gate, up, down)

    def experts_swiglu(self, gguf, layer: int, x, jobs, out) -> None:
        """Several experts of one layer: for each job (blob, rows, dest), with host index arrays,
        out[dest] = expert_swiglu(blob, x[rows])."""
        for blob, rows, dest in jobs:
            if len(rows):
                out[self.asarray(np.asarray(dest))] = self.expert_swiglu(
                    gguf, layer, blob, x[self.asarray(np.asarray(rows))])

    def experts_routed(self, gguf, layer: int, x, ids, addresses):
        """y [n, k, d] for routing held on the device (ids [n, k], a device array) with every
        expert of `layer` at the blob addresses `addresses` (host uint64 [n_expert]), computed
        without a host round trip; None where this backend cannot (the caller then brings the
        routing to the host)."""
        return None

    def row_layout(self, gguf, layer: int):
        """How this backend's row kernels read `layer`'s expert blobs, or None (no row kernels:
        the device-grouped prompt path of tiers.py `_prompt_on_device` is not taken)."""
        return None

    def prompt_attention(self, q, k, v, pos0: int, out: str | None = None):
        """The causal attention of a prompt chunk by the backend's own kernel, or None (the
        models' tiled path runs): q [n, H, D] at positions pos0.., k and v [pos0 + n, KVH, D]."""
        return None

    def linear_attention(self, g, w: dict, qkv, z, ba, conv, state):
        """A qwen3next linear layer's mixer (models/qwen3next.py gdn_mixer: the conv over `conv`
        and the gated delta rule on `state`, both updated in place, then the gated RMSNorm) by
        the backend's own kernels, or None (the models' array path runs)."""
        return None

    def decode_graph(self, model, max_cells: int):
        """A runner of the model's decode steps as one device graph (`.step`), or None where the
        general path runs (every backend but CuPy, or a stage the kernels do not cover)."""
        return None

    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device, or None for host memory."""
        return None
