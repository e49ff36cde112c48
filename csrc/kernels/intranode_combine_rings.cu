// Intranode combine through the rings: ring-sender warps push the rows of my receive blocks back to their owners'
// rings (each destination has its own warps); the publisher warp publishes their tails and the heads of the slots
// reduced. Reducer warps take my tokens of the channel (token i on reducer warp i % their count), each waiting only
// for its own slots. The send path of the mid SM budgets, and the only one for NVSHMEM put peers.
#include <cstdint>

#include "intranode_combine.cuh"

namespace deep_ep {
namespace kernels {

namespace {

struct CombineGeometry {
    RingGeometry ring;
    int64_t weights_offset;  // in the record
};

// kPut: some peers are NVSHMEM put peers (put.cuh): rows for them are staged and put per block by their ring
// senders; the tails follow as signals.
template <bool kPut>
__global__ void __launch_bounds__(kChannelThreads, 1)
    combine_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ CombineArgs args,
                   const __grid_constant__ CombineGeometry geo) {
    // Warps [0, W) push rows of my receive blocks back to their owners' rings: warp w serves destination index
    // w % (R - 1), so each destination's stream has its own warps and never waits on another stream. Warp W
    // publishes the tails of those streams and the heads of the rings it reduces from. The other warps reduce my
    // tokens of this channel, token i on reducer warp i % (their count), each waiting only for its own slots.
    __shared__ uint32_t tail_base[kMaxRanks];            // sender: tail shadow at kernel entry, per destination
    __shared__ volatile uint32_t head_cache[kMaxRanks];  // sender: a head seen earlier, per destination
    __shared__ uint32_t head_base[kMaxRanks];            // reducer: head shadow at kernel entry, per sending rank
    __shared__ volatile uint32_t tail_cache[kMaxRanks];  // reducer: a tail seen earlier, per sending rank
    __shared__ int block_first[kMaxRanks];               // my receive block (source s, this channel): first row of x
    __shared__ int block_count[kMaxRanks];               // and its number of rows
    __shared__ volatile int progress[kChannelWarps];     // per warp: index of its next item (row or token)
    __shared__ volatile int cta_failed;
    __shared__ volatile int agreement;                   // the call's verdict on the ranks' signature hashes

    const int rank = ctx.rank, num_ranks = ctx.num_ranks, channel = static_cast<int>(blockIdx.x);
    const int num_channels = args.num_channels, capacity = geo.ring.capacity;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    const int num_copy_warps = num_ranks > 1 ? args.num_send_warps : 0;
    const int first_reducer = num_ranks > 1 ? num_copy_warps + 1 : 0;
    const int num_reduce_warps = kChannelWarps - first_reducer;
    const int num_dests = num_ranks > 1 ? num_ranks - 1 : 1;
    const int64_t row_int4 = static_cast<int64_t>(args.hidden) * 2 / 16;
    const int* P = args.rank_prefix_matrix;
    const int* recv_cpm = args.recv_channel_prefix_matrix;
    int begin, end;
    channel_range(args.num_tokens, num_channels, channel, &begin, &end);
    const int num_channel_tokens = end - begin;

    if (threadIdx.x == 0) cta_failed = 0;
    if (threadIdx.x < kMaxRanks) {
        const int d = static_cast<int>(threadIdx.x);
        tail_base[d] = *workspace_u32(ctx, kWsCombineTailShadowOffset + 4 * counter_index(channel, d));
        head_cache[d] = tail_base[d];
        head_base[d] = *workspace_u32(ctx, kWsCombineHeadShadowOffset + 4 * counter_index(channel, d));
        tail_cache[d] = head_base[d];
        block_first[d] = 0;
        block_count[d] = 0;
        if (d < num_ranks) {
            const int src_block = d > 0 ? P[(d - 1) * num_ranks + rank] : 0;
            const int src_rows = P[d * num_ranks + rank] - src_block;
            const int channel_first = recv_cpm[d * num_channels + channel];
            const int channel_next = channel + 1 < num_channels ? recv_cpm[d * num_channels + channel + 1] : src_rows;
            block_first[d] = src_block + channel_first;
            block_count[d] = channel_next - channel_first;
        }
    }
    if (threadIdx.x < kChannelWarps) {
        const int w = static_cast<int>(threadIdx.x);
        progress[w] = w < num_copy_warps ? w / num_dests : (w >= first_reducer ? w - first_reducer : 0);
    }
    combine_agreement<kPut>(ctx, args, &agreement);
    __syncthreads();
    if (agreement != kCombineAgreementHolds) {
        // No row moves and no ring advances on any rank. A peer may have taken a landing-zone path in this call:
        // its next one waits for `freed` of this call from every rank.
        if (agreement == kCombineAgreementDiffers && args.mismatch_freed != 0u && channel == 0 &&
            static_cast<int>(threadIdx.x) < num_ranks && static_cast<int>(threadIdx.x) != rank) {
            fence_acq_rel_sys();
            st_release_sys(buffer_u32(ctx.buffers[threadIdx.x], kCombineFreedOffset) + rank, args.mismatch_freed);
        }
        return;
    }

    if (warp < first_reducer) {
        if constexpr (kPut) {  // a copy warp's progress starts at its first block (the ring-sender loop below)
            if (warp < num_copy_warps && lane == 0) {
                const int di = warp % num_dests, d = di < rank ? di : di + 1;
                const int stride = (num_copy_warps - di + num_dests - 1) / num_dests;
                progress[warp] = warp / num_dests * put_block_items(block_count[d], stride, args.num_max_send_tokens);
            }
        }
        // Warp 0: the previous call's data to every destination must be consumed first (geometry may differ).
        if (warp == 0 && !ctx.skip_sends) {
            const uint32_t peers = ((1u << num_ranks) - 1u) & ~(1u << rank);
            const int num_checked = raise_max_channels(ctx, kWsCombineMaxChannelsOffset, num_channels);
            if (!warp_wait_drained<kPut>(ctx, peers, num_checked, kCombineHeadOffset, kWsCombineTailShadowOffset,
                                         kKernelCombine, kPhaseCombineSendDrain, channel) && lane == 0)
                cta_failed = 1;
            // The rings share the combine half with the landing zones of copy-engine combines: those must be read.
            if (!warp_wait_freed(ctx, args.copy_epoch, channel) && lane == 0) cta_failed = 1;
        }
        named_barrier(kBarrierAllSenders, first_reducer * 32);
    }

    if (warp < num_copy_warps) {
        // ------------------------------------------------------------------ ring sender: rows back to their owners
        const int dest_index = warp % num_dests;
        const int dst = dest_index < rank ? dest_index : dest_index + 1;
        const int stride = (num_copy_warps - dest_index + num_dests - 1) / num_dests;
        const int64_t first = block_first[dst];
        const int count = block_count[dst];
        // With put peers, blocks of put_block consecutive rows go round the destination's warps instead of row j
        // to warp j % stride, and a warp puts each block's rows itself before it releases the block (put.cuh).
        const int put_block = kPut ? put_block_items(count, stride, args.num_max_send_tokens) : 1;
        for (int j = warp / num_dests * put_block; j < count && !ctx.skip_sends;
             j += kPut && (j + 1) % put_block != 0 ? 1 : (stride - 1) * put_block + 1) {
            if (cta_failed != 0) break;
            bool ok = true;
            if (lane == 0) {
                ok = wait_space<kPut>(ctx, head_cache, dst, channel, tail_base[dst] + static_cast<uint32_t>(j) + 1u,
                                      capacity, kCombineHeadOffset, kKernelCombine, kPhaseCombineSendWaitHead);
            }
            if (!__shfl_sync(0xffffffffu, ok, 0)) {
                if (lane == 0) cta_failed = 1;
                break;
            }
            const int64_t row = first + j;
            const uint32_t slot = (tail_base[dst] + static_cast<uint32_t>(j)) % static_cast<uint32_t>(capacity);
            char* rec = kPut && is_ring_put_peer(ctx, dst)  // the staging twin; this warp puts it
                ? staging_slot(ctx, geo.ring, channel, dst, static_cast<int>(slot))
                : static_cast<char*>(ctx.buffers[dst]) + geo.ring.slot_offset(channel, rank, static_cast<int>(slot));
            int4* rec_row = reinterpret_cast<int4*>(rec);
            const int4* src_row =
                reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + row * args.hidden * 2);
            warp_copy_row<false>(src_row, row_int4, &rec_row, 1);
            if (lane < args.num_topk)
                reinterpret_cast<float*>(rec + geo.weights_offset)[lane] = args.topk_weights[row * args.num_topk + lane];
            if constexpr (kPut) {
                if ((j + 1) % put_block == 0 || j + 1 == count) {
                    const int run_start = j - j % put_block;
                    put_staged_runs(ctx, geo.ring, channel, tail_base[dst] + static_cast<uint32_t>(run_start),
                                    lane == dst && is_ring_put_peer(ctx, dst) ? j + 1 - run_start : 0);
                    release_progress(progress, warp, run_start + stride * put_block);
                }
            } else {
                release_progress(progress, warp, j + stride);
            }
        }
    } else if (warp == num_copy_warps && num_ranks > 1) {
        // ------------------------------------------------------------------ publisher: tails and heads
        // Lane d: rows sent to d whose tail is published, and slots of d's ring (my tokens) consumed.
        int sent = 0, consumed = 0, reduced = 0, spins = 0;
        const int my_count = lane < num_ranks && lane != rank ? block_count[lane] : 0;
        while (cta_failed == 0) {
            bool acted = false;
            // Tails: per destination, the rows that every one of its warps has passed.
            int ready = 0;
            for (int di = 0; di < num_dests; ++di) {
                const int p = min_progress(progress, 0, num_copy_warps, num_dests, di);
                if (lane == (di < rank ? di : di + 1)) ready = min(p, my_count);
            }
            const bool publish = lane < num_ranks && lane != rank && !ctx.skip_sends && ready > sent &&
                                 (ready - sent >= args.num_max_send_tokens || ready == my_count);
            if (__any_sync(0xffffffffu, publish)) {
                const int next = publish ? ready : sent;
                publish_tails<kPut>(ctx, next, sent, tail_base, channel, kCombineTailOffset);
                sent = next;
                acted = true;
            }
            // Heads: the slots of the tokens that every reducer warp has passed are free again.
            const int done = min(min_progress(progress, first_reducer, kChannelWarps, 1, 0), num_channel_tokens);
            if (done > reduced && (done - reduced >= args.num_max_send_tokens || done == num_channel_tokens)) {
                const int old = consumed;
                consumed = raise_counts(args.send_head, num_ranks, begin + reduced, begin + done, consumed);
                if (lane < num_ranks && lane != rank && consumed > old)
                    publish_word<kPut>(ctx,
                                       buffer_u32(ctx.buffers[lane], kCombineHeadOffset) + counter_index(channel, rank),
                                       kCombineHeadOffset + 4 * counter_index(channel, rank), lane,
                                       head_base[lane] + static_cast<uint32_t>(consumed));
                reduced = done;
                acted = true;
            }
            const bool sends_done = ctx.skip_sends || __all_sync(0xffffffffu, sent == my_count);
            if (sends_done && reduced == num_channel_tokens) break;
            if (!acted) publisher_idle(ctx, &cta_failed, &spins);
        }
        // Ring positions for the next call (this call's rows to d, and my tokens' rows from d).
        if (cta_failed == 0 && lane < num_ranks && lane != rank) {
            if (!ctx.skip_sends)
                *workspace_u32(ctx, kWsCombineTailShadowOffset + 4 * counter_index(channel, lane)) =
                    tail_base[lane] + static_cast<uint32_t>(my_count);
            *workspace_u32(ctx, kWsCombineHeadShadowOffset + 4 * counter_index(channel, lane)) =
                head_base[lane] + static_cast<uint32_t>(consumed);
        }
    } else if (warp >= first_reducer) {
        // ------------------------------------------------------------------ reducer: my tokens of this channel
        const int reduce_warp = warp - first_reducer;
        const int64_t own_first = block_first[rank];
        // Lane d (< R) holds send_head[t][d] of the warp's token, loaded one token ahead: the load of the next
        // token's row is in flight while this token waits and reduces.
        auto head_of = [&](int item) {
            return lane < num_ranks && item < num_channel_tokens
                ? args.send_head[static_cast<int64_t>(begin + item) * num_ranks + lane] : -1;
        };
        int next_head = head_of(reduce_warp);
        for (int item = reduce_warp; item < num_channel_tokens; item += num_reduce_warps) {
            if (cta_failed != 0) break;
            const int t = begin + item;
            const int my_head = next_head;
            next_head = head_of(item + num_reduce_warps);
            // Lane d: wait until the slot of my token in d's ring is written (its tail has passed it).
            bool ok = true;
            if (lane < num_ranks && lane != rank) {
                const int j = my_head;
                const uint32_t needed = head_base[lane] + static_cast<uint32_t>(j) + 1u;
                if (j >= 0 && !seq_geq(tail_cache[lane], needed)) {
                    uint32_t seen;
                    const int64_t tail_offset = kCombineTailOffset + 4 * counter_index(channel, lane);
                    ok = wait_geq(ctx,
                                  peer_word<kPut>(ctx,
                                                  buffer_u32(ctx.buffers[rank], kCombineTailOffset) +
                                                      counter_index(channel, lane),
                                                  tail_offset, lane),
                                  needed, Site{kKernelCombine, kPhaseCombineRecvWaitTail, lane, channel}, &seen);
                    if (ok) {
                        after_peer_wait<kPut>(ctx, tail_offset, lane);
                        tail_cache[lane] = seen;
                    }
                }
                __threadfence_block();  // acquire: a cached tail was stored after its reader's acquire load
            }
            if (!__all_sync(0xffffffffu, ok)) {
                if (lane == 0) cta_failed = 1;
                break;
            }
            // Contribution sources: my row of x, and d's ring slot of sequence head_base[d] + j.
            const int4* srcs[kMaxRanks];
            const float* wsrcs[kMaxRanks];
            int own;
            const int num_srcs = token_sources(
                args, rank, num_ranks, my_head, own_first,
                [&](int d, int j, const int4** src, const float** wsrc) {
                    const uint32_t seq = head_base[d] + static_cast<uint32_t>(j);
                    const char* rec = static_cast<const char*>(ctx.buffers[rank]) +
                                      geo.ring.slot_offset(channel, d, static_cast<int>(seq % static_cast<uint32_t>(capacity)));
                    *src = reinterpret_cast<const int4*>(rec);
                    *wsrc = reinterpret_cast<const float*>(rec + geo.weights_offset);
                },
                srcs, wsrcs, &own);
            reduce_token(args, t, srcs, wsrcs, num_srcs, own, row_int4);
            release_progress(progress, warp, item + num_reduce_warps);
        }
    }
}

}  // namespace

Status intranode_combine(const KernelContext& ctx, const CombineArgs& args, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "combine"));
    DEEP_EP_RETURN_IF_FAILED(check_combine_rows(args));
    DEEP_EP_REQUIRE_ARG(args.num_tokens >= 0, "combine: num_tokens must be >= 0, got ", args.num_tokens);

    CombineGeometry geo;
    const int64_t record = combine_record_bytes(args.hidden, args.num_topk);
    geo.ring = ring_geometry(ctx.num_nvl_bytes, ctx.num_ranks, args.num_channels, record, args.num_max_recv_tokens,
                             true);
    geo.weights_offset = combine_weights_offset(args.hidden);
    if (ctx.num_ranks > 1) {
        DEEP_EP_RETURN_IF_FAILED(check_channels("combine", args.num_channels, args.num_max_send_tokens,
                                                geo.ring.capacity, record, ctx.num_nvl_bytes));
        // Copy warps: at least one per destination; the publisher and at least one reducer warp remain.
        DEEP_EP_RETURN_IF_FAILED(
            check_send_warps("combine", args.num_send_warps, ctx.num_ranks - 1, kChannelWarps - 2));
    } else {
        DEEP_EP_REQUIRE_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                            "combine: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
        if (geo.ring.capacity < 1) geo.ring.capacity = 1;
    }
    DEEP_EP_RETURN_IF_FAILED(check_resident("combine", args.num_channels));
    if (ctx.put_mask != 0)
        combine_kernel<true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else
        combine_kernel<false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
