"""The RoPE scaling keys a synthetic file may carry (`--rope-scaling`): what a long-context release
writes, so tests and benchmarks have such files (models/common.py `read_rope_scaling` reads them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

FORMS = "none, linear:FACTOR or yarn:FACTOR:ORIGINAL_CONTEXT"


@dataclass(frozen=True)
class RopeScalingSpec:
    kind: str                 # "linear" or "yarn"
    factor: float
    original_context: int = 0  # yarn: the pretrained context the factor stretches

    def context_length(self, geometry_context: int) -> int:
        """The file's context_length: under yarn the stretched one (factor x original), as the
        long-context releases declare; otherwise the geometry's."""
        if self.kind == "yarn":
            return int(round(self.factor * self.original_context))
        return geometry_context

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType(self.kind))
        w.add_rope_scaling_factor(self.factor)
        if self.kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(self.original_context)


def parse_rope_scaling(text: str | None) -> RopeScalingSpec | None:
    """"yarn:4:32768" / "linear:2" / "none" (or empty) -> the spec, None for none; anything else is
    a ValueError naming the forms."""
    if not text or text == "none":
        return None
    parts = text.split(":")
    try:
        if parts[0] == "linear" and len(parts) == 2:
            spec = RopeScalingSpec("linear", float(parts[1]))
        elif parts[0] == "yarn" and len(parts) == 3:
            spec = RopeScalingSpec("yarn", float(parts[1]), int(parts[2]))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"{text!r}: expected {FORMS}") from None
    if not (math.isfinite(spec.factor) and spec.factor >= 1) or (
            spec.kind == "yarn" and spec.original_context < 1):
        raise ValueError(f"{text!r}: the factor must be a finite number >= 1 and "
                         f"the original context a positive integer")
    return spec
