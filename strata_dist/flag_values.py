"""Checks of flag values that argparse's types let through. `float("nan")` and `float("inf")`
parse as floats; as seconds, NaN makes every deadline comparison false (a wait that never ends, or
a crash far from the flag) and inf is a wait without bound. strata-launch, strata-rank and
`strata-dist calibrate --serve` refuse them at start, naming the flag and the value."""
from __future__ import annotations

import math


def check_seconds(flag: str, value: float | None) -> None:
    """ValueError "<flag> <value>: want a finite number of seconds > 0" unless `value` is one
    (None: the flag was not given)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value}: want a finite number of seconds > 0")


__all__ = ["check_seconds"]
