"""--adapt-every and --adapt-swaps: the adaptive expert cache (strata_dist/adapt.py)."""
from __future__ import annotations

DEFAULT_SWAPS = 16


def add_adapt_flags(group) -> None:
    group.add_argument("--adapt-every", type=int, default=0, metavar="T",
                       help="every T tokens a stage swaps its coldest cached experts for the "
                            "hottest ones it missed, counted on the live workload; 0: the cache "
                            "stays as the plan filled it (default 0)")
    group.add_argument("--adapt-swaps", type=int, default=DEFAULT_SWAPS, metavar="S",
                       help=f"the most experts a stage swaps each --adapt-every round; 0: none "
                            f"(default {DEFAULT_SWAPS})")


def check_adapt_flags(args) -> None:
    """Both are counts >= 0 (a ValueError names the flag and its value: `error: …`, exit 2)."""
    for flag, value in (("--adapt-every", args.adapt_every), ("--adapt-swaps", args.adapt_swaps)):
        if value < 0:
            raise ValueError(f"{flag} {value}: expected a number >= 0 (0: off)")
