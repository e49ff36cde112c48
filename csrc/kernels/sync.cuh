// Device-side synchronisation: the ONE bounded wait helper and error reporting (primitives: ptx.cuh).
//
// Every spin in the intranode kernels goes through wait_geq(). It polls a local 32-bit monotonic counter with
// relaxed system-scope loads until it reaches a target (wrap-safe), then confirms with one ld.acquire.sys; it checks
// this rank's abort word every 64 spins, reads %globaltimer (ns) to bound the wait by KernelContext::timeout_ns,
// and backs off with nanosleep after a while.
// On failure it fills the host-mapped ErrorRecord (first writer wins), raises the abort word of every rank, and
// returns false; the caller then falls through to the common exit of its CTA (no trap, no early return past a
// barrier).
#pragma once

#include <cstdint>

#include "api.cuh"
#include "layout.cuh"
#include "error_record.cuh"
#include "ptx.cuh"
#include "put.cuh"

namespace deep_ep {
namespace kernels {

// ---- error reporting ----

// Where a wait or check happens; copied into the error record.
struct Site {
    int32_t kernel;   // KernelId
    int32_t phase;    // Phase
    int32_t peer;     // -1 if none
    int32_t channel;  // -1 if none
};

__device__ __forceinline__ uint32_t* abort_word(void* buffer) {
    return reinterpret_cast<uint32_t*>(static_cast<char*>(buffer) + kAbortOffset);
}

// One thread: rank r's abort word becomes `word` unless an earlier aborter's word is there (a compare-and-swap for a
// pointer peer; put.cuh put_abort for a put peer).
__device__ __forceinline__ void raise_abort(const KernelContext& ctx, int r, uint32_t word) {
    if (is_put_peer(ctx, r))
        put_abort(ctx, r, word);
    else
        atomicCAS_system(reinterpret_cast<unsigned int*>(abort_word(ctx.buffers[r])), 0u, word);
}

// Fills the error record if nobody of this rank did before (first writer wins, error_record.cuh), then raises every
// rank's abort word.
// static: internal linkage lets ptxas fit it into the callers' register limit (__launch_bounds__) under -rdc=true;
// an external non-inlined function gets its own register count, and a caller limited to fewer fails to link.
static __device__ __noinline__ void report_error(const KernelContext& ctx, int32_t code, const Site& site,
                                                 int64_t expected, int64_t observed, int64_t elapsed_ns) {
    unsigned int* claim = reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsErrorClaimOffset);
    fill_error_record(ctx.error, claim, code, site.kernel, site.phase, ctx.rank, site.peer, site.channel, ctx.call_seq,
                      expected, observed, elapsed_ns);
    // Tell every rank (own included) to stop waiting. The word names the code and the first aborting rank.
    const uint32_t word = (static_cast<uint32_t>(code) << 8) | static_cast<uint32_t>(ctx.rank + 1);
    for (int r = 0; r < ctx.num_ranks; ++r) raise_abort(ctx, r, word);
    __threadfence_system();
}

// Reports PEER_ABORTED for an abort word set by someone else (a no-op on the record if this rank already failed).
__device__ __forceinline__ void report_abort_seen(const KernelContext& ctx, uint32_t word, const Site& site,
                                                  int64_t expected, int64_t observed, int64_t elapsed_ns) {
    Site s = site;
    s.peer = static_cast<int32_t>(word & 0xffu) - 1;
    report_error(ctx, kErrorPeerAborted, s, expected, observed, elapsed_ns);
}

// The periodic check of a bounded spin begun at `start` (global_timer_ns): true, after reporting at `site` with the
// awaited and the last seen values, once some rank raised this rank's abort word (PEER_ABORTED) or the wait has
// outlasted the timeout (TIMEOUT).
__device__ __forceinline__ bool spin_expired(const KernelContext& ctx, uint64_t start, const Site& site,
                                             int64_t expected, int64_t observed) {
    const uint32_t word = ld_relaxed_sys(abort_word(ctx.buffers[ctx.rank]));
    const uint64_t elapsed = global_timer_ns() - start;
    if (word != 0) {
        report_abort_seen(ctx, word, site, expected, observed, static_cast<int64_t>(elapsed));
        return true;
    }
    if (elapsed > ctx.timeout_ns) {
        report_error(ctx, kErrorTimeout, site, expected, observed, static_cast<int64_t>(elapsed));
        return true;
    }
    return false;
}

// True once some rank raised the abort word of this rank.
__device__ __forceinline__ bool is_aborted(const KernelContext& ctx) {
    return ld_relaxed_sys(abort_word(ctx.buffers[ctx.rank])) != 0;
}

// ---- the bounded wait ----

// Wrap-safe "a >= b" for monotonic 32-bit sequence numbers.
__device__ __forceinline__ bool seq_geq(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// Spins until *addr >= target (wrap-safe) with acquire semantics. Returns the value seen (>= target) through
// `observed` and true; or, after a timeout or an abort, reports and returns false. Call from one thread.
// The first read and the confirming read are ld.acquire.sys (LDG.STRONG.SYS + CCTL.IVALL in SASS); the spin in
// between uses relaxed loads, so a waiter that spins for a whole kernel (the direct-to-output receiver, reducers
// ahead of their data) does not invalidate its SM's L1 on every poll while the copy warps of the CTA stream data.
// The counters are monotonic, so the confirming acquire load sees a value >= target as well.
static __device__ __noinline__ bool wait_geq(const KernelContext& ctx, const uint32_t* addr, uint32_t target,
                                             const Site& site, uint32_t* observed) {
    uint32_t value = ld_acquire_sys(addr);
    if (seq_geq(value, target)) {
        *observed = value;
        return true;
    }
    const uint64_t start = global_timer_ns();
    for (uint64_t spins = 1;; ++spins) {
        value = ld_relaxed_sys(addr);
        if (seq_geq(value, target)) {
            *observed = ld_acquire_sys(addr);
            return true;
        }
        if ((spins & 63) == 0 && spin_expired(ctx, start, site, target, value)) {
            *observed = value;
            return false;
        }
        // Back off once the wait has lasted a while (~256 polls of a few hundred ns): the poller then costs the
        // copy warps of its SM almost no issue slots, at up to 128 ns of added latency.
        if (spins > 256) __nanosleep(128);
    }
}

}  // namespace kernels
}  // namespace deep_ep
