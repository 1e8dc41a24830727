"""The gated delta rule op (qwen3next's linear layers): the causal convolution over the
session's conv state with SiLU and the q/k L2 norms (gdn_conv_step), then the gated delta rule on
its recurrent state with the gated RMSNorm (gdn_delta_step), both in place (kernels/
gated_delta.cuh); over a prompt chunk by default gdn_prompt.cu's row kernels (the convolution and
norms of every row at once, the delta rule a warp a state column).

Its argument table (`gdn_spec`, kernels/abi.py GdnSpec), the decode graph's launches
(`launch_gdn`, the build chosen by `decode_launch`) and the prompt chunk's chooser
(`prompt_gdn`: the row kernels, the decode graph's token loop, or None for the blocked array
path) live here."""
from __future__ import annotations

import numpy as np

try:
    import cupy as cp
except ImportError:   # the decode graph's launchers need none: backends/graph_ops.py imports
    cp = None         # them where CuPy is not (tests/test_model_interface.py reads its ops)

from ..compute_options import fall_back
from ..kernels.abi import GDN_SPEC
from ..kernels.gdn_launch import GdnLaunch, gdn_launch
from .expert_addresses import Unsupported
from .guards import MAX_GRID_Y, decode_defines, first_failed
from .tables import spec_array


def decode_launch(g) -> GdnLaunch:
    """The decode graph's build of the two kernels for the geometry `g` (kernels/abi.py
    gdn_launch); Unsupported where none takes it."""
    try:
        return gdn_launch(g.n_v_heads, g.head_k_dim, g.head_v_dim, g.conv_dim)
    except ValueError as e:
        raise Unsupported(str(e)) from None


def launch_gdn(launch, spec, n: int, gdn) -> None:
    """gdn_conv_step then gdn_delta_step over n rows in order; `launch(name)` gives the kernel
    (the decode graph's launcher, or a plain function), `gdn` the layer's GdnLaunch."""
    i32 = np.int32
    launch("gdn_conv_step")((gdn.conv_blocks,), (gdn.conv_threads,), (spec, i32(n)))
    launch("gdn_delta_step")((gdn.delta_blocks,), (gdn.delta_threads,), (spec, i32(n)),
                             shared_mem=gdn.delta_shared)


def _f32_array(a, name: str, shape: tuple[int, ...]):
    """A small float32 tensor the GDN kernels read in place (conv kernel, gates, norm)."""
    if not (isinstance(a, cp.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous
            and tuple(a.shape) == shape):
        raise Unsupported(f"{name}: kept as {getattr(a, 'dtype', type(a).__name__)} "
                          f"{getattr(a, 'shape', '')}, not float32 {shape} as the GDN kernels read")
    return a


def gdn_spec(g, w: dict, name: str, qkv, z, ba, mixed, out, sess, layer_slot: int,
             upload=None):
    """A linear layer's GdnSpec table (kernels/gated_delta.cuh): its weights `w` (models/qwen3next
    parts), the rows qkv [n, conv_dim], z [n, value_dim], ba [n, 2 n_v] it reads, the scratch
    `mixed` [n, conv_dim] and `out` [n, value_dim] it writes, and the pointer table `sess` whose
    entries 2 layer_slot and 2 layer_slot + 1 are its conv and recurrent state. `upload(name,
    host bytes)`: how the table reaches the device (a prompt's workspace; default a new array)."""
    ptr = lambda a: int(a.data.ptr)  # noqa: E731
    return spec_array(GDN_SPEC, [dict(
        qkv=ptr(qkv), z=ptr(z), ba=ptr(ba),
        conv_w=ptr(_f32_array(w["ssm_conv1d"], f"{name}.ssm_conv1d",
                              (g.conv_dim, g.ssm_conv_kernel))),
        ssm_a=ptr(_f32_array(w["ssm_a"], f"{name}.ssm_a", (g.n_v_heads,))),
        ssm_dt=ptr(_f32_array(w["ssm_dt"], f"{name}.ssm_dt", (g.n_v_heads,))),
        norm_w=ptr(_f32_array(w["ssm_norm"], f"{name}.ssm_norm", (g.head_v_dim,))),
        mixed=ptr(mixed), out=ptr(out), sess=ptr(sess), layer_slot=layer_slot, n_k=g.n_k_heads,
        n_v=g.n_v_heads, head_k=g.head_k_dim, head_v=g.head_v_dim, conv_dim=g.conv_dim,
        K=g.ssm_conv_kernel, eps=g.rms_eps)], upload=upload, name="gdn_spec")


def prompt_gdn(backend, mode: str, kernel_shape: str, g, w, qkv, z, ba, conv, state):
    """gdn_mixer through kernels, the state updated in place: by default gdn_prompt.cu's
    (the convolution and norms of every row at once, the delta rule a warp a state column),
    with STRATA_GDN_KERNELS=steps the decode graph's gated_delta.cuh (the rows in order, the
    token loop's arithmetic) (`mode`: ComputeOptions.gdn_kernels, "rows" or "steps";
    `kernel_shape`: decode.cu's build, the decode graph's). None (the blocked array path, the
    reason logged once) for a geometry the kernels do not take."""
    from ..kernels import function
    from ..kernels.gdn_launch import gdn_rows_launch
    n = int(qkv.shape[0])
    path = f"the linear layers' kernels of a prompt chunk (gdn_kernels={mode})"
    try:
        if mode == "rows":
            launch = gdn_rows_launch(g.n_v_heads, g.head_k_dim, g.head_v_dim, g.conv_dim,
                                     g.ssm_conv_kernel)
        else:
            launch = gdn_launch(g.n_v_heads, g.head_k_dim, g.head_v_dim, g.conv_dim)
    except ValueError as e:
        fall_back(path, str(e))
        return None
    why = first_failed((
        (conv.flags.c_contiguous and state.flags.c_contiguous
         and conv.dtype == cp.float32 and state.dtype == cp.float32,
         "the session's convolution or recurrent state is not contiguous float32"),
        (n <= MAX_GRID_Y, f"{n} rows (a launch takes at most {MAX_GRID_Y})")))
    if why:
        fall_back(path, why)
        return None
    rows = [cp.ascontiguousarray(a, dtype=cp.float32) for a in (qkv, z, ba)]
    mixed = backend.buffer("mixed", (n, g.conv_dim), cp.float32)
    out = backend.buffer("gdn_out", (n, g.n_v_heads, g.head_v_dim), cp.float32)
    sess = backend.upload("gdn_ptrs", np.array([conv.data.ptr, state.data.ptr], dtype=np.uint64))
    try:
        spec = gdn_spec(g, w, "linear layer", *rows, mixed, out, sess, 0, upload=backend.upload)
    except Unsupported as e:
        fall_back(path, str(e))
        return None
    if n == 0:
        return out
    if mode == "rows":
        launch.launch(lambda name: function("gdn_prompt.cu", name, backend.index), spec, n)
    else:
        defines = decode_defines(kernel_shape)
        launch_gdn(lambda name: function("decode.cu", name, backend.index, defines),
                   spec, n, launch)
    return out
