"""--adapt-every and --adapt-swaps: the adaptive expert cache (strata_dist/experts/adapt.py); and
--expert-profile-out: the routing seen while serving, saved as a profile (profile_io.LiveProfile)."""
from __future__ import annotations

import os

DEFAULT_SWAPS = 16
DEFAULT_PROFILE_EVERY_S = 60.0


def add_adapt_flags(group) -> None:
    group.add_argument("--adapt-every", type=int, default=0, metavar="T",
                       help="every T tokens a stage swaps its coldest cached experts for the "
                            "hottest ones it missed, counted on the live workload; 0: the cache "
                            "stays as the plan filled it (default 0)")
    group.add_argument("--adapt-swaps", type=int, default=DEFAULT_SWAPS, metavar="S",
                       help=f"the most experts a stage swaps each --adapt-every round; 0: none "
                            f"(default {DEFAULT_SWAPS})")
    group.add_argument("--expert-profile-out", default=None, metavar="FILE",
                       help="write the routing the stages count while serving to FILE, as the "
                            "routing profile --expert-profile reads: every --expert-profile-every "
                            "seconds and at a clean shutdown (replaced atomically)")
    group.add_argument("--expert-profile-every", type=float, default=DEFAULT_PROFILE_EVERY_S,
                       metavar="S", help="seconds between --expert-profile-out writes (default "
                                         f"{DEFAULT_PROFILE_EVERY_S:g})")


def check_adapt_flags(args) -> None:
    """Both are counts >= 0 (a ValueError names the flag and its value: `error: …`, exit 2)."""
    for flag, value in (("--adapt-every", args.adapt_every), ("--adapt-swaps", args.adapt_swaps)):
        if value < 0:
            raise ValueError(f"{flag} {value}: expected a number >= 0 (0: off)")
    every = args.expert_profile_every
    if not every > 0 or every == float("inf"):
        raise ValueError(f"--expert-profile-every {every:g}: expected seconds > 0")
    out = args.expert_profile_out
    if out is not None:
        folder = os.path.dirname(os.path.abspath(out))
        if not out or os.path.isdir(out):
            raise ValueError(f"--expert-profile-out {out}: expected a file name, not a folder")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--expert-profile-out {out}: its folder {folder} is not a writable "
                             "folder")
