// Launchers of the intranode normal-mode kernels: raw pointers, sizes and a cudaStream_t; no torch.
//
// The contract between the kernels and the host runtime (csrc/buffer.cpp):
//
// Host obligations (beyond the arguments):
//   * Zero the whole scale-up buffer (or at least kControlBytes of it) and the workspace before the first call;
//     zero the ErrorRecord and call intranode_reset on every rank (between two host barriers) after any failure.
//   * Pointers to x / recv_x / biases / combined_x must be 16-byte aligned (rows are copied in 16-byte words).
//   * combine: pass num_topk = 0 when topk_weights is None (the ring record size depends on it on every rank).
//   * config.num_sms <= device SMs (one resident 1024-thread CTA per channel); checked by the launchers.
//
// Conventions
//   * Every pointer is device memory of the current device unless it says "host-mapped" (the device alias of a
//     cudaHostAlloc(cudaHostAllocMapped) allocation).
//   * Launchers never throw (status.cuh says why): they return a Status. Kernel limits they validate give an
//     invalid-argument Status whose message names the argument, the rule and the value; CUDA launch failures give a
//     runtime-error Status. The host layer raises them (throw_if_failed: ValueError / RuntimeError in Python).
//   * Kernels never trap. Every spin is bounded by KernelContext::timeout_ns; on timeout, on a peer's abort, or on
//     inconsistent counts the kernel fills the host-mapped ErrorRecord (first writer wins), sets the abort word of
//     every rank, and every CTA runs to its end (outputs of that call are garbage). The host reads the record and
//     raises; the Buffer must then be reset collectively (intranode_reset on every rank between two host barriers).
//   * Kernel names contain "layout", "notify", "dispatch", "combine" or "barrier", at most one of them each:
//     layout_count_kernel, notify_counts_kernel, dispatch_kernel, combine_kernel, combine_landed_kernel,
//     combine_copy_prepare_kernel, combine_copy_flag_kernel, barrier_kernel, reset_state_kernel, signal_abort_kernel.
//   * No per-call state travels in host arguments (ring positions and epochs live in the device workspace and the
//     buffer), so dispatch / combine / notify are CUDA-graph capturable and may be replayed.
//   * Every call is collective: all ranks launch the same kernels with the same geometry (num_channels, chunk sizes,
//     hidden, num_scales, num_topk) in the same order. num_nvl_bytes must be equal on all ranks (check it at sync).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "constants.cuh"
#include "layout.cuh"
#include "status.cuh"

namespace deep_ep {
namespace kernels {

// ---------------------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------------------

enum ErrorCode : int32_t {
    kErrorNone = 0,
    kErrorTimeout = 1,        // a bounded wait ran out of time
    kErrorPeerAborted = 2,    // another rank (ErrorRecord::peer) reported an error first
    kErrorBadRouting = 3,     // routing inconsistent with the outputs (e.g. more rows than num_worst_tokens)
    kErrorCountMismatch = 4,  // num_tokens_per_rank disagrees with is_token_in_rank
    kErrorArgumentMismatch = 5,  // the ranks' call signatures differ (worst-token notify; no row moved, no abort)
};

enum KernelId : int32_t {
    kKernelNone = 0,
    kKernelNotify = 1,
    kKernelDispatch = 2,
    kKernelCombine = 3,
    kKernelBarrier = 4,
};

enum Phase : int32_t {
    kPhaseNone = 0,
    kPhaseNotifyCheckCounts = 1,     // peer = destination rank, expected = num_tokens_per_rank[d], observed = count
    kPhaseNotifyWaitCounts = 2,      // peer = source rank, expected = epoch, observed = flag seen
    kPhaseDispatchSendDrain = 3,     // sender waits until its previous call's data in the peer's ring is consumed
    kPhaseDispatchSendWaitHead = 4,  // sender waits for ring space (expected = head needed, observed = head)
    kPhaseDispatchRecvWaitTail = 5,  // receiver waits for data (expected = tail needed, observed = tail)
    kPhaseDispatchWorstOverflow = 6, // received rows exceed num_worst_tokens (expected = rows allocated)
    kPhaseCombineSendDrain = 7,
    kPhaseCombineSendWaitHead = 8,
    kPhaseCombineRecvWaitTail = 9,
    kPhaseBarrierWait = 10,          // peer = rank whose arrival is missing
    kPhaseDispatchSendWaitOutput = 11,  // sender waits for the receiver's output word (expected = epoch)
    kPhaseCombineCopyWaitFreed = 12,    // copy-engine combine: the owner has not finished reading the last call's rows
    kPhaseCombineRecvWaitLanded = 13,   // copy-engine combine: rows not landed (expected / observed: epoch << 20 | rows)
    kPhaseNotifyAgreement = 14,  // peer = first source whose signature differs, expected / observed = the first
                                 // differing int32 word of this rank's / the peer's signature
    kPhaseDispatchAgreement = 15,  // cached dispatch: peer = first rank whose signature hash differs (expected =
                                   // this rank's hash, observed = the peer's)
    kPhaseCombineAgreement = 16,   // checked combine: as kPhaseDispatchAgreement
    kPhaseCombineWaitAgreement = 17,  // checked combine: the peer's agreement word of this call has not arrived
                                      // (expected = this combine's call number, observed = the word's)
    kPhaseDispatchWaitAgreement = 18,  // checked cached dispatch (fused kernels): as kPhaseCombineWaitAgreement
};

inline const char* phase_name(int32_t phase) {
    switch (phase) {
        case kPhaseNotifyCheckCounts: return "notify check counts";
        case kPhaseNotifyWaitCounts: return "notify wait counts";
        case kPhaseDispatchSendDrain: return "dispatch send wait drain";
        case kPhaseDispatchSendWaitHead: return "dispatch send wait head";
        case kPhaseDispatchRecvWaitTail: return "dispatch recv wait tail";
        case kPhaseDispatchWorstOverflow: return "dispatch worst-token overflow";
        case kPhaseCombineSendDrain: return "combine send wait drain";
        case kPhaseCombineSendWaitHead: return "combine send wait head";
        case kPhaseCombineRecvWaitTail: return "combine recv wait tail";
        case kPhaseBarrierWait: return "barrier wait";
        case kPhaseDispatchSendWaitOutput: return "dispatch send wait output";
        case kPhaseCombineCopyWaitFreed: return "combine copy wait freed";
        case kPhaseCombineRecvWaitLanded: return "combine recv wait landed";
        case kPhaseNotifyAgreement: return "notify agreement";
        case kPhaseDispatchAgreement: return "dispatch agreement";
        case kPhaseCombineAgreement: return "combine agreement";
        case kPhaseCombineWaitAgreement: return "combine wait agreement";
        case kPhaseDispatchWaitAgreement: return "dispatch wait agreement";
        default: return "unknown phase";
    }
}

inline const char* error_code_name(int32_t code) {
    switch (code) {
        case kErrorNone: return "none";
        case kErrorTimeout: return "timeout";
        case kErrorPeerAborted: return "peer aborted";
        case kErrorBadRouting: return "bad routing";
        case kErrorCountMismatch: return "count mismatch";
        case kErrorArgumentMismatch: return "argument mismatch";
        default: return "unknown error";
    }
}

// Host-mapped, one per Buffer, zero-initialised. The first failing thread of the rank (decided by a claim word in
// the device workspace) fills every field, fences, then sets `ready` = 1. The host reads the fields only once
// `ready` is 1 (`code` may be visible slightly earlier). Zero it again together with intranode_reset.
struct ErrorRecord {
    int32_t code;        // ErrorCode
    int32_t ready;       // 1 once every field is written
    int32_t kernel;      // KernelId
    int32_t phase;       // Phase
    int32_t rank;        // the reporting rank
    int32_t peer;        // the rank waited for (-1 if none)
    int32_t channel;     // channel (-1 if none)
    int32_t block;       // CTA index
    int64_t call_seq;    // KernelContext::call_seq of the failing call
    int64_t expected;    // value awaited
    int64_t observed;    // value last seen
    int64_t elapsed_ns;  // time spent waiting
};

// ---------------------------------------------------------------------------------------------------------------
// Context shared by every launcher
// ---------------------------------------------------------------------------------------------------------------

// put_mask has a bit for every rank of a runtime.
static_assert(kMaxRuntimeRanks <= 64, "KernelContext::put_mask: one bit per rank");

// Whether bit r of a put mask is set (false for r outside [0, 64)).
DEEP_EP_HOST_DEVICE bool put_bit(uint64_t mask, int r) { return r >= 0 && r < 64 && ((mask >> r) & 1ull) != 0; }

struct KernelContext {
    // Scale-up buffer base of every rank (own = local): IPC- or nvshmem_ptr-mapped; null for a put peer.
    void* buffers[kMaxRuntimeRanks];
    void* workspace;           // this rank's private zeroed workspace (kWorkspaceBytes), see layout.cuh
    ErrorRecord* error;        // device alias of the host-mapped error record
    int64_t num_nvl_bytes;     // size of every rank's buffer (equal on all ranks)
    uint64_t timeout_ns;       // budget of every wait (DEEP_EP_TIMEOUT_S * 1e9)
    int64_t call_seq;          // host call counter, only reported in the error record
    int32_t rank;              // 0 <= rank < num_ranks
    int32_t num_ranks;         // 1..kMaxRuntimeRanks (each kernel family checks its own limit)
    int32_t skip_sends;        // fault injection (tests): 1 = this rank writes no ring data and publishes no tails
    // NVSHMEM put peers (symmetric runtimes only; layout.cuh, "put area"). Bit r set (put_bit): rank r has no
    // pointer and is reached by puts from this rank's staging (buffers[rank] is the symmetric address) and signals.
    // Ranks without the bit are reached by pointer. Needs an NVSHMEM build.
    uint64_t put_mask;
    // The put area (layout.cuh PutArea), the same on every rank of the world: with put pairs it starts at byte
    // num_nvl_bytes (the kernels' region ends there); kPutAreaMirror, the kernels stage in its staging halves,
    // kPutAreaInRegion, inside their region.
    int32_t put_area;
};

// ---------------------------------------------------------------------------------------------------------------
// get_dispatch_layout (no communication)
// ---------------------------------------------------------------------------------------------------------------

// topk_idx                  [num_tokens, num_topk] int32 (topk_idx_bytes 4) or int64 (8); -1 = none; ids >= E ignored
// num_tokens_per_rank       [num_ranks] int32 out: tokens with at least one expert on rank r
// num_tokens_per_rdma_rank  [num_ranks / ranks_per_node] int32 out, or nullptr
// num_tokens_per_expert     [num_experts] int32 out: (token, k) pairs selecting e
// is_token_in_rank          [num_tokens, num_ranks] bool out
// Limits: 1 <= num_ranks, num_experts % num_ranks == 0, num_experts <= kMaxExperts, num_topk <= 32.
Status get_dispatch_layout(const void* topk_idx, int topk_idx_bytes, int num_tokens, int num_topk, int num_ranks,
                           int num_experts, int ranks_per_node, int* num_tokens_per_rank,
                           int* num_tokens_per_rdma_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                           cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Notify (non-cached dispatch only): exchange counts, build the handle's prefix matrices
// ---------------------------------------------------------------------------------------------------------------

struct NotifyArgs {
    const int* num_tokens_per_rank;    // [R] int32: checked against is_token_in_rank (kErrorCountMismatch)
    const int* num_tokens_per_expert;  // [E] int32: forwarded to the experts' ranks
    const bool* is_token_in_rank;      // [N, R] bool, contiguous
    int num_tokens;                    // N
    int num_experts;                   // E (E % R == 0, E / R <= kMaxLocalExperts)
    int num_channels;                  // C = config.num_sms (1..kMaxChannels)
    int expert_alignment;              // >= 1: per-expert host counts are rounded up to a multiple of it
    int* rank_prefix_matrix;           // [R, R] int32 out: P[s][d] = sum_{s' <= s} count(s' -> d)
    int* channel_prefix_matrix;        // [R, C] int32 out: for dst d, inclusive prefix over channels of my tokens to d
    int* recv_channel_prefix_matrix;   // [R, C] int32 out: for src s, exclusive prefix over channels of s -> me
    // Host-mapped int32 [1 + L], or nullptr (worst-token mode). The host writes -1 to [0] before the launch; the
    // kernel writes [1 + i] = aligned count of local expert i, fences, then [0] = rows received (>= 0).
    int* host_counters;
    // The call signature of this rank (deep_ep/backends/agreement.py), sent in the notify slot to every rank.
    int64_t signature[kSignatureWords];
    // Host-mapped int64 [R][kSignatureWords], or nullptr: the kernel copies every source's signature there before
    // it publishes host_counters[0].
    int64_t* host_signatures;
    // 1: compare every source's signature with this rank's. On a difference the workspace's notify-mismatch word
    // becomes 1 (the dispatch of this call moves no row) and, in worst-token mode (host_counters == nullptr), the
    // error record gets kErrorArgumentMismatch (no abort: every rank sees the same signatures). 0: a rank that
    // refused the call sends its refusal and compares nothing.
    int check_signatures;
};

// One CTA (kNotifyThreads). No barrier and no zeroing: the counts carry a per-call epoch (two parities).
Status intranode_notify(const KernelContext& ctx, const NotifyArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Dispatch (cached or not: the same kernel; the non-cached call runs intranode_notify first on the same stream)
// ---------------------------------------------------------------------------------------------------------------

struct DispatchArgs {
    // Inputs
    const void* x;                     // [N, hidden_bytes] raw bytes, contiguous (BF16, FP8, any dtype)
    int64_t hidden_bytes;              // multiple of 16
    const void* x_scales;              // 4-byte elements (float32 or int32), or nullptr
    int num_scales;                    // S (0 without scales)
    int64_t scale_token_stride;        // in elements: x_scales[t * token_stride + s * hidden_stride]
    int64_t scale_hidden_stride;
    const void* topk_idx;              // [N, K] global expert ids (int32 or int64), -1 = none; or nullptr
    const float* topk_weights;         // [N, K] float32, or nullptr (both or neither)
    int num_topk;                      // K (0 without top-k), <= kMaxTopk
    int topk_idx_bytes;                // 4 or 8: element size of topk_idx and recv_topk_idx
    int num_experts;                   // E, to compute this rank's local id range (E / R per rank)
    const bool* is_token_in_rank;      // [N, R] bool: decides routing
    int num_tokens;                    // N
    const int* rank_prefix_matrix;     // [R, R] (notify output, or handle[0])
    const int* channel_prefix_matrix;  // [R, C] (notify output, or handle[1]): where my rows lie at each receiver
    const int* recv_channel_prefix_matrix;  // [R, C] (notify output, or handle[2])
    // Outputs
    int* send_head;                    // [N, R] int32: index j of token t among channel(t)'s tokens to d, or -1
    void* recv_x;                      // [num_recv_rows, hidden_bytes]
    void* recv_x_scales;               // [num_recv_rows, S] contiguous 4-byte, or nullptr
    int* recv_src_idx;                 // [num_recv_rows] int32: token index in the source's x
    void* recv_topk_idx;               // [num_recv_rows, K] local ids (e - rank * L) or -1, or nullptr
    float* recv_topk_weights;          // [num_recv_rows, K] weight where the local id >= 0, else 0; or nullptr
    int num_recv_rows;                 // rows allocated in the outputs (M, or num_worst_tokens)
    int worst_token_mode;              // 1: rows [M_real, num_recv_rows) of recv_topk_idx get -1
    // Tuning (Config)
    int num_channels;                  // C = config.num_sms (one CTA of kChannelThreads per channel)
    int num_max_send_tokens;           // Sn: fewest new tokens per tail publication (except a channel's last)
    int num_max_recv_tokens;           // Nn: upper bound of the ring capacity (slots per (channel, source))
    int num_send_warps;                // copy warps per channel when R > 1, in [2, 32 - R]
    // Direct-to-output receive. -1: this rank receives through the rings. Otherwise recv_x (with
    // recv_x_scales, recv_topk_idx, recv_topk_weights, as dispatch_output_layout places them) is the block at byte
    // direct_data_offset of this rank's buffer, inside the output pool, and senders write their rows there.
    // direct_meta_offset: recv_src_idx's block, or -1 (senders then do not write it; cached calls).
    // Each receiver chooses for itself; senders learn the choice from the DispatchOutputWord of the call.
    int64_t direct_data_offset;
    int64_t direct_meta_offset;
    // 1 (a non-cached dispatch after its notify): the kernel moves no row when that notify saw the ranks' call
    // signatures differ (workspace notify-mismatch word); every rank saw the same signatures, so all skip alike.
    int agreement_gate;
    // Cached dispatch (no notify) when != 0: the hash of this rank's call signature, carried by its output words.
    // Every channel then reads every pointer peer's word of the call before moving a row; when any hash differs
    // from this one, every rank's kernel moves no row and advances no ring (each sees the same hashes), and the
    // error record gets kErrorArgumentMismatch (no abort). Non-cached calls pass 0 (their notify compares).
    uint32_t signature_hash;
    // Host-mapped, or nullptr: the last CTA to compare the hashes writes the call's KernelContext::call_seq here
    // (after any mismatch record), so the host learns the verdict without waiting for the rows.
    int64_t* host_verdict;
};

Status intranode_dispatch(const KernelContext& ctx, const DispatchArgs& args, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Combine (reverse of the dispatch that produced the handle; one kernel, no preparatory kernel)
// ---------------------------------------------------------------------------------------------------------------

struct CombineArgs {
    const void* x;                     // [num_recv_tokens, hidden] BF16, rows aligned with the dispatch's recv_x
    int hidden;                        // elements; hidden * 2 % 16 == 0
    int num_recv_tokens;               // rows of x (extra rows beyond the real M are ignored)
    const float* topk_weights;         // [num_recv_tokens, K] float32 or nullptr
    int num_topk;                      // K (0 without weights), <= kMaxTopk
    const void* bias_0;                // [N, hidden] BF16 or nullptr
    const void* bias_1;                // [N, hidden] BF16 or nullptr
    const int* rank_prefix_matrix;     // [R, R] handle[0]
    const int* recv_channel_prefix_matrix;  // [R, C] handle[2] (DeepEP's combine calls it channel_prefix_matrix)
    const int* send_head;              // [N, R] handle[5] (never rewritten by this implementation)
    int num_tokens;                    // N
    void* combined_x;                  // [N, hidden] BF16 out
    float* combined_topk_weights;      // [N, K] float32 out, or nullptr
    int num_channels;                  // must equal the dispatch's (the matrices are [*, C])
    int num_max_send_tokens;           // Sn: fewest new rows / tokens per tail / head publication
    int num_max_recv_tokens;           // Nn (ring capacity bound)
    int num_send_warps;                // ring-sender warps per channel when R > 1, in [R - 1, 30]
    // Copy-engine combine (intranode_combine_landed): the rows come through the copy engine into landing zones.
    const int* channel_prefix_matrix;  // [R, C] handle[1]: my tokens to d in channels <= c (landing row of a token)
    uint32_t copy_epoch;               // copy-engine combine calls so far, this one included if it is one
    // != 0 (a checked combine): the hash of this rank's call signature. Every CTA compares every peer's hash of this
    // call (the combine-agreement words) with it before any row moves; on a difference every rank's kernel moves no
    // row and advances no ring (each sees the same hashes), and the error record gets kErrorArgumentMismatch (no
    // abort). Put peers exchange the words as signals (put.cuh). The call's number comes from the device
    // (checked_call_number: refusals count too, every rank's is the same while the ranks' calls stay paired, and a
    // call captured in a CUDA graph takes a new one at each replay). 0: unchecked (one rank, a composed stage).
    uint32_t signature_hash;
    // Ring kernel, != 0 (never with a put area): the `freed` value a mismatched call writes to every peer (the ranks
    // may have taken different send paths: a peer's landing-zone combine of this call then waits no longer for this
    // rank).
    uint32_t mismatch_freed;
    // Host-mapped, or nullptr: the last CTA to compare the hashes writes the call's KernelContext::call_seq here.
    int64_t* host_verdict;
};

Status intranode_combine(const KernelContext& ctx, const CombineArgs& args, cudaStream_t stream);

// Copy-engine combine, three launches (the host layer enqueues the copies between them, see Runtime::combine):
// * intranode_combine_landed on the caller's stream: `num_ctas` CTAs reduce every token of this rank from x and
//   the landing zones, each row as soon as its flag shows it landed; the last CTA tells every peer that its landing
//   zone is free again (`freed` = args.copy_epoch).
// * intranode_combine_copy_prepare on the copy stream, before the copies: waits until every peer has finished
//   reading the previous call's rows (ring heads and `freed`), so the copies may overwrite them.
// * intranode_combine_copy_flag on the copy stream after each chunk of copies: `landed[d]` of every peer d with
//   values[d] != 0 becomes values[d] in d's buffer.
struct LandedFlags {
    uint32_t values[kMaxRanks];
};
// zone: the same kernel with zone senders (args.num_send_warps per CTA) instead of copies: no copy-stream work.
Status intranode_combine_landed(const KernelContext& ctx, const CombineArgs& args, int num_ctas, bool zone,
                                cudaStream_t stream);
Status intranode_combine_copy_prepare(const KernelContext& ctx, uint32_t copy_epoch, cudaStream_t stream);
Status intranode_combine_copy_flag(const KernelContext& ctx, const LandedFlags& flags, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Collective utilities
// ---------------------------------------------------------------------------------------------------------------

// Bounded barrier over all ranks of the node (monotonic counters; no reset needed).
Status intranode_barrier(const KernelContext& ctx, cudaStream_t stream);

// Zeroes this rank's control region (abort word, barrier signals, notify flags, ring counters) and its workspace.
// Collective: every rank calls it between two host-side barriers, with no kernel of the Buffer in flight.
Status intranode_reset(const KernelContext& ctx, cudaStream_t stream);

// Sets the abort word of every rank (a host-side failure before launching, so peers stop waiting).
Status intranode_signal_abort(const KernelContext& ctx, cudaStream_t stream);

}  // namespace kernels
}  // namespace deep_ep
