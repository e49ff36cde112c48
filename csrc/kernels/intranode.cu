// Intranode normal-mode kernels over CUDA-IPC-shared NVLink buffers: notify, dispatch, combine, barrier, reset.
//
// Design (csrc/kernels/layout.cuh has the byte layout, ../shared design/kernels.md §2 the reasoning):
// * One CTA of 1024 threads per channel; channel c owns the contiguous token range channel_token_range(N, C, c).
// * Each (channel, source) pair has a ring in the receiver's buffer. Ring positions are monotonic uint32 sequence
//   numbers that never reset; the sender keeps its tail in the workspace and publishes it into the receiver's buffer,
//   the receiver keeps its head in the workspace and publishes it into the sender's buffer. Every wait is local.
// * Dispatch copy warps load every token row once (16 B per lane, several loads in flight) and store it to each
//   destination: straight into recv_x for the own rank (local bypass), into the peer's ring otherwise. Token i of a
//   channel belongs to copy warp i % W; copy warps never wait for flag publication. After each token a warp releases
//   its progress in shared memory; one publisher warp turns the smallest progress into the complete prefix of tokens
//   and publishes the tails (one system fence, then release stores) every >= Sn tokens and at the end. Receiver
//   warps, grouped per source, copy ready slots into recv_x and return heads.
// * send_head[t][d] is the index j of token t among its channel's tokens to d (-1 if not sent). The row of a
//   received token is rank_prefix(s -> me) + recv_channel_prefix[s][c] + j on both sides, which yields the spec's
//   order (source rank, then source token). Combine reuses j to find each contribution: no handle rewriting.
// * Combine sender warps push rows of the receive blocks back to their owners' rings (each destination has its own
//   warps); the publisher warp publishes their tails and the heads of the slots reduced. Reducer warps take my
//   tokens of the channel (token i on reducer warp i % their count), each waiting only for its own slots, and add
//   the own contribution (read straight from x) and the ring slots in ascending rank order in float32, plus the
//   biases, rounding to BF16 once. The warp split is a launch argument (deep_ep.config.INTRANODE_SEND_WARPS).
// * Copy-engine combine (Runtime::combine_by_copy; Buffer default for SM budgets <= COMBINE_COPY_MAX_SMS): the host
//   knows the pair counts from the notify, so each peer's rows (a contiguous block of x) go by cudaMemcpyAsync into
//   the owner's landing zone (the peer's sub-region of the combine half), in chunks growing to
//   COMBINE_COPY_CHUNK_ROWS, each followed by a `landed` word (cuStreamWriteValue32, or a one-warp kernel). All
//   CTAs of the budget reduce (combine_landed_kernel), token t on global warp t % warps, so the grid follows the
//   copy front; the last CTA writes `freed` to every peer, which the next call's copies (and ring combines) wait
//   for. No SM sends: the copy engine moves the bytes, the SMs only reduce.
// * Zone-sender combine (Buffer default for SM budgets >= COMBINE_ZONE_MIN_SMS, at most COMBINE_ZONE_MAX_CTAS
//   CTAs of kZoneWarps warps): the same landing zones, epochs and reducers, but sender warps of every CTA store the
//   rows (stripes of W rows, stripe s on CTA s % CTAs) and a publisher warp per CTA publishes each (CTA, source)
//   count of finished stripes; the combine's parallelism no longer depends on the dispatch's channel count.
// * Failures never trap: sync.cuh's wait_geq reports to the error record and every role falls through to the end.
#include <cuda_bf16.h>

#include <cstdint>

#include "api.cuh"
#include "exception.cuh"
#include "layout.cuh"
#include "sync.cuh"

namespace deep_ep {
namespace kernels {

namespace {

// ---- warp roles of the dispatch / combine CTA ----
constexpr int kUnroll = 4;               // 16-byte loads in flight per lane in row copies
constexpr int kPrefixBatch = 8;          // groups of 32 tokens whose routing bytes one send_head warp loads at once
constexpr int kReduceUnroll = 2;         // 16-byte chunks per lane (and contribution) in flight in the combine reducer
// Zone-sender combine (measured 2026-11-30, 2 x H200, EP2, hidden 7168, 24 SMs: 20 warps, 7 loads in flight per
// sender lane and 4 chunks per reducer lane and contribution: 222.5 us; 32 warps, 4 and 2: 254-270 us). With 20
// warps a thread has 96 registers, so the deeper unrolls do not spill.
constexpr int kZoneWarps = 20;
constexpr int kZoneSendUnroll = 7;
constexpr int kZoneReduceUnroll = 4;
// Named barrier ids (0 is __syncthreads).
constexpr int kBarrierAllSenders = 1;    // copy warps and the publisher, after the prologue
constexpr int kBarrierRecvGroup0 = 2;    // + source index, for receiver groups of more than one warp (group_sync)
// Receivers: one group per source of at least one warp, beside at least three sender warps (two copy warps and the
// publisher). A group of several warps syncs on its own named barrier, a one-warp group with __syncwarp. Groups
// get warps round robin, so with S sources and Wr <= kChannelWarps - 3 receiver warps the first min(S, Wr - S) groups
// have several: at most 14 (S <= 14, or Wr - S <= 29 - 15), ids 2..15 of the 16 hardware barriers.
static_assert(kMaxRanks - 1 + 3 <= kChannelWarps, "one receiver warp per source and three sender warps must fit a CTA");
static_assert(kMaxRanks < 32, "lane-per-rank masks (1u << num_ranks) and warp-wide rank loops");
static_assert(kBarrierRecvGroup0 + 14 <= 16, "named barriers of the multi-warp receiver groups");
// Every kernel takes its parameters (KernelContext, the Args and Geometry structs) as `const __grid_constant__`:
// reads, also with a run-time index (ctx.buffers[d], ctx.pe_of[d]), go to the parameter bank. A plain by-value
// parameter whose address is taken or that is indexed at run time is copied to local memory by every thread at entry
// (the context alone 43 eight-byte words at kMaxRanks = 24); on one H200 those copies and their loads cost the 1-rank
// dispatch 16-17 % of its kernel time (docs/performance.md, "Kernel parameters as grid constants").

__device__ __forceinline__ uint32_t* buffer_u32(void* buffer, int64_t offset) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(buffer) + offset);
}

__device__ __forceinline__ uint32_t* workspace_u32(const KernelContext& ctx, int64_t offset) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(ctx.workspace) + offset);
}

__device__ __forceinline__ int counter_index(int channel, int peer) { return channel * kMaxRanks + peer; }

__device__ __forceinline__ void channel_range(int num_tokens, int num_channels, int channel, int* begin, int* end) {
    const int per_channel = (num_tokens + num_channels - 1) / num_channels;
    const int64_t b = static_cast<int64_t>(per_channel) * channel;
    *begin = static_cast<int>(b < num_tokens ? b : num_tokens);
    const int64_t e = static_cast<int64_t>(*begin) + per_channel;
    *end = static_cast<int>(e < num_tokens ? e : num_tokens);
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }

__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Copies one row of `num_int4` 16-byte words from `src` to every pointer of `dsts[0..num_dsts)` (a warp).
// kSrcIsRing selects the coherent load for ring data written by peers; inputs use the non-coherent path.
template <bool kSrcIsRing, int kCopyUnroll = kUnroll>
__device__ __forceinline__ void warp_copy_row(const int4* src, int64_t num_int4, int4* const* dsts, int num_dsts) {
    const int lane = lane_id();
    for (int64_t base = lane; base < num_int4; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int64_t i = base + u * 32;
            if (i < num_int4) v[u] = kSrcIsRing ? ld_ring_int4(src + i) : ld_nc_int4(src + i);
        }
        for (int d = 0; d < num_dsts; ++d) {
            int4* dst = dsts[d];
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int64_t i = base + u * 32;
                if (i < num_int4) st_na_int4(dst + i, v[u]);
            }
        }
    }
}

// =============================================================================================================
// Notify: exchange per-destination, per-expert and per-channel counts; build the handle's prefix matrices.
// =============================================================================================================

// kPut: some peers are NVSHMEM put peers (put.cuh): their counts are staged in this rank's put area and put with the
// flag as signal.
template <bool kPut>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_counts_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ NotifyArgs args) {
    __shared__ int channel_counts[kMaxRanks][kMaxChannels];  // my tokens to d in channel c
    __shared__ int rank_totals[kMaxRanks];
    __shared__ int all_counts[kMaxRanks][kMaxRanks];           // count(s -> d) gathered from every source

    const int num_ranks = ctx.num_ranks, rank = ctx.rank, num_channels = args.num_channels;
    const int num_local_experts = args.num_experts / num_ranks;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    const int num_warps = static_cast<int>(blockDim.x) / 32;

    // 1. My per-(destination, channel) token counts from is_token_in_rank.
    for (int pair = warp; pair < num_ranks * num_channels; pair += num_warps) {
        const int d = pair / num_channels, c = pair % num_channels;
        int begin, end;
        channel_range(args.num_tokens, num_channels, c, &begin, &end);
        int count = 0;
        for (int t = begin + lane; t < end; t += 32)
            count += args.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d] ? 1 : 0;
        count = warp_sum(count);
        if (lane == 0) channel_counts[d][c] = count;
    }
    __syncthreads();

    // 2. Totals, sender-side channel prefix, and the check against the caller's num_tokens_per_rank.
    if (threadIdx.x < num_ranks) {
        const int d = static_cast<int>(threadIdx.x);
        int total = 0;
        for (int c = 0; c < num_channels; ++c) {
            total += channel_counts[d][c];
            args.channel_prefix_matrix[d * num_channels + c] = total;
        }
        rank_totals[d] = total;
        const int claimed = args.num_tokens_per_rank[d];
        if (claimed != total) {
            report_error(ctx, kErrorCountMismatch, Site{kKernelNotify, kPhaseNotifyCheckCounts, d, -1}, claimed,
                         total, 0);
        }
    }
    const uint32_t epoch = *workspace_u32(ctx, kWsNotifyEpochOffset) + 1;
    const int parity = static_cast<int>(epoch & 1u);
    __syncthreads();

    // 3. Write my counts into every rank's notify slot [parity][me]: [R totals][L expert counts of d][C channels].
    const int slot_ints = kNotifyInts;
    const int per_dst = num_ranks + num_local_experts + num_channels;
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks * per_dst; i += static_cast<int>(blockDim.x)) {
        const int d = i / per_dst, k = i % per_dst;
        int* slot = kPut && is_put_peer(ctx, d)
            ? reinterpret_cast<int*>(own_buffer(ctx) + ctx.num_nvl_bytes + kPutNotifyStageOffset) + d * slot_ints
            : reinterpret_cast<int*>(buffer_u32(ctx.buffers[d], kNotifyDataOffset)) +
                  (static_cast<int64_t>(parity) * kMaxRanks + rank) * slot_ints;
        int value, pos;
        if (k < num_ranks) {
            value = rank_totals[k];
            pos = k;
        } else if (k < num_ranks + num_local_experts) {
            value = args.num_tokens_per_expert[d * num_local_experts + (k - num_ranks)];
            pos = kMaxRanks + (k - num_ranks);
        } else {
            value = channel_counts[d][k - num_ranks - num_local_experts];
            pos = kMaxRanks + kMaxLocalExperts + (k - num_ranks - num_local_experts);
        }
        reinterpret_cast<volatile int*>(slot)[pos] = value;
    }
    __threadfence_system();
    __syncthreads();
    const int64_t my_slot = (static_cast<int64_t>(parity) * kMaxRanks + rank);
    if (threadIdx.x < num_ranks && !(kPut && is_put_peer(ctx, static_cast<int>(threadIdx.x)))) {
        const int d = static_cast<int>(threadIdx.x);
        fence_acq_rel_sys();
        st_release_sys(buffer_u32(ctx.buffers[d], kNotifyFlagOffset) + parity * kMaxRanks + rank, epoch);
    }
    // Put peer d: warp d puts my staged counts for d into my slot at d, with the flag as signal.
    if (kPut && warp < num_ranks && is_put_peer(ctx, warp)) {
        __syncwarp();  // the lanes of warp 0 that stored pointer peers' flags join first
        put_block_with_flag(ctx, own_buffer(ctx) + ctx.num_nvl_bytes + kPutNotifyStageOffset +
                                     static_cast<int64_t>(warp) * slot_ints * 4,
                            kNotifyDataOffset + my_slot * slot_ints * 4, static_cast<int64_t>(slot_ints) * 4, warp,
                            kNotifyFlagOffset + my_slot * 4, epoch);
    }

    // 4. Wait until every source's counts of this epoch are here.
    if (threadIdx.x < num_ranks) {
        const int s = static_cast<int>(threadIdx.x);
        const int64_t flag = kNotifyFlagOffset + 4 * (static_cast<int64_t>(parity) * kMaxRanks + s);
        uint32_t seen;
        // On failure the error is reported; the outputs below are then garbage but every write stays in bounds.
        uint32_t* word = buffer_u32(ctx.buffers[rank], kNotifyFlagOffset) + parity * kMaxRanks + s;
        if (wait_geq(ctx, peer_word<kPut>(ctx, word, flag, s), epoch,
                     Site{kKernelNotify, kPhaseNotifyWaitCounts, s, -1}, &seen))
            after_peer_wait<kPut>(ctx, flag, s);
    }
    __syncthreads();

    // 5. Prefix matrices and received counts (garbage, but bounded, if a wait failed).
    const volatile int* data = reinterpret_cast<const volatile int*>(buffer_u32(ctx.buffers[rank], kNotifyDataOffset)) +
                               static_cast<int64_t>(parity) * kMaxRanks * slot_ints;
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks * num_ranks; i += static_cast<int>(blockDim.x))
        all_counts[i / num_ranks][i % num_ranks] = data[(i / num_ranks) * slot_ints + (i % num_ranks)];
    __syncthreads();
    if (threadIdx.x < num_ranks) {
        const int d = static_cast<int>(threadIdx.x);
        int prefix = 0;
        for (int s = 0; s < num_ranks; ++s) {
            prefix += all_counts[s][d];
            args.rank_prefix_matrix[s * num_ranks + d] = prefix;
        }
    }
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks; i += static_cast<int>(blockDim.x)) {
        const int s = i;
        int prefix = 0;
        for (int c = 0; c < num_channels; ++c) {
            args.recv_channel_prefix_matrix[s * num_channels + c] = prefix;
            prefix += data[s * slot_ints + kMaxRanks + kMaxLocalExperts + c];
        }
    }
    if (args.host_counters != nullptr) {
        for (int e = static_cast<int>(threadIdx.x); e < num_local_experts; e += static_cast<int>(blockDim.x)) {
            int64_t sum = 0;
            for (int s = 0; s < num_ranks; ++s) sum += data[s * slot_ints + kMaxRanks + e];
            const int64_t align = args.expert_alignment;
            sum = (sum + align - 1) / align * align;
            reinterpret_cast<volatile int*>(args.host_counters)[1 + e] = static_cast<int>(sum);
        }
        // Then count(s -> d) of every pair (row-major [R][R]): the host sizes copy-engine combines with them.
        for (int i = static_cast<int>(threadIdx.x); i < num_ranks * num_ranks; i += static_cast<int>(blockDim.x))
            reinterpret_cast<volatile int*>(args.host_counters)[1 + kMaxLocalExperts + i] =
                all_counts[i / num_ranks][i % num_ranks];
        __threadfence_system();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (args.host_counters != nullptr) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) total += all_counts[s][rank];
            reinterpret_cast<volatile int*>(args.host_counters)[0] = total;
            __threadfence_system();
        }
        *workspace_u32(ctx, kWsNotifyEpochOffset) = epoch;
    }
}

// =============================================================================================================
// Shared pieces of dispatch and combine
// =============================================================================================================

// Whole warp: waits until the previous calls' data this rank wrote into the rings of this direction of every
// destination in `dst_mask` has been consumed, i.e. head[c'][d] >= tail_shadow[c'][d] for every channel c' that any
// call used (`num_checked` channels). Needed because the ring geometry may change between calls. Fast path: relaxed
// loads in parallel over lanes, then one system fence (acquire pattern). Returns false on failure (reported).
// A put peer's heads are the low halves of signal twins (put.cuh); they guard no data this rank reads.
template <bool kPut>
__device__ bool warp_wait_drained(const KernelContext& ctx, uint32_t dst_mask, int num_checked, int64_t head_offset,
                                  int64_t shadow_offset, int kernel, int phase, int channel) {
    uint32_t* heads = buffer_u32(ctx.buffers[ctx.rank], head_offset);
    const uint32_t* shadows = workspace_u32(ctx, shadow_offset);
    bool ok = true;
    for (int i = lane_id(); i < ctx.num_ranks * num_checked && ok; i += 32) {
        const int d = i % ctx.num_ranks, c = i / ctx.num_ranks;
        if (((dst_mask >> d) & 1u) == 0) continue;
        const uint32_t target = shadows[counter_index(c, d)];
        const uint32_t* head =
            peer_word<kPut>(ctx, heads + counter_index(c, d), head_offset + 4 * counter_index(c, d), d);
        if (seq_geq(ld_relaxed_sys(head), target)) continue;
        uint32_t seen;
        ok = wait_geq(ctx, head, target, Site{kernel, phase, d, channel}, &seen);
    }
    fence_acq_rel_sys();
    return __all_sync(0xffffffffu, ok);
}

// Whole warp: waits until every peer has finished reading the rows of this rank's copy-engine combines up to
// `copy_epoch` (its `freed` word, written by the peer, reached it). Returns false on failure (reported).
__device__ bool warp_wait_freed(const KernelContext& ctx, uint32_t copy_epoch, int channel) {
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

// One warp: this rank's rows of the previous calls in every peer's combine half are consumed (ring heads, and `freed`
// of the previous landing-zone combine), so the rows of landing-zone combine `copy_epoch` may be stored there.
__device__ bool warp_wait_landing_zones_free(const KernelContext& ctx, uint32_t copy_epoch) {
    const uint32_t peers = ((1u << ctx.num_ranks) - 1u) & ~(1u << ctx.rank);
    const int num_checked = static_cast<int>(*workspace_u32(ctx, kWsCombineMaxChannelsOffset));
    return warp_wait_drained<false>(ctx, peers, num_checked, kCombineHeadOffset, kWsCombineTailShadowOffset,
                                    kKernelCombine, kPhaseCombineSendDrain, -1) &&
           warp_wait_freed(ctx, copy_epoch - 1u, -1);
}

// Number of channels whose rings a drain check must cover: the largest channel count of any call of this direction
// since the last reset (raised here to include the current call).
__device__ __forceinline__ int raise_max_channels(const KernelContext& ctx, int64_t offset, int num_channels) {
    const unsigned int old = atomicMax(workspace_u32(ctx, offset), static_cast<unsigned int>(num_channels));
    return max(static_cast<int>(old), num_channels);
}

// ---- copy warps and the publisher warp (dispatch and combine) ----
// Copy warps never wait for flag publication. Each copy warp works through its own list of items in order and,
// after each item, releases its progress (index of its next item) at CTA scope. One publisher warp turns the
// smallest progress of a set of copy warps into the prefix of items that is complete, and publishes ring tails
// (after one system fence) or heads for that prefix. Its system fence is the only one per publication, and copy
// warps keep copying while it stalls in it.

// Copy warp, after an item: all lanes' stores and loads of the item come first (warp sync, CTA fence).
__device__ __forceinline__ void release_progress(volatile int* progress, int warp, int value) {
    __syncwarp();
    if (lane_id() == 0) {
        __threadfence_block();
        progress[warp] = value;
    }
}

__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Publisher warp: smallest progress over the warps w in [lo, hi) with (w - lo) % stride == first.
__device__ __forceinline__ int min_progress(const volatile int* progress, int lo, int hi, int stride, int first) {
    const int w = lo + lane_id();
    const int v = w < hi && (w - lo) % stride == first ? progress[w] : 0x7fffffff;
    const int result = warp_min(v);
    __syncwarp();
    __threadfence_block();  // acquire: what the copy warps released comes before the publication
    return result;
}

// Publisher warp: lane d's `count` (tokens to / from rank d among a prefix of the channel's tokens) is raised to
// cover the tokens [t_begin, t_end) of send_head; send_head[t][d] is the index of t among the tokens of rank d.
__device__ __forceinline__ int raise_counts(const int* send_head, int num_ranks, int t_begin, int t_end, int count) {
    const int lane = lane_id();
    for (int d = 0; d < num_ranks; ++d) {
        int m = 0;
        for (int t = t_begin + lane; t < t_end; t += 32) m = max(m, send_head[static_cast<int64_t>(t) * num_ranks + d] + 1);
        m = warp_max(m);
        if (lane == d) count = max(count, m);
    }
    return count;
}

// Publisher warp: once every `spin_check` idle spins, a short sleep and an abort check (sets *cta_failed).
__device__ __forceinline__ void publisher_idle(const KernelContext& ctx, volatile int* cta_failed, int* spins) {
    if ((++*spins & 255) == 0 && lane_id() == 0 && is_aborted(ctx)) *cta_failed = 1;
    __nanosleep(32);
}

// One lane, before writing ring slot `needed_end - 1` of destination `dst`: waits until the slot is free, i.e. the
// head (written by dst into my buffer) has reached needed_end - capacity. `head_cache` (shared, per destination)
// holds a head value seen earlier by any warp: heads only grow, so any cached value is a valid lower bound.
template <bool kPut>
__device__ __forceinline__ bool wait_space(const KernelContext& ctx, volatile uint32_t* head_cache, int dst,
                                           int channel, uint32_t needed_end, int capacity, int64_t head_offset,
                                           int kernel, int phase) {
    const uint32_t needed_head = needed_end - static_cast<uint32_t>(capacity);
    if (seq_geq(head_cache[dst], needed_head)) return true;
    uint32_t seen;
    uint32_t* word = buffer_u32(ctx.buffers[ctx.rank], head_offset) + counter_index(channel, dst);
    const bool ok = wait_geq(ctx, peer_word<kPut>(ctx, word, head_offset + 4 * counter_index(channel, dst), dst),
                             needed_head, Site{kernel, phase, dst, channel}, &seen);
    if (ok) head_cache[dst] = seen;
    return ok;
}

// Publisher lane 0: one system fence, then the new tails of every peer d whose count changed. A put peer's new
// records (staged by the copy warps) go with its tail: the whole warp puts them (put.cuh put_records).
template <bool kPut>
__device__ __forceinline__ void publish_tails(const KernelContext& ctx, int count, int old_count,
                                              const uint32_t* tail_base, int channel, int64_t tail_offset,
                                              RingGeometry ring) {
    const int lane = lane_id();
    if (lane == 0) fence_acq_rel_sys();
    for (int d = 0; d < ctx.num_ranks; ++d) {
        const int c = __shfl_sync(0xffffffffu, count, d);
        const int old = __shfl_sync(0xffffffffu, old_count, d);
        if (kPut && is_put_peer(ctx, d)) {
            if (d != ctx.rank && c > old && !ctx.skip_sends) {
                __syncwarp();  // lane 0's fence comes before the warp reads the staged records
                put_records(ctx, ring, channel, d, tail_base[d] + static_cast<uint32_t>(old), c - old,
                            tail_offset + 4 * counter_index(channel, ctx.rank),
                            tail_base[d] + static_cast<uint32_t>(c));
            }
        } else if (lane == 0 && d != ctx.rank && c > old && !ctx.skip_sends) {
            st_release_sys(buffer_u32(ctx.buffers[d], tail_offset) + counter_index(channel, ctx.rank),
                           tail_base[d] + static_cast<uint32_t>(c));
        }
    }
    __syncwarp();
}

// =============================================================================================================
// Dispatch
// =============================================================================================================

struct DispatchGeometry {
    RingGeometry ring;
    int64_t scales_offset;  // in the record
    int64_t meta_offset;    // in the record
};

// Lanes < num_topk: row `row` of the receiver `owner`'s recv_topk_idx / recv_topk_weights (either may be null)
// from a token's global top-k ids and weights: local id e - owner * L and the weight, or -1 and 0.
template <typename IdxT>
__device__ __forceinline__ void write_topk_row(IdxT* topk_idx_out, float* weights_out, const IdxT* src_idx_row,
                                               const float* src_weight_row, int64_t row, int owner,
                                               int num_local_experts, int num_topk) {
    const int lane = lane_id();
    if (lane < num_topk) {
        const int64_t e = static_cast<int64_t>(src_idx_row[lane]);
        const int64_t first = static_cast<int64_t>(owner) * num_local_experts;
        const bool mine = e >= first && e < first + num_local_experts;
        if (topk_idx_out != nullptr) topk_idx_out[row * num_topk + lane] = static_cast<IdxT>(mine ? e - first : -1);
        if (weights_out != nullptr) weights_out[row * num_topk + lane] = mine ? src_weight_row[lane] : 0.0f;
    }
}

// Direct-to-output: where a receiver's outputs of this call lie in its buffer (byte offsets from its base), as
// its DispatchOutputWord told this sender. data < 0: the receiver uses the rings.
struct DirectOutput {
    int64_t data, meta, scales, topk_idx, topk_weights;  // meta < 0: do not write recv_src_idx
    int64_t row_base;  // row of this channel's first token to the receiver
};

// kPut: some peers are NVSHMEM put peers (put.cuh). Rings only between put peers: a sender stages their records
// in its put area and its publisher puts them with the tails; a receiver neither tells them where its outputs lie
// nor receives their rows in place.
template <typename IdxT, bool kPut>
__global__ void __launch_bounds__(kChannelThreads, 1)
    dispatch_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ DispatchArgs args,
                    const __grid_constant__ DispatchGeometry geo) {
    __shared__ uint32_t tail_base[kMaxRanks];       // tail shadow at kernel entry, per destination
    __shared__ volatile uint32_t head_cache[kMaxRanks];  // a head seen earlier, per destination
    __shared__ int total[kMaxRanks];                // tokens of this channel to each destination
    __shared__ volatile int progress[kChannelWarps];  // copy warp w: channel-local index of its next token
    __shared__ int4* warp_dsts[kChannelWarps][kMaxRanks];
    __shared__ int recv_avail[kMaxRanks];
    __shared__ int local_row_base;
    __shared__ volatile int cta_failed;
    __shared__ uint32_t call_epoch;                 // this channel's dispatch call number (DispatchOutputWord)
    __shared__ DirectOutput direct[kMaxRanks];      // per destination; direct[d].data < 0: rings
    __shared__ DirectOutput staged[kMaxRanks];      // receiver d's output word of this call, before the checks
    __shared__ int64_t staged_rows[kMaxRanks];      // and its rows
    __shared__ int expected_total[kMaxRanks];       // the handle's count of this channel's tokens to d
    __shared__ int warp_dst_rank[kChannelWarps][kMaxRanks];   // destination of warp_dsts[w][k]
    __shared__ int64_t warp_dst_row[kChannelWarps][kMaxRanks];  // its output row if direct, else -1

    const int rank = ctx.rank, num_ranks = ctx.num_ranks, channel = static_cast<int>(blockIdx.x);
    const int num_channels = args.num_channels, capacity = geo.ring.capacity;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    // Warps [0, W) copy tokens, warp W publishes tails, the rest receive (R > 1); with one rank all warps copy.
    const int num_copy_warps = num_ranks > 1 ? args.num_send_warps : kChannelWarps;
    const int num_send_warps = num_ranks > 1 ? num_copy_warps + 1 : kChannelWarps;
    const int num_local_experts = args.num_topk > 0 ? args.num_experts / num_ranks : 0;
    const int64_t hidden_int4 = args.hidden_bytes / 16;
    const int* P = args.rank_prefix_matrix;
    const int* recv_cpm = args.recv_channel_prefix_matrix;
    int begin, end;
    channel_range(args.num_tokens, num_channels, channel, &begin, &end);

    // Real number of rows this rank receives; more than allocated means the routing broke a promise.
    const int num_real_rows = P[(num_ranks - 1) * num_ranks + rank];
    if (threadIdx.x == 0) {
        cta_failed = 0;
        call_epoch = *workspace_u32(ctx, kWsDispatchEpochOffset + 4 * channel) + 1u;
        local_row_base = (rank > 0 ? P[(rank - 1) * num_ranks + rank] : 0) + recv_cpm[rank * num_channels + channel];
        if (num_real_rows > args.num_recv_rows) {
            report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchWorstOverflow, -1, channel},
                         args.num_recv_rows, num_real_rows, 0);
            cta_failed = 1;
        }
    }
    if (threadIdx.x < kMaxRanks) {
        const int d = static_cast<int>(threadIdx.x);
        tail_base[d] = *workspace_u32(ctx, kWsDispatchTailShadowOffset + 4 * counter_index(channel, d));
        head_cache[d] = tail_base[d];  // the ring is empty between calls once drained
        total[d] = 0;
        expected_total[d] = 0;
        direct[d].data = -1;
        staged[d].data = -1;
        staged_rows[d] = 0;
    }
    if (threadIdx.x < kChannelWarps) progress[threadIdx.x] = static_cast<int>(threadIdx.x);
    __syncthreads();
    const bool overflow = cta_failed != 0;
    const bool receive_direct = args.direct_data_offset >= 0 && !overflow;

    // Tell every sender where my outputs of this call lie (or that I use the rings), before anything waits. A put
    // peer sends through the rings and reads no word.
    if (static_cast<int>(threadIdx.x) < num_ranks && static_cast<int>(threadIdx.x) != rank &&
        !(kPut && is_put_peer(ctx, static_cast<int>(threadIdx.x)))) {
        auto* word = reinterpret_cast<DispatchOutputWord*>(static_cast<char*>(ctx.buffers[threadIdx.x]) +
                                                           kDispatchOutputOffset) + counter_index(channel, rank);
        volatile uint32_t* fields = reinterpret_cast<volatile uint32_t*>(word);
        fields[1] = receive_direct ? static_cast<uint32_t>(args.direct_data_offset / kBufferAlignment) : kNoOutput;
        fields[2] = receive_direct && args.direct_meta_offset >= 0
                        ? static_cast<uint32_t>(args.direct_meta_offset / kBufferAlignment) : kNoOutput;
        fields[3] = static_cast<uint32_t>(args.num_recv_rows);
        fence_acq_rel_sys();
        st_release_sys(&word->epoch, call_epoch);
    }

    if (warp < num_send_warps) {
        // ------------------------------------------------------------------ sender
        // Phase A: send_head (index j among the channel's tokens to d) by ballot prefix, destination d on sender
        // warp d % (sender warps), kPrefixBatch groups of 32 tokens loaded before their ballots (one memory latency
        // per batch, not per group); warp num_ranks (mod sender warps) checks the previous call's data is drained
        // (one lane per destination); warp num_ranks + 1 (mod) waits for the receivers' output words (where each
        // wants its rows). With at least R + 2 sender warps (every tuned split up to 8 ranks) each warp has one role.
        for (int d = warp; d < num_ranks; d += num_send_warps) {
            int running = 0;
            for (int t0 = begin; t0 < end; t0 += 32 * kPrefixBatch) {
                bool in[kPrefixBatch];
#pragma unroll
                for (int u = 0; u < kPrefixBatch; ++u) {
                    const int t = t0 + u * 32 + lane;
                    in[u] = t < end && args.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d];
                }
#pragma unroll
                for (int u = 0; u < kPrefixBatch; ++u) {
                    const int t = t0 + u * 32 + lane;
                    const uint32_t ballot = __ballot_sync(0xffffffffu, in[u]);
                    const int j = running + __popc(ballot & ((1u << lane) - 1u));
                    if (t < end) args.send_head[static_cast<int64_t>(t) * num_ranks + d] = in[u] ? j : -1;
                    running += __popc(ballot);
                }
            }
            if (lane == 0) total[d] = running;
        }
        if (warp == num_ranks % num_send_warps && !overflow) {
            const uint32_t peers = ((1u << num_ranks) - 1u) & ~(1u << rank);
            const int num_checked = raise_max_channels(ctx, kWsDispatchMaxChannelsOffset, num_channels);
            if (!warp_wait_drained<kPut>(ctx, peers, num_checked, kDispatchHeadOffset, kWsDispatchTailShadowOffset,
                                         kKernelDispatch, kPhaseDispatchSendDrain, channel) && lane == 0)
                cta_failed = 1;
        }
        if (warp == (num_ranks + 1) % num_send_warps && lane < num_ranks && lane != rank && !overflow &&
            !ctx.skip_sends) {
            // Lane d: the handle's count of my tokens to d in this channel (channel_prefix_matrix is inclusive).
            // A receiver that expects rows from me cannot start its next call before it has them, so its word
            // holds this call's epoch or an older one; one that expects none may already be a call ahead, so
            // its word is not read (Phase A's count is checked against this one below).
            const int d = lane;
            const int* cpm_row = args.channel_prefix_matrix + d * num_channels;
            const int expected = cpm_row[channel] - (channel > 0 ? cpm_row[channel - 1] : 0);
            expected_total[d] = expected;
            if (expected > 0 && !(kPut && is_put_peer(ctx, d))) {
                auto* word = reinterpret_cast<DispatchOutputWord*>(static_cast<char*>(ctx.buffers[rank]) +
                                                                   kDispatchOutputOffset) + counter_index(channel, d);
                uint32_t seen;
                if (!wait_geq(ctx, &word->epoch, call_epoch,
                              Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel}, &seen)) {
                    cta_failed = 1;
                } else if (seen != call_epoch) {
                    report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel},
                                 call_epoch, seen, 0);
                    cta_failed = 1;
                } else {
                    const volatile uint32_t* fields = reinterpret_cast<const volatile uint32_t*>(word);
                    const uint32_t data_units = fields[1], meta_units = fields[2], rows = fields[3];
                    if (data_units != kNoOutput) {
                        const DispatchOutputLayout l = dispatch_output_layout(rows, args.hidden_bytes, args.num_scales,
                                                                              args.num_topk, args.topk_idx_bytes);
                        DirectOutput out;
                        out.data = static_cast<int64_t>(data_units) * kBufferAlignment;
                        out.meta = meta_units != kNoOutput ? static_cast<int64_t>(meta_units) * kBufferAlignment : -1;
                        out.scales = out.data + l.scales;
                        out.topk_idx = out.data + l.topk_idx;
                        out.topk_weights = out.data + l.topk_weights;
                        out.row_base = (rank > 0 ? P[(rank - 1) * num_ranks + d] : 0) +
                                       (channel > 0 ? cpm_row[channel - 1] : 0);
                        staged_rows[d] = static_cast<int64_t>(rows);
                        staged[d] = out;
                    }
                }
            }
        }
        named_barrier(kBarrierAllSenders, num_send_warps * 32);
        // Lane d of warp 0: Phase A's count must be the handle's, and the rows must fit the receiver's outputs.
        if (warp == 0 && lane < num_ranks && lane != rank && !overflow && !ctx.skip_sends && cta_failed == 0) {
            const int d = lane;
            if (total[d] != expected_total[d]) {
                report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel},
                             expected_total[d], total[d], 0);
                cta_failed = 1;
            } else if (staged[d].data >= 0) {
                if (staged[d].row_base + total[d] > staged_rows[d]) {
                    report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel},
                                 staged_rows[d], staged[d].row_base + total[d], 0);
                    cta_failed = 1;
                } else {
                    direct[d] = staged[d];
                }
            }
        }
        named_barrier(kBarrierAllSenders, num_send_warps * 32);
        const int num_channel_tokens = end - begin;

        if (warp < num_copy_warps) {
            // Phase B (copy warps): token i of the channel belongs to warp i % W; each warp goes in token order.
            for (int i = warp; i < num_channel_tokens && !overflow; i += num_copy_warps) {
                if (cta_failed != 0) break;
                const int t = begin + i;
                const int* head_row = args.send_head + static_cast<int64_t>(t) * num_ranks;
                bool ok = true;
                if (lane < num_ranks && lane != rank && !ctx.skip_sends && direct[lane].data < 0) {
                    const int j = head_row[lane];
                    if (j >= 0) {
                        ok = wait_space<kPut>(ctx, head_cache, lane, channel,
                                              tail_base[lane] + static_cast<uint32_t>(j) + 1u, capacity,
                                              kDispatchHeadOffset, kKernelDispatch, kPhaseDispatchSendWaitHead);
                    }
                }
                if (!__all_sync(0xffffffffu, ok)) {
                    if (lane == 0) cta_failed = 1;
                    break;
                }
                // Destinations of this token: the local recv_x row first (if any), then the peers' ring slots.
                int4** dsts = warp_dsts[warp];
                int num_dsts = 0;
                int64_t local_row = -1;
                const int local_j = head_row[rank];
                if (local_j >= 0) {
                    local_row = local_row_base + static_cast<int64_t>(local_j);
                    if (lane == 0)
                        dsts[0] = reinterpret_cast<int4*>(static_cast<char*>(args.recv_x) + local_row * args.hidden_bytes);
                    num_dsts = 1;
                }
                const int first_remote = num_dsts;
                if (!ctx.skip_sends) {
                    for (int d = 0; d < num_ranks; ++d) {
                        const int j = head_row[d];
                        if (j < 0 || d == rank) continue;
                        int64_t byte_offset, row = -1;
                        char* base = static_cast<char*>(ctx.buffers[d]);
                        if (direct[d].data >= 0) {  // straight into row `row` of d's recv_x
                            row = direct[d].row_base + j;
                            byte_offset = direct[d].data + row * args.hidden_bytes;
                        } else {
                            const uint32_t slot = (tail_base[d] + static_cast<uint32_t>(j)) % static_cast<uint32_t>(capacity);
                            byte_offset = geo.ring.slot_offset(channel, rank, static_cast<int>(slot));
                            if (kPut && is_put_peer(ctx, d)) {  // the staging twin; the publisher puts it
                                base = own_buffer(ctx) + put_stage_shift(ctx.num_nvl_bytes);
                                byte_offset = geo.ring.slot_offset(channel, d, static_cast<int>(slot));
                            }
                        }
                        if (lane == 0) {
                            dsts[num_dsts] = reinterpret_cast<int4*>(base + byte_offset);
                            warp_dst_rank[warp][num_dsts] = d;
                            warp_dst_row[warp][num_dsts] = row;
                        }
                        ++num_dsts;
                    }
                }
                __syncwarp();
                const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) +
                                                                static_cast<int64_t>(t) * args.hidden_bytes);
                warp_copy_row<false>(src, hidden_int4, dsts, num_dsts);

                // Scales: each loaded once (any strides), stored to every destination.
                for (int s = lane; s < args.num_scales; s += 32) {
                    const uint32_t value = static_cast<const uint32_t*>(args.x_scales)[
                        static_cast<int64_t>(t) * args.scale_token_stride + static_cast<int64_t>(s) * args.scale_hidden_stride];
                    if (local_row >= 0) static_cast<uint32_t*>(args.recv_x_scales)[local_row * args.num_scales + s] = value;
                    for (int k = first_remote; k < num_dsts; ++k) {
                        const int64_t row = warp_dst_row[warp][k];
                        char* scales = row >= 0 ? static_cast<char*>(ctx.buffers[warp_dst_rank[warp][k]]) +
                                                      direct[warp_dst_rank[warp][k]].scales + row * args.num_scales * 4
                                                : reinterpret_cast<char*>(dsts[k]) + geo.scales_offset;
                        reinterpret_cast<uint32_t*>(scales)[s] = value;
                    }
                }
                // Source index, top-k ids and weights: raw into ring records, transformed for the local row.
                const IdxT* idx_row = args.num_topk > 0
                    ? static_cast<const IdxT*>(args.topk_idx) + static_cast<int64_t>(t) * args.num_topk : nullptr;
                const float* weight_row = args.num_topk > 0 ? args.topk_weights + static_cast<int64_t>(t) * args.num_topk
                                                            : nullptr;
                if (local_row >= 0) {
                    if (lane == 0) args.recv_src_idx[local_row] = t;
                    if (args.num_topk > 0)
                        write_topk_row<IdxT>(static_cast<IdxT*>(args.recv_topk_idx), args.recv_topk_weights, idx_row,
                                             weight_row, local_row, rank, num_local_experts, args.num_topk);
                }
                // Direct destinations get the receiver's final form; ring records the raw ids (below).
                bool any_ring = false;
                for (int k = first_remote; k < num_dsts; ++k) {
                    const int64_t row = warp_dst_row[warp][k];
                    if (row < 0) {
                        any_ring = true;
                        continue;
                    }
                    const int d = warp_dst_rank[warp][k];
                    char* base = static_cast<char*>(ctx.buffers[d]);
                    if (lane == 0 && direct[d].meta >= 0) reinterpret_cast<int*>(base + direct[d].meta)[row] = t;
                    if (args.num_topk > 0)
                        write_topk_row<IdxT>(reinterpret_cast<IdxT*>(base + direct[d].topk_idx),
                                             reinterpret_cast<float*>(base + direct[d].topk_weights), idx_row,
                                             weight_row, row, d, num_local_experts, args.num_topk);
                }
                if (any_ring) {
                    int id = 0;
                    float weight = 0.0f;
                    if (lane < args.num_topk) {
                        id = static_cast<int>(idx_row[lane]);
                        weight = weight_row[lane];
                    }
                    for (int k = first_remote; k < num_dsts; ++k) {
                        if (warp_dst_row[warp][k] >= 0) continue;
                        int* meta = reinterpret_cast<int*>(reinterpret_cast<char*>(dsts[k]) + geo.meta_offset);
                        if (lane == 0) meta[0] = t;
                        if (lane < args.num_topk) {
                            meta[1 + lane] = id;
                            reinterpret_cast<float*>(meta)[1 + args.num_topk + lane] = weight;
                        }
                    }
                }
                release_progress(progress, warp, i + num_copy_warps);
            }
        } else if (!overflow) {
            // Publisher (R > 1): tails for the complete prefix of tokens, at least Sn new tokens per publication.
            // A receiver of direct-to-output rows only waits for its last row, so when no destination of this
            // channel uses a ring the tails are published once, at the end (one system fence per channel).
            const bool any_ring = __any_sync(0xffffffffu, lane < num_ranks && lane != rank && total[lane] > 0 &&
                                                              direct[lane].data < 0);
            int published = 0, count = 0, spins = 0;  // lane d: tokens to d among the first `published`
            while (published < num_channel_tokens) {
                const int ready = min(min_progress(progress, 0, num_copy_warps, 1, 0), num_channel_tokens);
                if (cta_failed != 0) break;
                if (ready > published &&
                    ((any_ring && ready - published >= args.num_max_send_tokens) || ready == num_channel_tokens)) {
                    const int old = count;
                    count = raise_counts(args.send_head, num_ranks, begin + published, begin + ready, count);
                    publish_tails<kPut>(ctx, count, old, tail_base, channel, kDispatchTailOffset, geo.ring);
                    published = ready;
                } else {
                    publisher_idle(ctx, &cta_failed, &spins);
                }
            }
            // Ring positions for the next call.
            if (lane < num_ranks && lane != rank && !ctx.skip_sends)
                *workspace_u32(ctx, kWsDispatchTailShadowOffset + 4 * counter_index(channel, lane)) =
                    tail_base[lane] + static_cast<uint32_t>(total[lane]);
        }
    } else {
        // ------------------------------------------------------------------ receiver (R > 1)
        const int num_sources = num_ranks - 1;
        const int recv_warp = warp - num_send_warps;
        const int num_recv_warps = kChannelWarps - num_send_warps;  // >= num_sources (launcher check)
        const int source_index = recv_warp % num_sources;
        const int src = source_index < rank ? source_index : source_index + 1;
        const int warp_in_group = recv_warp / num_sources;
        const int group_warps = (num_recv_warps - source_index + num_sources - 1) / num_sources;
        // A one-warp group (the groups past the first Wr - S; every group when Wr = S) needs no named barrier.
        auto group_sync = [&]() {
            if (group_warps > 1) named_barrier(kBarrierRecvGroup0 + source_index, group_warps * 32);
            else __syncwarp();
        };

        const int src_block = src > 0 ? P[(src - 1) * num_ranks + rank] : 0;
        const int src_rows = P[src * num_ranks + rank] - src_block;
        const int channel_first = recv_cpm[src * num_channels + channel];
        const int channel_next = channel + 1 < num_channels ? recv_cpm[src * num_channels + channel + 1] : src_rows;
        const int num_slots = channel_next - channel_first;
        const int64_t row_base = static_cast<int64_t>(src_block) + channel_first;
        uint32_t* head_shadow = workspace_u32(ctx, kWsDispatchHeadShadowOffset + 4 * counter_index(channel, src));
        const uint32_t base = *head_shadow;
        const int64_t tail_offset = kDispatchTailOffset + 4 * counter_index(channel, src);
        const uint32_t* tail_word = peer_word<kPut>(
            ctx, buffer_u32(ctx.buffers[rank], kDispatchTailOffset) + counter_index(channel, src), tail_offset, src);
        const int64_t head_offset = kDispatchHeadOffset + 4 * counter_index(channel, rank);  // in src's buffer
        uint32_t* remote_head = kPut && is_put_peer(ctx, src) ? nullptr : buffer_u32(ctx.buffers[src], head_offset);

        int done = 0;
        if (receive_direct && !(kPut && is_put_peer(ctx, src))) {
            // Senders wrote my rows in place: wait until their tails cover all of them, then free the sequence
            // numbers (the sender's next call checks the head before reusing the ring).
            if (warp_in_group == 0 && lane == 0 && num_slots > 0) {
                uint32_t seen;
                if (wait_geq(ctx, tail_word, base + static_cast<uint32_t>(num_slots),
                             Site{kKernelDispatch, kPhaseDispatchRecvWaitTail, src, channel}, &seen))
                    publish_word<kPut>(ctx, remote_head, head_offset, src, base + static_cast<uint32_t>(num_slots));
                else
                    cta_failed = 1;
            }
            done = num_slots;
        }
        while (done < num_slots && !overflow) {
            if (warp_in_group == 0 && lane == 0) {
                uint32_t seen;
                int avail = -1;
                if (wait_geq(ctx, tail_word, base + static_cast<uint32_t>(done) + 1u,
                             Site{kKernelDispatch, kPhaseDispatchRecvWaitTail, src, channel}, &seen)) {
                    after_peer_wait<kPut>(ctx, tail_offset, src);
                    avail = static_cast<int>(seen - base);
                    avail = avail < num_slots ? avail : num_slots;
                } else {
                    cta_failed = 1;
                }
                recv_avail[source_index] = avail;
            }
            group_sync();
            const int avail = recv_avail[source_index];
            if (avail < 0) break;
            for (int j = done + warp_in_group; j < avail; j += group_warps) {
                const uint32_t seq = base + static_cast<uint32_t>(j);
                const char* rec = static_cast<const char*>(ctx.buffers[rank]) +
                                  geo.ring.slot_offset(channel, src, static_cast<int>(seq % static_cast<uint32_t>(capacity)));
                const int64_t row = row_base + j;
                int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.recv_x) + row * args.hidden_bytes);
                warp_copy_row<true>(reinterpret_cast<const int4*>(rec), hidden_int4, &dst, 1);
                for (int s = lane; s < args.num_scales; s += 32)
                    static_cast<uint32_t*>(args.recv_x_scales)[row * args.num_scales + s] =
                        reinterpret_cast<const volatile uint32_t*>(rec + geo.scales_offset)[s];
                const volatile int* meta = reinterpret_cast<const volatile int*>(rec + geo.meta_offset);
                if (lane == 0) args.recv_src_idx[row] = meta[0];
                if (lane < args.num_topk) {
                    const int64_t e = meta[1 + lane];
                    const float w = reinterpret_cast<const volatile float*>(meta)[1 + args.num_topk + lane];
                    const int64_t first = static_cast<int64_t>(rank) * num_local_experts;
                    const bool mine = e >= first && e < first + num_local_experts;
                    if (args.recv_topk_idx != nullptr)
                        static_cast<IdxT*>(args.recv_topk_idx)[row * args.num_topk + lane] = static_cast<IdxT>(mine ? e - first : -1);
                    if (args.recv_topk_weights != nullptr)
                        args.recv_topk_weights[row * args.num_topk + lane] = mine ? w : 0.0f;
                }
            }
            group_sync();
            if (warp_in_group == 0 && lane == 0)
                publish_word<kPut>(ctx, remote_head, head_offset, src, base + static_cast<uint32_t>(avail));
            done = avail;
        }
        if (warp_in_group == 0 && lane == 0 && !overflow) *head_shadow = base + static_cast<uint32_t>(num_slots);
    }

    // Worst-token mode: rows past the real ones get -1 top-k ids (spread over the channels' CTAs).
    if (args.worst_token_mode && args.recv_topk_idx != nullptr && !overflow) {
        const int64_t first = static_cast<int64_t>(num_real_rows) * args.num_topk;
        const int64_t last = static_cast<int64_t>(args.num_recv_rows) * args.num_topk;
        for (int64_t i = first + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < last;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x)
            static_cast<IdxT*>(args.recv_topk_idx)[i] = static_cast<IdxT>(-1);
    }
    if (threadIdx.x == 0) *workspace_u32(ctx, kWsDispatchEpochOffset + 4 * channel) = call_epoch;
}

// =============================================================================================================
// Combine
// =============================================================================================================

struct CombineGeometry {
    RingGeometry ring;
    int64_t weights_offset;  // in the record
};

__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                               static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(words[i] << 16);
        acc[2 * i + 1] += __uint_as_float(words[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc);

// One warp: out = bf16(a + b) (b may be null: out = bf16(a)) in float32, kU 16-byte chunks of both rows in flight per
// lane; `*_ring` selects the coherent load for ring slots. The combine reducer's path when a token has one or two
// contributions and no bias (every routed token at EP2; a token routed nowhere takes the general path: zeros). Not inlined: inside the combine kernel's 64-register budget the
// loaded chunks would be spilled, which serialises the loads.
template <int kU>
__device__ __noinline__ void reduce_two(const int4* a, bool a_ring, const int4* b, bool b_ring, int4* out,
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

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_int4(static_cast<int>(words[0]), static_cast<int>(words[1]), static_cast<int>(words[2]),
                     static_cast<int>(words[3]));
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

// kPut: some peers are NVSHMEM put peers (put.cuh): rows for them are staged and put with the tails.
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
    __syncthreads();

    if (warp < first_reducer) {
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
        for (int j = warp / num_dests; j < count && !ctx.skip_sends; j += stride) {
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
            char* rec = kPut && is_put_peer(ctx, dst)  // the staging twin; the publisher puts it
                ? staging_slot(ctx, geo.ring, channel, dst, static_cast<int>(slot))
                : static_cast<char*>(ctx.buffers[dst]) + geo.ring.slot_offset(channel, rank, static_cast<int>(slot));
            int4* rec_row = reinterpret_cast<int4*>(rec);
            const int4* src_row =
                reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + row * args.hidden * 2);
            warp_copy_row<false>(src_row, row_int4, &rec_row, 1);
            if (lane < args.num_topk)
                reinterpret_cast<float*>(rec + geo.weights_offset)[lane] = args.topk_weights[row * args.num_topk + lane];
            release_progress(progress, warp, j + stride);
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
                publish_tails<kPut>(ctx, next, sent, tail_base, channel, kCombineTailOffset, geo.ring);
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

// ---- combines into landing zones: copy engine (kZone = false) or zone senders (kZone = true) ----
// Copy engine: it moves each peer's rows (its receive block from me, in my token order) into my landing zone for
// that peer, in chunks, each followed by a `landed` flag (Runtime::combine enqueues them on its copy stream).
// Zone senders: warps [0, W) of every CTA store rows of my receive blocks straight into the owners' landing zones
// (row k of a block: stripe k / W of W rows, stripe s on CTA s % CTAs, row k on its warp k % W) and warp W
// publishes, per destination, how many of the CTA's stripes are complete (`zone landed`, one word per (CTA,
// source) in the owner's buffer). Either way the reducing warps, over all CTAs, reduce my tokens in order (token t
// on global reducer warp t % reducers), so the grid follows the landing front; lane d waits for the word covering
// its token's landing row from peer d.

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
    __syncthreads();

    if (kZone && warp < first_reducer) {
        // Warp 0: the previous calls' rows of this rank in every peer's combine half must be consumed first.
        if (warp == 0 && !ctx.skip_sends && !warp_wait_landing_zones_free(ctx, args.copy_epoch) && lane == 0)
            cta_failed = 1;
        named_barrier(kBarrierAllSenders, first_reducer * 32);
    }
    // Zone senders: stripes of W rows of the largest block, stripe s on CTA s % CTAs; this CTA's count.
    int local_stripes = 0;
    if (kZone) {
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
        for (int t = static_cast<int>(blockIdx.x) * reducers_per_cta + reducer; t < args.num_tokens; t += num_warps) {
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

// =============================================================================================================
// Barrier, reset, abort
// =============================================================================================================

// Lane r signals rank r (an NVSHMEM signal for a put peer) and waits for r's arrival here.
__global__ void barrier_kernel(const __grid_constant__ KernelContext ctx) {
    const int lane = lane_id();
    const uint32_t epoch = *workspace_u32(ctx, kWsBarrierEpochOffset) + 1;
    const int64_t my_arrival = kBarrierOffset + 4 * ctx.rank, its_arrival = kBarrierOffset + 4 * lane;
    if (lane < ctx.num_ranks) {
        if (is_put_peer(ctx, lane))
            put_signal(ctx, my_arrival, lane, 1u, true);
        else
            red_add_release_sys(buffer_u32(ctx.buffers[lane], my_arrival), 1u);
    }
    if (lane < ctx.num_ranks) {
        uint32_t seen;
        if (wait_geq(ctx, peer_word<true>(ctx, buffer_u32(ctx.buffers[ctx.rank], its_arrival), its_arrival, lane),
                     epoch, Site{kKernelBarrier, kPhaseBarrierWait, lane, -1}, &seen))
            after_peer_wait<true>(ctx, its_arrival, lane);
    }
    __syncwarp();
    if (lane == 0) *workspace_u32(ctx, kWsBarrierEpochOffset) = epoch;
}

__global__ void reset_state_kernel(const __grid_constant__ KernelContext ctx) {
    uint32_t* control = buffer_u32(ctx.buffers[ctx.rank], 0);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kControlBytes / 4;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        control[i] = 0;
    uint32_t* ws = workspace_u32(ctx, 0);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kWsUsedBytes / 4;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        ws[i] = 0;
    if (ctx.put_mask != 0) {  // the signal twins of the control region (put.cuh)
        uint64_t* twins = signal_twin(ctx, 0);
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kControlBytes / 4;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x)
            twins[i] = 0;
    }
}

__global__ void signal_abort_kernel(const __grid_constant__ KernelContext ctx) {
    const uint32_t word = (static_cast<uint32_t>(kErrorPeerAborted) << 8) | static_cast<uint32_t>(ctx.rank + 1);
    const int r = static_cast<int>(threadIdx.x);
    if (r < ctx.num_ranks) raise_abort(ctx, r, word);
}

// ---- host-side checks ----

void check_context(const KernelContext& ctx, const char* what) {
    DEEP_EP_CHECK_ARG(ctx.num_ranks >= 1 && ctx.num_ranks <= kMaxRanks, what, ": num_ranks must be in [1, ", kMaxRanks,
                      "], got ", ctx.num_ranks);
    DEEP_EP_CHECK_ARG(ctx.rank >= 0 && ctx.rank < ctx.num_ranks, what, ": rank must be in [0, num_ranks), got ",
                      ctx.rank);
    DEEP_EP_CHECK_ARG(ctx.put_mask == 0 || (kHasPutPath && ((ctx.put_mask >> ctx.rank) & 1u) == 0 &&
                                            (ctx.put_mask >> ctx.num_ranks) == 0),
                      what, ": put peers (mask ", ctx.put_mask, ") need an NVSHMEM build, a put area and a valid mask");
    for (int r = 0; r < ctx.num_ranks; ++r)
        DEEP_EP_CHECK_ARG(ctx.buffers[r] != nullptr || ((ctx.put_mask >> r) & 1u) != 0, what, ": the buffer of rank ",
                          r, " is not mapped");
    DEEP_EP_CHECK_ARG(ctx.workspace != nullptr, what, ": workspace must not be null");
    DEEP_EP_CHECK_ARG(ctx.num_nvl_bytes >= kControlBytes, what, ": num_nvl_bytes must be >= ", kControlBytes,
                      ", got ", ctx.num_nvl_bytes);
}

// Every CTA of a dispatch / combine grid must be resident at once (CTAs wait for peers' CTAs): one per SM.
void check_resident(const char* what, int num_channels) {
    int device = 0, num_sms = 0;
    DEEP_EP_CUDA_CHECK(cudaGetDevice(&device));
    DEEP_EP_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    DEEP_EP_CHECK_ARG(num_channels <= num_sms, what, ": config.num_sms must be <= the device's ", num_sms,
                      " SMs (one resident CTA per channel), got ", num_channels);
}

void check_channels(const char* what, int num_channels, int num_max_send_tokens, int capacity,
                    int64_t record_bytes, int64_t num_nvl_bytes) {
    DEEP_EP_CHECK_ARG(num_channels >= 1 && num_channels <= kMaxChannels, what, ": config.num_sms must be in [1, ",
                      kMaxChannels, "], got ", num_channels);
    DEEP_EP_CHECK_ARG(num_max_send_tokens >= 1, what, ": num_max_nvl_chunked_send_tokens must be >= 1, got ",
                      num_max_send_tokens);
    DEEP_EP_CHECK_ARG(capacity >= 2 * num_max_send_tokens, what, ": ring capacity ", capacity,
                      " slots per (channel, rank) must be >= 2 * num_max_nvl_chunked_send_tokens = ",
                      2 * num_max_send_tokens, " (records of ", record_bytes, " bytes, ", num_channels,
                      " channels, num_nvl_bytes ", num_nvl_bytes,
                      "); raise num_nvl_bytes or num_max_nvl_chunked_recv_tokens, or lower num_sms");
}

void check_send_warps(const char* what, int num_send_warps, int lowest, int highest) {
    DEEP_EP_CHECK_ARG(num_send_warps >= lowest && num_send_warps <= highest, what, ": send warps per channel must be in [",
                      lowest, ", ", highest, "] for this rank count, got ", num_send_warps);
}

}  // namespace

// =============================================================================================================
// Launchers
// =============================================================================================================

void intranode_notify(const KernelContext& ctx, const NotifyArgs& args, cudaStream_t stream) {
    check_context(ctx, "notify");
    DEEP_EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                      "notify: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    DEEP_EP_CHECK_ARG(args.num_experts >= ctx.num_ranks && args.num_experts % ctx.num_ranks == 0,
                      "notify: num_experts must be a positive multiple of num_ranks, got ", args.num_experts);
    DEEP_EP_CHECK_ARG(args.num_experts / ctx.num_ranks <= kMaxLocalExperts, "notify: num_experts / num_ranks must be <= ",
                      kMaxLocalExperts, ", got ", args.num_experts / ctx.num_ranks);
    DEEP_EP_CHECK_ARG(args.expert_alignment >= 1, "notify: expert_alignment must be >= 1, got ", args.expert_alignment);
    DEEP_EP_CHECK_ARG(args.num_tokens >= 0, "notify: num_tokens must be >= 0, got ", args.num_tokens);
    if (ctx.put_mask != 0)
        notify_counts_kernel<true><<<1, kNotifyThreads, 0, stream>>>(ctx, args);
    else
        notify_counts_kernel<false><<<1, kNotifyThreads, 0, stream>>>(ctx, args);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_dispatch(const KernelContext& ctx, const DispatchArgs& args, cudaStream_t stream) {
    check_context(ctx, "dispatch");
    DEEP_EP_CHECK_ARG(args.hidden_bytes > 0 && args.hidden_bytes % 16 == 0,
                      "dispatch: hidden bytes per token must be a positive multiple of 16, got ", args.hidden_bytes);
    DEEP_EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "dispatch: num_topk must be in [0, ", kMaxTopk,
                      "], got ", args.num_topk);
    DEEP_EP_CHECK_ARG(args.num_topk == 0 || (args.topk_idx != nullptr && args.topk_weights != nullptr),
                      "dispatch: topk_idx and topk_weights must both be given when num_topk > 0");
    DEEP_EP_CHECK_ARG(args.topk_idx_bytes == 4 || args.topk_idx_bytes == 8,
                      "dispatch: topk_idx element size must be 4 or 8 bytes, got ", args.topk_idx_bytes);
    DEEP_EP_CHECK_ARG(args.num_topk == 0 || (args.num_experts >= ctx.num_ranks && args.num_experts % ctx.num_ranks == 0),
                      "dispatch: num_experts must be a positive multiple of num_ranks, got ", args.num_experts);
    DEEP_EP_CHECK_ARG(args.num_scales >= 0, "dispatch: num_scales must be >= 0, got ", args.num_scales);
    DEEP_EP_CHECK_ARG(args.num_scales == 0 || (args.x_scales != nullptr && args.recv_x_scales != nullptr),
                      "dispatch: x_scales and recv_x_scales must be given when num_scales > 0");
    DEEP_EP_CHECK_ARG(args.num_tokens >= 0, "dispatch: num_tokens must be >= 0, got ", args.num_tokens);
    DEEP_EP_CHECK_ARG(args.num_recv_rows >= 0, "dispatch: num_recv_rows must be >= 0, got ", args.num_recv_rows);

    DispatchGeometry geo;
    const int64_t record = dispatch_record_bytes(args.hidden_bytes, args.num_scales, args.num_topk);
    geo.ring = ring_geometry(ctx.num_nvl_bytes, ctx.num_ranks, args.num_channels, record, args.num_max_recv_tokens,
                             false);
    geo.scales_offset = dispatch_scales_offset(args.hidden_bytes);
    geo.meta_offset = dispatch_meta_offset(args.hidden_bytes, args.num_scales);
    if (ctx.num_ranks > 1) {
        check_channels("dispatch", args.num_channels, args.num_max_send_tokens, geo.ring.capacity, record,
                       ctx.num_nvl_bytes);
        // Copy warps: at least two (with the publisher they share Phase A's destinations, the drain check and the
        // output-word wait); the publisher and one receiver warp per source remain.
        check_send_warps("dispatch", args.num_send_warps, 2, kChannelWarps - ctx.num_ranks);
    } else
        DEEP_EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                          "dispatch: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    if (ctx.num_ranks == 1 && geo.ring.capacity < 1) geo.ring.capacity = 1;  // no ring is used with one rank

    check_resident("dispatch", args.num_channels);
    const bool put = ctx.put_mask != 0;
    if (args.topk_idx_bytes == 8 && put)
        dispatch_kernel<int64_t, true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else if (args.topk_idx_bytes == 8)
        dispatch_kernel<int64_t, false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else if (put)
        dispatch_kernel<int32_t, true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else
        dispatch_kernel<int32_t, false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_combine(const KernelContext& ctx, const CombineArgs& args, cudaStream_t stream) {
    check_context(ctx, "combine");
    DEEP_EP_CHECK_ARG(args.hidden > 0 && (args.hidden * 2) % 16 == 0,
                      "combine: hidden * 2 bytes must be a positive multiple of 16, got hidden ", args.hidden);
    DEEP_EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "combine: num_topk must be in [0, ", kMaxTopk,
                      "], got ", args.num_topk);
    DEEP_EP_CHECK_ARG(args.num_topk == 0 || args.topk_weights != nullptr,
                      "combine: topk_weights must be given when num_topk > 0");
    DEEP_EP_CHECK_ARG(args.num_tokens >= 0, "combine: num_tokens must be >= 0, got ", args.num_tokens);

    CombineGeometry geo;
    const int64_t record = combine_record_bytes(args.hidden, args.num_topk);
    geo.ring = ring_geometry(ctx.num_nvl_bytes, ctx.num_ranks, args.num_channels, record, args.num_max_recv_tokens,
                             true);
    geo.weights_offset = combine_weights_offset(args.hidden);
    if (ctx.num_ranks > 1) {
        check_channels("combine", args.num_channels, args.num_max_send_tokens, geo.ring.capacity, record,
                       ctx.num_nvl_bytes);
        // Copy warps: at least one per destination; the publisher and at least one reducer warp remain.
        check_send_warps("combine", args.num_send_warps, ctx.num_ranks - 1, kChannelWarps - 2);
    } else {
        DEEP_EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                          "combine: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
        if (geo.ring.capacity < 1) geo.ring.capacity = 1;
    }
    check_resident("combine", args.num_channels);
    if (ctx.put_mask != 0)
        combine_kernel<true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else
        combine_kernel<false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_combine_landed(const KernelContext& ctx, const CombineArgs& args, int num_ctas, bool zone,
                              cudaStream_t stream) {
    check_context(ctx, "combine");
    DEEP_EP_CHECK_ARG(ctx.put_mask == 0, "combine: the landing-zone combines store into peers' buffers; a world with ",
                      "NVSHMEM put peers (mask ", ctx.put_mask, ") combines through the rings");
    DEEP_EP_CHECK_ARG(args.hidden > 0 && (args.hidden * 2) % 16 == 0,
                      "combine: hidden * 2 bytes must be a positive multiple of 16, got hidden ", args.hidden);
    DEEP_EP_CHECK_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "combine: num_topk must be in [0, ", kMaxTopk,
                      "], got ", args.num_topk);
    DEEP_EP_CHECK_ARG(args.num_topk == 0 || args.topk_weights != nullptr,
                      "combine: topk_weights must be given when num_topk > 0");
    DEEP_EP_CHECK_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                      "combine: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    DEEP_EP_CHECK_ARG(args.channel_prefix_matrix != nullptr && args.copy_epoch != 0,
                      "combine: the copy-engine path needs the handle's channel_prefix_matrix and an epoch");
    DEEP_EP_CHECK_ARG(num_ctas >= 1 && num_ctas <= kMaxChannels, "combine: CTAs must be in [1, ", kMaxChannels,
                      "], got ", num_ctas);
    check_resident("combine", num_ctas);
    if (zone) {
        // Senders, the publisher and at least one reducer warp; the senders' count is the stripe's rows.
        check_send_warps("combine", args.num_send_warps, 1, kZoneWarps - 2);
        combine_landed_kernel<true, kZoneWarps><<<num_ctas, kZoneWarps * 32, 0, stream>>>(ctx, args);
    } else {
        combine_landed_kernel<false, kChannelWarps><<<num_ctas, kChannelThreads, 0, stream>>>(ctx, args);
    }
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_combine_copy_prepare(const KernelContext& ctx, uint32_t copy_epoch, cudaStream_t stream) {
    check_context(ctx, "combine");
    combine_copy_prepare_kernel<<<1, 32, 0, stream>>>(ctx, copy_epoch);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_combine_copy_flag(const KernelContext& ctx, const LandedFlags& flags, cudaStream_t stream) {
    combine_copy_flag_kernel<<<1, 32, 0, stream>>>(ctx, flags);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_barrier(const KernelContext& ctx, cudaStream_t stream) {
    check_context(ctx, "barrier");
    barrier_kernel<<<1, 32, 0, stream>>>(ctx);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_reset(const KernelContext& ctx, cudaStream_t stream) {
    check_context(ctx, "reset");
    reset_state_kernel<<<16, 256, 0, stream>>>(ctx);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

void intranode_signal_abort(const KernelContext& ctx, cudaStream_t stream) {
    check_context(ctx, "signal_abort");
    signal_abort_kernel<<<1, 32, 0, stream>>>(ctx);
    DEEP_EP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kernels
}  // namespace deep_ep
