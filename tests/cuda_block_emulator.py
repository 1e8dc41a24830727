"""A C++ prelude that lets a kernel source's block-level device code run on the host (g++,
no GPU): each CUDA thread of a block is a std::thread, __syncthreads a barrier of the block,
__shfl_xor_sync an exchange between the 32 threads of a warp behind a warp barrier, __shared__
variables static (a block's threads share them; blocks run one after another), __ldg / __ldcg
plain loads. Only what kernels/attention.cuh's decode attention and q8_0 write use is here;
weights.cuh's own helpers (pdl_entry, last_block_to_finish, warp_sum, warp_max) are taken from
its text, so the code run is the kernels'. tests/test_attention_q8_host.py builds with it.

What it cannot show: a GPU's own arithmetic (__expf, rsqrtf and FMA contraction round
differently here: results agree with the device to float rounding, not bit for bit), memory
ordering between blocks, and anything of the launches; tests/test_gpu_kernels.py runs those."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from strata_dist.kernels import KERNEL_DIR

CXX = shutil.which("g++")
NVCC = shutil.which("nvcc")


def _cuda_include() -> Path | None:
    """cuda_fp16.h's folder (its host half conversions, and vector_types.h): the toolkit nvcc
    belongs to, else /usr/local/cuda's (as tests/test_kernels_compile.py looks)."""
    roots = [Path(NVCC).resolve().parent.parent / "include"] if NVCC else []
    for d in roots + [Path("/usr/local/cuda/include")]:
        if (d / "cuda_fp16.h").exists():
            return d
    return None


CUDA_INCLUDE = _cuda_include()


def weights_helpers() -> str:
    """weights.cuh's pdl_entry .. warp_max, as written there."""
    text = (Path(KERNEL_DIR) / "weights.cuh").read_text()
    start = text.index("__device__ __forceinline__ void pdl_entry()")
    end = text.index("HOST_DEVICE float h2f")
    return text[start:end]


PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <cuda_fp16.h>
#include <vector_types.h>
#include <vector_functions.h>

// the CUDA keywords, as host C++ (after the toolkit's headers, which define some of them)
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;
#define MAX_ROWS 8
#define BLOCK_THREADS 256
#define ATTN_CHUNK 256
#define DESC_POS 0
#define DESC_ROWS 1
#define DESC_TOKENS 2
#define DESC_TABLE_WORDS (DESC_TOKENS + MAX_ROWS)
#define DESC_ROW_POS (DESC_TABLE_WORDS + 1)
#define DESC_ROW_TABLE (DESC_ROW_POS + MAX_ROWS)
#define DESC_ROW_END (DESC_ROW_TABLE + MAX_ROWS)

static inline float emu_int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
#define INF_F32 emu_int_as_float(0x7f800000)

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim threadIdx, blockIdx;
EmuDim blockDim, gridDim;
static std::barrier<>* emu_block_barrier;
static std::barrier<>* emu_warp_barrier[32];
static u64 emu_exchange[32][32];

static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> static inline T __ldg(const T* p) { return *p; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
// (the toolkit's headers declare some of these for the host without defining them: macros)
static inline float emu_expf(float x) { return expf(x); }
static inline float emu_rsqrtf(float x) { return 1.f / sqrtf(x); }
static inline int emu_min(int a, int b) { return a < b ? a : b; }
static inline int emu_max(int a, int b) { return a > b ? a : b; }
#define __expf emu_expf
#define rsqrtf emu_rsqrtf
#define min emu_min
#define max emu_max
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
    const unsigned w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64 bits = 0;
    memcpy(&bits, &v, sizeof(T));
    emu_exchange[w][lane] = bits;
    emu_warp_barrier[w]->arrive_and_wait();
    bits = emu_exchange[w][lane ^ o];
    emu_warp_barrier[w]->arrive_and_wait();
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}

// every block of the grid, one after another, its threads at once
static void emu_launch(EmuDim grid, unsigned threads, const std::function<void()>& body) {
    gridDim = grid;
    blockDim = EmuDim{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::barrier<> block((std::ptrdiff_t)threads);
                std::vector<std::unique_ptr<std::barrier<>>> warps;
                for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
                    warps.emplace_back(new std::barrier<>(32));
                    emu_warp_barrier[w] = warps.back().get();
                }
                emu_block_barrier = &block;
                std::vector<std::thread> team;
                for (unsigned t = 0; t < threads; ++t)
                    team.emplace_back([&, t] {
                        threadIdx = EmuDim{t, 0, 0};
                        blockIdx = EmuDim{x, y, z};
                        body();
                    });
                for (auto& th : team) th.join();
            }
}
"""


def emulated_source(body: str, *headers: str) -> str:
    """PRELUDE, weights.cuh's helpers, the kernel headers named (from kernels/), then `body`."""
    included = "\n".join((Path(KERNEL_DIR) / h).read_text() for h in headers)
    included = re.sub(r"^#pragma once\s*$", "", included, flags=re.M)
    return PRELUDE + weights_helpers() + included + body


def build(source: str, out: Path) -> list[str]:
    """The g++ command line that builds `source` (written next to `out`) into `out`."""
    src = out.with_suffix(".cpp")
    src.write_text(source)
    return [CXX, "-std=c++20", "-O1", "-pthread", "-w", "-I", str(CUDA_INCLUDE), "-o", str(out),
            str(src)]
