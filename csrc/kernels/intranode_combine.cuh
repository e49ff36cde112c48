// Reduction helpers of the intranode combines (intranode_combine_rings.cu, intranode_combine_landed.cu): every
// send path reduces a token the same way, its own row (read from x) and the peers' rows in ascending rank order in
// float32, plus the biases, rounding to BF16 once.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "intranode_common.cuh"

namespace deep_ep {
namespace kernels {

constexpr int kReduceUnroll = 2;  // 16-byte chunks per lane (and contribution) in flight in the combine reducer
// Zone-sender combine: 20 warps per CTA, 7 loads in flight per sender lane and 4 chunks per reducer lane and
// contribution (EP2, hidden 7168, 24 SMs on H200: 222.5 us, against 254-270 us with 32 warps and unrolls 4 and 2).
// With 20 warps a thread has 96 registers, so the deeper unrolls do not spill.
constexpr int kZoneWarps = 20;
constexpr int kZoneSendUnroll = 7;
constexpr int kZoneReduceUnroll = 4;

// Whole warp: waits until every peer has finished reading the rows of this rank's copy-engine combines up to
// `copy_epoch` (its `freed` word, written by the peer, reached it). Returns false on failure (reported).
static __device__ bool warp_wait_freed(const KernelContext& ctx, uint32_t copy_epoch, int channel) {
    const int lane = lane_id();
    bool ok = true;
    if (copy_epoch != 0 && lane < ctx.num_ranks && lane != ctx.rank) {
        uint32_t seen;
        ok = wait_geq(ctx, buffer_u32(ctx.buffers[ctx.rank], kCombineFreedOffset) + lane, copy_epoch,
                      Site{kKernelCombine, kPhaseCombineCopyWaitFreed, lane, channel}, &seen);
    }
    fence_acq_rel_sys();
    return __all_sync(0xffffffffu, ok);
}

// ---- agreement of a checked combine (args.signature_hash != 0) ----
// The verdict of the call in each CTA (shared): the hashes agree (or the call is unchecked), differ, or a wait for
// a peer's word failed (reported).
constexpr int kCombineAgreementHolds = 1, kCombineAgreementDiffers = 2, kCombineAgreementFailed = 3;

// Control-region offset of source `source`'s agreement word of combine call `call_number` (layout.cuh: by call
// parity).
__device__ __forceinline__ int64_t combine_agreement_offset(int source, uint32_t call_number) {
    return kCombineAgreementOffset + 8 * (2 * source + static_cast<int64_t>(call_number & 1u));
}

// Lane d of CTA 0's agreement warp: this rank's word of the call (call number, signature hash) into peer d's buffer,
// before the warp waits for anything: a release store for a pointer peer, a 64-bit signal into the word's twin for a
// put peer (put.cuh; the word arrives whole).
template <bool kPut>
__device__ __forceinline__ void publish_combine_agreement(const KernelContext& ctx, const CombineArgs& args,
                                                          uint32_t call_number) {
    const int d = lane_id();
    if (blockIdx.x != 0 || d >= ctx.num_ranks || d == ctx.rank) return;
    const int64_t offset = combine_agreement_offset(ctx.rank, call_number);
    const uint64_t word = (static_cast<uint64_t>(call_number) << 32) | args.signature_hash;
    if (kPut && is_ring_put_peer(ctx, d))
        put_signal(ctx, offset, d, word);
    else
        st_release_sys_u64(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.buffers[d]) + offset), word);
}

// One warp per CTA (checked combines): lane d waits for peer d's word of this call (in this rank's control region,
// or in its twin for a put peer) and the warp compares every peer's hash with this rank's. Every rank compares the
// same hashes, so every rank reaches the same verdict: if they are not all equal, every rank has a peer whose hash
// differs from its own. A difference fills the error record (kErrorArgumentMismatch, no abort). The last CTA to
// compare counts the call and, with host_verdict, publishes the call's call_seq.
template <bool kPut>
static __device__ __noinline__ int warp_combine_agreement(const KernelContext& ctx, const CombineArgs& args,
                                                          uint32_t call_number) {
    const int lane = lane_id();
    bool ok = true;
    uint32_t their_hash = args.signature_hash;
    if (lane < ctx.num_ranks && lane != ctx.rank) {
        const int64_t offset = combine_agreement_offset(lane, call_number);
        const uint64_t* word = kPut && is_ring_put_peer(ctx, lane)
            ? signal_twin(ctx, offset)
            : reinterpret_cast<const uint64_t*>(static_cast<const char*>(ctx.buffers[ctx.rank]) + offset);
        uint32_t seen;
        ok = wait_geq(ctx, reinterpret_cast<const uint32_t*>(word) + 1, call_number,  // the call number half
                      Site{kKernelCombine, kPhaseCombineWaitAgreement, lane, static_cast<int>(blockIdx.x)}, &seen);
        if (ok) {
            after_peer_wait<kPut>(ctx, offset, lane);
            their_hash = static_cast<uint32_t>(ld_acquire_sys_u64(word));
        }
    }
    const bool all_ok = __all_sync(0xffffffffu, ok);
    const uint32_t differ = __ballot_sync(0xffffffffu, their_hash != args.signature_hash);
    const int first = differ != 0u ? __ffs(static_cast<int>(differ)) - 1 : 0;
    const uint32_t first_hash = __shfl_sync(0xffffffffu, their_hash, first);
    if (lane == 0) {
        if (all_ok && differ != 0u)
            fill_error_record(ctx.error, workspace_u32(ctx, kWsErrorClaimOffset), kErrorArgumentMismatch,
                              kKernelCombine, kPhaseCombineAgreement, ctx.rank, first, static_cast<int>(blockIdx.x),
                              ctx.call_seq, args.signature_hash, first_hash, 0);
        publish_agreement_verdict(ctx, args.host_verdict, gridDim.x, call_number);
    }
    return !all_ok ? kCombineAgreementFailed : (differ != 0u ? kCombineAgreementDiffers : kCombineAgreementHolds);
}

// The last warp of every CTA, at kernel start: the verdict of the call into `agreement` (shared), before the CTA's
// first barrier. A checked call's number (checked_call_number) is loaded by this warp alone, so the other warps' first
// loads overlap it; the warp loads it before its CTA's arrival in publish_agreement_verdict, which is what keeps every
// CTA's number the same (the count advances only after every CTA has arrived). Ranks are at most 24: a lane each.
template <bool kPut>
__device__ __forceinline__ void combine_agreement(const KernelContext& ctx, const CombineArgs& args,
                                                  volatile int* agreement) {
    if (threadIdx.x / 32 != blockDim.x / 32 - 1) return;
    int verdict = kCombineAgreementHolds;
    if (args.signature_hash != 0u) {
        const uint32_t call_number = __shfl_sync(0xffffffffu, lane_id() == 0 ? checked_call_number(ctx) : 0u, 0);
        publish_combine_agreement<kPut>(ctx, args, call_number);
        verdict = warp_combine_agreement<kPut>(ctx, args, call_number);
    }
    if (lane_id() == 0) *agreement = verdict;
}

// One warp: out = bf16(a + b) (b may be null: out = bf16(a)) in float32, kU 16-byte chunks of both rows in flight per
// lane; `*_ring` selects the coherent load for ring slots. The combine reducer's path when a token has one or two
// contributions and no bias (every routed token at EP2; a token routed nowhere takes the general path: zeros). Not
// inlined: inside the combine kernel's 64-register budget the loaded chunks would be spilled, which serialises the
// loads.
template <int kU>
static __device__ __noinline__ void reduce_two(const int4* a, bool a_ring, const int4* b, bool b_ring, int4* out,
                                               int64_t row_int4) {
    for (int64_t base = lane_id(); base < row_int4; base += 32 * kU) {
        int4 va[kU], vb[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int64_t i = base + u * 32;
            if (i < row_int4) {
                va[u] = a_ring ? ld_ring_int4(a + i) : ld_nc_int4(a + i);
                if (b != nullptr) vb[u] = b_ring ? ld_ring_int4(b + i) : ld_nc_int4(b + i);
            }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int64_t i = base + u * 32;
            if (i >= row_int4) continue;
            float acc[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
            add_bf16x8(acc, va[u]);
            if (b != nullptr) add_bf16x8(acc, vb[u]);
            st_na_int4(out + i, pack_bf16x8(acc));
        }
    }
}

// Whole warp: a token's contribution sources in ascending rank order; returns their count and sets `own` to the
// index of this rank's own row (-1 if none). Lane d holds j_d = the token's index among its channel's tokens to d
// (-1: not sent there). This rank's row is x[own_base + j] (and its topk_weights row); a peer's source comes from
// peer_source(d, j, &src, &wsrc), called by the whole warp (d and j are the same on every lane).
template <typename PeerSource>
__device__ __forceinline__ int token_sources(const CombineArgs& args, int rank, int num_ranks, int lane_j,
                                             int64_t own_base, PeerSource peer_source, const int4** srcs,
                                             const float** wsrcs, int* own) {
    int num_srcs = 0;
    *own = -1;
    for (int d = 0; d < num_ranks; ++d) {
        const int j = __shfl_sync(0xffffffffu, lane_j, d);
        if (j < 0) continue;
        if (d == rank) {
            const int64_t row = own_base + j;
            *own = num_srcs;
            srcs[num_srcs] = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + row * args.hidden * 2);
            wsrcs[num_srcs] = args.num_topk > 0 ? args.topk_weights + row * args.num_topk : nullptr;
        } else {
            peer_source(d, j, &srcs[num_srcs], &wsrcs[num_srcs]);
        }
        ++num_srcs;
    }
    return num_srcs;
}

// One warp: combined_x[t] = bf16(bias_0[t] + bias_1[t] + sum of srcs[0..num_srcs) in that order) in float32, and
// combined_topk_weights[t] summed likewise from wsrcs. srcs[own] is this rank's x row (non-coherent loads); the
// others were written by peers or the copy engine (coherent loads).
__device__ __forceinline__ void reduce_token(const CombineArgs& args, int t, const int4* const* srcs,
                                             const float* const* wsrcs, int num_srcs, int own, int64_t row_int4,
                                             bool wide = false) {
    const int lane = lane_id();
    const int64_t row_offset = static_cast<int64_t>(t) * args.hidden * 2;
    const int4* bias0 = args.bias_0 != nullptr
        ? reinterpret_cast<const int4*>(static_cast<const char*>(args.bias_0) + row_offset) : nullptr;
    const int4* bias1 = args.bias_1 != nullptr
        ? reinterpret_cast<const int4*>(static_cast<const char*>(args.bias_1) + row_offset) : nullptr;
    int4* out = reinterpret_cast<int4*>(static_cast<char*>(args.combined_x) + row_offset);
    const int num_topk = args.num_topk;
    float* weights_out = args.combined_topk_weights != nullptr
        ? args.combined_topk_weights + static_cast<int64_t>(t) * num_topk : nullptr;
    if (num_srcs >= 1 && num_srcs <= 2 && bias0 == nullptr && bias1 == nullptr) {
        const int4* second = num_srcs > 1 ? srcs[1] : nullptr;
        if (wide) reduce_two<kZoneReduceUnroll>(srcs[0], own != 0, second, own != 1, out, row_int4);
        else reduce_two<kReduceUnroll>(srcs[0], own != 0, second, own != 1, out, row_int4);
    } else {
        for (int64_t base_i = lane; base_i < row_int4; base_i += 32 * kReduceUnroll) {
            float acc[kReduceUnroll][8];
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
                const int64_t i = base_i + u * 32;
                if (i < row_int4) {
                    if (bias0 != nullptr) add_bf16x8(acc[u], ld_nc_int4(bias0 + i));
                    if (bias1 != nullptr) add_bf16x8(acc[u], ld_nc_int4(bias1 + i));
                }
            }
            // Two contributions in flight at a time; additions stay in ascending rank order.
            for (int n = 0; n < num_srcs; n += 2) {
                const bool has_second = n + 1 < num_srcs;
                int4 v[2][kReduceUnroll];
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u) {
                    const int64_t i = base_i + u * 32;
                    if (i < row_int4) {
                        v[0][u] = n == own ? ld_nc_int4(srcs[n] + i) : ld_ring_int4(srcs[n] + i);
                        if (has_second)
                            v[1][u] = n + 1 == own ? ld_nc_int4(srcs[n + 1] + i) : ld_ring_int4(srcs[n + 1] + i);
                    }
                }
#pragma unroll
                for (int u = 0; u < kReduceUnroll; ++u) {
                    if (base_i + u * 32 >= row_int4) continue;
                    add_bf16x8(acc[u], v[0][u]);
                    if (has_second) add_bf16x8(acc[u], v[1][u]);
                }
            }
#pragma unroll
            for (int u = 0; u < kReduceUnroll; ++u) {
                const int64_t i = base_i + u * 32;
                if (i < row_int4) st_na_int4(out + i, pack_bf16x8(acc[u]));
            }
        }
    }
    if (weights_out != nullptr && lane < num_topk) {
        float w = 0.0f;
        for (int n = 0; n < num_srcs; ++n) {
            const bool is_own = n == own;
            w += is_own ? wsrcs[n][lane] : reinterpret_cast<const volatile float*>(wsrcs[n])[lane];
        }
        weights_out[lane] = w;
    }
}

// The checks every combine launcher makes of its rows: BF16 rows of a whole number of 16-byte units, top-k within
// the kernels' limit, weights whenever there is a top-k.
inline Status check_combine_rows(const CombineArgs& args) {
    DEEP_EP_REQUIRE_ARG(args.hidden > 0 && (args.hidden * 2) % 16 == 0,
                        "combine: hidden * 2 bytes must be a positive multiple of 16, got hidden ", args.hidden);
    DEEP_EP_REQUIRE_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "combine: num_topk must be in [0, ", kMaxTopk,
                        "], got ", args.num_topk);
    DEEP_EP_REQUIRE_ARG(args.num_topk == 0 || args.topk_weights != nullptr,
                        "combine: topk_weights must be given when num_topk > 0");
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
