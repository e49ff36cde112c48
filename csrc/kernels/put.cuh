// NVSHMEM put peers of the ring kernels (the internode backend's peers behind a NIC, docs/multinode.md): the few
// operations that differ from a pointer peer. Everything else of the ring kernels (intranode_*.cu) is the same for
// both kinds of peer.
//
// * A word that a peer publishes into this rank's control region (ring tail or head, notify flag, barrier arrival)
//   comes from a put peer as a 64-bit NVSHMEM signal into the word's twin in the put area (layout.cuh); the low half
//   of the twin holds the uint32 value, so the bounded wait (sync.cuh wait_geq) polls it unchanged. After a
//   successful wait the receiver runs NVSHMEM's consistency operation (proxy transports need it before the data
//   the signal covers is read).
// * Records for a put peer are written into this rank's staging twin of the destination's ring slot. With put
//   peers, each copy warp takes blocks of consecutive items (tokens, rows) instead of every W-th item, so the
//   records of one block for one peer are consecutive in the ring; after staging a block the warp puts each such
//   run itself (put_staged_runs) and waits for its delivery, and only then releases its progress. The publisher
//   publishes a tail that covers delivered runs only, as a signal (one per peer and publication, at least
//   num_max_nvl_chunked_send_tokens records apart). So all copy warps of a channel issue puts in parallel, and a
//   chunk travels as a few contiguous puts. A staging slot is reused only when its ring slot is, i.e. after the
//   receiver returned the head past it (credits: a slow receiver holds the senders back).
//
// Each helper takes `kPut`: false gives exactly the pointer code (the intranode kernels are instantiated so), true
// tests the peer's bit of KernelContext::put_mask (is_ring_put_peer). Without NVSHMEM (DEEP_EP_DISABLE_NVSHMEM) the
// NVSHMEM calls are left out: the launchers refuse a context with put peers there.
#pragma once

#include <cstdint>

#include "api.cuh"
#include "layout.cuh"
#include "ptx.cuh"

#ifndef DEEP_EP_DISABLE_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace deep_ep {
namespace kernels {

#ifdef DEEP_EP_DISABLE_NVSHMEM
constexpr bool kHasPutPath = false;
#else
constexpr bool kHasPutPath = true;
#endif

// Whether rank r (in [0, num_ranks)) is a put peer, for any rank of the runtime (the fused kernels, the barrier,
// the abort).
__device__ __forceinline__ bool is_put_peer(const KernelContext& ctx, int r) {
    return ((ctx.put_mask >> r) & 1ull) != 0;
}

// The same for the ring kernels: their groups (at most kMaxRanks ranks) have their bits in the mask's low word, so
// the test stays on 32 bits (their register budget).
static_assert(kMaxRanks <= 32, "the ring kernels' put bits lie in the low word of KernelContext::put_mask");
__device__ __forceinline__ bool is_ring_put_peer(const KernelContext& ctx, int r) {
    return r < 32 && ((static_cast<uint32_t>(ctx.put_mask) >> r) & 1u) != 0;
}

// The helpers below take group ranks (`pe`): a runtime's group is the NVSHMEM world, so a rank is its PE.

__device__ __forceinline__ char* own_buffer(const KernelContext& ctx) {
    return static_cast<char*>(ctx.buffers[ctx.rank]);
}

// The uint64 twin (a symmetric address: the same offset on every rank) of the control-region word at `offset`.
__device__ __forceinline__ uint64_t* signal_twin(const KernelContext& ctx, int64_t offset) {
    return reinterpret_cast<uint64_t*>(own_buffer(ctx) + ctx.num_nvl_bytes + 2 * offset);
}

// This rank's copy of the word at control-region `offset` that `peer` publishes: `word` (that word of this rank's
// buffer) for a pointer peer, the low half of its twin for a put peer. The callers pass the pointer expression of
// the pointer-only code, so that kPut = false compiles to exactly that code.
template <bool kPut>
__device__ __forceinline__ uint32_t* peer_word(const KernelContext& ctx, uint32_t* word, int64_t offset, int peer) {
    if (kPut && is_ring_put_peer(ctx, peer)) return reinterpret_cast<uint32_t*>(signal_twin(ctx, offset));
    return word;
}

// NVSHMEM's consistency operation after a signal was seen (a test that always succeeds runs it). Not inlined: the
// ring kernels keep their register budget.
static __device__ __noinline__ void put_wait_consistency(uint64_t* twin) {
#ifndef DEEP_EP_DISABLE_NVSHMEM
    nvshmem_uint64_test(twin, NVSHMEM_CMP_GE, 0ull);
#else
    (void)twin;
#endif
}

// After a successful wait on the word at `offset` published by `peer`.
template <bool kPut>
__device__ __forceinline__ void after_peer_wait(const KernelContext& ctx, int64_t offset, int peer) {
    if (kPut && is_ring_put_peer(ctx, peer)) put_wait_consistency(signal_twin(ctx, offset));
}

// One thread: `value` into the twin of the word at `offset` of put peer `pe` (`add`: added to it, else set; a
// uint64 word such as a combine-agreement word fills its twin whole), after
// everything this thread wrote or observed before (a system fence, then an NVSHMEM signal; nothing of this
// thread's is in flight as a put). `used` keeps its signature whole in every kernel file: the compiler does not
// specialise it to the constant `add` of one file's callers, so the callers' code does not depend on which other
// kernels share their file.
#ifndef DEEP_EP_DISABLE_NVSHMEM
__attribute__((used))
#endif
static __device__ __noinline__ void put_signal(const KernelContext& ctx, int64_t offset, int pe, uint64_t value,
                                               bool add = false) {
    fence_acq_rel_sys();
#ifndef DEEP_EP_DISABLE_NVSHMEM
    nvshmemx_signal_op(signal_twin(ctx, offset), value, add ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET, pe);
#else
    (void)ctx, (void)offset, (void)pe, (void)value, (void)add;
#endif
}

// One thread: `value` into `peer`'s word at control-region `offset`, release-ordered after this thread's earlier
// writes and what it observed: a release store to `word` (that word, mapped) for a pointer peer, put_signal for a
// put peer.
template <bool kPut>
__device__ __forceinline__ void publish_word(const KernelContext& ctx, uint32_t* word, int64_t offset, int peer,
                                             uint32_t value) {
    if (kPut && is_ring_put_peer(ctx, peer))
        put_signal(ctx, offset, peer, value);
    else
        st_release_sys(word, value);
}

// One thread: the abort word of put peer `pe` becomes `word` (a signal over the abort word and the unused word
// after it; unlike the pointer path's compare-and-swap it may replace an earlier aborter's word, and it never
// waits for the peer's answer, which a dead peer would not give).
static __device__ __noinline__ void put_abort(const KernelContext& ctx, int pe, uint32_t word) {
    static_assert(kAbortOffset % 8 == 0 && kAbortOffset + 8 <= kBarrierOffset, "the abort signal spans 8 bytes");
#ifndef DEEP_EP_DISABLE_NVSHMEM
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(own_buffer(ctx) + kAbortOffset), word, NVSHMEM_SIGNAL_SET, pe);
#else
    (void)ctx, (void)pe, (void)word;
#endif
}

// Where this rank stages a record for slot `slot` of its ring (channel) at `peer` (the staging twin of its own
// ring (channel, peer)).
__device__ __forceinline__ char* staging_slot(const KernelContext& ctx, const RingGeometry& ring, int channel, int peer,
                                              int slot) {
    return own_buffer(ctx) + put_stage_shift(ctx.num_nvl_bytes) + ring.slot_offset(channel, peer, slot);
}

// Whole warp, after it staged a block of records: lane d holds the sequence number `first` of the block's first
// record for rank d in this rank's ring (channel) at d, and their number `count` (0: none, or d is no put peer).
// Each such run of consecutive records goes to its ring slots at d in one put (two where it wraps round the
// ring), issued by the whole warp; then the warp waits until the runs are delivered (quiet), so that the
// publisher's later tail signal follows them on every transport (over P2P a put is a copy by the warp's threads;
// over a NIC, one work request per run). The lanes' staged stores come first (warp sync, then one system fence).
static __device__ __noinline__ void put_staged_runs(const KernelContext& ctx, const RingGeometry& ring, int channel,
                                                    uint32_t first, int count) {
#ifndef DEEP_EP_DISABLE_NVSHMEM
    if (!__any_sync(0xffffffffu, count > 0)) return;
    __syncwarp();
    if ((threadIdx.x & 31) == 0) fence_acq_rel_sys();
    __syncwarp();
    const int capacity = ring.capacity;
    char* base = own_buffer(ctx);
    for (int d = 0; d < ctx.num_ranks; ++d) {
        const int n = __shfl_sync(0xffffffffu, count, d);
        const uint32_t seq = __shfl_sync(0xffffffffu, first, d);
        if (n <= 0) continue;
        auto put_range = [&](int from, int records) {
            nvshmemx_putmem_nbi_warp(base + ring.slot_offset(channel, ctx.rank, from),
                                     staging_slot(ctx, ring, channel, d, from),
                                     static_cast<size_t>(records) * static_cast<size_t>(ring.record_bytes), d);
        };
        const int slot = static_cast<int>(seq % static_cast<uint32_t>(capacity));
        const int head_part = n < capacity - slot ? n : capacity - slot;
        put_range(slot, head_part);
        if (head_part < n) put_range(0, n - head_part);
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) nvshmem_quiet();
    __syncwarp();
#else
    (void)ctx, (void)ring, (void)channel, (void)first, (void)count;
#endif
}

// Whole warp: `bytes` at `offset` of this buffer's staging `src` to `offset` at put peer `pe`, then the twin of the
// word at `flag_offset` there becomes `flag` (put-with-signal); waits until the source may be rewritten.
static __device__ __noinline__ void put_block_with_flag(const KernelContext& ctx, const void* src, int64_t offset,
                                                        int64_t bytes, int pe, int64_t flag_offset, uint32_t flag) {
#ifndef DEEP_EP_DISABLE_NVSHMEM
    nvshmemx_putmem_signal_nbi_warp(own_buffer(ctx) + offset, src, static_cast<size_t>(bytes),
                                    signal_twin(ctx, flag_offset), flag, NVSHMEM_SIGNAL_SET, pe);
    nvshmem_quiet();
#else
    (void)ctx, (void)src, (void)offset, (void)bytes, (void)pe, (void)flag_offset, (void)flag;
#endif
}

}  // namespace kernels
}  // namespace deep_ep
