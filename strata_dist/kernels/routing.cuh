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
        // The warp's largest, then the least expert holding it, as two warp reductions (redux,
        // sm_80 on) rather than a five-step shuffle tree of (value, expert) pairs: the k rounds
        // are the router tail's serial part. A lane's best is a probability (>= 0, whose bits
        // order as signed ints the way the floats do; -0 as +0, which it equals) or -1 (nothing
        // left): key -1, below all.
        const int key = best > 0.f ? __float_as_int(best) : best == 0.f ? 0 : -1;
        const int top = __reduce_max_sync(0xffffffffu, key);
        best_e = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)best_e : 0x7fffffffu);
        best = top >= 0 ? __int_as_float(top) : -1.f;
        const float p = best / sum;
        picked_sum += p;
        if (lane == r) { mine = best_e; mine_p = p; }
        #pragma unroll
        for (int j = 0; j < PER; ++j)                     // taken (static indices: registers)
            if (lane + 32 * j == best_e) v[j] = -2.f;
    }
}
