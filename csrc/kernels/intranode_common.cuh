// Device helpers of the ring kernels (intranode_*.cu) and the host-side checks of their launchers.
//
// * One CTA of 1024 threads per channel; channel c owns the contiguous token range channel_range(N, C, c).
// * Each (channel, source) pair has a ring in the receiver's buffer (layout.cuh). Ring positions are monotonic uint32
//   sequence numbers that never reset; the sender keeps its tail in the workspace and publishes it into the
//   receiver's buffer, the receiver keeps its head in the workspace and publishes it into the sender's buffer. Every
//   wait is local.
// * Copy warps never wait for flag publication: after each item a copy warp releases its progress in shared memory,
//   and one publisher warp turns the smallest progress into the complete prefix of items and publishes tails (one
//   system fence, then release stores) or heads.
// * Failures never trap: sync.cuh's wait_geq reports to the error record and every role falls through to the end.
// Helpers that are not force-inlined have internal linkage (static): under -rdc ptxas then fits them into each
// kernel's register budget.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "api.cuh"
#include "layout.cuh"
#include "status.cuh"
#include "sync.cuh"

namespace deep_ep {
namespace kernels {

constexpr int kUnroll = 4;  // 16-byte loads in flight per lane in row copies
// Named barrier ids (0 is __syncthreads).
constexpr int kBarrierAllSenders = 1;  // copy warps and the publisher, after the prologue
constexpr int kBarrierRecvGroup0 = 2;  // + source index, for dispatch receiver groups of more than one warp
static_assert(kMaxRanks < 32, "lane-per-rank masks (1u << num_ranks) and warp-wide rank loops");
// Every kernel takes its parameters (KernelContext, the Args and Geometry structs) as `const __grid_constant__`:
// reads, also with a run-time index (ctx.buffers[d]), go to the parameter bank. A plain by-value
// parameter whose address is taken or that is indexed at run time is copied to local memory by every thread at entry
// (the context alone is 43 eight-byte words at kMaxRanks = 24); on one H200 those copies and their loads cost the
// 1-rank dispatch 16-17 % of its kernel time.

__device__ __forceinline__ uint32_t* buffer_u32(void* buffer, int64_t offset) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(buffer) + offset);
}

__device__ __forceinline__ uint32_t* workspace_u32(const KernelContext& ctx, int64_t offset) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(ctx.workspace) + offset);
}

__device__ __forceinline__ int counter_index(int channel, int peer) { return channel * kMaxRanks + peer; }

// The number of the checked call a kernel is about to compare (kWsCheckedCallsOffset). Read once per CTA, before
// the CTA's first barrier and its arrival in publish_agreement_verdict.
__device__ __forceinline__ uint32_t checked_call_number(const KernelContext& ctx) {
    return *reinterpret_cast<volatile uint32_t*>(workspace_u32(ctx, kWsCheckedCallsOffset)) + 1u;
}

// One thread per CTA of a kernel whose CTAs each compare the ranks' signature hashes (cached dispatch, checked
// combine), once its CTA has compared them: the last of the `num_ctas` CTAs counts the checked call `checked_call`
// as done (0: a call numbered otherwise, an intranode cached dispatch) and writes the call's call_seq to the
// host-mapped `host_verdict` (nullptr: nothing; under CUDA-graph capture), which the host's bounded wait reads
// (Runtime::await_agreement).
__device__ __forceinline__ void publish_agreement_verdict(const KernelContext& ctx, int64_t* host_verdict,
                                                          uint32_t num_ctas, uint32_t checked_call = 0u) {
    if (host_verdict == nullptr && checked_call == 0u) return;
    __threadfence();
    const uint32_t arrived = atomicAdd(workspace_u32(ctx, kWsAgreementArrivalsOffset), 1u) + 1u;
    if (arrived == num_ctas) {
        *workspace_u32(ctx, kWsAgreementArrivalsOffset) = 0u;
        if (checked_call != 0u) *workspace_u32(ctx, kWsCheckedCallsOffset) = checked_call;
        if (host_verdict != nullptr) {
            fence_acq_rel_sys();
            *reinterpret_cast<volatile int64_t*>(host_verdict) = ctx.call_seq;
            __threadfence_system();
        }
    }
}

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

// ---- ring drain checks (dispatch and combine) ----

// Whole warp: waits until the previous calls' data this rank wrote into the rings of this direction of every
// destination in `dst_mask` has been consumed, i.e. head[c'][d] >= tail_shadow[c'][d] for every channel c' that any
// call used (`num_checked` channels). Needed because the ring geometry may change between calls. Fast path: relaxed
// loads in parallel over lanes, then one system fence (acquire pattern). Returns false on failure (reported).
// A put peer's heads are the low halves of signal twins (put.cuh); they guard no data this rank reads.
template <bool kPut>
static __device__ bool warp_wait_drained(const KernelContext& ctx, uint32_t dst_mask, int num_checked,
                                         int64_t head_offset, int64_t shadow_offset, int kernel, int phase,
                                         int channel) {
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

// Publisher lane 0: one system fence, then the new tails of every peer d whose count changed: a release store for
// a pointer peer, a signal for a put peer (whose records the copy warps have put and seen delivered, put.cuh).
template <bool kPut>
__device__ __forceinline__ void publish_tails(const KernelContext& ctx, int count, int old_count,
                                              const uint32_t* tail_base, int channel, int64_t tail_offset) {
    const int lane = lane_id();
    if (lane == 0) fence_acq_rel_sys();
    for (int d = 0; d < ctx.num_ranks; ++d) {
        const int c = __shfl_sync(0xffffffffu, count, d);
        const int old = __shfl_sync(0xffffffffu, old_count, d);
        if (lane == 0 && d != ctx.rank && c > old && !ctx.skip_sends)
            publish_word<kPut>(ctx, buffer_u32(ctx.buffers[d], tail_offset) + counter_index(channel, ctx.rank),
                               tail_offset + 4 * counter_index(channel, ctx.rank), d,
                               tail_base[d] + static_cast<uint32_t>(c));
    }
    __syncwarp();
}

// Copy warps with put peers (put.cuh): items per block of one copy warp. A block is at most one publication
// (`chunk` items) and small enough that every copy warp gets one of the `num_items`.
__device__ __forceinline__ int put_block_items(int num_items, int num_copy_warps, int chunk) {
    const int even = (num_items + num_copy_warps - 1) / num_copy_warps;
    return max(1, min(chunk, even));
}

// ---- host-side checks of the launchers ----

// `max_ranks`: the calling kernels' group limit (the ring kernels' kMaxRanks unless given); `put_area`: the put area
// (PutArea) the calling kernels stage in when this rank has put peers (the ring kernels' kPutAreaMirror unless
// given; negative for kernels that stage nothing).
inline Status check_context(const KernelContext& ctx, const char* what, int max_ranks = kMaxRanks,
                            int put_area = kPutAreaMirror) {
    DEEP_EP_REQUIRE_ARG(ctx.num_ranks >= 1 && ctx.num_ranks <= max_ranks, what, ": num_ranks must be in [1, ",
                        max_ranks, "], got ", ctx.num_ranks);
    DEEP_EP_REQUIRE_ARG(ctx.rank >= 0 && ctx.rank < ctx.num_ranks, what, ": rank must be in [0, num_ranks), got ",
                        ctx.rank);
    DEEP_EP_REQUIRE_ARG(ctx.put_mask == 0 || (kHasPutPath && !put_bit(ctx.put_mask, ctx.rank) &&
                                              (ctx.num_ranks >= 64 || (ctx.put_mask >> ctx.num_ranks) == 0)),
                        what, ": put peers (mask ", ctx.put_mask, ") need an NVSHMEM build and a valid mask");
    DEEP_EP_REQUIRE_ARG(ctx.put_mask == 0 || put_area < 0 || ctx.put_area == put_area, what,
                        ": put peers need put area kind ", put_area, " (layout.cuh PutArea), got ", ctx.put_area);
    for (int r = 0; r < ctx.num_ranks; ++r)
        DEEP_EP_REQUIRE_ARG(ctx.buffers[r] != nullptr || put_bit(ctx.put_mask, r), what, ": the buffer of rank ", r,
                            " is not mapped");
    DEEP_EP_REQUIRE_ARG(ctx.workspace != nullptr, what, ": workspace must not be null");
    DEEP_EP_REQUIRE_ARG(ctx.num_nvl_bytes >= kControlBytes, what, ": num_nvl_bytes must be >= ", kControlBytes,
                        ", got ", ctx.num_nvl_bytes);
    return {};
}

// The counts a notify exchanges (the ring kernels' and the fused kernels'): experts, alignment and tokens.
inline Status check_notify_counts(const KernelContext& ctx, int num_experts, int expert_alignment, int num_tokens,
                                  const char* what) {
    DEEP_EP_REQUIRE_ARG(num_experts >= ctx.num_ranks && num_experts % ctx.num_ranks == 0, what,
                        ": num_experts must be a positive multiple of num_ranks, got ", num_experts);
    DEEP_EP_REQUIRE_ARG(num_experts / ctx.num_ranks <= kMaxLocalExperts, what, ": num_experts / num_ranks must be <= ",
                        kMaxLocalExperts, ", got ", num_experts / ctx.num_ranks);
    DEEP_EP_REQUIRE_ARG(expert_alignment >= 1, what, ": expert_alignment must be >= 1, got ", expert_alignment);
    DEEP_EP_REQUIRE_ARG(num_tokens >= 0, what, ": num_tokens must be >= 0, got ", num_tokens);
    return {};
}

// Every CTA of a dispatch / combine grid must be resident at once (CTAs wait for peers' CTAs): one per SM.
inline Status check_resident(const char* what, int num_channels) {
    int device = 0, num_sms = 0;
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    DEEP_EP_REQUIRE_ARG(num_channels <= num_sms, what, ": config.num_sms must be <= the device's ", num_sms,
                        " SMs (one resident CTA per channel), got ", num_channels);
    return {};
}

inline Status check_channels(const char* what, int num_channels, int num_max_send_tokens, int capacity,
                             int64_t record_bytes, int64_t num_nvl_bytes) {
    DEEP_EP_REQUIRE_ARG(num_channels >= 1 && num_channels <= kMaxChannels, what, ": config.num_sms must be in [1, ",
                        kMaxChannels, "], got ", num_channels);
    DEEP_EP_REQUIRE_ARG(num_max_send_tokens >= 1, what, ": num_max_nvl_chunked_send_tokens must be >= 1, got ",
                        num_max_send_tokens);
    DEEP_EP_REQUIRE_ARG(capacity >= 2 * num_max_send_tokens, what, ": ring capacity ", capacity,
                        " slots per (channel, rank) must be >= 2 * num_max_nvl_chunked_send_tokens = ",
                        2 * num_max_send_tokens, " (records of ", record_bytes, " bytes, ", num_channels,
                        " channels, num_nvl_bytes ", num_nvl_bytes,
                        "); raise num_nvl_bytes or num_max_nvl_chunked_recv_tokens, or lower num_sms");
    return {};
}

inline Status check_send_warps(const char* what, int num_send_warps, int lowest, int highest) {
    DEEP_EP_REQUIRE_ARG(num_send_warps >= lowest && num_send_warps <= highest, what,
                        ": send warps per channel must be in [", lowest, ", ", highest, "] for this rank count, got ",
                        num_send_warps);
    return {};
}

// Adds 8 BF16 values (one int4) to acc in fp32 (exact: a BF16 is the upper half of an fp32).
__device__ __forceinline__ void add_bf16x8(float* acc, const int4& v) {
    const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                               static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc[2 * i] += __uint_as_float(words[i] << 16);
        acc[2 * i + 1] += __uint_as_float(words[i] & 0xffff0000u);
    }
}

// 8 fp32 values rounded to nearest-even BF16, as one int4.
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

constexpr int kSignatureInts = 2 * kSignatureWords;  // a call signature as the notify slots hold it (int32)

// Notify, whole CTA (the intranode and the fused notify kernels; source s's signature in the gathered notify data
// starts at signatures + s * slot_ints). Every source's signature goes to the host and, with check_signatures, is
// compared with mine: *mismatch_source (shared, at least num_ranks before) becomes the first source that differs, the
// workspace's mismatch word says whether one did, and in worst-token mode (no host wait: host_counters == nullptr)
// the error record carries the disagreement to the host's next check. Ends with the CTA synchronised.
template <typename Args>
__device__ __forceinline__ void notify_agreement(const KernelContext& ctx, const Args& args,
                                                 const volatile int* signatures, int slot_ints, const int* my_signature,
                                                 int* mismatch_source) {
    const int num_ranks = ctx.num_ranks;
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks * kSignatureInts; i += static_cast<int>(blockDim.x)) {
        const int s = i / kSignatureInts, w = i % kSignatureInts;
        const int value = signatures[s * slot_ints + w];
        if (args.host_signatures != nullptr) reinterpret_cast<volatile int*>(args.host_signatures)[i] = value;
        if (args.check_signatures && value != my_signature[w]) atomicMin(mismatch_source, s);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int s = *mismatch_source;
        *workspace_u32(ctx, kWsNotifyMismatchOffset) = s < num_ranks ? 1u : 0u;
        if (s < num_ranks && args.host_counters == nullptr) {
            int w = 0;
            while (w + 1 < kSignatureInts && signatures[s * slot_ints + w] == my_signature[w]) ++w;
            fill_error_record(ctx.error,
                              reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsErrorClaimOffset),
                              kErrorArgumentMismatch, kKernelNotify, kPhaseNotifyAgreement, ctx.rank, s, -1,
                              ctx.call_seq, my_signature[w], signatures[s * slot_ints + w], 0);
        }
    }
}

// Notify, whole CTA, with a host wait (host_counters != nullptr): host_counters[1 + e] = the rows of local expert e
// from every source (source s's count of expert e at expert_counts[s * slot_ints + e]), rounded up to
// expert_alignment.
template <typename Args>
__device__ __forceinline__ void notify_expert_counts(const Args& args, const volatile int* expert_counts, int slot_ints,
                                                     int num_ranks, int num_local_experts) {
    for (int e = static_cast<int>(threadIdx.x); e < num_local_experts; e += static_cast<int>(blockDim.x)) {
        int64_t sum = 0;
        for (int s = 0; s < num_ranks; ++s) sum += expert_counts[s * slot_ints + e];
        const int64_t align = args.expert_alignment;
        reinterpret_cast<volatile int*>(args.host_counters)[1 + e] =
            static_cast<int>((sum + align - 1) / align * align);
    }
}

}  // namespace kernels
}  // namespace deep_ep
