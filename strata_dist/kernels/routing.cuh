// A router row's softmax and top-k in rank order, by one warp: the decode graph's router launch
// (experts.cuh) and a prompt chunk's routing (experts_rows.cu) pick experts with the same code.
#pragma once

// Softmax over the n_expert logits at l, then the k largest probabilities in rank order (ties: the
// lower expert, as a stable sort gives them). Lane r < k gets the r-th pick (`mine`, -1 or past
// n_expert when nothing was picked: NaN or infinite logits) and its probability; every lane gets
// the picks' sum. The logits may have been written by other blocks of the same launch: they are
// read through L2 (__ldcg), not a possibly stale L1. PER: logits per lane (32 * PER >= n_expert):
// the loops unroll to it, so 128 experts run a quarter of the 512-expert build's instructions.
template <int PER>
__device__ __forceinline__ void topk_softmax_row(const float* __restrict__ l, int n_expert, int k,
                                                 int lane, int& mine, float& mine_p,
                                                 float& picked_sum) {
    float v[PER];
    float m = -INF_F32;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? __ldcg(l + e) : -INF_F32;
        m = fmaxf(m, v[j]);
    }
    m = warp_max(m);
    float sum = 0.f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < n_expert ? __expf(v[j] - m) : -1.f;   // probabilities are >= 0
        if (e < n_expert) sum += v[j];
    }
    sum = warp_sum(sum);
    picked_sum = 0.f;
    mine = -1;                                            // lane r keeps the r-th pick
    mine_p = 0.f;
    for (int r = 0; r < k; ++r) {
        float best = -1.f; int best_e = 0x7fffffff;
        #pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int e = lane + 32 * j;
            if (v[j] > best || (v[j] == best && e < best_e)) { best = v[j]; best_e = e; }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
        }
        const float p = best / sum;
        picked_sum += p;
        if (lane == r) { mine = best_e; mine_p = p; }
        #pragma unroll
        for (int j = 0; j < PER; ++j)                     // taken (static indices: registers)
            if (lane + 32 * j == best_e) v[j] = -2.f;
    }
}
