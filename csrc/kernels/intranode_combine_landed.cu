// Intranode combines into landing zones (layout.cuh CombineLandingZone): every peer's rows for this rank land in
// this rank's landing zone for that peer, and the reducing warps of all CTAs reduce this rank's tokens from x and the
// zones (token t on global reducer warp t % reducers, so the grid follows the landing front; lane d waits for the
// word covering its token's landing row from peer d). The last CTA to finish writes `freed` to every peer, which the
// next call's copies and ring combines wait for. Two ways to move the rows:
// * copy engine (kZone = false, small SM budgets): Runtime::combine enqueues each peer's rows (its receive block from
//   this rank, in this rank's token order) on its copy stream in chunks, each followed by a `landed` word; no SM
//   sends.
// * zone senders (kZone = true, large SM budgets): warps [0, W) of every CTA store rows of this rank's receive blocks
//   straight into the owners' landing zones (row k of a block: stripe k / W of W rows, stripe s on CTA s % CTAs, row
//   k on warp k % W), and warp W publishes per destination how many of the CTA's stripes are complete (`zone landed`,
//   one word per (CTA, source) in the owner's buffer), so the combine's parallelism does not depend on the
//   dispatch's channel count.
#include <cstdint>

#include "intranode_combine.cuh"

namespace deep_ep {
namespace kernels {

namespace {

// One warp: this rank's rows of the previous calls in every peer's combine half are consumed (ring heads, and `freed`
// of the previous landing-zone combine), so the rows of landing-zone combine `copy_epoch` may be stored there.
__device__ bool warp_wait_landing_zones_free(const KernelContext& ctx, uint32_t copy_epoch) {
    const uint32_t peers = ((1u << ctx.num_ranks) - 1u) & ~(1u << ctx.rank);
    const int num_checked = static_cast<int>(*workspace_u32(ctx, kWsCombineMaxChannelsOffset));
    return warp_wait_drained<false>(ctx, peers, num_checked, kCombineHeadOffset, kWsCombineTailShadowOffset,
                                    kKernelCombine, kPhaseCombineSendDrain, -1) &&
           warp_wait_freed(ctx, copy_epoch - 1u, -1);
}

// Zone senders: rows of stripe `stripe` of a block live on CTA stripe % num_ctas as its local stripe stripe / num_ctas.
__device__ __forceinline__ void zone_stripe_of(int64_t row, int rows_per_stripe, int num_ctas, int* cta, int* local) {
    const int64_t stripe = row / rows_per_stripe;
    *cta = static_cast<int>(stripe % num_ctas);
    *local = static_cast<int>(stripe / num_ctas);
}

// Zone sender warp: item (q, d) = row (q * CTAs + this CTA) * W + warp of my block from d, for q < local_stripes,
// stored into d's landing zone (row and weights); progress released after each stripe. Not inlined, so that the
// reducers' registers stay out of this loop.
__device__ __noinline__ void zone_send_rows(const KernelContext& ctx, const CombineArgs& args,
                                            const int64_t* block_first, const int* block_rows,
                                            const int64_t* dest_zone, const int64_t* dest_weights, int local_stripes,
                                            int num_send_warps, volatile int* progress, volatile int* cta_failed) {
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    const int num_ctas = static_cast<int>(gridDim.x);
    const int64_t row_bytes = static_cast<int64_t>(args.hidden) * 2;
    int items = 0;
    for (int q = 0; q < local_stripes; ++q) {
        if (*cta_failed != 0) break;
        const int64_t row = (static_cast<int64_t>(q) * num_ctas + blockIdx.x) * num_send_warps + warp;
        for (int d = 0; d < ctx.num_ranks; ++d, ++items) {
            if (d == ctx.rank || row >= block_rows[d]) continue;
            char* base = static_cast<char*>(ctx.buffers[d]);
            int4* dst = reinterpret_cast<int4*>(base + dest_zone[d] + row * row_bytes);
            const int64_t src_row = block_first[d] + row;
            const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + src_row * row_bytes);
            warp_copy_row<false, kZoneSendUnroll>(src, row_bytes / 16, &dst, 1);
            if (lane < args.num_topk)
                reinterpret_cast<float*>(base + dest_weights[d])[row * args.num_topk + lane] =
                    args.topk_weights[src_row * args.num_topk + lane];
        }
        release_progress(progress, warp, items);
    }
}

template <bool kZone, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    combine_landed_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ CombineArgs args) {
    __shared__ volatile uint32_t landed_cache[kMaxRanks];  // copy engine: a landed word seen earlier, per source
    __shared__ const char* zone_data[kMaxRanks];           // my landing zone of source d: rows, weights
    __shared__ const char* zone_weights[kMaxRanks];
    __shared__ int64_t block_first[kMaxRanks];             // zone senders: my receive block from d in x: first row
    __shared__ int block_rows[kMaxRanks];                  // and its rows
    __shared__ int64_t dest_zone[kMaxRanks];               // byte offset of my landing zone in d's buffer (data)
    __shared__ int64_t dest_weights[kMaxRanks];            // and of its weights
    __shared__ volatile int progress[kWarps];              // zone senders: items done per sender warp
    __shared__ volatile int cta_failed;
    __shared__ volatile int agreement;                     // the call's verdict on the ranks' signature hashes

    const int rank = ctx.rank, num_ranks = ctx.num_ranks, num_channels = args.num_channels;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    const int64_t row_int4 = static_cast<int64_t>(args.hidden) * 2 / 16;
    const int* P = args.rank_prefix_matrix;
    const uint32_t epoch_bits = args.copy_epoch << kLandedRowBits;
    const int num_ctas = static_cast<int>(gridDim.x);
    const int num_send_warps = kZone ? args.num_send_warps : 0;  // zone senders per CTA (rows per stripe)
    const int first_reducer = kZone ? num_send_warps + 1 : 0;
    if (threadIdx.x == 0) cta_failed = 0;
    if (threadIdx.x < kMaxRanks) {
        const int d = static_cast<int>(threadIdx.x);
        landed_cache[d] = epoch_bits;
        zone_data[d] = zone_weights[d] = nullptr;
        block_first[d] = block_rows[d] = 0;
        dest_zone[d] = dest_weights[d] = 0;
        if (d < num_ranks && d != rank) {
            const int rows = P[rank * num_ranks + d] - (rank > 0 ? P[(rank - 1) * num_ranks + d] : 0);
            const CombineLandingZone z =
                combine_landing_zone(ctx.num_nvl_bytes, num_ranks, d, rows, args.hidden, args.num_topk);
            zone_data[d] = static_cast<const char*>(ctx.buffers[rank]) + z.data;
            zone_weights[d] = static_cast<const char*>(ctx.buffers[rank]) + z.weights;
            // My receive block from d (rows of x, in d's token order) and where it lands in d's buffer.
            block_first[d] = d > 0 ? P[(d - 1) * num_ranks + rank] : 0;
            block_rows[d] = P[d * num_ranks + rank] - static_cast<int>(block_first[d]);
            const CombineLandingZone out =
                combine_landing_zone(ctx.num_nvl_bytes, num_ranks, rank, block_rows[d], args.hidden, args.num_topk);
            dest_zone[d] = out.data;
            dest_weights[d] = out.weights;
        }
    }
    if (threadIdx.x < kWarps) progress[threadIdx.x] = 0;
    combine_agreement<false>(ctx, args, &agreement);
    __syncthreads();
    // The ranks disagree on this call: nothing is sent or reduced, and the last CTA still frees this rank's landing
    // zones (every peer's next landing-zone combine waits for that). Rows a peer's copies store into them meanwhile
    // are never read.
    const bool skip = agreement != kCombineAgreementHolds;
    if (agreement == kCombineAgreementFailed && threadIdx.x == 0) cta_failed = 1;

    if (kZone && warp < first_reducer) {
        // Warp 0: the previous calls' rows of this rank in every peer's combine half must be consumed first.
        if (warp == 0 && !ctx.skip_sends && !skip && !warp_wait_landing_zones_free(ctx, args.copy_epoch) &&
            lane == 0)
            cta_failed = 1;
        named_barrier(kBarrierAllSenders, first_reducer * 32);
    }
    // Zone senders: stripes of W rows of the largest block, stripe s on CTA s % CTAs; this CTA's count.
    int local_stripes = 0;
    if (kZone && !skip) {
        int most = 0;
        for (int d = 0; d < num_ranks; ++d) most = max(most, block_rows[d]);
        const int stripes = (most + max(num_send_warps, 1) - 1) / max(num_send_warps, 1);
        local_stripes = max(stripes - static_cast<int>(blockIdx.x) + num_ctas - 1, 0) / num_ctas;
    }
    if (kZone && warp < num_send_warps) {
        if (!ctx.skip_sends)
            zone_send_rows(ctx, args, block_first, block_rows, dest_zone, dest_weights, local_stripes, num_send_warps,
                           progress, &cta_failed);
    } else if (kZone && warp == num_send_warps) {
        // Zone publisher: lane d publishes the number of this CTA's stripes of my block from d that every sender
        // warp has finished (one system fence per publication).
        const int total_items = ctx.skip_sends ? 0 : local_stripes * num_ranks;
        int published = 0, spins = 0;
        while (cta_failed == 0) {
            const int done = min(min_progress(progress, 0, num_send_warps, 1, 0), total_items);
            // Stripes complete for lane d: items (q, d') are done in order q-major, d' inner.
            const int complete = lane < num_ranks && lane != rank ? (done - lane + num_ranks - 1) / num_ranks : 0;
            const bool advance = __any_sync(0xffffffffu, complete > published);
            if (advance) {
                // Lane 0 fences once and stores every destination's count (as publish_tails does for the rings).
                int counts[kMaxRanks];
#pragma unroll
                for (int d = 0; d < kMaxRanks; ++d) counts[d] = __shfl_sync(0xffffffffu, complete, d);
                if (lane == 0) {
                    fence_acq_rel_sys();
                    for (int d = 0; d < num_ranks; ++d)
                        if (d != rank && counts[d] > 0)
                            st_release_sys(buffer_u32(ctx.buffers[d], kCombineZoneLandedOffset) +
                                           counter_index(static_cast<int>(blockIdx.x), rank),
                                           epoch_bits | static_cast<uint32_t>(counts[d]));
                }
                published = max(published, complete);
            }
            if (done >= total_items) break;
            if (!advance) publisher_idle(ctx, &cta_failed, &spins);
        }
    } else {
        const int reducer = kZone ? warp - first_reducer : warp;
        const int reducers_per_cta = kWarps - first_reducer;
        const int64_t own_block = rank > 0 ? P[(rank - 1) * num_ranks + rank] : 0;
        const int per_channel = num_channels > 0 ? (args.num_tokens + num_channels - 1) / num_channels : 1;
        const int num_warps = num_ctas * reducers_per_cta;
        int cached_cta = -1;          // lane d, zone senders: the CTA of the last landed word it read, and that word
        uint32_t cached_word = 0u;
        for (int t = static_cast<int>(blockIdx.x) * reducers_per_cta + reducer; t < args.num_tokens && !skip;
             t += num_warps) {
            if (cta_failed != 0) break;
            const int c = t / per_channel;  // the dispatch channel of t (channel_range)
            // Lane d: j = index of t among channel c's tokens to d; k = landing row of t at d (rows in my token order).
            const int j = lane < num_ranks ? args.send_head[static_cast<int64_t>(t) * num_ranks + lane] : -1;
            int k = -1;
            bool ok = true;
            if (j >= 0 && lane != rank) {
                k = (c > 0 ? args.channel_prefix_matrix[lane * num_channels + c - 1] : 0) + j;
                if (kZone) {
                    int cta, local;
                    zone_stripe_of(k, max(num_send_warps, 1), num_ctas, &cta, &local);
                    const uint32_t needed = epoch_bits | static_cast<uint32_t>(local + 1);
                    if (cta != cached_cta || !seq_geq(cached_word, needed)) {
                        uint32_t seen;
                        ok = wait_geq(ctx,
                                      buffer_u32(ctx.buffers[rank], kCombineZoneLandedOffset) +
                                          counter_index(cta, lane),
                                      needed, Site{kKernelCombine, kPhaseCombineRecvWaitLanded, lane, cta}, &seen);
                        cached_cta = cta;
                        cached_word = seen;
                    }
                    __threadfence_block();  // acquire for the warp: lane d's acquire load came first
                } else {
                    const uint32_t needed = epoch_bits | static_cast<uint32_t>(k + 1);
                    if (!seq_geq(landed_cache[lane], needed)) {
                        uint32_t seen;
                        ok = wait_geq(ctx, buffer_u32(ctx.buffers[rank], kCombineLandedOffset) + lane, needed,
                                      Site{kKernelCombine, kPhaseCombineRecvWaitLanded, lane, c}, &seen);
                        if (ok) landed_cache[lane] = seen;
                    }
                    __threadfence_block();  // acquire: a cached word was stored after its reader's acquire load
                }
            }
            if (!__all_sync(0xffffffffu, ok)) {
                if (lane == 0) cta_failed = 1;
                break;
            }
            // Contribution sources: my row of x, and row k of my landing zone of d.
            const int4* srcs[kMaxRanks];
            const float* wsrcs[kMaxRanks];
            int own;
            const int num_srcs = token_sources(
                args, rank, num_ranks, j, own_block + args.recv_channel_prefix_matrix[rank * num_channels + c],
                [&](int d, int, const int4** src, const float** wsrc) {
                    const int64_t kd = __shfl_sync(0xffffffffu, k, d);
                    *src = reinterpret_cast<const int4*>(zone_data[d] + kd * args.hidden * 2);
                    *wsrc = reinterpret_cast<const float*>(zone_weights[d]) + kd * args.num_topk;
                },
                srcs, wsrcs, &own);
            reduce_token(args, t, srcs, wsrcs, num_srcs, own, row_int4, kZone);
        }
    }

    // The last CTA to finish frees my landing zones: every CTA's loads of them are complete (their values were used).
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) {
        last = false;
        if (cta_failed == 0) {
            __threadfence();
            unsigned int* done = workspace_u32(ctx, kWsCombineDoneOffset);
            if (atomicAdd(done, 1u) == gridDim.x - 1) {
                *done = 0u;
                last = true;
            }
        }
    }
    __syncthreads();
    if (last && threadIdx.x < num_ranks && static_cast<int>(threadIdx.x) != rank) {
        fence_acq_rel_sys();
        st_release_sys(buffer_u32(ctx.buffers[threadIdx.x], kCombineFreedOffset) + rank, args.copy_epoch);
    }
}

// One warp on the copy stream: the landing zones of call `copy_epoch` in every peer are free
// (warp_wait_landing_zones_free), so its copies may land there.
__global__ void combine_copy_prepare_kernel(const __grid_constant__ KernelContext ctx, uint32_t copy_epoch) {
    warp_wait_landing_zones_free(ctx, copy_epoch);
}

// One warp on the copy stream, after a chunk of copies: publishes the landed words (stream order puts the copies'
// writes before this kernel).
__global__ void combine_copy_flag_kernel(const __grid_constant__ KernelContext ctx,
                                         const __grid_constant__ LandedFlags flags) {
    const int d = lane_id();
    if (d < ctx.num_ranks && flags.values[d] != 0u) {
        fence_acq_rel_sys();
        st_release_sys(buffer_u32(ctx.buffers[d], kCombineLandedOffset) + ctx.rank, flags.values[d]);
    }
}

}  // namespace

Status intranode_combine_landed(const KernelContext& ctx, const CombineArgs& args, int num_ctas, bool zone,
                                cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "combine"));
    DEEP_EP_REQUIRE_ARG(ctx.put_mask == 0,
                        "combine: the landing-zone combines store into peers' buffers; a world with ",
                        "NVSHMEM put peers (mask ", ctx.put_mask, ") combines through the rings");
    DEEP_EP_RETURN_IF_FAILED(check_combine_rows(args));
    DEEP_EP_REQUIRE_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                        "combine: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    DEEP_EP_REQUIRE_ARG(args.channel_prefix_matrix != nullptr && args.copy_epoch != 0,
                        "combine: the copy-engine path needs the handle's channel_prefix_matrix and an epoch");
    DEEP_EP_REQUIRE_ARG(num_ctas >= 1 && num_ctas <= kMaxChannels, "combine: CTAs must be in [1, ", kMaxChannels,
                        "], got ", num_ctas);
    DEEP_EP_RETURN_IF_FAILED(check_resident("combine", num_ctas));
    if (zone) {
        // Senders, the publisher and at least one reducer warp; the senders' count is the stripe's rows.
        DEEP_EP_RETURN_IF_FAILED(check_send_warps("combine", args.num_send_warps, 1, kZoneWarps - 2));
        combine_landed_kernel<true, kZoneWarps><<<num_ctas, kZoneWarps * 32, 0, stream>>>(ctx, args);
    } else {
        combine_landed_kernel<false, kChannelWarps><<<num_ctas, kChannelThreads, 0, stream>>>(ctx, args);
    }
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status intranode_combine_copy_prepare(const KernelContext& ctx, uint32_t copy_epoch, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "combine"));
    combine_copy_prepare_kernel<<<1, 32, 0, stream>>>(ctx, copy_epoch);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status intranode_combine_copy_flag(const KernelContext& ctx, const LandedFlags& flags, cudaStream_t stream) {
    combine_copy_flag_kernel<<<1, 32, 0, stream>>>(ctx, flags);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
