// Launchers of the fused internode normal-mode kernels (N nodes x G GPUs, G > 1): raw pointers, sizes and a
// cudaStream_t; no torch. Plain C++ (host files include it). The kernels' design is described in
// fused_internode.cu.
//
// Contract beyond api.cuh's (errors, context, collectiveness):
//   * The context covers the whole group (rank r = node r / G, local r % G). Every peer of the own node is reached
//     by pointer; a peer of another node may be an NVSHMEM put peer (put_mask, api.cuh, in groups of up to
//     kFusedMaxRanks; every rank's buffer then ends with the put area's header, layout.cuh kPutAreaInRegion). The
//     kernels' region (the context's num_nvl_bytes) is carved by fused_layout(), with staging for put peers when
//     the context's put_area is kPutAreaInRegion.
//   * Every call is collective with the same geometry (channels, hidden bytes, scales, top-k, ring capacities).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "api.cuh"
#include "constants.cuh"
#include "layout.cuh"

namespace deep_ep {
namespace kernels {

// ---- limits ----
// Largest group of the fused kernels, and so (G >= 2) their largest node count: their own counters, notify slots and
// workspace shadows (below) are sized by kFusedMaxRanks, independent of the ring kernels' kMaxRanks; the combine
// owner gives each node a lane (kFusedMaxNodes <= 32). Roles beyond a CTA's 32 warps share warps
// (fused_internode.cu, Teams).
constexpr int kFusedMaxRanks = 64;
constexpr int kFusedMaxNodes = kFusedMaxRanks / 2;
static_assert(kFusedMaxRanks <= kMaxRuntimeRanks, "a fused group is one runtime");
static_assert(kFusedMaxRanks <= 64, "every rank of a fused group may be a put peer: a bit of KernelContext::put_mask");

// ---- buffer layout (after the shared control region of layout.cuh, which the fused kernels leave alone but for
// the abort word) ----
// Notify: flags uint32 [2 parities][kFusedMaxRanks sources] (the epoch of the source's last data here), data int32
// [2][kFusedMaxRanks][kFusedNotifyInts] per (parity, source s): [R counts s->d][L expert counts of my experts][C
// channel counts s->me][s's call signature as 2 * kSignatureWords int32].
constexpr int kFusedNotifySignaturePos = kFusedMaxRanks + kMaxLocalExperts + kMaxChannels;
constexpr int kFusedNotifyInts = kFusedNotifySignaturePos + 2 * kSignatureWords;
constexpr int64_t kFusedNotifyFlagOffset = kControlBytes;
constexpr int64_t kFusedNotifyDataOffset =
    kFusedNotifyFlagOffset + (8LL * kFusedMaxRanks + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
// Counter arrays are uint32 [kMaxChannels][kFusedMaxRanks], index fused_index(channel, i).
//   rail tails   at the forwarder, i = source node: written by the sender (n, my local) after its records
//   rail heads   at the sender, i = destination node: written by the forwarder (credits)
//   node tails   at the receiver, i = source rank: written by the forwarder after its records
//   node heads   at the forwarder, i = source node * G + receiver local: written by the receiver
//   node counts  int32 [2 parities][kFusedMaxRanks sources][kMaxChannels]: notify's per-channel count of the
//                source's tokens that need this rank's node (written by rail peers only)
constexpr int64_t kFusedCounterBytes = 4LL * kMaxChannels * kFusedMaxRanks;
DEEP_EP_HOST_DEVICE int fused_index(int channel, int i) { return channel * kFusedMaxRanks + i; }
constexpr int64_t kFusedRailTailOffset = kFusedNotifyDataOffset + 2LL * kFusedMaxRanks * kFusedNotifyInts * 4;
constexpr int64_t kFusedRailHeadOffset = kFusedRailTailOffset + kFusedCounterBytes;
constexpr int64_t kFusedNodeTailOffset = kFusedRailHeadOffset + kFusedCounterBytes;
constexpr int64_t kFusedNodeHeadOffset = kFusedNodeTailOffset + kFusedCounterBytes;
constexpr int64_t kFusedNodeCountOffset = kFusedNodeHeadOffset + kFusedCounterBytes;
// Combine counters, the same shape:
//   combine node tails  at the forwarder, i = source node * G + sending local rank: written by the local rank
//   combine node heads  at the sending local rank, i = owner rank: written by the forwarder
//   combine rail tails  at the owner, i = forwarder node: written by the forwarder (n, owner's local)
//   combine rail heads  at the forwarder, i = owner node: written by the owner (credits)
constexpr int64_t kFusedCombineNodeTailOffset = kFusedNodeCountOffset + 2LL * kFusedMaxRanks * kMaxChannels * 4;
constexpr int64_t kFusedCombineNodeHeadOffset = kFusedCombineNodeTailOffset + kFusedCounterBytes;
constexpr int64_t kFusedCombineRailTailOffset = kFusedCombineNodeHeadOffset + kFusedCounterBytes;
constexpr int64_t kFusedCombineRailHeadOffset = kFusedCombineRailTailOffset + kFusedCounterBytes;
// Signals (uint64, the value in the low half) that NVSHMEM put peers raise instead of the uint32 words above, at
// the same symmetric offsets on every rank: notify flags [2 parities][kFusedMaxRanks sources], then the rail counters
// [kMaxChannels][kFusedMaxNodes], index fused_node_index(channel, node), in the order rail tails, rail heads, combine
// rail tails, combine rail heads. Only the rail hops and notify cross a NIC; the node counters stay pointer words.
constexpr int64_t kFusedSignalBytes = 8LL * kMaxChannels * kFusedMaxNodes;
DEEP_EP_HOST_DEVICE int fused_node_index(int channel, int node) { return channel * kFusedMaxNodes + node; }
constexpr int64_t kFusedNotifyFlagSignalOffset = kFusedCombineRailHeadOffset + kFusedCounterBytes;
constexpr int64_t kFusedRailTailSignalOffset = kFusedNotifyFlagSignalOffset + 8LL * 2 * kFusedMaxRanks;
constexpr int64_t kFusedRailHeadSignalOffset = kFusedRailTailSignalOffset + kFusedSignalBytes;
constexpr int64_t kFusedCombineRailTailSignalOffset = kFusedRailHeadSignalOffset + kFusedSignalBytes;
constexpr int64_t kFusedCombineRailHeadSignalOffset = kFusedCombineRailTailSignalOffset + kFusedSignalBytes;
static_assert(kFusedNotifyFlagSignalOffset % 8 == 0, "64-bit signals");
// Agreement words uint64 [2 parities][kFusedMaxRanks sources], index parity * kFusedMaxRanks + source:
// `call << 32 | hash` that the source writes at the start of each checked call (a cached dispatch or a combine: its
// checked-call number, parity = call number % 2, and the hash of its call signature), by a release store for a
// pointer peer and an NVSHMEM signal for a put peer (the same symmetric offset on every rank).
constexpr int64_t kFusedAgreementOffset = kFusedCombineRailHeadSignalOffset + kFusedSignalBytes;
// End of the fused control words.
constexpr int64_t kFusedControlEnd =
    (kFusedAgreementOffset + 8LL * 2 * kFusedMaxRanks + kBufferAlignment - 1) / kBufferAlignment *
    kBufferAlignment;
// Control staging: per put peer d (any rank of another node, d < kFusedMaxRanks), notify stages slot [parity][d] of
// the notify data and, for a rail peer, row [parity][d] of the node counts at their twins here (word at offset o of
// [kControlBytes, kFusedControlEnd) at o + kFusedControlStageShift), then puts them to the same offsets at d as slot
// and row [parity][me].
constexpr int64_t kFusedControlStageShift = kFusedControlEnd - kControlBytes;
// The halves start after the control staging (about 1.2 MiB of fused control words at 64 ranks, and their twins).
constexpr int64_t kFusedRingsOffset = kFusedControlEnd + kFusedControlStageShift;
static_assert(kFusedNodeCountOffset + 2LL * kFusedMaxRanks * kMaxChannels * 4 == kFusedCombineNodeTailOffset &&
                  kFusedNotifyDataOffset + 2LL * kFusedMaxRanks * kFusedNotifyInts * 4 == kFusedRailTailOffset,
              "notify staging: one slot and one node-count row per (parity, put peer)");
static_assert(kFusedRailTailSignalOffset - kFusedNotifyFlagSignalOffset == 8LL * 2 * kFusedMaxRanks &&
                  kFusedSignalBytes == 8LL * kMaxChannels * kFusedMaxNodes,
              "signals: a notify flag per (parity, source rank), a rail counter per (channel, node)");
static_assert(kFusedControlStageShift % kBufferAlignment == 0, "the halves stay aligned");
// Fewest warps of a combine channel's owner team: with an even share of the CTA among N + 1 teams (3 warps at 8
// nodes, 1 at 16) the owner, which reads N partials of each token, would limit the combine.
constexpr int kFusedCombineOwnerWarps = 8;
static_assert(kFusedCombineOwnerWarps < kChannelWarps, "the combine's forwarders keep at least one warp");

// Warps of a combine channel's owner team, the even CTA's last ones (the others forward): an even share of the
// CTA among N + 1 teams, at least kFusedCombineOwnerWarps.
DEEP_EP_HOST_DEVICE int fused_combine_owner_warps(int num_nodes) {
    const int even = kChannelWarps / (num_nodes + 1);
    return even > kFusedCombineOwnerWarps ? even : kFusedCombineOwnerWarps;
}

// The rest of the kernels' region (num_nvl_bytes of the context: with put peers the put area's header follows it,
// layout.cuh kPutAreaInRegion) is two equal halves: dispatch rings, then combine rings (a rank may start its combine
// while a peer still reads its dispatch rings).
DEEP_EP_HOST_DEVICE int64_t fused_half_bytes(int64_t num_bytes) {
    const int64_t left = num_bytes - kFusedRingsOffset;
    return left > 0 ? align_down64(left / 2, kBufferAlignment) : 0;
}

// Private workspace words (after the intranode kernels' region): [kMaxChannels][kFusedMaxRanks] uint32 shadows and
// the largest channel count of any dispatch since the last reset.
constexpr int64_t kWsFusedBase = (kWsUsedBytes + 127) / 128 * 128;
// sender (c, dst node); forwarder (c, src node); forwarder (c, n * G + j); receiver (c, src rank)
constexpr int64_t kWsFusedRailTailShadow = kWsFusedBase;
constexpr int64_t kWsFusedRailHeadShadow = kWsFusedRailTailShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedNodeTailShadow = kWsFusedRailHeadShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedNodeHeadShadow = kWsFusedNodeTailShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedMaxChannels = kWsFusedNodeHeadShadow + kFusedCounterBytes;
// combine: sender (c, owner); forwarder (c, n * G + j); forwarder (c, owner node); owner (c, forwarder node)
constexpr int64_t kWsFusedCombineNodeTailShadow = kWsFusedMaxChannels + 128;
constexpr int64_t kWsFusedCombineNodeHeadShadow = kWsFusedCombineNodeTailShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedCombineRailTailShadow = kWsFusedCombineNodeHeadShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedCombineRailHeadShadow = kWsFusedCombineRailTailShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedCombineMaxChannels = kWsFusedCombineRailHeadShadow + kFusedCounterBytes;
constexpr int64_t kWsFusedEnd = kWsFusedCombineMaxChannels + 4;
static_assert(kWsFusedEnd <= kWorkspaceBytes, "workspace too small for the fused kernels");

// Host-mapped counter slot where the fused notify publishes the rows this rank forwards (F).
constexpr int kFusedForwardCounter = 1 + kMaxLocalExperts;

// A record (identical in rail and node rings): [payload, padded to 16][num_scales float32, padded to 16]
// [int32 local-rank mask of the destination node, K int32 global top-k ids, K float32 weights, padded to 16].
struct FusedGeometry {
    int num_nodes;           // N
    int gpus_per_node;       // G
    int num_channels;        // C
    int num_scales;          // S
    int num_topk;            // K
    int rail_capacity;       // slots per rail ring (channel, source node) at a forwarder
    int node_capacity;       // slots per node ring (channel, source rank) at a receiver
    int64_t hidden_bytes;    // payload bytes per token (a multiple of 16)
    int64_t scales_offset;   // in the record
    int64_t meta_offset;     // in the record
    int64_t record_bytes;
    int64_t rail_rings_offset;  // byte offset of the rail rings (the start of this direction's half)
    int64_t node_rings_offset;  // byte offset of the node rings
    int64_t rail_stage_offset;  // byte offset of the rail staging (put peers in the world), else 0
    int64_t end_offset;         // end of the layout (must not pass the end of the half)
    int64_t region_bytes;       // the kernels' region the layout was carved from
    int staged;                 // 1: put pairs in the world, the layout holds the rail staging

    DEEP_EP_HOST_DEVICE int64_t rail_slot(int channel, int src_node, uint32_t seq) const {
        return rail_rings_offset +
               ((static_cast<int64_t>(channel) * num_nodes + src_node) * rail_capacity + seq % rail_capacity) *
                   record_bytes;
    }
    // Where this rank stages what it puts at `offset` of a rail ring (slot k of rail ring (c, n) here stages what
    // it puts into slot k of ring (c, its node) at node n): the rail staging has the rail rings' shape.
    DEEP_EP_HOST_DEVICE int64_t rail_stage(int64_t offset) const {
        return offset - rail_rings_offset + rail_stage_offset;
    }
    DEEP_EP_HOST_DEVICE int64_t node_slot(int channel, int src_rank, uint32_t seq) const {
        return node_rings_offset +
               ((static_cast<int64_t>(channel) * num_nodes * gpus_per_node + src_rank) * node_capacity +
                seq % node_capacity) * record_bytes;
    }
};

// `ring_bytes`: the runtime's kernels' region (the context's num_nvl_bytes); `staged`: the world has put pairs, so
// each half also holds a rail staging (only the rail hops cross to put peers: the node rings stay pointer rings).
// `combine`: the combine half and its records ([BF16 row, padded to 16][K float32 weights, padded to 16]); the rail
// rings are then indexed by forwarder node and the node rings by (source node, sending local rank).
DEEP_EP_HOST_DEVICE FusedGeometry fused_layout(int num_nodes, int gpus_per_node, int num_channels, int64_t hidden_bytes,
                                               int num_scales, int num_topk, int rail_capacity, int node_capacity,
                                               int64_t ring_bytes, bool staged, bool combine) {
    FusedGeometry g{};
    g.region_bytes = ring_bytes;
    g.staged = staged ? 1 : 0;
    g.num_nodes = num_nodes;
    g.gpus_per_node = gpus_per_node;
    g.num_channels = num_channels;
    g.num_scales = num_scales;
    g.num_topk = num_topk;
    g.rail_capacity = rail_capacity;
    g.node_capacity = node_capacity;
    g.hidden_bytes = hidden_bytes;
    g.scales_offset = align_up64(hidden_bytes, 16);
    g.meta_offset = g.scales_offset + align_up64(4LL * num_scales, 16);
    g.record_bytes = combine ? g.meta_offset + align_up64(4LL * num_topk, 16)
                             : g.meta_offset + align_up64(4LL * (1 + 2 * num_topk), 16);
    const int64_t rail_bytes = static_cast<int64_t>(num_channels) * num_nodes * rail_capacity * g.record_bytes;
    g.rail_rings_offset = kFusedRingsOffset + (combine ? fused_half_bytes(ring_bytes) : 0);
    g.node_rings_offset = align_up64(g.rail_rings_offset + rail_bytes, kBufferAlignment);
    g.end_offset = g.node_rings_offset +
                   static_cast<int64_t>(num_channels) * num_nodes * gpus_per_node * node_capacity * g.record_bytes;
    if (staged) {
        g.rail_stage_offset = align_up64(g.end_offset, kBufferAlignment);
        g.end_offset = g.rail_stage_offset + rail_bytes;
    }
    return g;
}

// ---- notify (non-cached dispatch only) ----
struct FusedNotifyArgs {
    const int* num_tokens_per_rank;       // [R]: checked against is_token_in_rank (kErrorCountMismatch)
    const int* num_tokens_per_rdma_rank;  // [N] or nullptr: checked likewise (tokens needing node n)
    const int* num_tokens_per_expert;     // [E]
    const bool* is_token_in_rank;         // [T, R]
    int num_tokens;                       // T
    int num_experts;                      // E (E % R == 0, E / R <= kMaxLocalExperts)
    int num_channels;                     // C
    int gpus_per_node;                    // G (R % G == 0)
    int expert_alignment;                 // >= 1
    // Outputs (the internode handle's prefix matrices, int32)
    int* rdma_channel_prefix_matrix;      // [N, C] inclusive over channels: my tokens that need node n
    int* gbl_channel_prefix_matrix;       // [R, C] inclusive over channels: my tokens to rank d
    int* recv_rdma_channel_prefix_matrix; // [N, C]: rank (n, my local)'s rdma_channel_prefix_matrix[my node]
    int* recv_rdma_rank_prefix_sum;       // [N] inclusive prefix of its last column
    int* recv_gbl_channel_prefix_matrix;  // [R, C]: absolute first row of source s's channel c
    int* recv_gbl_rank_prefix_sum;        // [R] inclusive prefix over sources of rows received
    // Host-mapped int32 or nullptr (worst-token mode): [0] rows received (written last), [1 + i] aligned count of
    // local expert i, [kFusedForwardCounter] rows forwarded.
    int* host_counters;
    // The call signature (deep_ep/backends/agreement.py) in the notify slot, as for NotifyArgs: every source's goes
    // to host_signatures (host-mapped int64 [R][kSignatureWords], or nullptr) before host_counters[0]; with
    // check_signatures, a difference sets the workspace's notify-mismatch word (and, without host_counters, the
    // error record gets kErrorArgumentMismatch). A rank that refuses a call sends its refusal with the intranode
    // notify (same slots), and the host of every peer raises ArgumentMismatchError before the dispatch.
    int64_t signature[kSignatureWords];
    int64_t* host_signatures;
    int check_signatures;
};

// One CTA (kNotifyThreads); uses the fused notify flags and data slots (parity, epoch) above. A rank that refuses
// a call launches it with zero counts, no tokens and its refusal signature.
Status fused_notify(const KernelContext& ctx, const FusedNotifyArgs& args, cudaStream_t stream);

// ---- dispatch (cached or not) ----
struct FusedDispatchArgs {
    const void* x;                        // [T, hidden_bytes] raw bytes
    const void* x_scales;                 // 4-byte elements, or nullptr
    int64_t scale_token_stride;           // elements
    int64_t scale_hidden_stride;
    const void* topk_idx;                 // [T, K] int32/int64 global ids or -1, or nullptr
    const float* topk_weights;            // [T, K] or nullptr (both or neither)
    int topk_idx_bytes;                   // 4 or 8 (also recv_topk_idx's element size)
    int num_experts;                      // E
    const bool* is_token_in_rank;         // [T, R]
    int num_tokens;                       // T
    const int* recv_rdma_channel_prefix_matrix;  // [N, C] (notify output or handle)
    const int* recv_rdma_rank_prefix_sum;        // [N]
    const int* recv_gbl_channel_prefix_matrix;   // [R, C]
    const int* recv_gbl_rank_prefix_sum;         // [R]
    // Outputs; the handle's are nullptr in a cached call.
    int* send_rdma_head;                  // [T, N]: index of token t among channel(t)'s tokens to node n, or -1
    int* send_nvl_head;                   // [F, 8]: forwarded row's index per (source node, channel, local j), or -1
    int* recv_src_meta;                   // [M, 2] int32: (source node, local-rank mask of my node)
    void* recv_x;                         // [M, hidden_bytes]
    float* recv_x_scales;                 // [M, S] contiguous, or nullptr
    void* recv_topk_idx;                  // [M, K] local ids or -1, or nullptr
    float* recv_topk_weights;             // [M, K] or nullptr
    int num_recv_rows;                    // rows allocated (M, or num_worst_tokens)
    int worst_token_mode;                 // 1: rows past the real count get recv_topk_idx = -1
    int num_max_rdma_send_tokens;         // records per rail tail publication (at most)
    int num_max_nvl_send_tokens;          // records per node tail publication (at most)
    int agreement_gate;                   // 1 (non-cached): no row moves when the notify's signatures differed
    // A checked cached call (as FusedCombineArgs's two fields; a non-cached call is checked by its notify):
    // signature_hash != 0: every CTA compares it with every rank's of this call (kFusedAgreementOffset, the
    // numbering shared with the combines) before any row moves; 0: unchecked (a non-cached call).
    uint32_t signature_hash;
    int64_t* host_verdict;
};

// 2 * C CTAs of kChannelThreads: even CTAs send and forward channel c, odd CTAs receive it.
Status fused_dispatch(const KernelContext& ctx, const FusedGeometry& geometry, const FusedDispatchArgs& args,
                      cudaStream_t stream);

// ---- combine ----
// combined_x[t] = bf16(b0 + b1 + sum over nodes n ascending of bf16(sum over the local ranks j of node n
// ascending of x_j[row_j(t)])), fp32 accumulation; combined_topk_weights likewise without rounding.
struct FusedCombineArgs {
    const void* x;                        // [M, H] BF16 rows aligned with the dispatch's recv_x
    const float* topk_weights;            // [M, K] or nullptr
    const void* bias_0;                   // [T, H] BF16 or nullptr
    const void* bias_1;
    int num_tokens;                       // T
    const int* recv_rdma_channel_prefix_matrix;  // [N, C] (handle)
    const int* recv_rdma_rank_prefix_sum;        // [N]
    const int* recv_gbl_channel_prefix_matrix;   // [R, C]
    const int* recv_gbl_rank_prefix_sum;         // [R]
    const int* send_rdma_head;            // [T, N]
    const int* send_nvl_head;             // [F, 8]
    void* combined_x;                     // [T, H] BF16
    float* combined_topk_weights;         // [T, K] or nullptr
    int num_max_rdma_send_tokens;
    int num_max_nvl_send_tokens;
    // Checked calls (as CombineArgs, api.cuh; numbered on the device, cached dispatches and combines alike,
    // refusals too): != 0, the hash of this rank's call signature, which every CTA compares with every rank's of this
    // call (kFusedAgreementOffset) before any row moves: on a difference no rank moves a row or advances a ring, and
    // the error record gets kErrorArgumentMismatch (no abort). 0: unchecked. host_verdict: host-mapped, or nullptr
    // (CUDA-graph capture): the last CTA to compare writes the call's call_seq there.
    uint32_t signature_hash;
    int64_t* host_verdict;
};

// 2 * C CTAs: even CTAs forward (reduce inside the node) and own (final reduction) channel c, odd CTAs send the
// rows back to the forwarders.
Status fused_combine(const KernelContext& ctx, const FusedGeometry& geometry, const FusedCombineArgs& args,
                     cudaStream_t stream);

}  // namespace kernels
}  // namespace deep_ep
