// Low-latency (LL) mode over NVSHMEM: buffer carving, launch arguments and host entry points. Plain C++ (no
// NVSHMEM include): csrc/low_latency.cpp includes it; csrc/kernels/low_latency_{dispatch,combine,runtime}.cu
// implement it.
//
// Data path: one message per (token, destination rank) in dispatch, expanded into the per-expert
// packed layout by the receiver; one row per (token, expert) in combine, written straight into the owner's
// [expert][token] slot, with an arrival word per (token, expert owner) so the reduction starts as soon as a token
// is complete and a missing owner is known by name (shrink masks it, otherwise it is reported).
// NVLink peers (nvshmem_ptr != nullptr) are written with plain stores; other peers get a put-with-signal from the
// local symmetric staging area. Every wait is bounded (DEEP_EP_TIMEOUT_S) and reports to the host-mapped
// ErrorRecord of api.cuh; with enable_shrink a timed-out peer is masked instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "api.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

// kMaxTopk and kMaxExperts are the kernels' shared limits (constants.cuh); the rank limit is LL's own.
constexpr int kMaxTokens = 1024;
constexpr int kMinHidden = 1024;
constexpr int kMaxHidden = 16384;
constexpr int kMaxRanks = 1024;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 160;
constexpr int kFp8Block = 128;

// Kernel ids and phases of LL errors (values distinct from api.cuh's intranode ones).
enum LlKernel : int32_t { kKernelLlDispatch = 20, kKernelLlCombine = 21, kKernelLlBarrier = 22 };
enum LlPhase : int32_t {
    kPhaseLlDispatchWaitCounts = 100,   // peer = source, expected = epoch, observed = epoch seen
    kPhaseLlDispatchWaitData = 101,     // peer = source, expected / observed = arrival counter
    kPhaseLlCombineWaitToken = 102,     // peer = owner of the missing rows, channel = token, rows expected / seen
    kPhaseLlBarrierWait = 103,          // peer = -1, expected / observed = barrier counter
    kPhaseLlBadRouting = 104,           // expert id >= num_experts (expected = E, observed = id)
    kPhaseLlDispatchAgreement = 105,    // peer = source whose signature hash differs (expected = mine, observed)
    kPhaseLlHalfRelease = 106,          // peer, channel = half; expected / observed = its releases (mod 2^16)
    kPhaseLlCombineAgreement = 107,     // peer = owner whose rows of token `channel` carried another hash; expected /
                                        // observed = the hash sums of its arrivals (rows x hash: mine, theirs)
    kPhaseLlCombineToldDisagreement = 108,  // peer = the rank that saw a combine's hashes differ and told this rank
    kPhaseLlCombineRefused = 109,       // this rank's validation refused the combine (expected = its refusal hash)
};

const char* ll_phase_name(int32_t phase);

// Byte carving of the symmetric buffer (identical on every rank):
//   [global: barrier word (u64) | abort word (u64) | disagreement word (u64) | pad to 128]
//   half h = 0, 1: [ctrl: count words [R][L+1] u64 | dispatch arrival [R] u64 | combine arrival [T][R] u64]
//                  [data: csend [L][R*T] x cmsg | crecv [E][T] x 2H]                 (combine)
//                  [data: drecv [R][T] x dmsg | dstage [T] x dmsg (R > 1 only)]    (dispatch, overlays the combine)
// A half serves one LL call at a time (calls alternate halves), so dispatch and combine regions may overlap: a send
// phase writes into a peer's half only once that peer has released it (its receive phases there are complete; the
// release count sits in the high 16 bits of the dispatch arrival words, low_latency_device.cuh acquire_half).
// Combine arrival word (t, o) of a half counts the rows owner o has delivered for this rank's token t in its low 32
// bits and sums their senders' call-signature hashes in its high 32 bits (each row adds 1 + (hash << 32)); ctrl:
// zeroed by clean, consumed by the reducer. The cmsg - 2H = H/32 >= 32 tail bytes of each csend slot hold two u32
// words outside the zero-copy view: at +0 the sender's RDMA staging of its row's LogFMT chunk flags, at +4 the
// receiver's word of (expert, token) = (slot / T, slot % T): the LogFMT chunk flags of that row, or, for a row read
// in place, its packed index (combine_flag_off). Both are written before the arrival that the reader waits for, in
// the same call, so they need no zeroing. This keeps the carving inside DeepEP's hint with the [T][R] arrival words
// (every allowed (T, H, R, E); tests/test_layout.py sweeps a mirror of make_layout).
struct Layout {
    int num_ranks, num_tokens_max, hidden, num_experts, num_local, num_topk_max;
    int64_t cmsg;            // combine slot: H/128 * 4 + 2H (DeepEP's zero-copy row stride)
    int64_t dmsg;            // dispatch message: header (16 B aligned) + max(2H, H + 4 H/128)
    int64_t header_bytes;    // int32 [1 + kMaxTopk]: source token, then per k (expert << 16 | row) or -1
    int64_t half_offset[2];  // start of each half
    // Selects without indexing: a kernel-parameter array indexed at run time is copied to local memory first.
    __host__ __device__ int64_t half_start(int h) const { return h != 0 ? half_offset[1] : half_offset[0]; }
    int64_t count_off, darrive_off, carrive_off, data_off;  // relative to a half
    int64_t csend_off, crecv_off, drecv_off, dstage_off;  // relative to a half
    int64_t total_bytes;
};

// The two u32 words of a csend slot's tail (cmsg - 2H = H/32 bytes) need H >= 256; kMinHidden keeps them there.
static_assert(kMinHidden / 32 >= 8, "the csend slot tail must hold the two u32 (expert, token) words");
// Offset (relative to a half) of the receiver's u32 word of (expert e, token t): LogFMT chunk flags, or the packed
// index of an own row read in place. Lives in the tail of csend slot e * T + t (see the carving above).
inline __host__ __device__ int64_t combine_flag_off(const Layout& lay, int64_t e, int64_t t) {
    return lay.csend_off + (e * lay.num_tokens_max + t) * lay.cmsg + int64_t(lay.hidden) * 2 + 4;
}
// Offset (relative to a half) of the combine arrival word of token t from expert owner (sender) o.
inline __host__ __device__ int64_t combine_arrive_off(const Layout& lay, int64_t t, int64_t o) {
    return lay.carrive_off + (t * lay.num_ranks + o) * 8;
}

// Computes the carving into `layout`; an invalid-argument Status (naming the sizes) if it needs more than
// `num_rdma_bytes`.
Status make_layout(int num_ranks, int num_tokens_max, int hidden, int num_experts, int64_t num_rdma_bytes,
                   Layout* layout);

struct Context {
    void* sym;                 // this rank's symmetric buffer (nvshmem_align)
    void* const* peers;        // device array [R]: nvshmem_ptr(sym, r) (nullptr = remote transport)
    void* workspace;           // private zeroed device memory (workspace_bytes())
    ErrorRecord* error;        // device alias of the host-mapped record
    int* mask;                 // device [R] int32 shrink mask (1 = masked), or nullptr without shrink
    uint64_t timeout_ns;
    int64_t call_seq;
    int rank, num_ranks, num_blocks;
    int all_p2p;               // 1 when every peer is reachable with nvshmem_ptr
    Layout layout;
};

int64_t workspace_bytes(int num_ranks);

struct DispatchArgs {
    const void* x;            // [N, H] BF16
    const void* topk_idx;     // [N, K] int32/int64
    int topk_idx_bytes, num_tokens, num_topk;
    int use_fp8, round_scale, use_ue8m0;
    void* recv_x;             // [L, R*T, H] fp8 or BF16
    void* recv_scales;        // [L, S, R*T] float32 or [L, S/4, R*T] int32 (UE8M0), or nullptr
    int* src_info;            // [L, R*T]
    int64_t* layout_range;    // [L, R]
    int* packed_recv_count;   // [L]
    int* cumulative_stats;    // [L] or nullptr
    int64_t* wait_stats;      // [R] or nullptr (ns added)
    int half, phases;         // phases: 1 = send, 2 = receive, 3 = both
    // A receive launch (phases 2): 1 = it leaves the release of half h to the rank's next send (the host issued no
    // later send and orders the next one after it), 0 = it releases the half at its end (low_latency_device.cuh).
    int release_by_next_send;
    // 32-bit hash of the call's signature (deep_ep/backends/agreement.py), carried in every count word this rank
    // sends; a receiver whose own hash differs takes no row from that source and records kErrorArgumentMismatch.
    uint32_t signature_hash;
};

struct CombineArgs {
    const void* x;            // [L, R*T, H] BF16 (ignored with zero_copy)
    const void* topk_idx;     // [N, K]
    const float* topk_weights;
    int topk_idx_bytes, num_tokens, num_topk;
    const int* src_info;      // [L, R*T]
    const int64_t* layout_range;  // [L, R]
    int use_logfmt, zero_copy;
    void* out;                // [N, H] BF16
    int64_t* wait_stats;      // [R] or nullptr
    int half, phases;
    int release_by_next_send;  // as DispatchArgs
    int stage_slots, stage_offset;  // set by combine(): rows staged in shared memory, and where the stage starts
    // 32-bit hash of the call's signature, summed into every arrival word this rank adds to; a receiver whose
    // arrivals from an owner sum another hash reduces no row from it, records kErrorArgumentMismatch and tells
    // every peer (tell_disagreement).
    uint32_t signature_hash;
};

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// Sets the kernels' dynamic shared-memory ceiling on the current device; once, before the first launch there.
Status configure_kernels();
Status dispatch(const Context& ctx, const DispatchArgs& args, cudaStream_t stream);
Status combine(const Context& ctx, const CombineArgs& args, cudaStream_t stream);
// Bounded barrier over all PEs, on `stream`.
Status barrier(const Context& ctx, cudaStream_t stream);
// This rank's validation refused a combine that its peers make: one thread tells every peer and records the refusal
// (phase kPhaseLlCombineRefused, `signature_hash` = the refusal's hash), so that no rank waits for its rows.
Status refuse_combine(const Context& ctx, uint32_t signature_hash, cudaStream_t stream);
// Zeroes both halves' control words and the workspace (call between two barriers).
Status clean(const Context& ctx, cudaStream_t stream);

// ---- NVSHMEM host side (bootstrap from a unique id, symmetric allocation) ----
Status nvshmem_unique_id(std::vector<uint8_t>* unique_id);
// Initialises NVSHMEM as PE `rank` of `num_ranks` (once per process; a second call must agree).
Status nvshmem_bootstrap(const std::vector<uint8_t>& unique_id, int rank, int num_ranks);
// The world this process joined: {PE, number of PEs}, or {-1, 0} before the first nvshmem_bootstrap.
std::pair<int, int> nvshmem_world();
Status nvshmem_alloc_zeroed(int64_t bytes, void** allocation);  // collective
void nvshmem_release(void* ptr);  // collective
// nvshmem_ptr(ptr, pe) for every pe < num_pes.
std::vector<void*> nvshmem_peer_pointers(void* ptr, int num_pes);

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
