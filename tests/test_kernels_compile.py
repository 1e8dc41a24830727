"""The CUDA kernels compile (nvcc -arch=sm_90, no GPU needed) and their argument tables have the
layout Python writes (kernels/abi.py), so a syntax error or a drifted struct never costs GPU time.
Skips where nvcc is not installed."""
import os
import shutil
import subprocess

import pytest

from strata_dist.kernels import KERNEL_DIR, source_text, sources
from strata_dist.kernels import abi
from strata_dist.kernels.abi import (ATTN_CHUNK, ATTN_SCRATCH_BYTES, BF16, BLOCK_THREADS,
                                     DOWN_PER_BLOCK, F16, F32, FF_PER_BLOCK, GDN_ROWS, IQ2_XXS,
                                     IQ3_S, IQ4_NL, IQ4_XS, MAX_ROWS, NEXT_HEAD_DIM, NEXT_ROT,
                                     Q2_K, Q3_K, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, STRUCTS, TYPE_NAMES,
                                     AttnScratchError, KernelShape, attn_heads_choices,
                                     attn_kernel, attn_launch, default_attn_heads,
                                     rows_per_block, source_kernel_names)

NVCC = shutil.which("nvcc")
DESC_NAMES = ("DESC_POS", "DESC_ROWS", "DESC_TOKENS", "DESC_TABLE_WORDS", "DESC_ROW_POS",
              "DESC_ROW_TABLE", "DESC_ROW_END")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def test_kernel_shape_parses_and_refuses():
    assert KernelShape.parse("") == KernelShape() and KernelShape().defines() == ()
    assert KernelShape.parse("ff_per_block=8").defines() == ("-DFF_PER_BLOCK=8",)
    assert KernelShape.parse("factored_dots=0,cvt_magic=0").defines() == (
        "-DFACTORED_DOTS=0", "-DCVT_MAGIC=0")
    # Q4_K experts, and by default every type of INT_TYPE_SWITCHES (Q6_K here), take the integer
    # path's grid (8 warps a block, two rows a warp for gate/up), every other type (Q8_0 included)
    # the float one's
    shape = KernelShape()
    assert (shape.gate_up_block(Q4_K), shape.gate_up_block(Q6_K), shape.down_block(Q4_K),
            shape.gate_up_block(Q8_0), shape.down_block(Q8_0)) == \
        (16, 16, 8, FF_PER_BLOCK, DOWN_PER_BLOCK)
    assert shape.int_types() == {Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, IQ3_S, IQ2_XXS}
    shape = KernelShape.parse("int_ff_per_warp=1,int_down_per_warp=2")
    assert shape.defines() == ("-DINT_FPW=1", "-DINT_DPW=2")
    assert (shape.gate_up_block(Q4_K), shape.down_block(Q4_K)) == (8, 16)
    assert (shape.gate_up_block(Q8_0), shape.down_block(Q8_0)) == (FF_PER_BLOCK, DOWN_PER_BLOCK)
    assert KernelShape.parse("int_gate_up=0,int_down=0").gate_up_block(Q4_K) == FF_PER_BLOCK
    # Q5_K / Q6_K take the integer path's grid by default (the per-warp rows too), each behind
    # its own switch; int_gate_up / int_down still switch the whole path
    assert (shape.gate_up_block(Q5_K), shape.down_block(Q6_K)) == (8, 16)
    shape = KernelShape.parse("int_q6_k=0")
    assert shape.defines() == ("-DINT_Q6_K=0",)
    assert (shape.gate_up_block(Q6_K), shape.down_block(Q6_K), shape.gate_up_block(Q5_K)) == \
        (FF_PER_BLOCK, DOWN_PER_BLOCK, 16)
    assert KernelShape.parse(INT_ALL) == KernelShape()
    assert KernelShape.parse(INT_OFF).int_types() == {Q4_K}
    assert KernelShape.parse(INT_OFF).defines() == tuple(
        f"-D{name.upper()}=0" for name in abi.INT_TYPE_SWITCHES)
    shape = KernelShape.parse("int_q3_k=0,int_q2_k=0,int_iq4_xs=0,int_iq3_s=0,int_iq2_xxs=0,"
                              "int_down=0")
    assert shape.int_types() == {Q4_K, Q5_K, Q6_K}
    assert KernelShape.parse("int_q3_k=0").int_types() == {Q4_K, Q5_K, Q6_K, Q2_K, IQ4_XS, IQ3_S,
                                                           IQ2_XXS}
    assert (shape.gate_up_block(Q5_K), shape.down_block(Q5_K)) == (16, DOWN_PER_BLOCK)
    assert KernelShape.parse("matvec_threads=128").defines() == ("-DMATVEC_THREADS=128",)
    # the dense matvecs' integer path, deleted after it measured slower, is refused with why; so
    # are the builds measured and deleted on 2026-12-07
    with pytest.raises(ValueError, match="int_matvec was removed on 2026-12-06"):
        KernelShape.parse("int_matvec=1")
    # a pieces block: two warps a group of 4 weight rows, at every row count
    assert [abi.rows_per_block(n, True, KernelShape(), Q6_K) for n in (1, 8)] == [8, 8]
    for gone in ("piece_stage", "piece_ahead", "int_down_ahead", "int_gate_up_group",
                 "piece_split", "piece_accs"):
        with pytest.raises(ValueError, match=f"{gone} was removed on 2026-12-07"):
            KernelShape.parse(f"{gone}=1")
    for bad in ("ff_per_block", "ff_per_block=x", "rows=2", "down_per_block=0", "cvt_magic=2",
                "q4k_pairs=1", "int_ff_per_warp=5", "int_down=2",
                "matvec_threads=64", "int_gate_up=1,ff_per_block=32",  # 32 does not tile 16
                "int_down=1,down_per_block=16", "int_q6_k=2", "int_q5_k=-1", "int_q4_k=1",
                "int_matvec=0"):
        with pytest.raises(ValueError, match="kernel shape"):
            KernelShape.parse(bad)


@pytest.mark.parametrize("text, name, macro, date, figure", [
    ("matvec_warp=1", "matvec_warp", "MATVEC_WARP", "2026-12-05", "0.780 against 0.641 ms"),
    ("matvec_threads=128, matvec_warp=0", "matvec_warp", "MATVEC_WARP", "2026-12-05",
     "0.780 against 0.641 ms"),
    ("matvec_warp", "matvec_warp", "MATVEC_WARP", "2026-12-05", "0.780 against 0.641 ms"),
    ("int_q8_0=1", "int_q8_0", "INT_Q8_0", "2026-12-05", "0.607 against 0.592 ms"),
    ("int_down=1,int_q8_0=0", "int_q8_0", "INT_Q8_0", "2026-12-05", "0.607 against 0.592 ms"),
    ("expert_prefetch=1", "expert_prefetch", "EXPERT_PREFETCH", "2026-12-07",
     "305.0 against 323.6 tok/s"),
    ("matvec_pieces=1,expert_prefetch=0", "expert_prefetch", "EXPERT_PREFETCH", "2026-12-07",
     "305.0 against 323.6 tok/s"),
])
def test_a_deleted_build_is_refused_saying_it_was_removed(text, name, macro, date, figure):
    """matvec_warp (a warp a weight row), int_q8_0 (Q8_0 experts on the integer path) and
    expert_prefetch (expert rows asked into L2 ahead), deleted after they measured slower, are
    refused naming the part of the text and why, whatever the value (the old default 0 too): never
    dropped in silence, never taken for an unknown name; their macros are gone from the sources."""
    part = next(p.strip() for p in text.split(",") if name in p)
    with pytest.raises(ValueError) as e:
        KernelShape.parse(text)
    assert str(e.value).startswith(f"kernel shape {part!r}: {name} was removed on {date}")
    assert figure in str(e.value)
    assert name not in KernelShape.MACROS and macro not in source_text("decode.cu")


def test_attention_builds_take_whole_groups_or_parts_that_divide_them():
    assert attn_kernel(8, "f16") == "attn_decode_128_g8"
    assert attn_kernel(8, "q8_0", 2) == "attn_decode_128_g2_q8"
    assert attn_kernel(6, "f16", 6) == "attn_decode_128_g8"       # a whole group: the next bound
    assert attn_kernel(8, "f16", head_dim=256) == "attn_decode_256_g8"   # qwen3next's heads
    assert attn_kernel(8, "q8_0", 2, head_dim=256) == "attn_decode_256_g2_q8"
    for kv_type, head_dim in (("f32", 128), ("f16", 64)):     # no such build: refused, named
        with pytest.raises(ValueError, match=f"{head_dim}-wide heads over {kv_type}"):
            attn_kernel(8, kv_type, head_dim=head_dim)
    for group, heads in ((8, 3), (6, 4), (2, 4), (32, 32)):
        with pytest.raises(ValueError, match="query heads per attention block"):
            attn_kernel(group, "f16", heads)
    assert attn_heads_choices(8) == [8, 4, 2] and attn_heads_choices(6) == [6, 2]
    assert attn_heads_choices(32) == [16, 8, 4, 2] and attn_heads_choices(1) == [1]
    # short splits take 2 query heads a block; long ones (and odd groups) the whole group
    assert default_attn_heads(8, 64) == 2 and default_attn_heads(8, 256) == 8
    assert default_attn_heads(5, 64) == 5


def test_attention_launch_takes_the_shortest_splits_that_fit():
    """Qwen3-30B-A3B's 32 query heads over 4 kv heads: 64-key splits, 2 heads a block, up to the
    scratch budget's cells; then 128- and 256-key splits with fewer rows a step; past that, the
    general path (AttnScratchError)."""
    a = attn_launch(32, 4, 128, 1024, "f16")
    assert (a.kernel, a.heads, a.chunk, a.n_split, a.max_rows) == ("attn_decode_128_g2", 2, 64,
                                                                   16, MAX_ROWS)
    per_split_row = 32 * (128 + 2) * 4
    longest_64 = (ATTN_SCRATCH_BYTES // per_split_row) * 64
    assert attn_launch(32, 4, 128, longest_64, "f16").chunk == 64
    b = attn_launch(32, 4, 128, longest_64 + 1, "q8_0")
    assert (b.chunk, b.heads, b.kernel) == (128, 2, "attn_decode_128_g2_q8") and b.max_rows == 1
    c = attn_launch(32, 4, 128, 3 * longest_64, "f16")
    assert (c.chunk, c.heads, c.kernel) == (256, 8, "attn_decode_128_g8")
    assert attn_launch(32, 4, 128, 1024, "f16", heads=4).kernel == "attn_decode_128_g4"
    with pytest.raises(AttnScratchError, match="MiB of attention partials"):
        attn_launch(32, 4, 128, 5 * longest_64, "f16")
    with pytest.raises(ValueError, match="query heads per attention block"):
        attn_launch(32, 4, 128, 1024, "f16", heads=3)


def test_gdn_launches_of_the_qwen3_next_geometry_and_a_refusal():
    """gated_delta.cuh's launches for Qwen3-Next-80B's linear layers (16 key heads and 32 value
    heads of 128): a block a key head of channels for the conv, a block of 1,024 threads a value
    head for the delta rule; a key head narrower than a warp is refused, naming it."""
    from strata_dist.kernels.gdn_launch import gdn_launch
    got = gdn_launch(n_v=32, head_k=128, head_v=128, conv_dim=2 * 16 * 128 + 32 * 128)
    assert (got.conv_blocks, got.conv_threads, got.delta_blocks, got.delta_threads) == \
        (64, 128, 32, 1024)
    assert got.delta_shared == (2 * 128 + 1024) * 4
    with pytest.raises(ValueError, match="16 x 24"):
        gdn_launch(n_v=4, head_k=16, head_v=24, conv_dim=2 * 2 * 16 + 4 * 24)


def test_the_package_has_kernel_sources():
    assert [p.name for p in sources()] == ["decode.cu", "experts_rows.cu", "gdn_prompt.cu",
        "prefill_attention.cu", "prompt_ops.cu", "sample_rows.cu"]
    text = source_text("decode.cu")        # weights.cuh inlined, once
    assert "#include \"" not in text and text.count("HOST_DEVICE float h2f(") == 1


# A type table of fewer lines (weights.cuh FOR_EACH_TYPE) for the builds that check what does not
# depend on the type: each line costs a decode.cu build ~3 s, and those builds are many. One type
# per decoder family (float, the K-quants with and without a min, Q8_0, Q4_K of the integer
# path, a legacy type with an unfused min, a 32-wide i-quant); every line of the whole table is
# built by the default shape's build of each source and by the decoders' other build
# (factored_dots=0,cvt_magic=0).
FEW_TYPES = (F32, F16, BF16, Q8_0, Q4_K, Q6_K, Q4_1, IQ4_NL)


def few_types_option(tmp_path, types=FEW_TYPES) -> str:
    """nvcc's option for a build of `types` only: a header defining FOR_EACH_TYPE, included
    first (nvcc splits a -D value at its commas)."""
    from gguf import GGML_QUANT_SIZES
    lines = " ".join(f"X({TYPE_NAMES[t]}, {t}, {GGML_QUANT_SIZES[t][0]}, {GGML_QUANT_SIZES[t][1]})"
                     for t in types)
    header = tmp_path / "few_types.h"
    header.write_text(f"#define FOR_EACH_TYPE(X) {lines}\n")
    return f"--pre-include={header}"


def built_kernel_names(source: str, types=None) -> list[str]:
    """source_kernel_names of a build of `types` only (None: the whole table): without the
    per-type kernels (decode.cu's matvec_* and moe_*, experts_rows.cu's moe_*_rows*) of the
    others."""
    from strata_dist.kernels.abi import MATVEC_ROWS
    left_out = set()
    for t, name in TYPE_NAMES.items():
        if types is not None and t not in types:
            left_out |= {f"matvec_{name}_{n}" for n in MATVEC_ROWS}
            left_out |= {f"{kind}{mma}_{name}" for kind in ("moe_gate_up", "moe_down",
                                                           "moe_gate_up_rows", "moe_down_rows")
                         for mma in ("", "_mma")}
    return [k for k in source_kernel_names(source) if k not in left_out]


# every switch of kernels/abi.py INT_TYPE_SWITCHES on (the default): each type the integer path
# has; and every one off: those types on the float path, Q4_K alone on the integer path
INT_ALL = ",".join(f"{name}=1" for name in abi.INT_TYPE_SWITCHES)
INT_OFF = ",".join(f"{name}=0" for name in abi.INT_TYPE_SWITCHES)
INT_TYPES = (Q4_K, *abi.INT_TYPE_SWITCHES.values())

# every source at the default shape, whole type table; decode.cu (the one source built with a
# KernelShape's -D values, kernels/prebuild.py) at each shape tune_decode.py tries
SHAPE_BUILDS = [(p.name, "", None) for p in sources()] + [
    ("decode.cu", "factored_dots=0,cvt_magic=0", None),       # every decoder's other form
    *(("decode.cu", shape, FEW_TYPES) for shape in (
        "ff_per_block=8,down_per_block=2", "int_gate_up=0,int_down=0",
        "int_ff_per_warp=2,int_down_per_warp=4",
        "matvec_pieces=0,matvec_threads=128", "matvec_pieces=0,matvec_accs=64")),
    # the tensor-core matvec's four paths: 32 or 16 columns a scale, with a min or without
    ("decode.cu", "matvec_mma=1,mma_threads=512", FEW_TYPES + (Q2_K,)),
    # the integer path of every type it has (INT_TYPE_SWITCHES on, the default: the whole table's
    # build above reads them in place) staged, and those types on the float path (switches off)
    *(("decode.cu", shape, tuple(dict.fromkeys(FEW_TYPES + INT_TYPES))) for shape in (
        "int_direct=0", INT_OFF))]


@needs_nvcc
@pytest.mark.parametrize("source,shape,types", SHAPE_BUILDS,
                         ids=[f"{s}-{sh or 'default'}{'-few_types' if t else ''}"
                              for s, sh, t in SHAPE_BUILDS])
def test_kernel_compiles_for_hopper(tmp_path, source, shape, types):
    """Every source, with the default expert-kernel shape and with one that tune_decode.py tries."""
    defines = list(KernelShape.parse(shape).defines()) + (
        [few_types_option(tmp_path, types)] if types else [])
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--std=c++17", "-Werror=all-warnings",
                           *defines, "-o", str(tmp_path / "k.cubin"), str(KERNEL_DIR / source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # every kernel the runners may launch is in the binary
    strings = set((tmp_path / "k.cubin").read_bytes().split(b"\0"))
    want = built_kernel_names(source, types)
    missing = [k for k in want if k.encode() not in strings]
    assert not missing, missing
    if types is None:
        assert len(want) == len(source_kernel_names(source))


# kernels allowed to use the stack (local memory), and how many bytes: ptxas holds the multi-row
# matvecs and the two smallest attention builds to 64-80 registers and spills a few values there
# (up to 32 bytes, which moves with unrelated edits; an array indexed at run time is far larger);
# moe_down of IQ2_XXS, IQ2_XS and IQ4_NL spill 4-8 bytes at 48 registers (ptxas -v, CUDA 13.0;
# the i-quants' first version, not yet measured on a GPU); the --kv-resident `_ring` builds of
# those two spill 8 bytes (each key's row chosen between the card and the host copy); in the
# default build (integer path on: int_iq4_xs / int_iq2_xxs), moe_down of IQ4_XS / IQ2_XXS: 16 / 8
# bytes at 64 registers (ptxas -v, CUDA 13.0, 2026-12-06; the build measured faster all the same,
# benchmarks/results/decode-qwen3-30b-a3b-iq4_xs-2026-12-06-051350-f6081f8.json); the 256-wide
# q8_0 builds of 2 and 4 heads (qwen3next, --kv-type q8_0) spill 16 bytes into a 16-byte frame
# at 128 registers, as the 128-wide q8_0 g4 build does (ptxas -v, CUDA 13.0, 2026-12-06; their
# `_q8_ring` builds have no frame; run on an H100 on 2026-12-06); matvec_q4_0_1 spills 16 bytes at
# the 64 registers ptxas gives it since the router's redux top-k tail (route_after_last_block,
# compiled into every matvec, run by the router's last block only) came into the default build
# (ptxas -v, CUDA 13.0, 2026-12-07; not measured on a Q4_0 file)
STACK_ALLOWED = [(r"matvec_\w+_[248]", 32),
                 (r"matvec_q4_0_1", 16),
                 (r"attn_decode_(128|256)_g[24](_q8|_ring|_q8_ring)?", 16),
                 (r"moe_down_iq\w+", 16)]


def stack_allowed(kernel: str) -> int:
    import re
    return next((n for pattern, n in STACK_ALLOWED if re.fullmatch(pattern, kernel)), 0)


@needs_nvcc
@pytest.mark.parametrize("source,shape,types", [(p.name, "", None) for p in sources()]
                         + [("decode.cu", "int_direct=0", INT_TYPES),
                            ("decode.cu", INT_OFF, INT_TYPES),
                            ("decode.cu", "matvec_pieces=0", FEW_TYPES)],
                         ids=[p.name for p in sources()] + ["decode.cu-int_types-staged",
                                                            "decode.cu-int_types-float_path",
                                                            "decode.cu-plain_matvecs"])
def test_kernels_keep_their_values_in_registers(tmp_path, source, shape, types):
    """ptxas's report of every kernel: no stack frame (an array indexed at run time lands in local
    memory and costs a memory round trip per access), but for the ones allowed above; the
    integer expert path's types (on in the default build) staged too, and on the float path; the
    plain K-quant matvecs (matvec_pieces=0)."""
    import re
    defines = list(KernelShape.parse(shape).defines()) + (
        [few_types_option(tmp_path, types)] if types else [])
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "--std=c++17", "-Xptxas", "-v", *defines,
                           "-o", str(tmp_path / "k.cubin"), str(KERNEL_DIR / source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stacks = dict(re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame",
                             done.stderr))
    assert stacks, done.stderr[-2000:]
    over = {k: int(v) for k, v in stacks.items() if int(v) > stack_allowed(k)}
    assert not over, over


@needs_nvcc
def test_argument_tables_match_the_structs(tmp_path):
    """A host program built from decode.cu prints its constants, the rows each matvec warp takes,
    sizeof and every field's offset of the tables: what the runner assumes (kernels/abi.py)."""
    lines = ['printf("MAX_ROWS %d ATTN_CHUNK %d BLOCK_THREADS %d FF_PER_BLOCK %d '
             'DOWN_PER_BLOCK %d\\n", MAX_ROWS, ATTN_CHUNK, BLOCK_THREADS, FF_PER_BLOCK, '
             'DOWN_PER_BLOCK);',
             'printf("INT_FF_BLOCK %d INT_DOWN_BLOCK %d\\n", INT_FF_BLOCK, INT_DOWN_BLOCK);',
             'printf("GDN_ROWS %d NEXT_D %d NEXT_ROT %d MMA_ROWS %d\\n", GDN_ROWS, NEXT_D, '
             'NEXT_ROT, MMA_ROWS);',
             'printf("PIECE_ROWS %d PIECE_THREADS %d PIECE_SPLIT %d\\n", PIECE_ROWS, '
             'PIECE_THREADS, PIECE_SPLIT);']
    lines += [f'printf("{name} %d\\n", (int)({name}));' for name in DESC_NAMES]
    lines += [f'printf("rows_per_block {n} {w} %d\\n", rows_per_block({n}, {w}));'
              for n in range(1, MAX_ROWS + 1) for w in (0, 1)]
    lines += [f'printf("mma_scale_cols {t} %d\\n", mma_scale_cols({t}));' for t in abi.KERNEL_TYPES]
    lines += [f'printf("piece_type {t} %d\\n", (int)piece_type({t}));' for t in abi.KERNEL_TYPES]
    # every KernelShape default is the macro's own (an undefined -D builds the default shape)
    lines += [f'printf("{macro} %d\\n", (int)({macro}));' for macro in KernelShape.MACROS.values()]
    for struct, dtype in STRUCTS.items():
        lines.append(f'printf("{struct} size %zu\\n", sizeof({struct}));')
        for field in dtype.names:
            lines.append(f'printf("{struct} {field} %zu\\n", offsetof({struct}, {field}));')
    main = tmp_path / "abi.cu"
    main.write_text(f'#include <cstdio>\n#include <cstddef>\n#include "{KERNEL_DIR / "decode.cu"}"\n'
                    f'int main() {{ {" ".join(lines)} return 0; }}\n')
    exe = tmp_path / "abi"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", few_types_option(tmp_path), "-o",
                           str(exe), str(main)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split("\n")
    want = [f"MAX_ROWS {MAX_ROWS} ATTN_CHUNK {ATTN_CHUNK} BLOCK_THREADS {BLOCK_THREADS} "
            f"FF_PER_BLOCK {FF_PER_BLOCK} DOWN_PER_BLOCK {DOWN_PER_BLOCK}",
            f"INT_FF_BLOCK {KernelShape().gate_up_block(Q4_K)} "
            f"INT_DOWN_BLOCK {KernelShape().down_block(Q4_K)}",
            f"GDN_ROWS {GDN_ROWS} NEXT_D {NEXT_HEAD_DIM} NEXT_ROT {NEXT_ROT} MMA_ROWS {abi.MMA_ROWS}",
            f"PIECE_ROWS {abi.PIECE_ROWS} PIECE_THREADS {abi.PIECE_THREADS} "
            f"PIECE_SPLIT {abi.PIECE_SPLIT}"]
    # the step descriptor's words (backends/decode_rows.py packs what the kernels read)
    want += [f"{name} {getattr(abi, name)}" for name in DESC_NAMES]
    want += [f"rows_per_block {n} {w} {rows_per_block(n, bool(w))}"
             for n in range(1, MAX_ROWS + 1) for w in (0, 1)]
    want += [f"mma_scale_cols {t} {abi.MMA_SCALE_COLS.get(t, 0)}" for t in abi.KERNEL_TYPES]
    want += [f"piece_type {t} {int(t in abi.PIECE_TYPES)}" for t in abi.KERNEL_TYPES]
    want += [f"{macro} {getattr(KernelShape(), name)}" for name, macro in KernelShape.MACROS.items()]
    for struct, dtype in STRUCTS.items():
        want.append(f"{struct} size {dtype.itemsize}")
        want += [f"{struct} {f} {dtype.fields[f][1]}" for f in dtype.names]
    assert [line for line in got if line] == want



@needs_nvcc
def test_row_kernel_tiles_match_the_host(tmp_path):
    """experts_rows.cu's tile and grouping macros are the ones the host sizes its launches and
    its work items by (kernels/abi.py; the host's items must be the device grouping's)."""
    from strata_dist.kernels.abi import MAX_GROUP_EXPERTS, ROWS_TILE_K, ROWS_TILE_M, ROWS_TILE_N
    got = _host_print(tmp_path, "experts_rows.cu", '"%d %d %d %d %zu", TILE_M, TILE_N, TILE_K, '
                                                   'MAX_GROUP_EXPERTS, sizeof(RowsItem)')
    assert got == f"{ROWS_TILE_M} {ROWS_TILE_N} {ROWS_TILE_K} {MAX_GROUP_EXPERTS} 16"


@needs_nvcc
def test_row_kernel_shared_memory_matches_the_host(tmp_path):
    """The dynamic shared memory each tensor-core row kernel carves (weight stages, rows, decoded
    steps) is what the host launches it with and allows it (kernels/abi.py rows_mma_shared_bytes):
    a launch with less would overrun its buffers. Every build stays within sm_90's 227 KiB and,
    for the two blocks an SM the kernels are tuned for, within half of the SM's 228 KiB."""
    from strata_dist.kernels.abi import TYPE_NAMES, rows_mma_shared_bytes
    cases = [(t, nmat) for t in TYPE_NAMES for nmat in (1, 2)]
    fmt = " ".join("%d" for _ in cases)
    args = ", ".join(f"rows_mma_shared_bytes({t}, {nmat})" for t, nmat in cases)
    got = _host_print(tmp_path, "experts_rows.cu", f'"{fmt}", {args}').split()
    want = [rows_mma_shared_bytes(t, nmat) for t, nmat in cases]
    assert [int(v) for v in got] == want
    assert max(want) + 1024 <= 228 << 9, want    # + the 1 KiB a block's runtime reserves


@needs_nvcc
def test_prompt_gdn_constants_match_the_host(tmp_path):
    """gdn_prompt.cu's lanes, convolution bound and columns a block are the ones the host checks
    a geometry against and sizes its grids by (kernels/gdn_launch.py gdn_rows_launch)."""
    from strata_dist.kernels.gdn_launch import GDN_COLUMNS_PER_BLOCK, GDN_LANE_ROWS, GDN_MAX_K
    got = _host_print(tmp_path, "gdn_prompt.cu", '"%d %d %d", GDN_LANE_ROWS, GDN_MAX_K, '
                                                 'GDN_COLUMNS_PER_BLOCK')
    assert got == f"{GDN_LANE_ROWS} {GDN_MAX_K} {GDN_COLUMNS_PER_BLOCK}"


@needs_nvcc
def test_prompt_attention_rows_match_the_host(tmp_path):
    """prefill_attention.cu's rows a block and shared bytes are the ones the host sizes its
    launches by, for both builds and for a build with other -D values."""
    from strata_dist.kernels.abi import prefill_attention_launch
    printf = ('"%d %d %d %d", FA_ROWS(FA_MT_128), FA_SHARED_BYTES(128, FA_BN_128, FA_MT_128), '
              'FA_ROWS(FA_MT_256), FA_SHARED_BYTES(256, FA_BN_256, FA_MT_256)')
    (rows128, _, shared128), (rows256, _, shared256) = (prefill_attention_launch(128),
                                                        prefill_attention_launch(256))
    assert _host_print(tmp_path, "prefill_attention.cu", printf) == \
        f"{rows128} {shared128} {rows256} {shared256}"
    rows, _, shared = prefill_attention_launch(128, mt=1, bn=64)
    assert _host_print(tmp_path, "prefill_attention.cu", printf,
                       ("-DFA_MT_128=1", "-DFA_BN_128=64")).split()[:2] == [str(rows), str(shared)]


def _host_print(tmp_path, source: str, printf_args: str, defines=()) -> str:
    """What printf(printf_args) prints in a host program built from a kernel source with nvcc
    (its macros and struct sizes as the compiler sees them)."""
    main = tmp_path / "host.cu"
    main.write_text(f'#include <cstdio>\n#include "{KERNEL_DIR / source}"\n'
                    f'int main() {{ printf({printf_args}); return 0; }}\n')
    exe = tmp_path / "host"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", *defines, "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout


def _nvrtc():
    """libnvrtc (the nvidia-cuda-nvrtc wheel of the test extras, or the system's), or None."""
    import ctypes
    import ctypes.util
    import glob
    import importlib.util
    paths = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        paths += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    found = ctypes.util.find_library("nvrtc")
    paths += [found] if found else []
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _cuda_include():
    root = os.path.dirname(os.path.dirname(os.path.realpath(NVCC))) if NVCC else ""
    for d in (os.path.join(root, "include"), "/usr/local/cuda/include"):
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return d
    return None


# every source at the default shape
NVRTC_BUILDS = [(p.name, "") for p in sources()]


@pytest.mark.parametrize("source,shape", NVRTC_BUILDS,
                         ids=[f"{s}-{sh or 'default'}" for s, sh in NVRTC_BUILDS])
def test_kernel_compiles_with_nvrtc_as_cupy_does(source, shape):
    """CuPy compiles the sources at run time with NVRTC, which has no system headers (no
    <math.h>): build them the same way here, so what nvcc accepts but NVRTC refuses shows too."""
    import ctypes
    from strata_dist.kernels import COMPILE_OPTIONS
    lib, include = _nvrtc(), _cuda_include()
    if lib is None or include is None:
        pytest.skip("no NVRTC library or CUDA headers")
    prog = ctypes.c_void_p()
    src = source_text(source).encode()          # what kernels.module hands to CuPy
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None) == 0
    opts = [o.encode() for o in (*COMPILE_OPTIONS, *KernelShape.parse(shape).defines(),
                                 "-arch=compute_90", f"-I{include}")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")


@needs_nvcc
@pytest.mark.parametrize("cvt_magic", [1, 0])
def test_weight_decoders_match_gguf_on_the_host(tmp_path, cvt_magic):
    """weights.cuh's `chunk8` (what every kernel reads weights with) built for the host and run over
    random rows of each type, its integers converted either way: the floats must be gguf-py's."""
    from quant_rows import TYPES, random_rows
    main = tmp_path / "decoders.cu"      # weights.cuh alone: chunk8 and DISPATCH_TYPE, no kernels
    main.write_text(f'#include <cstdio>\n#include <vector>\n#include "{KERNEL_DIR / "weights.cuh"}"\n' + r'''
int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb");
    FILE* out = fopen(argv[2], "wb");
    long long head[4];                      // type, row bytes, columns, rows
    if (fread(head, sizeof head, 1, in) != 1) return 1;
    std::vector<unsigned char> raw(head[1] * head[3]);
    if (fread(raw.data(), 1, raw.size(), in) != raw.size()) return 1;
    const int type = (int)head[0], ncols = (int)head[2];
    for (long long r = 0; r < head[3]; ++r)
        for (int c = 0; c < ncols / 8; ++c) {
            float w[8] = {0};
            DISPATCH_TYPE(type, (chunk8<TT>(raw.data() + r * head[1], c, w)));
            fwrite(w, sizeof(float), 8, out);
        }
    return 0;
}
''')
    exe = tmp_path / "decoders"
    done = subprocess.run([NVCC, "-arch=sm_90", "--std=c++17", f"-DCVT_MAGIC={cvt_magic}",
                           "-o", str(exe), str(main)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import numpy as np
    for qtype in TYPES:
        raw, ref = random_rows(qtype, 5, 768, int(qtype))
        data = tmp_path / f"{qtype.name}.bin"
        data.write_bytes(np.array([int(qtype), raw.shape[1], 768, 5], dtype=np.int64).tobytes()
                         + raw.tobytes())
        got_path = tmp_path / f"{qtype.name}.out"
        subprocess.run([str(exe), str(data), str(got_path)], check=True, timeout=60)
        got = np.fromfile(got_path, dtype=np.float32).reshape(ref.shape)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7, err_msg=qtype.name)


@needs_nvcc
def test_programmatic_launch_structs_match_cuda_h(tmp_path):
    """kernels/pdl.py writes CUlaunchConfig and CUlaunchAttribute with ctypes: their sizes, field
    offsets and the attribute's id must be cuda.h's, or the driver reads garbage on the GPU."""
    import ctypes
    from strata_dist.kernels import pdl
    cfg_fields = [f for f, _ in pdl._Config._fields_]
    src = tmp_path / "launch.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void) {\n"
        'printf("attr %zu %zu %zu\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, id),'
        " offsetof(CUlaunchAttribute, value));\n"
        'printf("id %d\\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n'
        'printf("cfg %zu\\n", sizeof(CUlaunchConfig));\n'
        + "".join(f'printf("{f} %zu\\n", offsetof(CUlaunchConfig, {f}));\n' for f in cfg_fields)
        + "return 0; }\n")
    exe = tmp_path / "launch"
    built = subprocess.run([NVCC, "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=120)      # nvcc knows where its cuda.h is
    assert built.returncode == 0, built.stderr
    got = dict(line.split(" ", 1) for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, timeout=30).stdout.splitlines())
    assert got["attr"] == f"{ctypes.sizeof(pdl._Attr)} {pdl._Attr.id.offset} {pdl._Attr.value.offset}"
    assert int(got["id"]) == pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert int(got["cfg"]) == ctypes.sizeof(pdl._Config)
    for f in cfg_fields:
        assert int(got[f]) == getattr(pdl._Config, f).offset, f


def test_expert_layout_of_a_file_and_a_refusal(tmp_path, monkeypatch):
    """kernels/abi.py expert_layout (what the decode graph and the row kernels read blobs by):
    the parts of a Q8_0 file's blob add up to GGUFModel.blob_bytes, and a type no kernel reads
    is refused naming the tensor."""
    from gguf import GGMLQuantizationType as QT

    from hf_fixtures import tiny_qwen3moe, write_gguf
    from strata_dist.gguf_file.reader import GGUFModel
    from strata_dist.kernels.abi import ExpertLayout, KERNEL_TYPES, expert_layout
    g = GGUFModel(write_gguf(tiny_qwen3moe(5, head_dim=32), tmp_path / "q8.gguf", "q8_0"))
    lay = expert_layout(g, 1)
    assert isinstance(lay, ExpertLayout) and lay.gate_type == lay.up_type == int(QT.Q8_0)
    assert lay.n_embd == 64 and lay.n_ff == 32 and lay.align == KERNEL_TYPES[int(QT.Q8_0)]
    assert lay.down_at + lay.down_row_bytes * lay.n_embd == g.blob_bytes(1)
    assert lay.up_at == lay.gate_row_bytes * lay.n_ff
    monkeypatch.delitem(KERNEL_TYPES, int(QT.Q8_0))
    with pytest.raises(ValueError, match="ffn_gate_exps.weight: type Q8_0 is not readable"):
        expert_layout(g, 1)


def test_prebuilt_cubins_are_named_by_what_was_compiled():
    """A prebuilt binary is found only for the same source text, options, defines and compute
    capability (kernels/__init__.py cubin_name); decode.cu is built once per shape asked for."""
    from strata_dist.kernels import cubin_name
    from strata_dist.kernels.prebuild import builds
    base = cubin_name("decode.cu", (), "90")
    assert base.startswith("decode-sm90-") and base.endswith(".cubin")
    assert cubin_name("decode.cu", ("-DINT_DOWN=0",), "90") != base
    assert cubin_name("decode.cu", (), "100") != base
    assert cubin_name("experts_rows.cu", (), "90") != base
    todo = builds(["", "int_gate_up=0,int_down=0", "int_down=0,int_gate_up=0"])
    assert [n for n, _ in todo].count("decode.cu") == 2          # the same shape once
    assert ("decode.cu", ("-DINT_GATE_UP=0", "-DINT_DOWN=0")) in todo
    assert {n for n, _ in todo} == {p.name for p in sources()}


@needs_nvcc
def test_prebuild_writes_the_cubin_module_would_load(tmp_path):
    from strata_dist.kernels import cubin_name
    from strata_dist.kernels.prebuild import build
    path = build(NVCC, "prefill_attention.cu", (), "90", tmp_path)
    assert path.name == cubin_name("prefill_attention.cu", (), "90")
    assert b"prefill_attention_128" in path.read_bytes()
