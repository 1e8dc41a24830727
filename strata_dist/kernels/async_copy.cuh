// Copies into shared memory without a register on the way (sm_80+ cp.async, sm_90 bulk copies
// completed on an mbarrier), shared by the kernel sources.
#pragma once
#include "weights.cuh"   // the integer typedefs

// 16 bytes from global to shared memory without a register (zeros where !valid)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(at), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_newest_pending() {   // all but the last group done
    asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// The copy engine's side (sm_90): an mbarrier counting `arrivals` threads and the bytes they
// announce; bulk copies that count their bytes on it; a wait for one of its phases.
__device__ __forceinline__ unsigned smem_at(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(u64* bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_at(bar)), "r"(arrivals));
}
__device__ __forceinline__ void mbar_init_fence() {     // the inits visible to the copy engine
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// this thread arrives, announcing `bytes`, then copies them (16-byte aligned, a multiple of 16)
__device__ __forceinline__ void bulk_copy_counted(void* smem, const void* gmem, unsigned bytes,
                                                  u64* bar) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // after the reads of the last use
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_at(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 :: "r"(smem_at(smem)), "l"(gmem), "r"(bytes), "r"(smem_at(bar)) : "memory");
}
// Until phase `parity` of the barrier has completed. Bounded: a copy that never lands (a bad
// address) traps, failing the launch, instead of hanging the device.
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
    for (unsigned tries = 0;; ++tries) {
        unsigned done;
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_at(bar)), "r"(parity) : "memory");
        if (done) return;
        if (tries > (1u << 24)) __trap();
    }
}
