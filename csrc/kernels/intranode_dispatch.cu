// Intranode dispatch (cached or not: the same kernel; a non-cached call runs intranode_notify first).
//
// * Copy warps load every token row once (16 B per lane, several loads in flight) and store it to each
//   destination: straight into recv_x for the own rank (local bypass), into the peer's ring otherwise, or into the
//   peer's output block when that receiver takes its rows directly (its DispatchOutputWord of the call). Token i of a
//   channel belongs to copy warp i % W. The publisher warp publishes the tails every >= Sn tokens and at the end.
//   Receiver warps, grouped per source, copy ready slots into recv_x and return heads.
// * send_head[t][d] is the index j of token t among its channel's tokens to d (-1 if not sent). The row of a
//   received token is rank_prefix(s -> me) + recv_channel_prefix[s][c] + j on both sides, which yields the order
//   (source rank, then source token). Combine reuses j to find each contribution: no handle rewriting.
#include <cstddef>
#include <cstdint>

#include "intranode_common.cuh"

namespace deep_ep {
namespace kernels {

namespace {

constexpr int kPrefixBatch = 8;  // groups of 32 tokens whose routing bytes one send_head warp loads at once
// The verdict of a cached call on the ranks' signature hashes (the kernel's shared `agreement`).
constexpr int kAgreementPending = 0, kAgreementHolds = 1, kAgreementDiffers = 2;

// Control-region offset of hash[epoch & 1] in the output word that `writer` keeps in a sender's buffer for
// `channel` (word counter_index(channel, writer)); a put peer's hash arrives in the twin of that word.
__device__ __forceinline__ int64_t dispatch_hash_offset(int channel, int writer, uint32_t epoch) {
    return kDispatchOutputOffset + static_cast<int64_t>(counter_index(channel, writer)) * sizeof(DispatchOutputWord) +
           offsetof(DispatchOutputWord, hash) + 4 * static_cast<int64_t>(epoch & 1u);
}
// Receivers: one group per source of at least one warp, beside at least three sender warps (two copy warps and the
// publisher). A group of several warps syncs on its own named barrier, a one-warp group with __syncwarp. Groups
// get warps round robin, so with S sources and Wr <= kChannelWarps - 3 receiver warps the first min(S, Wr - S) groups
// have several: at most 14 (S <= 14, or Wr - S <= 29 - 15), ids 2..15 of the 16 hardware barriers.
static_assert(kMaxRanks - 1 + 3 <= kChannelWarps, "one receiver warp per source and three sender warps must fit a CTA");
static_assert(kBarrierRecvGroup0 + 14 <= 16, "named barriers of the multi-warp receiver groups");

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

// One lane: put peer d's hash of this cached call, from the signal it raised into the twin of its output word's
// hash[parity] (`epoch << 32 | hash`); false when the bounded wait failed. Not inlined: the ring kernels keep their
// register budget.
static __device__ __noinline__ bool wait_put_hash(const KernelContext& ctx, int channel, int d, uint32_t epoch,
                                                  uint32_t* hash) {
    const int64_t offset = dispatch_hash_offset(channel, d, epoch);
    const uint64_t* twin = signal_twin(ctx, offset);
    uint32_t seen;
    if (!wait_geq(ctx, reinterpret_cast<const uint32_t*>(twin) + 1, epoch,
                  Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel}, &seen))
        return false;
    put_wait_consistency(signal_twin(ctx, offset));
    *hash = static_cast<uint32_t>(ld_acquire_sys_u64(twin));
    return true;
}

// kPut: some peers are NVSHMEM put peers (put.cuh). Rings only between put peers: a sender's copy warps stage
// their records in its put area and put them per block, its publisher signals the tails; a receiver neither tells
// them where its outputs lie nor receives their rows in place, and a cached call's hash reaches them as a signal.
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
    // Cached call: kAgreementPending until the output-word warp has compared every peer's signature hash.
    __shared__ volatile int agreement;

    // The notify of this call saw the ranks' signatures differ: every rank skips alike, no state advances.
    if (args.agreement_gate && *workspace_u32(ctx, kWsNotifyMismatchOffset) != 0u) return;

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
    // Tokens per copy-warp block (put.cuh); 1 without put peers: token i on copy warp i % W.
    const int put_block = kPut ? put_block_items(end - begin, num_copy_warps, args.num_max_send_tokens) : 1;

    // Real number of rows this rank receives; more than allocated means the routing broke a promise.
    const int num_real_rows = P[(num_ranks - 1) * num_ranks + rank];
    if (threadIdx.x == 0) {
        cta_failed = 0;
        agreement = args.signature_hash != 0u ? kAgreementPending : kAgreementHolds;
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
    if (threadIdx.x < kChannelWarps) progress[threadIdx.x] = static_cast<int>(threadIdx.x) * put_block;
    __syncthreads();
    const bool overflow = cta_failed != 0;
    const bool receive_direct = args.direct_data_offset >= 0 && !overflow;

    // Tell every sender where my outputs of this call lie (or that I use the rings), before anything waits. A put
    // peer sends through the rings and reads no word.
    if (static_cast<int>(threadIdx.x) < num_ranks && static_cast<int>(threadIdx.x) != rank &&
        !(kPut && is_ring_put_peer(ctx, static_cast<int>(threadIdx.x)))) {
        auto* word = reinterpret_cast<DispatchOutputWord*>(static_cast<char*>(ctx.buffers[threadIdx.x]) +
                                                           kDispatchOutputOffset) + counter_index(channel, rank);
        volatile uint32_t* fields = reinterpret_cast<volatile uint32_t*>(word);
        fields[1] = receive_direct ? static_cast<uint32_t>(args.direct_data_offset / kBufferAlignment) : kNoOutput;
        fields[2] = receive_direct && args.direct_meta_offset >= 0
                        ? static_cast<uint32_t>(args.direct_meta_offset / kBufferAlignment) : kNoOutput;
        fields[3] = static_cast<uint32_t>(args.num_recv_rows);
        fields[4 + (call_epoch & 1u)] = args.signature_hash;
        fence_acq_rel_sys();
        st_release_sys(&word->epoch, call_epoch);
    }
    // A put peer reads only a cached call's hash: the twin of my word's hash[parity] there gets `epoch << 32 | hash`
    // in one signal (it is at most one call ahead of me, and that call has the other parity).
    if (kPut && args.signature_hash != 0u && static_cast<int>(threadIdx.x) < num_ranks &&
        static_cast<int>(threadIdx.x) != rank && is_ring_put_peer(ctx, static_cast<int>(threadIdx.x)))
        put_signal(ctx, dispatch_hash_offset(channel, rank, call_epoch), static_cast<int>(threadIdx.x),
                   (static_cast<uint64_t>(call_epoch) << 32) | args.signature_hash);

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
        if (warp == (num_ranks + 1) % num_send_warps) {
            // Lane d: the handle's count of my tokens to d in this channel (channel_prefix_matrix is inclusive).
            // A receiver that expects rows from me cannot start its next call before it has them, so its word
            // holds this call's epoch or an older one; one that expects none may already be a call ahead, so
            // its word is only read by a cached call, for the hash of this call (Phase A's count is checked
            // against this one below).
            const int d = lane;
            const bool check = args.signature_hash != 0u;
            uint32_t their_hash = args.signature_hash;
            bool ahead_with_rows = false;  // a cached call: d is a call ahead although it expects rows from me
            if (lane < num_ranks && lane != rank && !overflow && !ctx.skip_sends) {
                const int* cpm_row = args.channel_prefix_matrix + d * num_channels;
                const int expected = cpm_row[channel] - (channel > 0 ? cpm_row[channel - 1] : 0);
                expected_total[d] = expected;
                if (kPut && check && is_ring_put_peer(ctx, d)) {
                    if (!wait_put_hash(ctx, channel, d, call_epoch, &their_hash)) cta_failed = 1;
                } else if ((expected > 0 || check) && !(kPut && is_ring_put_peer(ctx, d))) {
                    auto* word = reinterpret_cast<DispatchOutputWord*>(static_cast<char*>(ctx.buffers[rank]) +
                                                                       kDispatchOutputOffset) + counter_index(channel, d);
                    uint32_t seen;
                    if (!wait_geq(ctx, &word->epoch, call_epoch,
                                  Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel}, &seen)) {
                        cta_failed = 1;
                    } else if (seen != call_epoch && (!check || seen != call_epoch + 1u)) {
                        report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel},
                                     call_epoch, seen, 0);
                        cta_failed = 1;
                    } else {
                        const volatile uint32_t* fields = reinterpret_cast<const volatile uint32_t*>(word);
                        if (check) their_hash = fields[4 + (call_epoch & 1u)];
                        ahead_with_rows = seen != call_epoch && expected > 0;
                        const uint32_t data_units = fields[1], meta_units = fields[2], rows = fields[3];
                        if (expected > 0 && seen == call_epoch && data_units != kNoOutput) {
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
            if (check) {
                // Every rank compares the same hashes, so every rank's kernels skip alike on a difference.
                const uint32_t differ = __ballot_sync(0xffffffffu, their_hash != args.signature_hash);
                const int first = differ != 0u ? __ffs(static_cast<int>(differ)) - 1 : 0;
                const uint32_t first_hash = __shfl_sync(0xffffffffu, their_hash, first);
                if (lane == 0) {
                    if (differ != 0u)
                        fill_error_record(ctx.error, workspace_u32(ctx, kWsErrorClaimOffset), kErrorArgumentMismatch,
                                          kKernelDispatch, kPhaseDispatchAgreement, rank, first, channel, ctx.call_seq,
                                          args.signature_hash, first_hash, 0);
                    agreement = differ != 0u ? kAgreementDiffers : kAgreementHolds;
                }
                // Equal hashes mean the same handle: a peer a call ahead that expects rows from me broke it.
                if (differ == 0u && ahead_with_rows) {
                    report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchSendWaitOutput, d, channel},
                                 call_epoch, call_epoch + 1u, 0);
                    cta_failed = 1;
                }
                if (lane == 0) publish_agreement_verdict(ctx, args.host_verdict, static_cast<uint32_t>(num_channels));
            }
        }
        named_barrier(kBarrierAllSenders, num_send_warps * 32);
        // Lane d of warp 0: Phase A's count must be the handle's, and the rows must fit the receiver's outputs.
        if (warp == 0 && lane < num_ranks && lane != rank && !overflow && !ctx.skip_sends && cta_failed == 0 &&
            agreement != kAgreementDiffers) {
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
        // The ranks disagree on this cached call: no row moves and no ring advances.
        const bool skip = overflow || agreement == kAgreementDiffers;

        if (warp < num_copy_warps) {
            // Phase B (copy warps): token i of the channel belongs to warp i % W; each warp goes in token order.
            // With put peers, blocks of put_block consecutive tokens go round the warps instead, and a warp puts
            // each block's records itself before it releases the block (put.cuh).
            uint32_t run_first = 0;  // lane d: sequence number of the block's first record for put peer d
            int run_count = 0;       // and the number of its records
            for (int i = warp * put_block; i < num_channel_tokens && !skip;
                 i += kPut && (i + 1) % put_block != 0 ? 1 : (num_copy_warps - 1) * put_block + 1) {
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
                            if (kPut && is_ring_put_peer(ctx, d)) {  // the staging twin; this warp puts it
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
                if constexpr (kPut) {
                    if (lane < num_ranks && is_ring_put_peer(ctx, lane) && !ctx.skip_sends && head_row[lane] >= 0 &&
                        run_count++ == 0)
                        run_first = tail_base[lane] + static_cast<uint32_t>(head_row[lane]);
                    if ((i + 1) % put_block == 0 || i + 1 == num_channel_tokens) {
                        put_staged_runs(ctx, geo.ring, channel, run_first, run_count);
                        run_count = 0;
                        release_progress(progress, warp, i - i % put_block + num_copy_warps * put_block);
                    }
                } else {
                    release_progress(progress, warp, i + num_copy_warps);
                }
            }
        } else if (!skip) {
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
                    publish_tails<kPut>(ctx, count, old, tail_base, channel, kDispatchTailOffset);
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
        // A cached call waits for the verdict on the signature hashes (bounded: the output-word warp's waits are).
        while (agreement == kAgreementPending) __nanosleep(64);
        const bool skip = overflow || agreement == kAgreementDiffers;
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
        uint32_t* remote_head =
            kPut && is_ring_put_peer(ctx, src) ? nullptr : buffer_u32(ctx.buffers[src], head_offset);

        int done = 0;
        if (receive_direct && !skip && !(kPut && is_ring_put_peer(ctx, src))) {
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
        while (done < num_slots && !skip) {
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
        if (warp_in_group == 0 && lane == 0 && !skip) *head_shadow = base + static_cast<uint32_t>(num_slots);
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

}  // namespace

Status intranode_dispatch(const KernelContext& ctx, const DispatchArgs& args, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "dispatch"));
    DEEP_EP_REQUIRE_ARG(args.hidden_bytes > 0 && args.hidden_bytes % 16 == 0,
                        "dispatch: hidden bytes per token must be a positive multiple of 16, got ", args.hidden_bytes);
    DEEP_EP_REQUIRE_ARG(args.num_topk >= 0 && args.num_topk <= kMaxTopk, "dispatch: num_topk must be in [0, ", kMaxTopk,
                        "], got ", args.num_topk);
    DEEP_EP_REQUIRE_ARG(args.num_topk == 0 || (args.topk_idx != nullptr && args.topk_weights != nullptr),
                        "dispatch: topk_idx and topk_weights must both be given when num_topk > 0");
    DEEP_EP_REQUIRE_ARG(args.topk_idx_bytes == 4 || args.topk_idx_bytes == 8,
                        "dispatch: topk_idx element size must be 4 or 8 bytes, got ", args.topk_idx_bytes);
    DEEP_EP_REQUIRE_ARG(args.num_topk == 0 ||
                            (args.num_experts >= ctx.num_ranks && args.num_experts % ctx.num_ranks == 0),
                        "dispatch: num_experts must be a positive multiple of num_ranks, got ", args.num_experts);
    DEEP_EP_REQUIRE_ARG(args.num_scales >= 0, "dispatch: num_scales must be >= 0, got ", args.num_scales);
    DEEP_EP_REQUIRE_ARG(args.num_scales == 0 || (args.x_scales != nullptr && args.recv_x_scales != nullptr),
                        "dispatch: x_scales and recv_x_scales must be given when num_scales > 0");
    DEEP_EP_REQUIRE_ARG(args.num_tokens >= 0, "dispatch: num_tokens must be >= 0, got ", args.num_tokens);
    DEEP_EP_REQUIRE_ARG(args.num_recv_rows >= 0, "dispatch: num_recv_rows must be >= 0, got ", args.num_recv_rows);

    DispatchGeometry geo;
    const int64_t record = dispatch_record_bytes(args.hidden_bytes, args.num_scales, args.num_topk);
    geo.ring = ring_geometry(ctx.num_nvl_bytes, ctx.num_ranks, args.num_channels, record, args.num_max_recv_tokens,
                             false);
    geo.scales_offset = dispatch_scales_offset(args.hidden_bytes);
    geo.meta_offset = dispatch_meta_offset(args.hidden_bytes, args.num_scales);
    if (ctx.num_ranks > 1) {
        DEEP_EP_RETURN_IF_FAILED(check_channels("dispatch", args.num_channels, args.num_max_send_tokens,
                                                geo.ring.capacity, record, ctx.num_nvl_bytes));
        // Copy warps: at least two (with the publisher they share Phase A's destinations, the drain check and the
        // output-word wait); the publisher and one receiver warp per source remain.
        DEEP_EP_RETURN_IF_FAILED(check_send_warps("dispatch", args.num_send_warps, 2, kChannelWarps - ctx.num_ranks));
    } else
        DEEP_EP_REQUIRE_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                            "dispatch: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    if (ctx.num_ranks == 1 && geo.ring.capacity < 1) geo.ring.capacity = 1;  // no ring is used with one rank

    DEEP_EP_RETURN_IF_FAILED(check_resident("dispatch", args.num_channels));
    const bool put = ctx.put_mask != 0;
    if (args.topk_idx_bytes == 8 && put)
        dispatch_kernel<int64_t, true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else if (args.topk_idx_bytes == 8)
        dispatch_kernel<int64_t, false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else if (put)
        dispatch_kernel<int32_t, true><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    else
        dispatch_kernel<int32_t, false><<<args.num_channels, kChannelThreads, 0, stream>>>(ctx, args, geo);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
