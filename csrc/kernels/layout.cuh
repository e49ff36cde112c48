// Byte layout of the intranode scale-up (NVLink) buffer and of the private device workspace.
//
// This file mirrors deep_ep/layout.py (intranode_control_layout, intranode_workspace_layout,
// intranode_ring_geometry, ...): the same regions at the same offsets. Change both together.
// Plain C++ usable from host files (.cpp) and device code (.cu).
//
// Scale-up buffer of one rank (the receiver owns the rings; peers write into them over NVLink):
//
//   [control, kControlBytes]
//     abort word        int32                       0, or (code << 8 | aborting rank + 1), set by any rank on failure
//     barrier signals   int32 [kMaxRuntimeRanks]    slot s counts barrier arrivals of rank s (monotonic)
//     notify flags      uint32 [2][kMaxRanks]       parity p, source s: epoch of the last notify data s wrote here
//     notify data       int32 [2][kMaxRanks][kNotifyInts]
//                                                   per (parity, source s): [R counts s->d][L expert counts of my
//                                                   experts][C channel counts s->me][s's call signature, int64
//                                                   kSignatureWords as 2 * kSignatureWords int32]
//     dispatch tails    uint32 [kMaxChannels][kMaxRanks]   index c*kMaxRanks+src: written by src (sequence numbers)
//     dispatch heads    uint32 [kMaxChannels][kMaxRanks]   index c*kMaxRanks+dst: written by dst, polled here by me
//     combine tails     uint32 [kMaxChannels][kMaxRanks]
//     combine heads     uint32 [kMaxChannels][kMaxRanks]
//     dispatch outputs  DispatchOutputWord [kMaxChannels][kMaxRanks]  index c*kMaxRanks+dst: written by dst (the receiver)
//                                                   at the start of each dispatch: where its outputs of this call
//                                                   lie (direct-to-output receive) or that it uses the rings, and
//                                                   the hash of its call signature (cached calls compare them)
//     combine landed    uint32 [kMaxRanks]          index src: (epoch << 20) | rows of src's copy-engine combine
//                                                   that have landed in src's landing zone here (copy stream)
//     combine freed     uint32 [kMaxRanks]          index owner: last copy-engine combine epoch whose landing zone
//                                                   of my rows the owner has finished reading
//     zone landed       uint32 [kMaxChannels][kMaxRanks]  index cta*kMaxRanks+src: (epoch << 20) | stripes of src's CTA cta
//                                                   that its zone senders have stored into my landing zone
//     combine agreement uint64 [kMaxRanks][2]       index src*2+parity: (combine call number << 32) | hash of src's
//                                                   call signature, written by src at the start of each checked
//                                                   combine (parity = call number & 1)
//   [dispatch half: per source s a sub-region of src_bytes; ring (c, s) = capacity records at c*capacity*record]
//   [combine half:  same shape with combine records; a copy-engine combine uses source s's sub-region as one
//                   landing zone instead: [rows x hidden BF16][rows x K float32 weights] (CombineLandingZone)]
//   (each half is at most kMaxRingHalfBytes)
//   [output pool: the rest of the buffer; blocks of it hold dispatch outputs that peers write directly, see
//    DispatchOutputLayout and deep_ep/pool.py]
//
// Ring sequence numbers are monotonic uint32 that never reset (compare by wrap-safe difference); the slot of
// sequence q is q % capacity. Every ring is empty between calls, so geometry may change from call to call; a
// sender waits until its old data is drained (head == its tail shadow for every channel) before writing.
#pragma once

#include <cstdint>

#include "constants.cuh"

#if defined(__CUDACC__)
#define DEEP_EP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DEEP_EP_HOST_DEVICE inline
#endif

namespace deep_ep {
namespace kernels {

DEEP_EP_HOST_DEVICE int64_t align_up64(int64_t value, int64_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

DEEP_EP_HOST_DEVICE int64_t align_down64(int64_t value, int64_t alignment) { return value / alignment * alignment; }

// ---- control region (fixed offsets, independent of the call) ----
// Position of the call signature in a notify slot (int32 index), then the slot's size.
constexpr int kNotifySignaturePos = kMaxRanks + kMaxLocalExperts + kMaxChannels;
constexpr int kNotifyInts = kNotifySignaturePos + 2 * kSignatureWords;
// Every region starts at a multiple of kBufferAlignment (deep_ep/layout.py chain()); the barrier grows with
// kMaxRuntimeRanks, the notify flags and data with kMaxRanks.
constexpr int64_t kAbortOffset = 0;
constexpr int64_t kBarrierOffset = kBufferAlignment;
constexpr int64_t kNotifyFlagOffset =
    kBarrierOffset + (4LL * kMaxRuntimeRanks + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
constexpr int64_t kNotifyDataOffset =
    kNotifyFlagOffset + (8LL * kMaxRanks + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
constexpr int64_t kNotifyDataBytes = 2LL * kMaxRanks * kNotifyInts * 4;
constexpr int64_t kCounterBytes = (int64_t)kMaxChannels * kMaxRanks * 4;
constexpr int64_t kDispatchTailOffset = kNotifyDataOffset + kNotifyDataBytes;
static_assert(kNotifySignaturePos + 2 * kSignatureWords == kNotifyInts && kNotifySignaturePos % 2 == 0,
              "notify slot: the signature closes the slot");
constexpr int64_t kDispatchHeadOffset = kDispatchTailOffset + kCounterBytes;
constexpr int64_t kCombineTailOffset = kDispatchHeadOffset + kCounterBytes;
constexpr int64_t kCombineHeadOffset = kCombineTailOffset + kCounterBytes;
constexpr int64_t kDispatchOutputOffset = kCombineHeadOffset + kCounterBytes;
constexpr int64_t kCombineLandedOffset = kDispatchOutputOffset + (int64_t)kMaxChannels * kMaxRanks * 24;
constexpr int64_t kCombineFreedOffset = kCombineLandedOffset + kBufferAlignment;
constexpr int64_t kCombineZoneLandedOffset = kCombineFreedOffset + kBufferAlignment;
static_assert(4 * kMaxRanks <= kBufferAlignment, "combine landed / freed: one uint32 per rank in one aligned region");
// A source is at most one checked combine ahead of a reader of its word (its next checked combine waits for the
// reader's word of that call), so two words per source, by call parity, keep the hash of the reader's call.
constexpr int64_t kCombineAgreementOffset = kCombineZoneLandedOffset + kCounterBytes;
constexpr int64_t kControlBytes =
    (kCombineAgreementOffset + 16LL * kMaxRanks + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
// Copy-engine combine flags: the landed word packs the call's epoch above the row count, so it grows across calls.
constexpr int kLandedRowBits = 20;
constexpr int64_t kMaxLandedRows = (1 << kLandedRowBits) - 1;

// Where receiver `dst` puts its outputs of one dispatch call (24 bytes, in every sender's control region at index
// channel * kMaxRanks + dst). The receiver writes data_units, meta_units, rows and hash[epoch & 1], then (system
// fence) the epoch with a release store; a sender reads the other fields after an acquire load shows the epoch of
// its call. A cached dispatch reads every peer's word; a peer that expects no rows from this rank may already have
// written the next call's word (epoch + 1, the other hash), never the one after: that call waits for this rank's.
// Offsets are in units of kBufferAlignment from the buffer base; kNoOutput means "not in the pool".
struct DispatchOutputWord {
    uint32_t epoch;       // per-channel dispatch call counter (workspace kWsDispatchEpochOffset), 1, 2, ...
    uint32_t data_units;  // block holding recv_x, scales, top-k ids and weights; kNoOutput: use the rings
    uint32_t meta_units;  // block holding recv_src_idx; kNoOutput: senders skip it (cached calls)
    uint32_t rows;        // rows of the receiver's outputs (sizes the sections of the data block)
    uint32_t hash[2];     // by epoch parity: the call's signature hash (DispatchArgs::signature_hash; 0 unchecked)
};
static_assert(sizeof(DispatchOutputWord) == 24, "dispatch output words: 24 bytes (deep_ep/layout.py)");
constexpr uint32_t kNoOutput = 0xffffffffu;

// ---- private workspace (zeroed device memory, never shared) ----
// All uint32, each region 128-byte aligned: notify epoch, barrier epoch, the largest channel count any dispatch
// (resp. combine) call used since the last reset, the error-record claim word (0 = unclaimed; the first failing
// thread of this rank takes it and fills the host-mapped record), then four [kMaxChannels][kMaxRanks] shadows.
constexpr int64_t kWsNotifyEpochOffset = 0;
constexpr int64_t kWsBarrierEpochOffset = 128;
constexpr int64_t kWsDispatchMaxChannelsOffset = 256;
constexpr int64_t kWsCombineMaxChannelsOffset = 384;
constexpr int64_t kWsErrorClaimOffset = 512;
constexpr int64_t kWsDispatchTailShadowOffset = 640;  // sender: last tail published per (c, dst)
constexpr int64_t kWsDispatchHeadShadowOffset = kWsDispatchTailShadowOffset + kCounterBytes;  // receiver, (c, src)
constexpr int64_t kWsCombineTailShadowOffset = kWsDispatchHeadShadowOffset + kCounterBytes;
constexpr int64_t kWsCombineHeadShadowOffset = kWsCombineTailShadowOffset + kCounterBytes;
constexpr int64_t kWsDispatchEpochOffset = kWsCombineHeadShadowOffset + kCounterBytes;  // uint32 [kMaxChannels]
// Copy-engine combine: CTAs of the reducing kernel that finished this call (the last one signals `freed`).
constexpr int64_t kWsCombineDoneOffset = kWsDispatchEpochOffset + (int64_t)kMaxChannels * 4;
// Notify: 1 when the signatures of its last call disagreed (the dispatch that follows it then moves no row), else 0.
constexpr int64_t kWsNotifyMismatchOffset = kWsCombineDoneOffset + kBufferAlignment;
// Cached dispatch and checked combine: CTAs of the current call that have compared the peers' signature hashes
// (the last one resets it and publishes the call's verdict to the host).
constexpr int64_t kWsAgreementArrivalsOffset = kWsNotifyMismatchOffset + kBufferAlignment;
// Checked calls (a checked combine; on the fused kernels a checked cached dispatch too) whose CTAs have all compared
// the hashes: a call's number is one more (checked_call_number), on the device, so that a call captured in a CUDA
// graph takes a new number at every replay.
constexpr int64_t kWsCheckedCallsOffset = kWsAgreementArrivalsOffset + kBufferAlignment;
constexpr int64_t kWsUsedBytes = kWsCheckedCallsOffset + 4;
static_assert(kWsUsedBytes <= kWorkspaceBytes, "workspace too small");

// ---- ring records ----
// Dispatch record: [hidden bytes, padded to 16][num_scales float32, padded to 16][src_idx int32, K int32 global
// top-k ids, K float32 weights, padded to 16]. Identical for every destination.
DEEP_EP_HOST_DEVICE int64_t dispatch_scales_offset(int64_t hidden_bytes) { return align_up64(hidden_bytes, 16); }
DEEP_EP_HOST_DEVICE int64_t dispatch_meta_offset(int64_t hidden_bytes, int num_scales) {
    return dispatch_scales_offset(hidden_bytes) + align_up64((int64_t)num_scales * 4, 16);
}
DEEP_EP_HOST_DEVICE int64_t dispatch_record_bytes(int64_t hidden_bytes, int num_scales, int num_topk) {
    return dispatch_meta_offset(hidden_bytes, num_scales) + align_up64((1 + 2 * (int64_t)num_topk) * 4, 16);
}
// Combine record: [hidden BF16][K float32 weights, padded to 16].
DEEP_EP_HOST_DEVICE int64_t combine_weights_offset(int64_t hidden) { return align_up64(hidden * 2, 16); }
DEEP_EP_HOST_DEVICE int64_t combine_record_bytes(int64_t hidden, int num_topk) {
    return combine_weights_offset(hidden) + align_up64((int64_t)num_topk * 4, 16);
}

// Geometry of one direction's rings (dispatch or combine) for one call.
struct RingGeometry {
    int64_t half_offset;    // byte offset of this direction's half of the buffer
    int64_t source_bytes;   // bytes of each source's sub-region inside the half
    int64_t record_bytes;   // bytes per slot
    int capacity;           // slots per ring (channel, source); 0 if nothing fits

    // Byte offset (from the buffer base) of slot `slot` of ring (channel, source).
    DEEP_EP_HOST_DEVICE int64_t slot_offset(int channel, int source, int slot) const {
        return half_offset + source * source_bytes + ((int64_t)channel * capacity + slot) * record_bytes;
    }
};

// Bytes of each direction's half: what is left after the control region, split in two, at most kMaxRingHalfBytes
// (enough for 256 slots of 7168-BF16-hidden records per (channel, source) at 2 ranks and 24 channels).
constexpr int64_t kMaxRingHalfBytes = 256LL << 20;
DEEP_EP_HOST_DEVICE int64_t ring_half_bytes(int64_t num_nvl_bytes) {
    int64_t left = num_nvl_bytes - kControlBytes;
    int64_t half = left > 0 ? align_down64(left / 2, kBufferAlignment) : 0;
    return half < kMaxRingHalfBytes ? half : kMaxRingHalfBytes;
}

// Output pool: [pool_offset, num_nvl_bytes) (empty unless num_nvl_bytes exceeds the control region plus two full
// ring halves).
DEEP_EP_HOST_DEVICE int64_t pool_offset(int64_t num_nvl_bytes) {
    return kControlBytes + 2 * ring_half_bytes(num_nvl_bytes);
}
DEEP_EP_HOST_DEVICE int64_t pool_bytes(int64_t num_nvl_bytes) {
    int64_t left = num_nvl_bytes - pool_offset(num_nvl_bytes);
    return left > 0 ? left : 0;
}

// Sections of a dispatch output data block for `rows` rows, each starting at a multiple of kBufferAlignment:
// recv_x [rows, hidden_bytes], recv_x_scales [rows, num_scales] 4-byte, recv_topk_idx [rows, num_topk] of
// topk_idx_bytes, recv_topk_weights [rows, num_topk] float32. recv_src_idx [rows] int32 is a block of its own
// (the handle keeps it alive long after recv_x is gone).
struct DispatchOutputLayout {
    int64_t scales, topk_idx, topk_weights, total;
};
DEEP_EP_HOST_DEVICE DispatchOutputLayout dispatch_output_layout(int64_t rows, int64_t hidden_bytes, int num_scales,
                                                                int num_topk, int topk_idx_bytes) {
    DispatchOutputLayout l;
    l.scales = align_up64(rows * hidden_bytes, kBufferAlignment);
    l.topk_idx = l.scales + align_up64(rows * num_scales * 4, kBufferAlignment);
    l.topk_weights = l.topk_idx + align_up64(rows * num_topk * topk_idx_bytes, kBufferAlignment);
    l.total = l.topk_weights + align_up64(rows * num_topk * 4, kBufferAlignment);
    return l;
}

// ---- put area (worlds with NVSHMEM put peers: the internode backend's peers behind a NIC) ----
// A rank that reaches a peer only through NVSHMEM (no nvshmem_ptr) cannot store into the peer's rings: it stages
// each record in its own buffer and puts it to the same offset at the peer, then publishes the counter with a
// signal. When some pair of the world is such a put pair, every rank's buffer of `num_nvl_bytes` is carved as
//   [the kernels' region of ring_bytes: control, two ring halves, output pool (possibly empty)]
//   [put area at put_offset = ring_bytes:
//     signal twins   uint64 [kControlBytes / 4]  the twin of the control region's uint32 word at byte o lives at
//                                                put_offset + 2 * o; a put peer publishes a flag or counter there
//                                                (NVSHMEM signals are 64-bit), the low half holds the uint32 value;
//                                                the twin of a uint64 word (combine agreement) holds it whole
//     notify staging int32 [kMaxRanks][kNotifyInts]  this rank's notify counts for each put destination
//     dispatch staging, combine staging: the shape of the two ring halves; record slot k of ring (c, s) here
//                                        stages what this rank puts into slot k of its own ring (c, me) at rank s]
// The layout is the same on every rank of the world (ring_bytes is what the kernels see as num_nvl_bytes).
// The fused internode kernels stage what they put inside their own layout (fused_internode.cuh): their put area is
// the header alone (signal twins and notify staging, kPutHeaderBytes), so ring_bytes = num_nvl_bytes -
// kPutHeaderBytes. KernelContext::put_area says which of the two a world with put pairs carves.
enum PutArea : int32_t {
    kPutAreaNone = 0,      // no put pairs in the world
    kPutAreaMirror = 1,    // header and staging halves that mirror the ring halves (the ring kernels)
    kPutAreaInRegion = 2,  // header only: the kernels stage inside their region (the fused kernels)
};
constexpr int64_t kPutNotifyStageOffset = 2 * kControlBytes;
constexpr int64_t kPutHeaderBytes =
    kPutNotifyStageOffset + ((int64_t)kMaxRanks * kNotifyInts * 4 + kBufferAlignment - 1) / kBufferAlignment *
                                kBufferAlignment;
static_assert(kPutNotifyStageOffset + (int64_t)kMaxRanks * kNotifyInts * 4 <= kPutHeaderBytes,
              "put-peer notify staging: one whole slot per destination rank");
struct PutLayout {
    int64_t ring_bytes;  // the kernels' region [0, ring_bytes); the put area starts here
    int64_t half;        // bytes of each ring half, and of each staging half
};
// Each staging half equals a ring half, so the rings get a quarter of what is left after the fixed regions (at
// most kMaxRingHalfBytes each); bytes beyond that stay the output pool. half = 0: num_nvl_bytes is too small.
DEEP_EP_HOST_DEVICE PutLayout put_layout(int64_t num_nvl_bytes) {
    PutLayout p;
    const int64_t left = num_nvl_bytes - kControlBytes - kPutHeaderBytes;
    p.half = left > 0 ? align_down64(left / 4, kBufferAlignment) : 0;
    if (p.half > kMaxRingHalfBytes) p.half = kMaxRingHalfBytes;
    p.ring_bytes = p.half < kMaxRingHalfBytes ? kControlBytes + 2 * p.half
                                              : num_nvl_bytes - kPutHeaderBytes - 2 * p.half;
    return p;
}
// Byte offset from slot offset `slot_offset` of ring (c, s) (RingGeometry::slot_offset, either half) to its
// staging twin: the put area's staging halves mirror the ring halves.
DEEP_EP_HOST_DEVICE int64_t put_stage_shift(int64_t put_offset) { return put_offset + kPutHeaderBytes - kControlBytes; }

// is_combine selects the second half. capacity = min(max_capacity, source_bytes / (num_channels * record_bytes)).
DEEP_EP_HOST_DEVICE RingGeometry ring_geometry(int64_t num_nvl_bytes, int num_ranks, int num_channels,
                                               int64_t record_bytes, int max_capacity, bool is_combine) {
    RingGeometry g;
    int64_t half = ring_half_bytes(num_nvl_bytes);
    g.half_offset = kControlBytes + (is_combine ? half : 0);
    g.source_bytes = num_ranks > 0 ? align_down64(half / num_ranks, kBufferAlignment) : 0;
    g.record_bytes = record_bytes;
    int64_t fit = (num_channels > 0 && record_bytes > 0) ? g.source_bytes / ((int64_t)num_channels * record_bytes) : 0;
    g.capacity = (int)(fit < max_capacity ? fit : max_capacity);
    return g;
}

// Copy-engine combine: where the rows that `source` sends back to this rank land in this rank's buffer (the
// source's sub-region of the combine half), for `rows` rows. fits: the sub-region holds them.
struct CombineLandingZone {
    int64_t data;     // byte offset of [rows, hidden] BF16
    int64_t weights;  // byte offset of [rows, num_topk] float32
    bool fits;
};
DEEP_EP_HOST_DEVICE CombineLandingZone combine_landing_zone(int64_t num_nvl_bytes, int num_ranks, int source,
                                                            int64_t rows, int64_t hidden, int num_topk) {
    const RingGeometry g = ring_geometry(num_nvl_bytes, num_ranks, 1, 1, 1, true);
    CombineLandingZone z;
    z.data = g.half_offset + source * g.source_bytes;
    z.weights = z.data + align_up64(rows * hidden * 2, kBufferAlignment);
    z.fits = rows <= kMaxLandedRows && (z.weights - z.data) + rows * num_topk * 4 <= g.source_bytes;
    return z;
}

}  // namespace kernels
}  // namespace deep_ep
