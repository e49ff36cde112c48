// Device side shared by the low-latency kernel files (low_latency_*.cu): the fixed offsets of the symmetric
// buffer and the private workspace, the bounded wait on a symmetric word, error reports, signals, and the
// cooperative launch. The kernels have external linkage so that profilers show readable names
// (deep_ep::kernels::ll::ll_*_kernel<N>); helpers that are not force-inlined have internal linkage (static), so that
// ptxas fits them into each kernel's register budget under -rdc.
#pragma once

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "error_record.cuh"
#include "status.cuh"
#include "low_latency.cuh"
#include "ptx.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

// Symmetric buffer: the global words before the two halves (low_latency.cuh has the carving).
constexpr int64_t kAlign = 128;
constexpr int64_t kGlobalBytes = 128;     // barrier word at 0, abort word at 8, disagreement word at 16
constexpr int64_t kBarrierOffset = 0;
constexpr int64_t kAbortOffset = 8;
// u64: 0, or 1 + the rank that saw a combine's call-signature hashes differ and told this rank (tell_disagreement).
constexpr int64_t kDisagreementOffset = 16;
// Private workspace: the error-record claim word, the barrier base, per-CTA epochs, send-phase counts, unreleased
// halves and arrival bases, and the per-half count of CTAs that finished a hooked receive.
constexpr int64_t kWsClaim = 0;
constexpr int64_t kWsBarrierBase = 8;
// u32: 1 once a dispatch or combine saw a peer's call-signature hash differ from its own, or a peer told this rank
// so (kDisagreementOffset); every LL dispatch and combine kernel then returns at once until the host clears it.
constexpr int64_t kWsMismatch = 16;
constexpr int64_t kWsEpochs = 256;        // u32 [kMaxBlocks][2]
constexpr int64_t kWsSends = 1536;        // u32 [kMaxBlocks][2]: send phases this CTA ran on each half
constexpr int64_t kWsUnreleased = 2816;   // u32 [kMaxBlocks]: bit h = a receive on half h awaits the next send
constexpr int64_t kWsRecvDone = 3456;     // u64 [2]: CTAs that finished a hooked receive phase on each half
constexpr int64_t kWsBases = 3584;        // u64 [kMaxBlocks][2][R]
static_assert(kWsEpochs + kMaxBlocks * 2 * 4 <= kWsSends && kWsSends + kMaxBlocks * 2 * 4 <= kWsUnreleased &&
                  kWsUnreleased + kMaxBlocks * 4 <= kWsRecvDone && kWsRecvDone + 2 * 8 <= kWsBases,
              "workspace regions overlap");
// Dispatch arrival word s of a half (this rank's buffer) holds two counters: the low 48 bits count the dispatch
// messages source s delivered on that half, the high 16 bits the receive phases on that half that rank s has
// released (acquire_half below).
constexpr int kReleaseShift = 48;
constexpr uint64_t kArrivalMask = (uint64_t(1) << kReleaseShift) - 1;
constexpr int kHeaderInts = 1 + kMaxTopk;
__host__ __device__ inline int64_t workspace_end(int num_ranks) {
    return kWsBases + int64_t(kMaxBlocks) * 2 * num_ranks * 8;
}

__device__ __forceinline__ char* half_base(const Context& ctx, void* base, int half) {
    return static_cast<char*>(base) + ctx.layout.half_start(half);
}

__device__ __forceinline__ int64_t load_topk(const void* topk, int bytes, int64_t i) {
    return bytes == 8 ? static_cast<const int64_t*>(topk)[i] : static_cast<const int32_t*>(topk)[i];
}

// Stops this rank's LL kernels (kWsMismatch) and records the disagreement (the first record of the rank wins).
static __device__ __noinline__ void record_disagreement(const Context ctx, int32_t kernel, int32_t phase, int32_t peer,
                                                        int32_t channel, int64_t expected, int64_t observed) {
    *reinterpret_cast<volatile unsigned int*>(static_cast<char*>(ctx.workspace) + kWsMismatch) = 1u;
    fill_error_record(ctx.error, reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsClaim),
                      kErrorArgumentMismatch, kernel, phase, ctx.rank, peer, channel, ctx.call_seq, expected, observed,
                      0);
}

// The two words that say whether the ranks' call signatures differed: this rank saw it (kWsMismatch), or a peer
// told it (the disagreement word). Loaded together, so that a kernel's start pays one memory round trip for both and
// for the loads issued with them.
struct DisagreementWords {
    unsigned int seen;
    uint64_t told;
};
__device__ __forceinline__ DisagreementWords load_disagreement(const Context& ctx) {
    DisagreementWords w;
    w.seen = *reinterpret_cast<volatile unsigned int*>(static_cast<char*>(ctx.workspace) + kWsMismatch);
    w.told = *reinterpret_cast<volatile uint64_t*>(static_cast<char*>(ctx.sym) + kDisagreementOffset);
    return w;
}

// True when the words say the ranks' call signatures differed; a peer's word is recorded here.
__device__ __forceinline__ bool signatures_disagreed(const Context& ctx, const DisagreementWords& w) {
    if (w.seen != 0u) return true;
    if (w.told == 0) return false;
    record_disagreement(ctx, kKernelLlCombine, kPhaseLlCombineToldDisagreement, static_cast<int32_t>(w.told) - 1, -1,
                        0, 0);
    return true;
}
__device__ __forceinline__ bool signatures_disagreed(const Context& ctx) {
    return signatures_disagreed(ctx, load_disagreement(ctx));
}

__device__ __forceinline__ bool is_masked(const Context& ctx, int r) {
    return ctx.mask != nullptr && *reinterpret_cast<volatile int*>(ctx.mask + r) != 0;
}

// First failing thread of this rank fills the record (claim word in the workspace), then raises every peer's abort.
// `used` keeps its signature whole in every kernel file: the compiler does not specialise it to the arguments that
// are constant in one file's calls, so the callers' code does not depend on which other kernels share their file.
__attribute__((used)) static __device__ __noinline__ void report(const Context ctx, int32_t code, int32_t kernel,
                                                                 int32_t phase, int32_t peer, int32_t channel,
                                                                 int64_t expected, int64_t observed, int64_t elapsed) {
    auto* claim = reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsClaim);
    fill_error_record(ctx.error, claim, code, kernel, phase, ctx.rank, peer, channel, ctx.call_seq, expected, observed,
                      elapsed);
    const uint64_t word = (uint64_t(code) << 32) | uint64_t(ctx.rank + 1);
    for (int r = 0; r < ctx.num_ranks; ++r) {
        if (ctx.peers[r] != nullptr) {
            // System scope: ranks on other GPUs may raise the same word at the same time.
            atomicCAS_system(reinterpret_cast<unsigned long long*>(static_cast<char*>(ctx.peers[r]) + kAbortOffset),
                             0ull, static_cast<unsigned long long>(word));
        } else {
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset), word,
                               NVSHMEM_SIGNAL_SET, r);
        }
    }
    __threadfence_system();
}

// A combine's receiver saw `peer`'s call-signature hash differ. A rank hears from the owners of its tokens' experts
// only, so it tells every peer (their disagreement word: their waits stop and their next kernel records it) before
// it records the difference itself: once its host raises, every peer has been told.
static __device__ __noinline__ void tell_disagreement(const Context ctx, int32_t kernel, int32_t phase, int32_t peer,
                                                      int32_t channel, int64_t expected, int64_t observed) {
    const unsigned long long word = static_cast<unsigned long long>(ctx.rank + 1);
    for (int r = 0; r < ctx.num_ranks; ++r) {
        if (r == ctx.rank) continue;
        if (ctx.peers[r] != nullptr) {
            auto* told = reinterpret_cast<unsigned long long*>(static_cast<char*>(ctx.peers[r]) + kDisagreementOffset);
            atomicCAS(told, 0ull, word);
        } else {
            nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kDisagreementOffset), word,
                               NVSHMEM_SIGNAL_SET, r);
        }
    }
    if (!ctx.all_p2p) nvshmem_quiet();
    __threadfence_system();
    record_disagreement(ctx, kernel, phase, peer, channel, expected, observed);
}

// kWaitMasked: the awaited peer was masked meanwhile (by another thread's timeout in shrink mode).
// kWaitDisagreed: `stop_on_disagreement` and the call signatures differed (signatures_disagreed: recorded).
enum WaitResult { kWaitOk = 0, kWaitTimeout = 1, kWaitAborted = 2, kWaitMasked = 3, kWaitDisagreed = 4 };

// Bounded spin until pred(value) holds on a local symmetric word. Every 64 spins: abort word, deadline and, when
// `watch_peer` >= 0, its mask bit (so waits on a peer that another CTA has just masked stop within ~64 spins
// instead of each running its own full timeout).
// Uses nvshmem_uint64_test when some peer is remote (its success path runs the proxy transports' consistency op).
template <typename Pred>
__device__ __forceinline__ WaitResult wait_word(const Context& ctx, uint64_t* addr, Pred pred, uint64_t* seen,
                                                uint64_t* elapsed_ns, int watch_peer = -1,
                                                bool stop_on_disagreement = false) {
    const uint64_t* abort = reinterpret_cast<const uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset);
    const uint64_t start = global_timer_ns();
    for (uint64_t spins = 0;; ++spins) {
        const uint64_t v = ld_acquire_sys_u64(addr);
        if (pred(v)) {
            if (!ctx.all_p2p) nvshmem_uint64_test(addr, NVSHMEM_CMP_EQ, v);
            *seen = v;
            *elapsed_ns = global_timer_ns() - start;
            return kWaitOk;
        }
        if ((spins & 63) == 63) {
            const uint64_t elapsed = global_timer_ns() - start;
            *seen = v;
            *elapsed_ns = elapsed;
            if (ld_acquire_sys_u64(abort) != 0) return kWaitAborted;
            if (watch_peer >= 0 && is_masked(ctx, watch_peer)) return kWaitMasked;
            if (stop_on_disagreement && signatures_disagreed(ctx)) return kWaitDisagreed;
            if (elapsed > ctx.timeout_ns) return kWaitTimeout;
            if (spins > 4096) __nanosleep(64);
        }
    }
}

// Handles a failed wait: with shrink, masks `peer` and returns true (the caller continues without it); otherwise
// reports (timeout or peer aborted) and returns false.
static __device__ bool on_wait_failure(const Context& ctx, WaitResult res, int kernel, int phase, int peer,
                                       int channel, int64_t expected, uint64_t seen, uint64_t elapsed) {
    if (res == kWaitTimeout && ctx.mask != nullptr && peer >= 0) {
        atomicExch(ctx.mask + peer, 1);
        return true;
    }
    if (res == kWaitAborted) {
        const uint64_t word =
            ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset));
        report(ctx, kErrorPeerAborted, kernel, phase, static_cast<int32_t>(word & 0xffffffffu) - 1, channel,
               expected, static_cast<int64_t>(seen), static_cast<int64_t>(elapsed));
    } else {
        report(ctx, kErrorTimeout, kernel, phase, peer, channel, expected, static_cast<int64_t>(seen),
               static_cast<int64_t>(elapsed));
    }
    return false;
}

// Adds `value` to the word at `offset` of PE `pe` (NVLink store or NVSHMEM signal), release-ordered after the
// caller's prior writes (and after whatever the caller observed through a barrier).
// `ordered`: the add is a release of this thread's earlier writes (false: the caller's accesses are ordered by
// other means, a kernel boundary, and the add need not wait for them).
__device__ __forceinline__ void signal_add(const Context& ctx, int pe, int64_t offset, uint64_t value,
                                           bool ordered = true) {
    if (ctx.peers[pe] != nullptr) {
        uint64_t* word = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.peers[pe]) + offset);
        if (ordered)
            red_add_release_sys_u64(word, value);
        else
            red_add_relaxed_sys_u64(word, value);
    } else {
        if (ordered) nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + offset), value,
                           NVSHMEM_SIGNAL_ADD, pe);
    }
}

// ---- Reuse of a buffer half across calls ----
// Calls alternate halves, so call k of a rank writes into the peers' half that their call k - 2 used. Nothing else
// orders the two: a combine waits only for the owners of its own tokens, so a rank whose combine k - 1 needs nothing
// from a peer (no token routed there) can start call k while that peer still reads call k - 2 (count words,
// messages, combine rows, arrival and flag words), and a receive hook may run after its rank sent its next call.
// So every send phase on half h first waits until each unmasked peer has released as many receive phases on h as
// this rank ran send phases there (acquire_half), and every receive phase is released once, when it is complete:
//   fused launch (send and receive in one kernel, the calls without a hook): by the rank's next send-capable
//     launch, at its start, before its own wait (acquire_half). The host runs the launches with a send phase in
//     the order they are issued (LowLatencyRuntime::order_launch), so the kernel boundary has completed every read
//     of the receive; nothing is added to the receive's critical path, and a sender that reaches call k only waits
//     where the peer has not yet started its call k - 1 at all.
//   hooked receive (its own launch): when the rank has issued no later send yet (the usual send, hook, next call),
//     as a fused one, by the rank's next send (defer_release; the host orders that send after this launch); when
//     the rank's next send was issued before it (two calls overlapped), at its end, by the last CTA of the grid to
//     finish (release_half): only that case adds to a receive's critical path.
// A receive hook of call k must therefore run before its rank issues call k + 2 (at most two calls in flight):
// otherwise the peers' sends of call k + 2 (and the rank's own, which precedes the hook on its stream) wait for
// that receive and time out (phase kPhaseLlHalfRelease).

// Whole CTA, before a send phase on half h writes anything: releases the receives of this rank's earlier launches
// that await it (kWsUnreleased: CTA b signals peers d = b mod nb, as the dispatch count words; relaxed adds, since
// the kernel boundary already ordered those receives' reads before this launch), then the acquire
// above (one waiting thread per peer; nearly always satisfied at the first load), then this CTA counts the send
// phase and, for a fused launch, marks half h's receive as awaiting release by the next send (set at the start:
// the host runs the next send after this launch's end). False: a wait failed without shrink (reported); the CTA
// must not write.
__device__ __forceinline__ bool acquire_half(const Context& ctx, int h, bool fused, int32_t kernel, int* failed) {
    char* ws = static_cast<char*>(ctx.workspace);
    uint32_t* sends = reinterpret_cast<uint32_t*>(ws + kWsSends) + blockIdx.x * 2 + h;
    uint32_t* unreleased = reinterpret_cast<uint32_t*>(ws + kWsUnreleased) + blockIdx.x;
    const uint32_t need = *sends, bits = *unreleased;
    if (threadIdx.x == 0) *failed = 0;
    __syncthreads();
    if (bits != 0) {
        const int64_t slot = ctx.layout.darrive_off + int64_t(ctx.rank) * 8;
        for (int d = blockIdx.x + threadIdx.x * gridDim.x; d < ctx.num_ranks; d += gridDim.x * blockDim.x) {
            if (is_masked(ctx, d)) continue;
            for (int half = 0; half < 2; ++half)
                if ((bits >> half) & 1u)
                    signal_add(ctx, d, ctx.layout.half_start(half) + slot, uint64_t(1) << kReleaseShift, false);
        }
    }
    char* mine = half_base(ctx, ctx.sym, h);
    for (int d = threadIdx.x; d < ctx.num_ranks; d += blockDim.x) {
        if (is_masked(ctx, d)) continue;
        uint64_t* word = reinterpret_cast<uint64_t*>(mine + ctx.layout.darrive_off + int64_t(d) * 8);
        uint64_t seen = 0, elapsed = 0;
        const WaitResult res = wait_word(
            ctx, word, [need](uint64_t v) { return int16_t(uint16_t(v >> kReleaseShift) - uint16_t(need)) >= 0; },
            &seen, &elapsed, ctx.mask != nullptr ? d : -1);
        if (res != kWaitOk && res != kWaitMasked &&
            !on_wait_failure(ctx, res, kernel, kPhaseLlHalfRelease, d, h, need & 0xffffu, seen >> kReleaseShift,
                             elapsed))
            *failed = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *sends = need + 1;
        *unreleased = fused ? 1u << h : 0u;
    }
    return *failed == 0;
}

// At the start of a hooked receive on half h that leaves its release to the rank's next send (the host issued no
// later send, and runs the next one after this launch): marks half h in this CTA's record, as a fused launch does.
__device__ __forceinline__ void defer_release(const Context& ctx, int h) {
    if (threadIdx.x == 0)
        atomicOr(reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsUnreleased) + blockIdx.x,
                 1u << h);
}

// Whole CTA, after the last read of a hooked receive phase on half h: the last CTA of the grid to arrive adds one
// release to this rank's arrival word of half h at every unmasked peer (each CTA's count is a gpu-scope
// acquire-release after its reads, so the last count follows every CTA's reads; the signal is a system-scope
// release after it).
__device__ __forceinline__ void release_half(const Context& ctx, int h, int* last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        auto* done = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsRecvDone) + h;
        *last = (atom_add_acq_rel_gpu_u64(done, 1) + 1) % gridDim.x == 0 ? 1 : 0;
    }
    __syncthreads();
    if (*last == 0) return;
    const int64_t offset = ctx.layout.half_start(h) + ctx.layout.darrive_off + int64_t(ctx.rank) * 8;
    for (int d = threadIdx.x; d < ctx.num_ranks; d += blockDim.x)
        if (!is_masked(ctx, d)) signal_add(ctx, d, offset, uint64_t(1) << kReleaseShift);
}

__device__ __forceinline__ float bf16_to_float(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

// Cooperative launch: co-residency of every CTA is required, not a grid.sync() — in dispatch every CTA spins on the
// count words that CTA (d mod nb) of each rank writes, its own grid's included, so a CTA left unscheduled would
// stall the others (bounded, but a spurious timeout). The shared-memory ceiling is set once (configure_kernels).
template <typename Kernel, typename... Args>
Status launch_cooperative(Kernel kernel, int blocks, int smem, cudaStream_t stream, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaLaunchKernelEx(&cfg, kernel, args...));
    return {};
}


// cudaFuncAttributeMaxDynamicSharedMemorySize of each file's kernels (configure_kernels calls both).
Status configure_dispatch_kernels();
Status configure_combine_kernels();

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
