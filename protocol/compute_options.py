"""ComputeOptions: every switch that changes which kernels or paths a rank runs, in one record.

The launcher reads the record once from its environment (strata_dist/compute_options.py, the one
module that reads the STRATA_* compute variables), prints it with the plan, keeps it in the plan's
JSON and sends it in every Assign (since protocol v13); a rank runs the record it was sent and
never reads these variables itself, so two hosts of one launch cannot take different paths.
Single-process tools read it the same way at their start.

Pure data: the record, how each variable's text becomes a field's value, and the checks of a
value. The planner's own tunables (STRATA_SPLIT_*, STRATA_PROMPT_LOANS, STRATA_WEIGHT_SLICE, ...)
are PlanParams (strata_dist/plan/params.py), read once by the launcher in the same way and kept
in the plan beside this record."""

from __future__ import annotations

from dataclasses import fields
from typing import Literal, Mapping

from .env_table import EnvVar, checked_table, choice, record_from_env, switch, variable_of
from .structs import Struct, struct

GdnKernels = Literal["rows", "steps", "off"]
MAX_KERNEL_SHAPE_CHARS = 512   # a kernel shape names a handful of NAME=N macros


@struct
class ComputeOptions(Struct):
    """The compute switches of a launch; each default is what runs when its variable is unset.

    kernel_shape      the decode kernels' compile-time shape, "NAME=N,..." (kernels/abi.py
                      KernelShape; "" its defaults) (STRATA_KERNEL_SHAPE).
    decode_graph      GPU decode steps replay one captured CUDA graph; off: the kernels launch one
                      by one (STRATA_DECODE_GRAPH=0).
    pdl               the decode step's kernels as programmatic dependent launches on Hopper
                      cards (STRATA_PDL=0: plain launches).
    decode_ahead      a rank that is the whole pipeline launches each next greedy step before the
                      host reads the token (STRATA_DECODE_AHEAD=0: off).
    attn_heads        query heads of one decode attention block (STRATA_ATTN_HEADS=N; 0: chosen
                      by the geometry, kernels/abi.py default_attn_heads).
    host_mapped       a GPU stage pins the experts its cache lacks in host memory, its decode graph
                      reading them in place: None where no other card's helper tier holds pairs
                      for it (strata_dist/experts/host_pinning.py), True always (STRATA_HOST_MAPPED=1),
                      False never (=0).
    grouped_experts   a GPU prompt's experts through the row kernels, pairs grouped by expert
                      (STRATA_GROUPED_EXPERTS=0: one dequantize and two GEMMs per expert).
    rows_mma          the row kernels on tensor cores (STRATA_ROWS_MMA=0: float32 FMA).
    device_routing    with the row kernels, a chunk's top-k and grouping on the device
                      (STRATA_DEVICE_ROUTING=0: on the host).
    flash_prefill     a prompt chunk's attention as one flash-attention kernel
                      (STRATA_FLASH_PREFILL=0: array operations).
    fused_prompt_ops  a chunk's RMSNorms, q/k norm + RoPE + K/V write and combine as one launch
                      each (STRATA_FUSED_PROMPT_OPS=0: array operations).
    f16_prompt_gemm   a prompt's quantized dense matrices decoded to f16 for tensor-core GEMMs
                      (STRATA_F16_PROMPT_GEMM=0: float32 GEMMs).
    gdn_kernels       a qwen3next prompt's linear layers: "rows" (gdn_prompt.cu), "steps" (the
                      decode graph's token loop), "off" (the blocked array form)
                      (STRATA_GDN_KERNELS=rows|steps|0).
    cuda_ipc          hidden rows between GPU ranks of one host through CUDA IPC buffers
                      (STRATA_IPC=0: every hand-off as frames).
    """

    kernel_shape: str = ""
    decode_graph: bool = True
    pdl: bool = True
    decode_ahead: bool = True
    attn_heads: int = 0
    host_mapped: bool | None = None
    grouped_experts: bool = True
    rows_mma: bool = True
    device_routing: bool = True
    flash_prefill: bool = True
    fused_prompt_ops: bool = True
    f16_prompt_gemm: bool = True
    gdn_kernels: GdnKernels = "rows"
    cuda_ipc: bool = True

    def check(self, arrays: list) -> None:
        if self.attn_heads < 0:
            raise ValueError(f"attn_heads must be >= 0 (0: by the geometry), got {self.attn_heads}")
        if len(self.kernel_shape) > MAX_KERNEL_SHAPE_CHARS:
            raise ValueError(f"kernel_shape is {len(self.kernel_shape)} characters; at most "
                             f"{MAX_KERNEL_SHAPE_CHARS}")

    def changed(self) -> list[str]:
        """The fields whose value is not the default."""
        default = ComputeOptions()
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]

    def describe(self) -> str:
        """"name=value ..." of every field (on/off for switches, auto for host_mapped's None)."""
        def text(v) -> str:
            return "auto" if v is None else ("on" if v else "off") if isinstance(v, bool) \
                else (str(v) or "default")
        return " ".join(f"{f.name}={text(getattr(self, f.name))}" for f in fields(self))


def _heads(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError("expected a number of query heads")
    return int(text)


# variable -> the field it sets and the parser of its text; every field has exactly one variable
ENV_VARS: dict[str, EnvVar] = checked_table(ComputeOptions, {
    "STRATA_KERNEL_SHAPE": EnvVar("kernel_shape", str),
    "STRATA_DECODE_GRAPH": EnvVar("decode_graph", switch),
    "STRATA_PDL": EnvVar("pdl", switch),
    "STRATA_DECODE_AHEAD": EnvVar("decode_ahead", switch),
    "STRATA_ATTN_HEADS": EnvVar("attn_heads", _heads),
    "STRATA_HOST_MAPPED": EnvVar("host_mapped", choice({"auto": None, "1": True, "0": False})),
    "STRATA_GROUPED_EXPERTS": EnvVar("grouped_experts", switch),
    "STRATA_ROWS_MMA": EnvVar("rows_mma", switch),
    "STRATA_DEVICE_ROUTING": EnvVar("device_routing", switch),
    "STRATA_FLASH_PREFILL": EnvVar("flash_prefill", switch),
    "STRATA_FUSED_PROMPT_OPS": EnvVar("fused_prompt_ops", switch),
    "STRATA_F16_PROMPT_GEMM": EnvVar("f16_prompt_gemm", switch),
    "STRATA_GDN_KERNELS": EnvVar("gdn_kernels", choice({"rows": "rows", "steps": "steps",
                                                        "0": "off"})),
    "STRATA_IPC": EnvVar("cuda_ipc", switch),
})
VARIABLE_OF = variable_of(ENV_VARS)

# Paths deleted after they measured slower (issue 52: a measured loser is deleted, its figure kept
# in docs/BENCHMARKS.md). A launch still asking for one is refused with why, never run on another
# path unsaid: variable -> {text: why}, where the text None stands for any text (the variable
# itself is gone: STRATA_FUSED_QK_NORM had no value left but the one that always runs).
REMOVED: dict[str, dict[str | None, str]] = {
    "STRATA_FUSED_QK_NORM": {None: (
        "removed on 2026-12-05 with both of its fused forms, which measured no faster than the "
        "separate q/k norm kernel (=1, in the q/k/v matvec: 0.689 against 0.692 ms a step; "
        "=attention: 0.577 against 0.574 ms; docs/BENCHMARKS.md); the q/k norm always runs as "
        "its own kernel: unset the variable")},
    "STRATA_GDN_KERNELS": {"staged": (
        "removed on 2026-12-05: the staged delta rule measured slower than the rows kernel "
        "(82.2 against 81.0 ms a prompt, docs/BENCHMARKS.md); expected rows, steps, 0")},
}


def refuse_removed(environ: Mapping[str, str]) -> None:
    """ValueError "VAR='text': why" where `environ` sets a variable or value of REMOVED (surrounding
    blanks dropped; empty is unset, as record_from_env reads them)."""
    for var, gone in REMOVED.items():
        raw = environ.get(var, "").strip()
        why = gone.get(raw, gone.get(None)) if raw else None
        if why is not None:
            raise ValueError(f"{var}={raw!r}: {why}")


def env_text(options: ComputeOptions) -> dict[str, str]:
    """Each variable's text that gives `options`' value (the inverse of options_from_env; "" for
    a value its variable's absence gives and no text names: the default kernel shape, the
    geometry's attention heads)."""
    out = {}
    for var, (name, parse) in ENV_VARS.items():
        value = getattr(options, name)
        if isinstance(value, bool) and parse is switch:
            out[var] = "1" if value else "0"
        elif hasattr(parse, "table"):
            out[var] = next(k for k, v in parse.table.items() if v == value)
        else:
            out[var] = str(value) if value else ""
    return out


def options_from_env(environ: Mapping[str, str], base: ComputeOptions | None = None) -> ComputeOptions:
    """ComputeOptions from the STRATA_* variables in `environ` (unset or empty keeps `base`'s value).
    Raises ValueError naming the variable and its value (a removed one's saying why, REMOVED)."""
    refuse_removed(environ)
    return record_from_env(ENV_VARS, environ, base or ComputeOptions(),
                           check=lambda options: options.check([]))


__all__ = ["ComputeOptions", "ENV_VARS", "REMOVED", "VARIABLE_OF", "env_text", "options_from_env",
           "refuse_removed"]
