"""Where a prompt's time goes on the GPU path: one stage in one process (SingleProcessRunner), a
prompt read once to warm up (kernel builds, pools), then read again plainly (the wall time), then
once more with every backend operation wrapped: the host time spent inside the call (Python and
launches) and the device time between CUDA events recorded around it on the current stream (no
synchronization until the end, so overlap stays as it is). Operations nest (`moe` holds
`experts_swiglu`, `route` holds `to_host`), so their rows overlap; the wall time is the reference.
With --cprofile the host's top functions by cumulative time follow.

    python benchmarks/profile_prefill.py --model q30_8l.gguf --tokens 512 [--host-routing] \
        [--general-path]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict

OPS = ("rms_norm", "rope", "linear", "attend", "prompt_attention", "linear_attention", "route", "moe",
       "experts_swiglu", "expert_swiglu", "rows", "asarray", "to_host", "synchronize")


def wrap_ops(backend, cp):
    """Replace the backend's operations by timed ones; returns (host_s, events) per op name."""
    host = defaultdict(float)
    events = defaultdict(list)
    calls = defaultdict(int)
    for name in OPS:
        fn = getattr(backend, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _name=name, **kw):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                host[_name] += time.perf_counter() - t0
                end.record()
                events[_name].append((start, end))
                calls[_name] += 1
        setattr(backend, name, timed)
    return host, events, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--host-routing", action="store_true",
                    help="STRATA_DEVICE_ROUTING=0 (route and group on the host)")
    ap.add_argument("--general-path", action="store_true",
                    help="STRATA_GROUPED_EXPERTS=0 STRATA_FLASH_PREFILL=0 (per-expert GEMMs)")
    ap.add_argument("--once", action="store_true",
                    help="read the prompt once and stop (for a profiler that wraps the script)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the host's N top functions by cumulative time")
    args = ap.parse_args()
    if args.host_routing:
        os.environ["STRATA_DEVICE_ROUTING"] = "0"
    if args.general_path:
        os.environ["STRATA_GROUPED_EXPERTS"] = os.environ["STRATA_FLASH_PREFILL"] = "0"
    import cupy as cp
    from strata_dist.tools.single_process import SingleProcessRunner
    eng = SingleProcessRunner(args.model, args.device, max_context=args.tokens + 64,
                              prompt_chunk=args.tokens)
    vocab = eng.model.g.n_vocab
    ids = [(7919 * i) % (vocab - 10) + 10 for i in range(args.tokens)]

    def read() -> float:
        eng.session.reset(0)
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        eng.prefill(ids)
        cp.cuda.get_current_stream().synchronize()
        return time.perf_counter() - t0

    first = read()                                    # warm-up: builds, pools
    if args.once:
        print(f"{args.tokens} tokens read once: {first * 1e3:.1f} ms (builds included)")
        return 0
    wall = read()
    layers = eng.model.le - eng.model.lb
    print(f"{args.tokens} tokens, {layers} layers, general_path={args.general_path} "
          f"host_routing={args.host_routing}: "
          f"{wall * 1e3:.1f} ms ({args.tokens / wall:.0f} tok/s, {wall * 1e3 / layers:.2f} ms a "
          f"layer)")
    host, events, calls = wrap_ops(eng.backend, cp)
    prof = cProfile.Profile() if args.cprofile else None
    if prof:
        prof.enable()
    wrapped = read()
    if prof:
        prof.disable()
    print(f"wrapped: {wrapped * 1e3:.1f} ms")
    print(f"  {'operation':18s} {'calls':>6s} {'host ms':>9s} {'device ms':>10s}")
    rows = []
    for name in events:
        dev = sum(cp.cuda.get_elapsed_time(s, e) for s, e in events[name])
        rows.append((dev, name))
    for dev, name in sorted(rows, reverse=True):
        print(f"  {name:18s} {calls[name]:6d} {host[name] * 1e3:9.1f} {dev:10.1f}")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
