"""Our numpy forward against llama.cpp's own forward, on the synth's files of every file type.

The synth writes a file (`write_synthetic`, or `strata-dist synth` for the split file), llama.cpp
evaluates a token sequence in one batch through its C API (tests/llama_logits.cpp, compiled here
with g++ against the llama.cpp named by STRATA_LLAMA_CPP: a source tree with include/,
ggml/include/ and a CPU build in build/bin/libllama.so, as .ci/run builds it), our
SingleProcessRunner evaluates the same tokens on "cpu", and the logits are compared position by
position. The comparisons are skipped without STRATA_LLAMA_CPP.

Geometries: `tiny` and `tiny-next` (64-wide rows: the K and i-quant types fall back to the legacy
32-wide ones, as the synth's rules say, so these are the files every other test uses), and WIDE /
WIDE_NEXT, 512 wide with 256-wide expert rows, where every K and i-quant type appears as itself
(16 experts, so the eight-expert rules stay out; n_gqa 4, so the i-quant files raise attn_v).

The bound, derived (docs/DEVELOPING.md, "Numerics against llama.cpp", has the measurements):
llama.cpp's CPU dot products quantize the activation vector to 8 bits for every quantized weight
type (one scale per block of 32 for the legacy types, of 256 for K and i-quants: step
d = max|x| / 127), f16 for F16 weights and bf16 for BF16. A rounding error uniform in +-d/2
adds to a dot product an error of relative rms eps_q = c / (127 * sqrt(12)), c the rms of a
block's max|x| over the rms of x: 2.4 for a block of 32 normal values and 3.1 for 256, so
eps_q = 0.54% and 0.70%. The output projection adds eps_q to every logit; each earlier
projection adds at most eps_q of its own branch, and independent errors add in quadrature, so the
rms of (ours - llama.cpp) over a position's logits, over the std of its logits, is about one to
two eps_q. RMS_BOUND = 3% (~4.5 eps_q, room for ~20 full-share projections) and, for the single
worst logit of ~24k, MAX_BOUND = 5 x RMS_BOUND (a normal tail reaches ~4.1 sigma at that count;
5 for positions whose error is above the average). A wrong weight is not noise of that size: a
scale, a sub-block or a sign misread moves the logits by tens of percent of their spread.
Argmax: random models' top two logits are often near-ties, so the argmax must agree wherever the
reference's top-two gap is more than ARGMAX_GAP of the spread (2 x RMS_BOUND; the max bound alone
would only guarantee it above 2 x MAX_BOUND), and on most positions overall.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_dist.tools.single_process import SingleProcessRunner
from strata_dist.synth import (FILE_TYPES, GEOMETRIES, NEXT_GEOMETRIES, SynthGeometry,
                               write_synthetic)

ROOT = Path(__file__).resolve().parents[1]
TOOL_SOURCE = Path(__file__).with_name("llama_logits.cpp")
LLAMA_CPP = os.environ.get("STRATA_LLAMA_CPP", "")

NO_LLAMA_CPP = ("set STRATA_LLAMA_CPP to a llama.cpp source tree with a CPU build of libllama in "
                "build/bin (.ci/run builds one) to compare our logits with llama.cpp's")

RMS_BOUND = 0.03          # rms |ours - llama.cpp| over a position's logit std (module docstring)
MAX_BOUND = 5 * RMS_BOUND
ARGMAX_GAP = 2 * RMS_BOUND
ARGMAX_SHARE = 0.75       # positions whose argmax agrees, near-ties included
N_TOKENS = 48

T = gguf.GGMLQuantizationType
WIDE = SynthGeometry("wide", n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
                     n_expert=16, n_expert_used=4, n_ff_exp=256, n_vocab=512, context_length=4096)
WIDE_NEXT = dataclasses.replace(NEXT_GEOMETRIES["tiny-next"], name="wide-next", n_layer=4,
                                n_embd=512, n_head=8, n_head_kv=2, head_dim=64, n_expert=16,
                                n_expert_used=4, n_ff_exp=256, n_ff_shexp=256, head_k_dim=64,
                                head_v_dim=64)
GEOMETRY = {"tiny": GEOMETRIES["tiny"], "tiny-next": NEXT_GEOMETRIES["tiny-next"], "wide": WIDE,
            "wide-next": WIDE_NEXT}
# qwen3next's wide files take ~2 s each in our forward: the file types users run most, and each
# i-quant family once
WIDE_NEXT_TYPES = ("q2_k", "q3_k_m", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "q5_1",
                   "iq1_m", "iq2_xxs", "iq3_s", "iq4_xs", "bf16")
CASES = [*((g, q) for g in ("tiny", "tiny-next", "wide") for q in FILE_TYPES),
         *(("wide-next", q) for q in WIDE_NEXT_TYPES)]
# every type the synth's rules give (F32: norms, routers and the f32 file type)
ALL_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K,
             T.Q5_K, T.Q6_K, T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
             T.IQ4_NL, T.IQ4_XS}


def token_ids(n_vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(5).integers(0, n_vocab, N_TOKENS)]


def build_tool(llama_cpp: Path, out_dir: Path) -> Path:
    """tests/llama_logits.cpp compiled against `llama_cpp`'s headers and libllama."""
    lib_dir = llama_cpp / "build" / "bin"
    for need in (lib_dir / "libllama.so", llama_cpp / "include" / "llama.h",
                 llama_cpp / "ggml" / "include" / "ggml.h"):
        if not need.exists():
            pytest.fail(f"STRATA_LLAMA_CPP={llama_cpp}: {need} is missing (a llama.cpp source tree "
                        f"with a CPU build of libllama in build/bin is expected)")
    if shutil.which("g++") is None:
        pytest.fail(f"STRATA_LLAMA_CPP={llama_cpp} is set but g++ is not on PATH to build "
                    f"{TOOL_SOURCE.name}")
    exe = out_dir / "llama_logits"
    cmd = ["g++", "-O1", "-std=c++17", f"-I{llama_cpp / 'include'}",
           f"-I{llama_cpp / 'ggml' / 'include'}", str(TOOL_SOURCE), f"-L{lib_dir}", "-lllama",
           f"-Wl,-rpath,{lib_dir}", "-o", str(exe)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{' '.join(cmd)}:\n{p.stderr[-3000:]}"
    return exe


@pytest.fixture(scope="module")
def llama_tool(tmp_path_factory) -> Path:
    if not LLAMA_CPP:
        pytest.skip(NO_LLAMA_CPP)
    return build_tool(Path(LLAMA_CPP), tmp_path_factory.mktemp("llama_logits"))


def llama_cpp_logits(tool: Path, model: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [len(ids), n_vocab] of `ids` at positions 0.. in one batch."""
    out = model.with_suffix(".llama.npy")
    p = subprocess.run([str(tool), str(model), str(out), *map(str, ids)], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        said = [ln for ln in p.stderr.splitlines()
                if any(w in ln.lower() for w in ("error", "fail", "missing", "unknown", "wrong"))]
        raise AssertionError(f"llama.cpp on {model.name} exited {p.returncode}:\n"
                             + "\n".join(said[-12:] or p.stderr.splitlines()[-12:]))
    return np.load(out)


def agreement(ours: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """The comparison's numbers: rms and max of |ours - ref| over each position's logit std, the
    share of positions whose argmax agrees, and whether it agrees wherever the gap is clear."""
    spread = ref.std(axis=1, keepdims=True)
    rel = np.abs(ours - ref) / spread
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / spread[:, 0] > ARGMAX_GAP
    same = ours.argmax(axis=1) == ref.argmax(axis=1)
    return {"rms": float(np.sqrt(np.mean(rel ** 2))), "max": float(rel.max()),
            "argmax": float(same.mean()), "clear_agree": bool(same[clear].all()),
            "min_spread": float(spread.min())}


def assert_agrees(ours: np.ndarray, ref: np.ndarray, what: str) -> dict[str, float]:
    assert ours.shape == ref.shape, f"{what}: our logits {ours.shape}, llama.cpp's {ref.shape}"
    a = agreement(ours, ref)
    assert a["min_spread"] > 0.05, f"{what}: logits that say nothing ({a})"
    assert a["rms"] <= RMS_BOUND, f"{what}: rms relative difference {a['rms']:.4f} > {RMS_BOUND}"
    assert a["max"] <= MAX_BOUND, f"{what}: max relative difference {a['max']:.4f} > {MAX_BOUND}"
    assert a["clear_agree"], f"{what}: argmax differs where the top-two gap is clear ({a})"
    assert a["argmax"] >= ARGMAX_SHARE, f"{what}: argmax agrees on {a['argmax']:.0%} of positions"
    return a


def compare(tool: Path, path: Path, n_vocab: int, what: str) -> dict[str, float]:
    ids = token_ids(n_vocab)
    ref = llama_cpp_logits(tool, path, ids)
    return assert_agrees(SingleProcessRunner(str(path)).logits(ids), ref, what)


@pytest.mark.parametrize("geometry,ftype", CASES, ids=[f"{g}-{q}" for g, q in CASES])
def test_logits_match_llama_cpp(llama_tool, tmp_path, geometry, ftype):
    g = GEOMETRY[geometry]
    s = write_synthetic(tmp_path / f"{geometry}-{ftype}.gguf", g, quant=ftype,
                        popularity="zipf:1.0", seed=7)
    compare(llama_tool, s.path, g.n_vocab, f"{geometry} {ftype} {sorted(set(s.types.values()))}")


def test_the_cases_cover_every_type_the_synth_writes():
    """Each GGML type the synth writes appears in some compared file (from the files' type plans,
    without their data)."""
    from strata_dist.synth.moe import plan_moe
    from strata_dist.synth.next import plan_next
    from strata_dist.synth.writer import Popularity
    seen: set[T] = set()
    for geometry, ftype in CASES:
        plan = plan_next if geometry.endswith("next") else plan_moe
        tensors, _ = plan(GEOMETRY[geometry], ftype, Popularity("uniform"), 0)
        seen |= {t.ggml_type for t in tensors}
    assert seen == ALL_TYPES, f"missing {ALL_TYPES - seen}, unexpected {seen - ALL_TYPES}"


def test_the_seeds_iq3_s_in_two_shards(llama_tool, tmp_path):
    """The seeds' model's file: qwen3next, IQ3_S, two shards (the wide geometry, so IQ3_S is
    itself). llama.cpp opens the first shard and finds the second; its logits are those of the
    same file unsplit, bit for bit, and ours agree with them."""
    whole = write_synthetic(tmp_path / "whole.gguf", WIDE_NEXT, quant="iq3_s", seed=3)
    data = sum(t.n_bytes for t in gguf.GGUFReader(whole.path).tensors)
    split = write_synthetic(tmp_path / "split.gguf", WIDE_NEXT, quant="iq3_s", seed=3,
                            split_max_size=data * 6 // 10)
    assert [p.name for p in split.shards] == ["split-00001-of-00002.gguf",
                                              "split-00002-of-00002.gguf"]
    assert T.IQ3_S in {T[v] for v in split.types.values()}
    ids = token_ids(WIDE_NEXT.n_vocab)
    ref = llama_cpp_logits(llama_tool, split.path, ids)
    assert np.array_equal(ref, llama_cpp_logits(llama_tool, whole.path, ids))
    assert_agrees(SingleProcessRunner(str(split.path)).logits(ids), ref, "wide-next iq3_s, 2 shards")


def test_a_split_file_from_the_command_line(llama_tool, tmp_path):
    """`strata-dist synth --split-max-size` (tiny, q4_k_m, three shards): llama.cpp reads it."""
    out = tmp_path / "tiny.gguf"
    p = subprocess.run([sys.executable, "-m", "launcher.tools", "synth", "--like", "tiny",
                        "--quant", "q4_k_m", "--split-max-size", "100K", "--quiet", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    shards = sorted(tmp_path.glob("tiny-0000?-of-00003.gguf"))
    assert len(shards) == 3, sorted(x.name for x in tmp_path.iterdir())
    compare(llama_tool, shards[0], GEOMETRIES["tiny"].n_vocab, "tiny q4_k_m, 3 shards")


def main() -> None:
    """`STRATA_LLAMA_CPP=... python tests/test_llama_cpp_logits.py`: the table of
    docs/DEVELOPING.md (every case's numbers, not only pass or fail)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tool = build_tool(Path(LLAMA_CPP), Path(d))
        print(f"{'geometry':10} {'file type':9} {'rms':>7} {'max':>7} {'argmax':>7}  types")
        for geometry, ftype in CASES:
            g = GEOMETRY[geometry]
            s = write_synthetic(Path(d) / "f.gguf", g, quant=ftype, popularity="zipf:1.0", seed=7)
            ids = token_ids(g.n_vocab)
            a = agreement(SingleProcessRunner(str(s.path)).logits(ids),
                          llama_cpp_logits(tool, s.path, ids))
            types = " ".join(sorted(set(s.types.values()) - {"F32"}))
            print(f"{geometry:10} {ftype:9} {a['rms']:7.4f} {a['max']:7.4f} {a['argmax']:7.0%}  "
                  f"{types}", flush=True)


if __name__ == "__main__":
    main()
