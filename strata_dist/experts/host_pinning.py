"""Whether a GPU stage keeps the experts its cache lacks pinned in host memory
(backends/host_mapped.py: its decode graph reads them in place, its prompts stream them by DMA).
Policy only, no CUDA: the stage asks before pinning, the decode graph before building."""
from __future__ import annotations

from ..compute_options import compute_options

PIN_SHARE = 0.75     # by default pin at most this share of the host's available memory


def _forced() -> bool | None:
    """ComputeOptions.host_mapped (STRATA_HOST_MAPPED): True (1), False (0), None (auto)."""
    return compute_options().host_mapped


def reads_host_in_place(experts, once_opened: bool = False) -> bool:
    """Whether a GPU stage pins the experts its cache lacks in host memory, its decode graph
    reading them in place and its prompts streaming them by DMA (backends/host_mapped.py).
    STRATA_HOST_MAPPED=1 always, =0 never; unset (or "auto") wherever no helper tier on another
    card holds pairs for the stage: measured 17-24x the general path's decode with experts off the
    card (docs/BENCHMARKS.md). The card's own helper tier does not count: the decode graph reads its
    pairs in place, as it does the cache's. A stage another card's helper serves keeps the general
    path, whose decode asks that helper (the graph would read its pairs from host memory instead),
    until the helper's tier is opened through CUDA IPC and read in place too (tiers.py).
    `once_opened`: as it will be once every helper asked for its tier buffer has answered (what a
    stage pins for when it starts, before any answer)."""
    forced = _forced()
    if forced is not None:
        return forced
    if once_opened and getattr(experts, "may_read_helpers", False):
        return True
    return not getattr(experts, "asks_helpers", False)


def pin_room_error(nbytes: int, meminfo: str = "/proc/meminfo") -> str:
    """Why pinning nbytes would not be left to the default (empty when it would): more than
    PIN_SHARE of the host's available memory, which page-locked copies would take from the page
    cache the model file is read through. STRATA_HOST_MAPPED=1 pins regardless."""
    if _forced():
        return ""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return ""          # not Linux's /proc: the allocation itself says whether it fits
    if nbytes <= PIN_SHARE * available:
        return ""
    return (f"{nbytes / 2**30:.1f} GiB of experts would take more than {PIN_SHARE:.0%} of the "
            f"host's {available / 2**30:.1f} GiB available (STRATA_HOST_MAPPED=1 pins them anyway)")
