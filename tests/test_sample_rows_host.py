"""kernels/sample_rows.cu's greedy_rows run on the host (tests/cuda_block_emulator.py: g++, a
std::thread a CUDA thread), against numpy's argmax facts of each row, which the batched step's
last stage read before (backends/batched_decode.py _greedy_rows): the first maximum's index, the
first NaN's where a row holds one, whether the value there is finite, whether the row holds a NaN.
Rows of ties across threads and warps, NaNs, infinities and no finite logit; blocks of one warp
and of several. tests/test_gpu_batched_decode.py runs the kernel on the card."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from cuda_block_emulator import CUDA_INCLUDE, CXX, build, emulated_source
from strata_dist.kernels import KERNEL_DIR

pytestmark = pytest.mark.skipif(CXX is None or CUDA_INCLUDE is None,
                                reason="g++ or the CUDA toolkit's headers are not installed")

MAIN = r"""
int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    int head[3];
    if (fread(head, 4, 3, f) != 3) return 2;
    const int rows = head[0], vocab = head[1], threads = head[2];
    std::vector<float> logits((size_t)rows * vocab);
    if (fread(logits.data(), 4, logits.size(), f) != logits.size()) return 2;
    fclose(f);
    std::vector<int> out(3 * (size_t)rows, -1);
    emu_launch(EmuDim{(unsigned)rows, 1, 1}, (unsigned)threads,
               [&] { greedy_rows(logits.data(), vocab, rows, out.data()); });
    f = fopen(argv[2], "wb");
    fwrite(out.data(), 4, out.size(), f);
    fclose(f);
    return 0;
}
"""


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("greedy_rows")
    exe = tmp / "greedy_rows"
    source = emulated_source((KERNEL_DIR / "sample_rows.cu").read_text() + MAIN)
    done = subprocess.run(build(source, exe), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    def run(logits: np.ndarray, threads: int) -> np.ndarray:
        rows, vocab = logits.shape
        src, dst = tmp / "in", tmp / "out"
        src.write_bytes(np.asarray([rows, vocab, threads], np.int32).tobytes()
                        + np.ascontiguousarray(logits, np.float32).tobytes())
        ran = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True,
                             timeout=600)
        assert ran.returncode == 0, ran.stderr[-2000:]
        return np.frombuffer(dst.read_bytes(), np.int32).reshape(3, rows)
    return run


def numpy_facts(logits: np.ndarray) -> np.ndarray:
    best = logits.argmax(axis=1)
    return np.stack([best, np.isfinite(logits[np.arange(len(logits)), best]),
                     np.isnan(logits).any(axis=1)]).astype(np.int32)


def hostile_rows(vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((10, vocab)) * 4).astype(np.float32)
    rows[1, [vocab - 1, 3, 700]] = 50.0                  # a tie: the first index wins
    rows[2, [5, 37]] = 50.0                              # a tie inside one warp's first pass
    rows[3, [900, 40]] = np.nan                          # NaNs: the first one is numpy's argmax
    rows[3, 1] = 60.0
    rows[4, :] = -np.inf                                 # no finite logit: index 0, not finite
    rows[5, 17] = np.inf                                 # an infinite best: not finite
    rows[6, :] = -np.inf
    rows[6, vocab - 2] = -3.0                            # one finite value among -inf
    rows[7, :] = 1.0                                     # all equal: index 0
    rows[8, vocab - 1] = np.nan                          # the last value only
    rows[9, :] = -np.inf
    rows[9, 200] = np.nan
    return rows


@pytest.mark.parametrize("threads", [32, 128])
def test_greedy_rows_gives_numpys_argmax_facts(greedy, threads):
    rows = hostile_rows(vocab=1_003, seed=threads)       # a vocabulary no block width divides
    assert np.array_equal(greedy(rows, threads), numpy_facts(rows))


def test_a_wrong_first_index_on_ties_would_show(greedy):
    """The facts tell rows apart: the tie rows' answers are not their last maximum's."""
    rows = hostile_rows(vocab=1_003, seed=0)
    got = greedy(rows, 64)
    assert got[0, 1] == 3 and got[0, 2] == 5 and got[0, 3] == 40
    assert got[1].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert got[2].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1, 1]
