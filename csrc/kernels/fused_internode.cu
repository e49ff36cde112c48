// Fused internode normal-mode kernels for N nodes x G GPUs (G > 1): notify, dispatch and combine.
//
// Rank r sits on node m = r / G at local index l = r % G. A token of rank (m, l) that needs node n crosses the
// scale-out network once, to its rail peer (n, l) (the forwarder), which copies it over NVLink to every local rank
// of node n in the token's mask, in the same kernel:
//   * senders (even CTA, channel c, one team per destination node n): walk the channel's tokens, pack each token
//     that needs node n once (payload, scales, local-rank mask of node n, global top-k ids and weights) into the
//     rail ring (c, m) of the forwarder (n, l), and publish the ring's tail every num_max_rdma_send_tokens records;
//   * forwarders (even CTA, one team per source node n): poll the tail of their rail ring (c, n) (local memory),
//     copy each record into the node ring (c, source rank (n, l)) of every local rank in its mask, publish those
//     tails, and return credits (the rail head) to the sender;
//   * receivers (odd CTA, one team per source rank s): copy the records of node ring (c, s) into rows
//     recv_gbl_channel_prefix[s][c] onwards (the contract's order: source rank, then token), top-k ids made local,
//     and return the node head.
// Warps: the even CTA's 32 warps form 2N teams (senders of nodes 0 .. N-1, then forwarders), the odd CTA's 32
// warps R receiver teams (each last warp first fills its share of the worst-token tail); combine's even CTA forms one
// owner team of its last fused_combine_owner_warps(N) warps and N forwarder teams of the others, its
// odd CTA R sender teams. Teams take consecutive warps, sizes differing by at most one (at N = 2, G = 2: dispatch 8
// warps per sender, forwarder and receiver; combine 11, 11 and 10 (owner), 8 per sender; at N = 8: 8 owner warps,
// 3 per forwarder). Where a CTA has more roles than warps (past 32 ranks, 16 nodes for dispatch, 24 for combine's
// forwarders), each warp serves several of them one after the other, in ascending order on every rank
// (make_roles). In dispatch every warp of a team runs the role's control flow over windows of up to 32 records
// (one lane per record loads its routing) and copies whole records of each window in turn, so each warp has a whole
// row's loads in flight; the team's first warp writes the side outputs and alone publishes a tail or credit,
// once every warp's progress has passed it (Team below). In combine the warps of a team take whole rows in turn (a
// reduction per warp keeps enough loads in flight) and the first warp publishes the finished prefix.
// Roles overlap through the rings; the only waits are on ring counters (bounded, sync.cuh), and the chain
// receiver <- forwarder <- sender has no cycle. Ring positions are monotonic uint32 kept in the workspace between
// calls; every ring is empty between calls, and a writer first waits until the rings it wrote in earlier calls are
// drained (ring geometry may change between calls). Every peer is reached by pointer (CUDA IPC or nvshmem_ptr).
//
// Combine runs the reverse in one kernel: the local rank j sends its rows of source s = (n, l) (odd CTAs, team s)
// into the node ring (c, n, j) of the forwarder (its node, l); the forwarder (team n of an even CTA) sums each
// forwarded token's rows in fp32 in ascending j, rounds once to BF16 (the per-node partial) and sends it into the
// rail ring (c, its node) of the owner (n, l) (one scale-out transfer per (token, node)); the owner (the even CTA's
// owner team) adds the biases, then the partials in ascending node order, in fp32, and rounds once more. send_nvl_head
// and send_rdma_head give each row's position in its ring. A team publishes what it holds back (tails, credits)
// before any wait that could depend on it, and a role returns only once it has published everything it finished,
// so a warp that serves several roles holds nothing back for an earlier one while it serves a later one. Dispatch
// and combine rings live in separate halves of the buffer. A checked combine (FusedCombineArgs::signature_hash)
// first sends its agreement word to every rank of the group and, in every CTA, waits for every rank's word of the
// call: unless every hash equals its own, no rank moves a row or advances a ring.
//
// Notify exchanges, from every source to every rank, the per-rank totals, per-expert counts and per-channel counts
// (the fused notify slots of fused_internode.cuh), and, to rail peers only, the per-channel counts of tokens that
// need the peer's node; it builds the internode handle's prefix matrices as reference/ defines them.
#include <cuda_bf16.h>

#include <cstdint>

#include "fused_internode.cuh"
#include "intranode_common.cuh"
#include "put.cuh"

namespace deep_ep {
namespace kernels {

namespace {

constexpr int kMaxGpusPerNode = 8;  // send_nvl_head has 8 columns; local masks are 8 bits
static_assert(kFusedMaxNodes <= 32, "a lane per node (combine owner, notify)");
static_assert(kFusedMaxRanks <= kNotifyThreads - kFusedMaxRanks, "notify: a thread per rank, another per node");

// Lane 0 waits, the warp learns the outcome and the value seen.
__device__ __forceinline__ bool warp_wait_geq(const KernelContext& ctx, const uint32_t* word, uint32_t target,
                                              const Site& site, uint32_t* seen) {
    bool ok = true;
    uint32_t value = 0;
    if (lane_id() == 0) ok = wait_geq(ctx, word, target, site, &value);
    *seen = __shfl_sync(0xffffffffu, value, 0);
    return __shfl_sync(0xffffffffu, ok ? 1 : 0, 0) != 0;
}

// The whole warp's stores so far become visible before `value` lands in `word` (lane 0 publishes).
__device__ __forceinline__ void warp_publish(uint32_t* word, uint32_t value) {
    __syncwarp();
    if (lane_id() == 0) {
        fence_acq_rel_sys();
        st_release_sys(word, value);
    }
    __syncwarp();
}

// ---------------------------------------------------------------------------------------------------------------
// NVSHMEM put peers (put.cuh): the rail hops and notify's exchanges with ranks of other nodes
// ---------------------------------------------------------------------------------------------------------------

// The word that `peer` raises in this rank's buffer: `word` for a pointer peer, the low half of this rank's signal
// at `signal_offset` for a put peer.
__device__ __forceinline__ uint32_t* raised_word(const KernelContext& ctx, uint32_t* word, int64_t signal_offset,
                                                 int peer) {
    return is_put_peer(ctx, peer) ? reinterpret_cast<uint32_t*>(own_buffer(ctx) + signal_offset) : word;
}

// After a successful wait on a word that put peer `peer` raised (no-op for a pointer peer): NVSHMEM's consistency
// operation, so that the data the signal covers is read after it.
__device__ __forceinline__ void after_raised(const KernelContext& ctx, int64_t signal_offset, int peer) {
    if (is_put_peer(ctx, peer)) put_wait_consistency(reinterpret_cast<uint64_t*>(own_buffer(ctx) + signal_offset));
}

// One thread: the signal at `signal_offset` of put peer `pe` becomes `value`, after everything this thread wrote or
// observed (its puts, if any, are complete: the callers quiet first).
static __device__ __noinline__ void fused_signal(const KernelContext& ctx, int64_t signal_offset, int pe,
                                                 uint64_t value) {
    fence_acq_rel_sys();
#ifndef DEEP_EP_DISABLE_NVSHMEM
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(own_buffer(ctx) + signal_offset), value, NVSHMEM_SIGNAL_SET, pe);
#else
    (void)ctx, (void)signal_offset, (void)pe, (void)value;
#endif
}

// Where this rank stages what it puts at control-region byte `offset` of a put peer's buffer (its twin in the
// control staging, fused_internode.cuh).
__device__ __forceinline__ char* fused_control_stage(const KernelContext& ctx, int64_t offset) {
    return own_buffer(ctx) + kFusedControlStageShift + offset;
}

// Lane 0 raises `word` of a pointer peer (release store) or the signal at `signal_offset` of put peer `peer` to
// `value`, after the whole warp's stores (the warp_publish of either kind of peer).
__device__ __forceinline__ void warp_raise(const KernelContext& ctx, uint32_t* word, int64_t signal_offset, int peer,
                                           uint32_t value) {
    if (is_put_peer(ctx, peer)) {
        __syncwarp();
        if (lane_id() == 0) fused_signal(ctx, signal_offset, peer, value);
        __syncwarp();
    } else {
        warp_publish(word, value);
    }
}

// Whole warp: records [from, to) (sequence numbers) of rail ring (channel, `dest_node`) at put peer `pe`, from this
// rank's staging of its own rail ring (channel, `stage_node`) (`geo`: the direction's layout), as one put (two where
// the run wraps); once they are delivered (quiet), the signal at `signal_offset` there becomes `to`. The records'
// stores (the team's, acquired by the caller's team wait) come first.
static __device__ __noinline__ void fused_put_run(const KernelContext& ctx, const FusedGeometry& geo, int channel,
                                                  int stage_node, int dest_node, uint32_t from, uint32_t to, int pe,
                                                  int64_t signal_offset) {
#ifndef DEEP_EP_DISABLE_NVSHMEM
    const int capacity = geo.rail_capacity;
    const int64_t record_bytes = geo.record_bytes;
    const int64_t stage_ring = geo.rail_slot(channel, stage_node, 0), dest_ring = geo.rail_slot(channel, dest_node, 0);
    const int n = static_cast<int>(to - from);
    __syncwarp();
    if (lane_id() == 0) fence_acq_rel_sys();
    __syncwarp();
    if (n > 0) {
        const int slot = static_cast<int>(from % static_cast<uint32_t>(capacity));
        const int first = n < capacity - slot ? n : capacity - slot;
        char* dest = own_buffer(ctx) + dest_ring;
        const char* stage = own_buffer(ctx) + geo.rail_stage(stage_ring);
        nvshmemx_putmem_nbi_warp(dest + slot * record_bytes, stage + slot * record_bytes,
                                 static_cast<size_t>(first * record_bytes), pe);
        if (first < n)
            nvshmemx_putmem_nbi_warp(dest, stage, static_cast<size_t>((n - first) * record_bytes), pe);
        __syncwarp();
        if (lane_id() == 0) nvshmem_quiet();
    }
    if (lane_id() == 0) fused_signal(ctx, signal_offset, pe, to);
    __syncwarp();
#else
    (void)ctx, (void)geo, (void)channel, (void)stage_node, (void)dest_node, (void)from, (void)to, (void)pe,
        (void)signal_offset;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Notify
// ---------------------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kNotifyThreads, 1)
    fused_notify_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ FusedNotifyArgs args) {
    __shared__ int rank_totals[kFusedMaxRanks];
    __shared__ int recv_starts[kFusedMaxRanks];  // first row of each source's block
    __shared__ int mismatch_source;              // the first source whose signature differs, or kFusedMaxRanks

    const int num_ranks = ctx.num_ranks, rank = ctx.rank, num_channels = args.num_channels;
    const int per_node = args.gpus_per_node, num_nodes = num_ranks / per_node;
    const int my_local = rank % per_node;
    const int num_local_experts = args.num_experts / num_ranks;
    const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = lane_id();
    const int num_warps = static_cast<int>(blockDim.x) / 32;
    // My tokens to rank d in channel c, then my tokens that need node n in channel c: first as counts in the
    // sender-side prefix matrices, which step 2 turns into inclusive prefixes in place.
    int* rank_matrix = args.gbl_channel_prefix_matrix;
    int* node_matrix = args.rdma_channel_prefix_matrix;
    auto count_of = [](const int* prefix_row, int c) {
        return prefix_row[c] - (c > 0 ? prefix_row[c - 1] : 0);
    };

    // 1. Per-(rank, channel) and per-(node, channel) counts from is_token_in_rank.
    for (int pair = warp; pair < (num_ranks + num_nodes) * num_channels; pair += num_warps) {
        const int which = pair / num_channels, c = pair % num_channels;
        int begin, end;
        channel_range(args.num_tokens, num_channels, c, &begin, &end);
        int count = 0;
        for (int t = begin + lane; t < end; t += 32) {
            const bool* row = args.is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
            if (which < num_ranks) {
                count += row[which] ? 1 : 0;
            } else {
                bool any = false;
                for (int j = 0; j < per_node; ++j) any |= row[(which - num_ranks) * per_node + j];
                count += any ? 1 : 0;
            }
        }
        count = warp_sum(count);
        if (lane == 0) {
            if (which < num_ranks)
                rank_matrix[which * num_channels + c] = count;
            else
                node_matrix[(which - num_ranks) * num_channels + c] = count;
        }
    }
    __syncthreads();

    // 2. Sender-side prefix matrices and the checks against the caller's layout.
    if (tid < num_ranks) {
        const int d = tid;
        int total = 0;
        for (int c = 0; c < num_channels; ++c) {
            total += rank_matrix[d * num_channels + c];
            rank_matrix[d * num_channels + c] = total;
        }
        rank_totals[d] = total;
        if (args.num_tokens_per_rank[d] != total)
            report_error(ctx, kErrorCountMismatch, Site{kKernelNotify, kPhaseNotifyCheckCounts, d, -1},
                         args.num_tokens_per_rank[d], total, 0);
    } else if (tid >= kFusedMaxRanks && tid < kFusedMaxRanks + num_nodes) {
        const int n = tid - kFusedMaxRanks;
        int total = 0;
        for (int c = 0; c < num_channels; ++c) {
            total += node_matrix[n * num_channels + c];
            node_matrix[n * num_channels + c] = total;
        }
        if (args.num_tokens_per_rdma_rank != nullptr && args.num_tokens_per_rdma_rank[n] != total)
            report_error(ctx, kErrorCountMismatch, Site{kKernelNotify, kPhaseNotifyCheckCounts, n * per_node, -1},
                         args.num_tokens_per_rdma_rank[n], total, 0);
    }
    const uint32_t epoch = *workspace_u32(ctx, kWsNotifyEpochOffset) + 1;
    const int parity = static_cast<int>(epoch & 1u);
    if (tid == 0) mismatch_source = kFusedMaxRanks;
    __syncthreads();

    // 3. My counts into every rank's slot [parity][me]: [R totals][L expert counts of d][C channel counts to d]
    //    [my signature], and to my rail peers the channel counts of tokens that need their node. For a put peer d
    //    they go to my staging of slot [parity][d] (and of d's node counts) first, and a warp puts them (3b).
    const int* my_signature = reinterpret_cast<const int*>(args.signature);
    const int per_dst = num_ranks + num_local_experts + 2 * num_channels + kSignatureInts;
    for (int i = tid; i < num_ranks * per_dst; i += static_cast<int>(blockDim.x)) {
        const int d = i / per_dst, k = i % per_dst;
        const bool put = is_put_peer(ctx, d);
        volatile int* slot =
            put ? reinterpret_cast<volatile int*>(fused_control_stage(ctx, kFusedNotifyDataOffset)) +
                      (static_cast<int64_t>(parity) * kFusedMaxRanks + d) * kFusedNotifyInts
                : reinterpret_cast<volatile int*>(buffer_u32(ctx.buffers[d], kFusedNotifyDataOffset)) +
                      (static_cast<int64_t>(parity) * kFusedMaxRanks + rank) * kFusedNotifyInts;
        if (k < num_ranks) {
            slot[k] = rank_totals[k];
        } else if (k < num_ranks + num_local_experts) {
            slot[kFusedMaxRanks + (k - num_ranks)] =
                args.num_tokens_per_expert[d * num_local_experts + (k - num_ranks)];
        } else if (k < num_ranks + num_local_experts + num_channels) {
            const int c = k - num_ranks - num_local_experts;
            slot[kFusedMaxRanks + kMaxLocalExperts + c] = count_of(rank_matrix + d * num_channels, c);
        } else if (k >= num_ranks + num_local_experts + 2 * num_channels) {
            const int w = k - num_ranks - num_local_experts - 2 * num_channels;
            slot[kFusedNotifySignaturePos + w] = my_signature[w];
        } else if (d % per_node == my_local) {
            const int c = k - num_ranks - num_local_experts - num_channels;
            volatile int* counts = reinterpret_cast<volatile int*>(
                put ? fused_control_stage(ctx, kFusedNodeCountOffset) : reinterpret_cast<char*>(ctx.buffers[d]) +
                                                                   kFusedNodeCountOffset);
            counts[(static_cast<int64_t>(parity) * kFusedMaxRanks + (put ? d : rank)) * kMaxChannels + c] =
                count_of(node_matrix + (d / per_node) * num_channels, c);
        }
    }
    __threadfence_system();
    __syncthreads();
    const int64_t my_flag_signal = kFusedNotifyFlagSignalOffset + 8LL * (parity * kFusedMaxRanks + rank);
    if (tid < num_ranks && !ctx.skip_sends && !is_put_peer(ctx, tid)) {
        fence_acq_rel_sys();
        st_release_sys(buffer_u32(ctx.buffers[tid], kFusedNotifyFlagOffset) + parity * kFusedMaxRanks + rank, epoch);
    }
    // 3b. A warp per put peer d: my staged slot (and node counts, to a rail peer) into d's slot [parity][me], then
    //     the flag's signal once they are delivered.
    for (int d = warp; d < num_ranks && ctx.put_mask != 0 && !ctx.skip_sends; d += num_warps) {
        if (!is_put_peer(ctx, d)) continue;
        if (lane == 0) fence_acq_rel_sys();
        __syncwarp();
#ifndef DEEP_EP_DISABLE_NVSHMEM
        const int64_t slot_bytes = 4LL * kFusedNotifyInts, counts_bytes = 4LL * kMaxChannels;
        const int64_t mine = static_cast<int64_t>(parity) * kFusedMaxRanks + rank;
        const int64_t theirs = static_cast<int64_t>(parity) * kFusedMaxRanks + d;
        nvshmemx_putmem_nbi_warp(own_buffer(ctx) + kFusedNotifyDataOffset + mine * slot_bytes,
                                 fused_control_stage(ctx, kFusedNotifyDataOffset) + theirs * slot_bytes,
                                 static_cast<size_t>(slot_bytes), d);
        if (d % per_node == my_local)
            nvshmemx_putmem_nbi_warp(own_buffer(ctx) + kFusedNodeCountOffset + mine * counts_bytes,
                                     fused_control_stage(ctx, kFusedNodeCountOffset) + theirs * counts_bytes,
                                     static_cast<size_t>(counts_bytes), d);
        __syncwarp();
        if (lane == 0) nvshmem_quiet();
#endif
        if (lane == 0) fused_signal(ctx, my_flag_signal, d, epoch);
        __syncwarp();
    }

    // 4. Wait for every source's counts of this epoch (a put peer's flag is its signal).
    if (tid < num_ranks) {
        uint32_t seen;
        const int64_t signal = kFusedNotifyFlagSignalOffset + 8LL * (parity * kFusedMaxRanks + tid);
        const uint32_t* flag = raised_word(
            ctx, buffer_u32(ctx.buffers[rank], kFusedNotifyFlagOffset) + parity * kFusedMaxRanks + tid, signal, tid);
        if (wait_geq(ctx, flag, epoch, Site{kKernelNotify, kPhaseNotifyWaitCounts, tid, -1}, &seen))
            after_raised(ctx, signal, tid);
    }
    __syncthreads();

    // 5. Receiver-side matrices (garbage but bounded if a wait failed).
    const volatile int* data =
        reinterpret_cast<const volatile int*>(buffer_u32(ctx.buffers[rank], kFusedNotifyDataOffset)) +
        static_cast<int64_t>(parity) * kFusedMaxRanks * kFusedNotifyInts;
    const volatile int* node_data =
        reinterpret_cast<const volatile int*>(buffer_u32(ctx.buffers[rank], kFusedNodeCountOffset)) +
        static_cast<int64_t>(parity) * kFusedMaxRanks * kMaxChannels;
    if (tid == 0) {
        int prefix = 0;
        for (int s = 0; s < num_ranks; ++s) {
            recv_starts[s] = prefix;
            prefix += data[s * kFusedNotifyInts + rank];
            args.recv_gbl_rank_prefix_sum[s] = prefix;
        }
    } else if (tid == 32) {
        int forwarded = 0;
        for (int n = 0; n < num_nodes; ++n) {
            const int s = n * per_node + my_local;
            int prefix = 0;
            for (int c = 0; c < num_channels; ++c) {
                prefix += node_data[s * kMaxChannels + c];
                args.recv_rdma_channel_prefix_matrix[n * num_channels + c] = prefix;
            }
            forwarded += prefix;
            args.recv_rdma_rank_prefix_sum[n] = forwarded;
        }
        if (args.host_counters != nullptr)
            reinterpret_cast<volatile int*>(args.host_counters)[kFusedForwardCounter] = forwarded;
    }
    __syncthreads();
    if (tid < num_ranks) {
        const int s = tid;
        int row = recv_starts[s];
        for (int c = 0; c < num_channels; ++c) {
            args.recv_gbl_channel_prefix_matrix[s * num_channels + c] = row;
            row += data[s * kFusedNotifyInts + kFusedMaxRanks + kMaxLocalExperts + c];
        }
    }
    // Every source's signature: to the host, and compared with mine.
    notify_agreement(ctx, args, data + kFusedNotifySignaturePos, kFusedNotifyInts, my_signature, &mismatch_source);
    if (args.host_counters != nullptr) {
        notify_expert_counts(args, data + kFusedMaxRanks, kFusedNotifyInts, num_ranks, num_local_experts);
        __threadfence_system();
    }
    __syncthreads();
    if (tid == 0) {
        if (args.host_counters != nullptr) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) total += data[s * kFusedNotifyInts + rank];
            reinterpret_cast<volatile int*>(args.host_counters)[0] = total;
            __threadfence_system();
        }
        *workspace_u32(ctx, kWsNotifyEpochOffset) = epoch;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------------------------------------------


// ---------------------------------------------------------------------------------------------------------------
// Teams
// ---------------------------------------------------------------------------------------------------------------

// Progress of a team warp that has left its role's loop (above any item count).
constexpr int kTeamDone = 0x40000000;

// The consecutive warps of a CTA that run one role instance. Every warp runs the role's whole control flow (the same
// waits on the same monotonic counters for the same items) and copies its records of each window (whole records,
// in turn); warp 0 of the team, the leader, also writes the side outputs, and alone publishes tails and credits.
// Each other warp releases its progress (items finished, CTA scope) after every window and before any wait of the
// next one; the leader publishes a position only after every warp's progress has passed it. A warp behind the
// leader waits only for conditions the leader has seen hold (the same targets on monotonic counters), and one ahead
// of it has passed the position the leader waits for, so the leader's wait on its team ends.
struct Team {
    int rank;                // this warp's index in the team; 0 is the leader
    int size;                // warps in the team
    volatile int* progress;  // shared, progress[rank] for each warp of the team

    __device__ __forceinline__ bool leader() const { return rank == 0; }

    // A non-leader warp has finished its part of the first `done` items (no-op for the leader).
    __device__ __forceinline__ void report(int done) const {
        if (rank != 0) release_progress(progress, rank, done);
    }

    // Leader, whole warp: every warp of the team has finished the first `done` items (lane w watches warp w). Bounded
    // like wait_geq; a failure is reported at `site` (the role's own phase and peer).
    __device__ __noinline__ bool wait(const KernelContext& ctx, int done, const Site& site) const {
        const int lane = lane_id();
        bool ok = true;
        if (lane > 0 && lane < size && progress[lane] < done) {
            const uint64_t start = global_timer_ns();
            for (uint32_t spins = 1; progress[lane] < done; ++spins) {
                if ((spins & 63) == 0 && spin_expired(ctx, start, site, done, progress[lane])) {
                    ok = false;
                    break;
                }
                if (spins > 256) __nanosleep(32);
            }
        }
        __syncwarp();
        __threadfence_block();  // acquire: the warps' released rows come before the leader's publication
        return __all_sync(0xffffffffu, ok);
    }
};

// Warp `warp` of `num_warps` in teams of consecutive warps, `num_teams` of them (<= num_warps), sizes differing by at
// most one (the larger ones first); `*team` is the team's index.
__device__ __forceinline__ Team make_team(volatile int* progress, int warp, int num_warps, int num_teams, int* team) {
    const int base = num_warps / num_teams, extra = num_warps % num_teams, big = extra * (base + 1);
    int first, size;
    if (warp < big) {
        size = base + 1;
        *team = warp / size;
        first = *team * size;
    } else {
        size = base;
        *team = extra + (warp - big) / base;
        first = big + (*team - extra) * base;
    }
    return Team{warp - first, size, progress + first};
}

// Role instances [0, count) over the warps [0, num_warps) of a CTA. Up to num_warps instances: teams (make_team), one
// instance each. More: one warp per team, warp w serving instances w, w + num_warps, ... one after the other in
// ascending order; `*first` and `*stride` give the loop. No cycle follows: give each instance the key of the flow
// it serves (dispatch: source node + destination node of its rail connection; combine: the owner's rank). Within a
// flow the roles are the unshared design's; a shared warp makes an instance wait only for instances earlier in the
// warp's order, every one of a lower key (a receiver's or combine sender's lower source rank, a sender's or
// forwarder's node 16 lower, a combine forwarder's owner of node 0). The lowest key still waited on thus has all its
// instances running or done, and its flow drains. An instance publishes what it holds back before (combine: inside)
// each of its waits and returns only once it has published everything it finished (dispatch: its last batch;
// combine: team_drain), so no wait of a warp depends on its own unpublished records, of this instance or an earlier
// one (tests/test_fused_role_order.py models the order and the combine's publications).
__device__ __forceinline__ Team make_roles(volatile int* progress, int warp, int num_warps, int count, int* first,
                                           int* stride) {
    if (count <= num_warps) {
        *stride = count;
        return make_team(progress, warp, num_warps, count, first);
    }
    *first = warp;
    *stride = num_warps;
    return Team{0, 1, progress + warp};
}

// Every team's progress words start at 0 (before any role runs; the whole CTA calls it).
__device__ __forceinline__ void reset_teams(volatile int* progress) {
    if (threadIdx.x < kChannelWarps) progress[threadIdx.x] = 0;
    __syncthreads();
}

// The k-th set bit (from 0) of `bits`; k < popc(bits).
__device__ __forceinline__ int nth_set_bit(uint32_t bits, int k) {
    for (int i = 0; i < k; ++i) bits &= bits - 1u;
    return __ffs(bits) - 1;
}

// Lanes below this one, as a mask.
__device__ __forceinline__ uint32_t lanes_below() { return (1u << lane_id()) - 1u; }

// Tokens per sender window and records per forwarder window: at most 32 (a lane each), and at most half a rail ring
// each, so that a forwarder waiting for its whole window never waits for records that its sender can only write
// after more credits (the sender holds at most one window unpublished while it waits for room); a forwarder window
// also fits a node ring whole.
__device__ __forceinline__ int fused_window(int rail_capacity, int node_capacity) {
    return max(1, min(min(32, rail_capacity / 2), node_capacity));
}

// Sender team of destination node n for channel c. The channel's tokens go in windows of up to 32 (lane i loads the
// local-rank mask of node n of the window's token i); the window's records take consecutive rail slots, and the
// team's warps copy whole records in turn (record k of the window on warp k % size), each warp with a whole row's
// loads in flight.
static __device__ void fused_send(const KernelContext& ctx, const FusedGeometry& geo, const FusedDispatchArgs& args,
                                  const Team& team, int channel, int n, int num_checked) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_ranks = ctx.num_ranks;
    const int my_node = ctx.rank / per_node, fwd = n * per_node + ctx.rank % per_node;
    // A put forwarder: records go to my staging of my rail ring (c, n) and are put as runs into its ring (c, my
    // node) when the tail is published; its credits arrive as signals.
    const bool put = is_put_peer(ctx, fwd);
    auto head_word = [&](int c) {
        return raised_word(ctx, buffer_u32(ctx.buffers[ctx.rank], kFusedRailHeadOffset) + fused_index(c, n),
                           kFusedRailHeadSignalOffset + 8LL * fused_node_index(c, n), fwd);
    };
    uint32_t* shadows = workspace_u32(ctx, kWsFusedRailTailShadow);

    bool ok = true;
    for (int c = channel; c < num_checked && ok; c += geo.num_channels) {
        uint32_t seen;
        ok = warp_wait_geq(ctx, head_word(c), shadows[fused_index(c, n)],
                           Site{kKernelDispatch, kPhaseDispatchSendDrain, fwd, c}, &seen);
    }
    fence_acq_rel_sys();
    uint32_t tail = shadows[fused_index(channel, n)];
    uint32_t head = tail, published = tail;
    uint32_t* remote_tail =
        put ? nullptr : buffer_u32(ctx.buffers[fwd], kFusedRailTailOffset) + fused_index(channel, my_node);
    const int64_t tail_signal = kFusedRailTailSignalOffset + 8LL * fused_node_index(channel, my_node);
    // Leader, whole warp: the records [published, tail) are finished by every warp; they reach the forwarder.
    auto raise_tail = [&]() {
        if (put)
            fused_put_run(ctx, geo, channel, n, my_node, published, tail, fwd, tail_signal);
        else
            warp_publish(remote_tail, tail);
    };
    const bool leader = team.leader(), publish = !ctx.skip_sends && leader;
    const Site site{kKernelDispatch, kPhaseDispatchSendWaitHead, fwd, channel};
    int begin, end;
    channel_range(args.num_tokens, geo.num_channels, channel, &begin, &end);
    const int window = fused_window(geo.rail_capacity, geo.node_capacity);
    const int row_int4 = static_cast<int>(geo.hidden_bytes / 16);
    int count = 0;  // this call's records: the team's items
    for (int t0 = begin; t0 < end && ok; t0 += window) {
        const int t = t0 + lane;
        uint32_t mask = 0;
        if (lane < window && t < end) {
            const bool* bits = args.is_token_in_rank + static_cast<int64_t>(t) * num_ranks + n * per_node;
            for (int j = 0; j < per_node; ++j) mask |= bits[j] ? 1u << j : 0u;
        }
        const uint32_t needed = __ballot_sync(0xffffffffu, mask != 0u);
        if (leader && args.send_rdma_head != nullptr && lane < window && t < end)
            args.send_rdma_head[static_cast<int64_t>(t) * geo.num_nodes + n] =
                mask != 0u ? count + __popc(needed & lanes_below()) : -1;
        const int batch = __popc(needed);
        if (batch == 0) continue;
        // Space for the whole window; pending records go out first so that the forwarder can return slots.
        const uint32_t needed_head = tail + static_cast<uint32_t>(batch) - static_cast<uint32_t>(geo.rail_capacity);
        if (!seq_geq(head, needed_head)) {
            if (published != tail && publish) {
                ok = team.wait(ctx, count, site);
                if (!ok) break;
                raise_tail();
            }
            published = tail;
            ok = warp_wait_geq(ctx, head_word(channel), needed_head, site, &head);
            if (!ok) break;
        }
        for (int k = team.rank; k < batch; k += team.size) {
            const int source_lane = nth_set_bit(needed, k);
            const int64_t token = t0 + source_lane;
            const uint32_t token_mask = __shfl_sync(0xffffffffu, mask, source_lane);
            const uint32_t seq = tail + static_cast<uint32_t>(k);
            char* slot = put ? own_buffer(ctx) + geo.rail_stage(geo.rail_slot(channel, n, seq))
                             : static_cast<char*>(ctx.buffers[fwd]) + geo.rail_slot(channel, my_node, seq);
            int4* dst = reinterpret_cast<int4*>(slot);
            warp_copy_row<false>(
                reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + token * geo.hidden_bytes), row_int4,
                &dst, 1);
            if (args.x_scales != nullptr) {
                const uint32_t* scales = static_cast<const uint32_t*>(args.x_scales);
                for (int i = lane; i < geo.num_scales; i += 32)
                    reinterpret_cast<uint32_t*>(slot + geo.scales_offset)[i] =
                        scales[token * args.scale_token_stride + i * args.scale_hidden_stride];
            }
            int* meta = reinterpret_cast<int*>(slot + geo.meta_offset);
            if (lane == 0) meta[0] = static_cast<int>(token_mask);
            if (args.topk_idx != nullptr) {
                for (int k2 = lane; k2 < geo.num_topk; k2 += 32) {
                    const int64_t i = token * geo.num_topk + k2;
                    const int64_t e = args.topk_idx_bytes == 8 ? static_cast<const int64_t*>(args.topk_idx)[i]
                                                               : static_cast<const int32_t*>(args.topk_idx)[i];
                    meta[1 + k2] = static_cast<int>(e);
                    meta[1 + geo.num_topk + k2] = __float_as_int(args.topk_weights[i]);
                }
            }
        }
        tail += static_cast<uint32_t>(batch);
        count += batch;
        team.report(count);
        if (static_cast<int>(tail - published) >= args.num_max_rdma_send_tokens) {
            if (publish) {
                ok = team.wait(ctx, count, site);
                if (!ok) break;
                raise_tail();
            }
            published = tail;
        }
    }
    team.report(kTeamDone);
    if (leader) {
        const bool all_done = team.wait(ctx, kTeamDone, site);
        if (ok && all_done && published != tail && publish) raise_tail();
        if (lane == 0) shadows[fused_index(channel, n)] = tail;
    }
}

// Forwarder team of source node n for channel c: rank (n, my local)'s records that need my node, in windows of up
// to 32 consecutive records of the call (the same windows on every warp; lane i loads the mask of the window's record
// i, and a ballot per local rank j gives the window's records for receiver j, held by lane j). Each warp copies whole
// records of a window in turn, each to every local rank of its mask; the leader publishes the node tails and returns
// the rail credits after each window.
static __device__ void fused_forward(const KernelContext& ctx, const FusedGeometry& geo,
                                     const FusedDispatchArgs& args, const Team& team, int channel, int n,
                                     int num_checked) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_channels = geo.num_channels;
    const int my_node = ctx.rank / per_node, src_rank = n * per_node + ctx.rank % per_node;
    char* own = static_cast<char*>(ctx.buffers[ctx.rank]);
    uint32_t* node_heads = buffer_u32(own, kFusedNodeHeadOffset);
    uint32_t* node_tail_shadows = workspace_u32(ctx, kWsFusedNodeTailShadow);
    const bool is_dst_lane = lane < per_node;
    const int pair = n * per_node + lane;  // counter index of (source node n, receiver lane) at this forwarder

    // Drain: the node rings this role wrote in earlier calls (receiver = lane) are consumed.
    bool ok = true;
    if (is_dst_lane) {
        for (int c = channel; c < num_checked && ok; c += num_channels) {
            uint32_t seen;
            const uint32_t target = node_tail_shadows[fused_index(c, pair)];
            if (!seq_geq(ld_relaxed_sys(node_heads + fused_index(c, pair)), target))
                ok = wait_geq(ctx, node_heads + fused_index(c, pair), target,
                              Site{kKernelDispatch, kPhaseDispatchSendDrain, my_node * per_node + lane, c}, &seen);
        }
    }
    ok = __all_sync(0xffffffffu, ok);
    fence_acq_rel_sys();

    const int* prefix = args.recv_rdma_channel_prefix_matrix + n * num_channels;
    const int before = channel > 0 ? prefix[channel - 1] : 0;
    const int num_records = prefix[channel] - before;
    const int64_t first_row = (n > 0 ? args.recv_rdma_rank_prefix_sum[n - 1] : 0) + before;
    uint32_t* rail_heads_shadow = workspace_u32(ctx, kWsFusedRailHeadShadow) + fused_index(channel, n);
    // A put sender raises the rail tail as a signal (after its records are delivered) and gets its credits so.
    const int64_t tail_signal = kFusedRailTailSignalOffset + 8LL * fused_node_index(channel, n);
    const int64_t credit_signal = kFusedRailHeadSignalOffset + 8LL * fused_node_index(channel, my_node);
    const uint32_t* rail_tail =
        raised_word(ctx, buffer_u32(own, kFusedRailTailOffset) + fused_index(channel, n), tail_signal, src_rank);
    uint32_t* credit = is_put_peer(ctx, src_rank)
                           ? nullptr
                           : buffer_u32(ctx.buffers[src_rank], kFusedRailHeadOffset) + fused_index(channel, my_node);
    uint32_t rail_head = *rail_heads_shadow;
    // Lane j < G: node ring (channel, src_rank) at receiver (my node, j).
    uint32_t node_tail = is_dst_lane ? node_tail_shadows[fused_index(channel, pair)] : 0;
    uint32_t node_head = node_tail;
    uint32_t* remote_node_tail =
        is_dst_lane ? buffer_u32(ctx.buffers[my_node * per_node + lane], kFusedNodeTailOffset) +
                          fused_index(channel, src_rank)
                    : nullptr;
    int seq = 0;  // lane j < G: this call's records to receiver j
    const bool leader = team.leader(), publish = !ctx.skip_sends && leader;
    const Site site{kKernelDispatch, kPhaseDispatchRecvWaitTail, src_rank, channel};
    const int window = fused_window(geo.rail_capacity, geo.node_capacity);
    const int record_int4 = static_cast<int>(geo.record_bytes / 16);

    for (int done = 0; done < num_records && ok;) {
        const int batch = min(window, num_records - done);
        uint32_t seen;
        ok = warp_wait_geq(ctx, rail_tail, rail_head + static_cast<uint32_t>(batch), site, &seen);
        if (!ok) break;
        if (lane == 0) after_raised(ctx, tail_signal, src_rank);
        __syncwarp();
        const uint32_t mask =
            lane < batch ? static_cast<uint32_t>(ld_ring_int(reinterpret_cast<const int*>(
                               own + geo.rail_slot(channel, n, rail_head + static_cast<uint32_t>(lane)) +
                               geo.meta_offset)))
                         : 0u;
        uint32_t bits = 0;  // lane j < G: the window's records that go to receiver j
        for (int j = 0; j < per_node; ++j) {
            const uint32_t b = __ballot_sync(0xffffffffu, ((mask >> j) & 1u) != 0u);
            if (lane == j) bits = b;
        }
        if (leader && args.send_nvl_head != nullptr) {
            int* out = lane < batch ? args.send_nvl_head + (first_row + done + lane) * kMaxGpusPerNode : nullptr;
            for (int j = 0; j < kMaxGpusPerNode; ++j) {
                const int from = j < per_node ? j : 0;
                const uint32_t of_j = __shfl_sync(0xffffffffu, bits, from);
                const int seq_j = __shfl_sync(0xffffffffu, seq, from);
                if (out != nullptr)
                    out[j] = j < per_node && ((mask >> j) & 1u) != 0u ? seq_j + __popc(of_j & lanes_below()) : -1;
            }
        }
        // Space in every destination ring for the whole window (the previous windows' tails are published).
        const uint32_t needed_head =
            node_tail + static_cast<uint32_t>(__popc(bits)) - static_cast<uint32_t>(geo.node_capacity);
        if (is_dst_lane && bits != 0u && !seq_geq(node_head, needed_head)) {
            uint32_t head_seen;
            ok = wait_geq(ctx, node_heads + fused_index(channel, pair), needed_head,
                          Site{kKernelDispatch, kPhaseDispatchSendWaitHead, my_node * per_node + lane, channel},
                          &head_seen);
            node_head = head_seen;
        }
        ok = __all_sync(0xffffffffu, ok);
        if (!ok) break;
        for (int k = team.rank; k < batch; k += team.size) {
            const uint32_t record_mask = __shfl_sync(0xffffffffu, mask, k);
            const char* record = own + geo.rail_slot(channel, n, rail_head + static_cast<uint32_t>(k));
            int4* dsts[kMaxGpusPerNode];
            int num_dsts = 0;
            for (int j = 0; j < per_node; ++j) {
                const uint32_t position =
                    __shfl_sync(0xffffffffu, node_tail + static_cast<uint32_t>(__popc(bits & ((1u << k) - 1u))), j);
                if ((record_mask >> j) & 1u)
                    dsts[num_dsts++] = reinterpret_cast<int4*>(static_cast<char*>(ctx.buffers[my_node * per_node + j]) +
                                                               geo.node_slot(channel, src_rank, position));
            }
            warp_copy_row<true>(reinterpret_cast<const int4*>(record), record_int4, dsts, num_dsts);
        }
        const uint32_t published = node_tail;
        if (is_dst_lane) {
            node_tail += static_cast<uint32_t>(__popc(bits));
            seq += __popc(bits);
        }
        rail_head += static_cast<uint32_t>(batch);
        done += batch;
        team.report(done);
        // The window is copied out by every warp: its node tails go out and its rail slots go back to the sender.
        if (leader) {
            ok = team.wait(ctx, done, site);
            if (!ok) break;
            if (is_dst_lane && published != node_tail && publish) {
                fence_acq_rel_sys();
                st_release_sys(remote_node_tail, node_tail);
            }
            warp_raise(ctx, credit, credit_signal, src_rank, rail_head);
        }
    }
    team.report(kTeamDone);
    if (leader) {
        team.wait(ctx, kTeamDone, site);
        if (lane == 0) *rail_heads_shadow = rail_head;
        if (is_dst_lane) node_tail_shadows[fused_index(channel, pair)] = node_tail;
    }
}

// Receiver team of source rank s for channel c: record i of the call goes to warp i % size, whole, whatever part of
// the ring a warp sees published at once; the leader returns the node credits after each batch.
static __device__ void fused_receive(const KernelContext& ctx, const FusedGeometry& geo,
                                     const FusedDispatchArgs& args, const Team& team, int channel, int s) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_channels = geo.num_channels;
    const int my_node = ctx.rank / per_node, src_node = s / per_node;
    const int fwd = my_node * per_node + s % per_node;
    char* own = static_cast<char*>(ctx.buffers[ctx.rank]);
    const int first_row = args.recv_gbl_channel_prefix_matrix[s * num_channels + channel];
    const int end_row = channel + 1 < num_channels ? args.recv_gbl_channel_prefix_matrix[s * num_channels + channel + 1]
                                                   : args.recv_gbl_rank_prefix_sum[s];
    if (end_row > args.num_recv_rows) {
        if (team.leader() && lane == 0)
            report_error(ctx, kErrorBadRouting, Site{kKernelDispatch, kPhaseDispatchWorstOverflow, s, channel},
                         args.num_recv_rows, end_row, 0);
        return;
    }
    const int num_local_experts = args.num_experts / ctx.num_ranks;
    const int expert_begin = ctx.rank * num_local_experts;
    uint32_t* head_shadow = workspace_u32(ctx, kWsFusedNodeHeadShadow) + fused_index(channel, s);
    const uint32_t* tail = buffer_u32(own, kFusedNodeTailOffset) + fused_index(channel, s);
    uint32_t* remote_head = buffer_u32(ctx.buffers[fwd], kFusedNodeHeadOffset) +
                            fused_index(channel, src_node * per_node + ctx.rank % per_node);
    uint32_t head = *head_shadow;
    const bool leader = team.leader();
    const Site site{kKernelDispatch, kPhaseDispatchRecvWaitTail, fwd, channel};
    const int row_int4 = static_cast<int>(geo.hidden_bytes / 16);
    bool ok = true;
    for (int row = first_row; row < end_row && ok;) {
        uint32_t seen;
        ok = warp_wait_geq(ctx, tail, head + 1, site, &seen);
        if (!ok) break;
        const int available = min(static_cast<int>(seen - head), end_row - row);
        // Record i of the call (row first_row + i) is warp i % size's, whatever batches a warp sees.
        const int skip = (team.rank - (row - first_row) % team.size + team.size) % team.size;
        for (int k = skip; k < available; k += team.size) {
            const char* record = own + geo.node_slot(channel, s, head + static_cast<uint32_t>(k));
            const int64_t r = row + k;
            int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.recv_x) + r * geo.hidden_bytes);
            warp_copy_row<true>(reinterpret_cast<const int4*>(record), row_int4, &dst, 1);
            if (args.recv_x_scales != nullptr) {
                for (int i = lane; i < geo.num_scales; i += 32)
                    reinterpret_cast<int*>(args.recv_x_scales)[r * geo.num_scales + i] =
                        ld_ring_int(reinterpret_cast<const int*>(record + geo.scales_offset) + i);
            }
            const int* meta = reinterpret_cast<const int*>(record + geo.meta_offset);
            if (args.recv_src_meta != nullptr && lane == 0) {
                args.recv_src_meta[2 * r] = src_node;
                args.recv_src_meta[2 * r + 1] = ld_ring_int(meta);
            }
            if (args.recv_topk_idx != nullptr) {
                for (int i = lane; i < geo.num_topk; i += 32) {
                    const int e = ld_ring_int(meta + 1 + i);
                    const float w = __int_as_float(ld_ring_int(meta + 1 + geo.num_topk + i));
                    const bool mine = e >= expert_begin && e < expert_begin + num_local_experts;
                    const int64_t at = r * geo.num_topk + i;
                    const int local = mine ? e - expert_begin : -1;
                    if (args.topk_idx_bytes == 8)
                        static_cast<int64_t*>(args.recv_topk_idx)[at] = local;
                    else
                        static_cast<int32_t*>(args.recv_topk_idx)[at] = local;
                    args.recv_topk_weights[at] = mine ? w : 0.0f;
                }
            }
        }
        row += available;
        head += static_cast<uint32_t>(available);
        team.report(row - first_row);
        // Every warp has copied the batch out: its slots go back to the forwarder.
        if (leader) {
            ok = team.wait(ctx, row - first_row, site);
            if (!ok) break;
            warp_publish(remote_head, head);
        }
    }
    team.report(kTeamDone);
    if (leader) {
        team.wait(ctx, kTeamDone, site);
        if (lane == 0) *head_shadow = head;
    }
}

// ---- agreement of a checked call (a cached dispatch or a combine; signature_hash != 0) ----
// Byte offset of source `source`'s agreement word of checked call `call_number` (the same in every rank's buffer).
__device__ __forceinline__ int64_t fused_agreement_offset(int source, uint32_t call_number) {
    return kFusedAgreementOffset + 8LL * ((call_number & 1u) * kFusedMaxRanks + source);
}

// CTA 0, thread d: this rank's word of the call (call number, signature hash) into rank d's buffer, at kernel start
// and before anything waits: a release store for a pointer peer, an NVSHMEM signal for a put peer. The slot of the
// call's parity is free: every rank's kernel of the checked call two calls back has finished, since each rank
// started its previous checked call only after every rank had started its own (each waits for every word), and
// every checked call of a rank runs on one stream.
__device__ __forceinline__ void publish_fused_agreement(const KernelContext& ctx, uint32_t call_number,
                                                        uint32_t signature_hash) {
    const int d = static_cast<int>(threadIdx.x);
    if (blockIdx.x != 0 || d >= ctx.num_ranks || d == ctx.rank) return;
    const int64_t offset = fused_agreement_offset(ctx.rank, call_number);
    const uint64_t word = (static_cast<uint64_t>(call_number) << 32) | signature_hash;
    if (is_put_peer(ctx, d))
        fused_signal(ctx, offset, d, word);
    else
        st_release_sys_u64(reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.buffers[d]) + offset), word);
}

// One warp per CTA: lane l waits for the words of ranks l, l + 32 of this call and the warp compares every rank's
// hash with this rank's. Every rank compares the same hashes, so every rank reaches the same verdict: if they are
// not all equal, every rank has one whose hash differs from its own. A difference fills the error record
// (kErrorArgumentMismatch in `phase`, the first differing rank, both hashes; no abort). The last CTA to compare
// counts the call and, with host_verdict, publishes the call's call_seq. Returns whether rows may move (the hashes
// agree and every word came).
static __device__ __noinline__ bool fused_agreement(const KernelContext& ctx, uint32_t call_number,
                                                    uint32_t signature_hash, int64_t* host_verdict, int32_t kernel,
                                                    int32_t wait_phase, int32_t phase) {
    const int lane = lane_id();
    bool ok = true;
    int first = kFusedMaxRanks;  // this lane's first rank whose hash differs
    uint32_t first_hash = signature_hash;
    for (int s = lane; s < ctx.num_ranks && ok; s += 32) {
        if (s == ctx.rank) continue;
        const uint64_t* word =
            reinterpret_cast<const uint64_t*>(own_buffer(ctx) + fused_agreement_offset(s, call_number));
        uint32_t seen;
        ok = wait_geq(ctx, reinterpret_cast<const uint32_t*>(word) + 1, call_number,  // the call number half
                      Site{kernel, wait_phase, s, static_cast<int>(blockIdx.x)}, &seen);
        const uint32_t hash = ok ? static_cast<uint32_t>(ld_acquire_sys_u64(word)) : signature_hash;
        if (hash != signature_hash && first == kFusedMaxRanks) {
            first = s;
            first_hash = hash;
        }
    }
    const bool all_ok = __all_sync(0xffffffffu, ok);
    const int first_all = warp_min(first);
    const uint32_t their_hash = __shfl_sync(0xffffffffu, first_hash, first_all % 32);
    const bool differ = first_all < kFusedMaxRanks;
    if (lane == 0) {
        if (all_ok && differ)
            fill_error_record(ctx.error, workspace_u32(ctx, kWsErrorClaimOffset), kErrorArgumentMismatch, kernel,
                              phase, ctx.rank, first_all, static_cast<int>(blockIdx.x), ctx.call_seq, signature_hash,
                              their_hash, 0);
        publish_agreement_verdict(ctx, host_verdict, gridDim.x, call_number);
    }
    return all_ok && !differ;
}

// Every thread of a CTA of a checked call (signature_hash != 0): number the call (checked_call_number), publish
// this rank's word, compare every rank's (the first warp), and return whether rows may move (true for an unchecked
// call). `shared`: two words of the CTA's shared memory. Ends with the CTA synchronised.
__device__ __forceinline__ bool fused_rows_move(const KernelContext& ctx, uint32_t signature_hash,
                                                int64_t* host_verdict, int32_t kernel, int32_t wait_phase,
                                                int32_t phase, volatile uint32_t* shared) {
    if (signature_hash == 0u) return true;
    if (threadIdx.x == 0) shared[0] = checked_call_number(ctx);
    __syncthreads();
    const uint32_t call_number = shared[0];
    publish_fused_agreement(ctx, call_number, signature_hash);
    if (threadIdx.x < 32) {
        const bool holds = fused_agreement(ctx, call_number, signature_hash, host_verdict, kernel, wait_phase, phase);
        if (threadIdx.x == 0) shared[1] = holds ? 1u : 0u;
    }
    __syncthreads();
    return shared[1] != 0u;
}

__global__ void __launch_bounds__(kChannelThreads, 1)
    fused_dispatch_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ FusedGeometry geo,
                          const __grid_constant__ FusedDispatchArgs args) {
    // A non-cached call whose notify saw the ranks' signatures differ moves no row (every rank skips alike); nor
    // does a checked cached call unless every rank's hash of this call is this rank's.
    if (args.agreement_gate && *workspace_u32(ctx, kWsNotifyMismatchOffset) != 0u) return;
    __shared__ int team_progress[kChannelWarps];
    __shared__ uint32_t agreement[2];
    if (!fused_rows_move(ctx, args.signature_hash, args.host_verdict, kKernelDispatch, kPhaseDispatchWaitAgreement,
                         kPhaseDispatchAgreement, agreement))
        return;
    reset_teams(team_progress);
    const int channel = static_cast<int>(blockIdx.x) / 2, warp = static_cast<int>(threadIdx.x) / 32;
    const int num_nodes = geo.num_nodes;
    int role;
    if ((blockIdx.x & 1u) == 0) {
        int num_checked = 0;
        if (lane_id() == 0) num_checked = raise_max_channels(ctx, kWsFusedMaxChannels, geo.num_channels);
        num_checked = __shfl_sync(0xffffffffu, num_checked, 0);
        // Up to 16 nodes, teams 0 .. N-1 send to node n and teams N .. 2N-1 forward from node n - N. Past 16 nodes,
        // the first half of the warps send, the second half forward, each warp serving its nodes in ascending order
        // (make_roles): rail connection (m, n) waits on (m, n - 16) through its sender's warp and on (m - 16, n)
        // through its forwarder's. One call site per role keeps the kernel's registers to one copy of each.
        bool sends;
        int stride;
        Team team;
        if (2 * num_nodes <= kChannelWarps) {
            team = make_team(team_progress, warp, kChannelWarps, 2 * num_nodes, &role);
            sends = role < num_nodes;
            role = sends ? role : role - num_nodes;
            stride = num_nodes;
        } else {
            constexpr int kHalf = kChannelWarps / 2;
            const int in_half = warp % kHalf;
            team = make_roles(team_progress + (warp - in_half), in_half, kHalf, num_nodes, &role, &stride);
            sends = warp < kHalf;
        }
        for (int n = role; n < num_nodes; n += stride) {
            if (sends)
                fused_send(ctx, geo, args, team, channel, n, num_checked);
            else
                fused_forward(ctx, geo, args, team, channel, n, num_checked);
        }
        return;
    }
    // Each channel's last warp first fills its share of the worst-token tail (no waits); then team s receives from
    // source rank s.
    if (warp == kChannelWarps - 1 && args.worst_token_mode && args.recv_topk_idx != nullptr) {
        const int real_rows = args.recv_gbl_rank_prefix_sum[ctx.num_ranks - 1];
        for (int64_t i = static_cast<int64_t>(real_rows) * geo.num_topk + channel * 32 + lane_id();
             i < static_cast<int64_t>(args.num_recv_rows) * geo.num_topk; i += 32 * geo.num_channels) {
            if (args.topk_idx_bytes == 8)
                static_cast<int64_t*>(args.recv_topk_idx)[i] = -1;
            else
                static_cast<int32_t*>(args.recv_topk_idx)[i] = -1;
            args.recv_topk_weights[i] = 0.0f;
        }
    }
    int stride;
    const Team team = make_roles(team_progress, warp, kChannelWarps, ctx.num_ranks, &role, &stride);
    for (int s = role; s < ctx.num_ranks; s += stride) fused_receive(ctx, geo, args, team, channel, s);
}

// ---------------------------------------------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------------------------------------------

// Row-interleaved teams (the combine roles): warp w of a team of T handles items w, w + T, w + 2T, ... whole, and
// keeps progress[w] at the next item it will handle, so every item below the team's minimum progress is finished.
// Only the leader publishes (tails, credits), non-blocking, from that minimum; it does so after its own items and
// inside every spin of its waits, so a teammate's wait on a peer (which may need those publications) always ends.

// This warp's progress: every item of it below `next` is finished; the warp's stores come first (CTA scope).
__device__ __forceinline__ void team_progress(const Team& team, int next) {
    release_progress(team.progress, team.rank, next);
}

// Leader, whole warp: the items the whole team has finished (a prefix), with their stores visible to this warp.
__device__ __forceinline__ int team_finished(const Team& team, int num_items) {
    const int lane = lane_id();
    const int p = warp_min(lane < team.size ? min(team.progress[lane], num_items) : num_items);
    __syncwarp();  // the lanes that read the progress words come before lane 0's publication
    __threadfence_block();
    return p;
}

// Whole warp: every lane with `word` != nullptr sees *word >= target (cached in *cache). While some lane does not,
// the leader calls flush() between polls. Bounded like wait_geq; a lane's failure is reported at its `site`.
template <typename Flush>
__device__ __forceinline__ bool team_wait_geq(const KernelContext& ctx, const uint32_t* word, uint32_t target,
                                              const Site& site, uint32_t* cache, bool leader, Flush&& flush) {
    bool pending = word != nullptr && !seq_geq(*cache, target);
    if (pending) {
        *cache = ld_acquire_sys(word);
        pending = !seq_geq(*cache, target);
    }
    if (!__any_sync(0xffffffffu, pending)) {
        __syncwarp();  // the waiting lanes' acquire orders every lane's reads that follow
        return true;
    }
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 1;; ++spins) {
        if (leader) flush();
        if (pending) {
            const uint32_t value = ld_relaxed_sys(word);
            if (seq_geq(value, target)) {
                *cache = ld_acquire_sys(word);
                pending = false;
            }
        }
        if (!__any_sync(0xffffffffu, pending)) {
            __syncwarp();
            return true;
        }
        const bool failed =
            (spins & 63) == 0 && pending && spin_expired(ctx, start, site, target, ld_relaxed_sys(word));
        if (__any_sync(0xffffffffu, failed)) return false;
        if (spins > 256) __nanosleep(128);
    }
}

// Leader, whole warp, after its own items: publishes until the whole team has finished `num_items` (bounded).
template <typename Flush>
__device__ __forceinline__ bool team_drain(const KernelContext& ctx, const Team& team, int num_items,
                                           const Site& site, Flush&& flush) {
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 1;; ++spins) {
        const int finished = team_finished(team, num_items);
        flush(true);  // publishes at least `finished`
        if (finished >= num_items) return true;
        const bool failed = (spins & 63) == 0 && lane_id() == 0 && spin_expired(ctx, start, site, num_items, finished);
        if (__any_sync(0xffffffffu, failed)) return false;
        if (spins > 256) __nanosleep(128);
    }
}

// One warp: out = bf16(bias_0 + bias_1 + srcs[0] + srcs[1] + ...) over n int4, summed in fp32 in that order (absent
// biases skipped), kU int4 of two sources in flight per lane. Sources are ring slots written by peers. Not inlined:
// inside the combine kernel's 64-register budget the loaded chunks would be spilled.
template <int kU>
static __device__ __noinline__ void reduce_row(const int4* const* srcs, int num_srcs, const int4* bias_0,
                                               const int4* bias_1, int4* out, int n) {
    for (int base = lane_id(); base < n; base += 32 * kU) {
        float acc[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
        if (bias_0 != nullptr)
#pragma unroll
            for (int u = 0; u < kU; ++u)
                if (base + u * 32 < n) add_bf16x8(acc[u], ld_nc_int4(bias_0 + base + u * 32));
        if (bias_1 != nullptr)
#pragma unroll
            for (int u = 0; u < kU; ++u)
                if (base + u * 32 < n) add_bf16x8(acc[u], ld_nc_int4(bias_1 + base + u * 32));
        for (int k = 0; k < num_srcs; k += 2) {
            const bool two = k + 1 < num_srcs;
            int4 a[kU], b[kU];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                if (base + u * 32 >= n) continue;
                a[u] = ld_ring_int4(srcs[k] + base + u * 32);
                if (two) b[u] = ld_ring_int4(srcs[k + 1] + base + u * 32);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                if (base + u * 32 >= n) continue;
                add_bf16x8(acc[u], a[u]);
                if (two) add_bf16x8(acc[u], b[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u)
            if (base + u * 32 < n) st_na_int4(out + base + u * 32, pack_bf16x8(acc[u]));
    }
}

// Sending team of source rank s for channel c: my rows of (s, c) back to the forwarder (my node, local of s), each
// warp whole rows in turn (row-interleaved team).
static __device__ void fused_combine_send(const KernelContext& ctx, const FusedGeometry& geo,
                                          const FusedCombineArgs& args, const Team& team, int channel, int s,
                                          int num_checked) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_channels = geo.num_channels;
    const int my_node = ctx.rank / per_node, my_local = ctx.rank % per_node;
    const int fwd = my_node * per_node + s % per_node, ring = (s / per_node) * per_node + my_local;
    uint32_t* heads = buffer_u32(ctx.buffers[ctx.rank], kFusedCombineNodeHeadOffset);
    uint32_t* shadows = workspace_u32(ctx, kWsFusedCombineNodeTailShadow);
    bool ok = true;
    for (int c = channel; c < num_checked && ok; c += num_channels) {
        uint32_t seen;
        ok = warp_wait_geq(ctx, heads + fused_index(c, s), shadows[fused_index(c, s)],
                           Site{kKernelCombine, kPhaseCombineSendDrain, fwd, c}, &seen);
    }
    fence_acq_rel_sys();
    const int first_row = args.recv_gbl_channel_prefix_matrix[s * num_channels + channel];
    const int end_row = channel + 1 < num_channels ? args.recv_gbl_channel_prefix_matrix[s * num_channels + channel + 1]
                                                   : args.recv_gbl_rank_prefix_sum[s];
    const int num_rows = end_row - first_row;
    const uint32_t tail0 = shadows[fused_index(channel, s)];
    uint32_t head = tail0;
    int published = 0;
    uint32_t* remote_tail = buffer_u32(ctx.buffers[fwd], kFusedCombineNodeTailOffset) + fused_index(channel, ring);
    const bool leader = team.leader(), publish = !ctx.skip_sends;
    const Site site{kKernelCombine, kPhaseCombineSendWaitHead, fwd, channel};
    // Leader: the finished prefix's tail to the forwarder, at least a chunk apart unless `force`.
    auto flush = [&](bool force = false) {
        const int finished = team_finished(team, num_rows);
        if (finished > published && (force || finished - published >= args.num_max_nvl_send_tokens)) {
            if (publish) warp_publish(remote_tail, tail0 + static_cast<uint32_t>(finished));
            published = finished;
        }
    };
    const int row_int4 = static_cast<int>(geo.hidden_bytes / 16);
    team_progress(team, min(team.rank, num_rows));
    for (int i = team.rank; i < num_rows && ok; i += team.size) {
        const uint32_t needed_head = tail0 + static_cast<uint32_t>(i) + 1 - static_cast<uint32_t>(geo.node_capacity);
        ok = team_wait_geq(ctx, lane == 0 ? heads + fused_index(channel, s) : nullptr, needed_head, site, &head,
                           leader, [&] { flush(true); });
        if (!ok) break;
        head = __shfl_sync(0xffffffffu, head, 0);
        const int row = first_row + i;
        char* slot = static_cast<char*>(ctx.buffers[fwd]) + geo.node_slot(channel, ring, tail0 + static_cast<uint32_t>(i));
        int4* dst = reinterpret_cast<int4*>(slot);
        warp_copy_row<false>(reinterpret_cast<const int4*>(static_cast<const char*>(args.x) + row * geo.hidden_bytes),
                             row_int4, &dst, 1);
        if (args.topk_weights != nullptr)
            for (int k = lane; k < geo.num_topk; k += 32)
                reinterpret_cast<float*>(slot + geo.meta_offset)[k] =
                    args.topk_weights[static_cast<int64_t>(row) * geo.num_topk + k];
        team_progress(team, min(i + team.size, num_rows));
        if (leader) flush();
    }
    if (leader) {
        ok = team_drain(ctx, team, num_rows, site, flush) && ok;
        if (lane == 0) shadows[fused_index(channel, s)] = tail0 + static_cast<uint32_t>(published);
    }
}

// Forwarder team of source node n for channel c: each forwarded token's rows from the local ranks of its mask,
// summed in fp32 in ascending local order, rounded to BF16 once, to the owner (n, my local). Each warp reduces whole
// records in turn (row-interleaved team); the leader returns node credits and publishes the rail tail.
static __device__ void fused_combine_forward(const KernelContext& ctx, const FusedGeometry& geo,
                                             const FusedCombineArgs& args, const Team& team, int channel, int n,
                                             int num_checked) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_channels = geo.num_channels;
    const int my_node = ctx.rank / per_node, owner = n * per_node + ctx.rank % per_node;
    char* own = static_cast<char*>(ctx.buffers[ctx.rank]);
    // A put owner: partials go to my staging of my rail ring (c, n) and are put as runs into its ring (c, my node)
    // when the tail is published; its credits arrive as signals.
    const bool put = is_put_peer(ctx, owner);
    auto head_word = [&](int c) {
        return raised_word(ctx, buffer_u32(own, kFusedCombineRailHeadOffset) + fused_index(c, n),
                           kFusedCombineRailHeadSignalOffset + 8LL * fused_node_index(c, n), owner);
    };
    uint32_t* rail_shadows = workspace_u32(ctx, kWsFusedCombineRailTailShadow);
    bool ok = true;
    for (int c = channel; c < num_checked && ok; c += num_channels) {
        uint32_t seen;
        ok = warp_wait_geq(ctx, head_word(c), rail_shadows[fused_index(c, n)],
                           Site{kKernelCombine, kPhaseCombineSendDrain, owner, c}, &seen);
    }
    fence_acq_rel_sys();
    const int* prefix = args.recv_rdma_channel_prefix_matrix + n * num_channels;
    const int before = channel > 0 ? prefix[channel - 1] : 0;
    const int num_records = prefix[channel] - before;
    const int64_t first_row = (n > 0 ? args.recv_rdma_rank_prefix_sum[n - 1] : 0) + before;

    // Lane j < G: node ring (channel, n * G + j) here, written by local rank j.
    const bool is_src_lane = lane < per_node;
    const int pair = n * per_node + lane;
    uint32_t* node_head_shadows = workspace_u32(ctx, kWsFusedCombineNodeHeadShadow);
    const uint32_t base = is_src_lane ? node_head_shadows[fused_index(channel, pair)] : 0;
    const uint32_t* node_tail = is_src_lane ? buffer_u32(own, kFusedCombineNodeTailOffset) + fused_index(channel, pair)
                                            : nullptr;
    uint32_t* remote_node_head = is_src_lane ? buffer_u32(ctx.buffers[my_node * per_node + lane],
                                                          kFusedCombineNodeHeadOffset) + fused_index(channel, owner)
                                             : nullptr;
    uint32_t tail_cache = base, consumed = 0, released = 0;
    const uint32_t rail_tail0 = rail_shadows[fused_index(channel, n)];
    uint32_t rail_head = rail_tail0;
    int published = 0, scanned = 0;
    uint32_t* remote_rail_tail =
        put ? nullptr : buffer_u32(ctx.buffers[owner], kFusedCombineRailTailOffset) + fused_index(channel, my_node);
    const int64_t tail_signal = kFusedCombineRailTailSignalOffset + 8LL * fused_node_index(channel, my_node);
    const bool leader = team.leader(), publish = !ctx.skip_sends;
    const Site site{kKernelCombine, kPhaseCombineSendWaitHead, owner, channel};
    // Leader: the finished prefix's rail tail to the owner and its node slots back to the local senders, at least a
    // chunk apart unless `force`.
    auto flush = [&](bool force = false) {
        const int finished = team_finished(team, num_records);
        if (finished <= published || (!force && finished - published < args.num_max_rdma_send_tokens)) return;
        for (; scanned < finished; ++scanned) {
            const int index = is_src_lane ? args.send_nvl_head[(first_row + scanned) * kMaxGpusPerNode + lane] : -1;
            if (index >= 0) consumed = static_cast<uint32_t>(index) + 1;
        }
        if (put && publish) {
            fused_put_run(ctx, geo, channel, n, my_node, rail_tail0 + static_cast<uint32_t>(published),
                          rail_tail0 + static_cast<uint32_t>(finished), owner, tail_signal);
        } else if (lane == 0 && publish) {
            fence_acq_rel_sys();
            st_release_sys(remote_rail_tail, rail_tail0 + static_cast<uint32_t>(finished));
        }
        if (is_src_lane && released != consumed) {
            fence_acq_rel_sys();
            st_release_sys(remote_node_head, base + consumed);
            released = consumed;
        }
        published = finished;
        __syncwarp();
    };
    const int row_int4 = static_cast<int>(geo.hidden_bytes / 16);
    team_progress(team, min(team.rank, num_records));
    for (int i = team.rank; i < num_records && ok; i += team.size) {
        const int64_t f = first_row + i;
        const int index = is_src_lane ? args.send_nvl_head[f * kMaxGpusPerNode + lane] : -1;
        const uint32_t mask = __ballot_sync(0xffffffffu, index >= 0);
        // The rows of every local rank in the mask are here.
        ok = team_wait_geq(ctx, index >= 0 ? node_tail : nullptr, base + static_cast<uint32_t>(index) + 1,
                           Site{kKernelCombine, kPhaseCombineRecvWaitTail, my_node * per_node + lane, channel},
                           &tail_cache, leader, [&] { flush(true); });
        if (!ok) break;
        // Room in the owner's rail ring.
        const uint32_t needed_head = rail_tail0 + static_cast<uint32_t>(i) + 1 - static_cast<uint32_t>(geo.rail_capacity);
        ok = team_wait_geq(ctx, lane == 0 ? head_word(channel) : nullptr, needed_head, site, &rail_head, leader,
                           [&] { flush(true); });
        if (!ok) break;
        rail_head = __shfl_sync(0xffffffffu, rail_head, 0);
        const int4* srcs[kMaxGpusPerNode];
        int num_srcs = 0;
        for (int j = 0; j < per_node; ++j) {
            const int position = __shfl_sync(0xffffffffu, index, j);
            const uint32_t ring_base = __shfl_sync(0xffffffffu, base, j);
            if ((mask >> j) & 1u)
                srcs[num_srcs++] = reinterpret_cast<const int4*>(
                    own + geo.node_slot(channel, n * per_node + j, ring_base + static_cast<uint32_t>(position)));
        }
        const uint32_t seq = rail_tail0 + static_cast<uint32_t>(i);
        char* slot = put ? own_buffer(ctx) + geo.rail_stage(geo.rail_slot(channel, n, seq))
                         : static_cast<char*>(ctx.buffers[owner]) + geo.rail_slot(channel, my_node, seq);
        reduce_row<2>(srcs, num_srcs, nullptr, nullptr, reinterpret_cast<int4*>(slot), row_int4);
        if (args.topk_weights != nullptr) {
            for (int k = lane; k < geo.num_topk; k += 32) {
                float w = 0.f;
                for (int q = 0; q < num_srcs; ++q)
                    w += __int_as_float(ld_ring_int(reinterpret_cast<const int*>(
                        reinterpret_cast<const char*>(srcs[q]) + geo.meta_offset) + k));
                reinterpret_cast<float*>(slot + geo.meta_offset)[k] = w;
            }
        }
        team_progress(team, min(i + team.size, num_records));
        if (leader) flush();
    }
    if (leader) {
        ok = team_drain(ctx, team, num_records, site, flush) && ok;
        if (lane == 0) rail_shadows[fused_index(channel, n)] = rail_tail0 + static_cast<uint32_t>(published);
        if (is_src_lane) node_head_shadows[fused_index(channel, pair)] = base + released;
    }
}

// Owner team for channel c: my tokens' node partials in ascending node order, after the biases; each warp reduces
// whole tokens in turn (row-interleaved team); the leader returns the rail slots to the forwarders.
static __device__ void fused_combine_own(const KernelContext& ctx, const FusedGeometry& geo,
                                         const FusedCombineArgs& args, const Team& team, int channel) {
    const int lane = lane_id(), per_node = geo.gpus_per_node, num_nodes = geo.num_nodes;
    const int my_node = ctx.rank / per_node, my_local = ctx.rank % per_node;
    char* own = static_cast<char*>(ctx.buffers[ctx.rank]);
    // Lane n < N: rail ring (channel, n) here, written by the forwarder (n, my local).
    // A put forwarder raises the rail tail as a signal (after its partials are delivered) and gets its credits so.
    const bool is_node_lane = lane < num_nodes;
    const int forwarder = lane * per_node + my_local;
    const bool put = is_node_lane && is_put_peer(ctx, forwarder);
    const int64_t tail_signal = kFusedCombineRailTailSignalOffset + 8LL * fused_node_index(channel, lane);
    const int64_t credit_signal = kFusedCombineRailHeadSignalOffset + 8LL * fused_node_index(channel, my_node);
    uint32_t* head_shadows = workspace_u32(ctx, kWsFusedCombineRailHeadShadow);
    const uint32_t base = is_node_lane ? head_shadows[fused_index(channel, lane)] : 0;
    const uint32_t* rail_tail =
        is_node_lane ? raised_word(ctx, buffer_u32(own, kFusedCombineRailTailOffset) + fused_index(channel, lane),
                                   tail_signal, forwarder)
                     : nullptr;
    uint32_t* remote_head = is_node_lane && !put ? buffer_u32(ctx.buffers[forwarder], kFusedCombineRailHeadOffset) +
                                                       fused_index(channel, my_node)
                                                 : nullptr;
    uint32_t tail_cache = base, consumed = 0, released = 0;
    const bool leader = team.leader();
    const Site site{kKernelCombine, kPhaseCombineRecvWaitTail, -1, channel};
    int begin, end;
    channel_range(args.num_tokens, geo.num_channels, channel, &begin, &end);
    const int num_items = end - begin;
    int published = 0;
    // Leader: the rail slots of the finished prefix back to the forwarders, at least a chunk apart unless `force`.
    auto flush = [&](bool force = false) {
        const int finished = team_finished(team, num_items);
        if (finished <= published || (!force && finished - published < args.num_max_rdma_send_tokens)) return;
        for (; published < finished; ++published) {
            const int index = is_node_lane
                ? args.send_rdma_head[static_cast<int64_t>(begin + published) * num_nodes + lane] : -1;
            if (index >= 0) consumed = static_cast<uint32_t>(index) + 1;
        }
        if (is_node_lane && released != consumed) {
            if (put) {
                fused_signal(ctx, credit_signal, forwarder, base + consumed);
            } else {
                fence_acq_rel_sys();
                st_release_sys(remote_head, base + consumed);
            }
            released = consumed;
        }
        __syncwarp();
    };
    const int row_int4 = static_cast<int>(geo.hidden_bytes / 16);
    bool ok = true;
    team_progress(team, min(team.rank, num_items));
    for (int i = team.rank; i < num_items && ok; i += team.size) {
        const int t = begin + i;
        const int index = is_node_lane ? args.send_rdma_head[static_cast<int64_t>(t) * num_nodes + lane] : -1;
        const uint32_t mask = __ballot_sync(0xffffffffu, index >= 0);
        ok = team_wait_geq(ctx, index >= 0 ? rail_tail : nullptr, base + static_cast<uint32_t>(index) + 1,
                           Site{kKernelCombine, kPhaseCombineRecvWaitTail, lane * per_node + my_local, channel},
                           &tail_cache, leader, [&] { flush(true); });
        if (!ok) break;
        if (put && index >= 0) after_raised(ctx, tail_signal, forwarder);
        const int4* srcs[kFusedMaxNodes];
        int num_srcs = 0;
        for (int m = 0; m < num_nodes; ++m) {
            const int position = __shfl_sync(0xffffffffu, index, m);
            const uint32_t node_base = __shfl_sync(0xffffffffu, base, m);
            if ((mask >> m) & 1u)
                srcs[num_srcs++] = reinterpret_cast<const int4*>(
                    own + geo.rail_slot(channel, m, node_base + static_cast<uint32_t>(position)));
        }
        const int4* bias_0 = args.bias_0 == nullptr ? nullptr
            : reinterpret_cast<const int4*>(static_cast<const char*>(args.bias_0) + t * geo.hidden_bytes);
        const int4* bias_1 = args.bias_1 == nullptr ? nullptr
            : reinterpret_cast<const int4*>(static_cast<const char*>(args.bias_1) + t * geo.hidden_bytes);
        reduce_row<2>(srcs, num_srcs, bias_0, bias_1,
                      reinterpret_cast<int4*>(static_cast<char*>(args.combined_x) + t * geo.hidden_bytes), row_int4);
        if (args.combined_topk_weights != nullptr) {
            for (int k = lane; k < geo.num_topk; k += 32) {
                float w = 0.f;
                for (int q = 0; q < num_srcs; ++q)
                    w += __int_as_float(ld_ring_int(reinterpret_cast<const int*>(
                        reinterpret_cast<const char*>(srcs[q]) + geo.meta_offset) + k));
                args.combined_topk_weights[static_cast<int64_t>(t) * geo.num_topk + k] = w;
            }
        }
        team_progress(team, min(i + team.size, num_items));
        if (leader) flush();
    }
    if (leader) {
        ok = team_drain(ctx, team, num_items, site, flush) && ok;
        if (is_node_lane) head_shadows[fused_index(channel, lane)] = base + released;
    }
}

__global__ void __launch_bounds__(kChannelThreads, 1)
    fused_combine_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ FusedGeometry geo,
                         const __grid_constant__ FusedCombineArgs args) {
    __shared__ int team_progress[kChannelWarps];
    __shared__ uint32_t agreement[2];
    // A checked call moves no row and advances no ring unless every rank's hash of this call is this rank's.
    if (!fused_rows_move(ctx, args.signature_hash, args.host_verdict, kKernelCombine, kPhaseCombineWaitAgreement,
                         kPhaseCombineAgreement, agreement))
        return;
    reset_teams(team_progress);
    const int channel = static_cast<int>(blockIdx.x) / 2, warp = static_cast<int>(threadIdx.x) / 32;
    const int num_nodes = geo.num_nodes;
    int num_checked = 0;
    if (lane_id() == 0) num_checked = raise_max_channels(ctx, kWsFusedCombineMaxChannels, geo.num_channels);
    num_checked = __shfl_sync(0xffffffffu, num_checked, 0);
    int role;
    if ((blockIdx.x & 1u) == 0) {
        // The last fused_combine_owner_warps(N) warps own the channel's tokens. The others forward, team n to the
        // owners of node n; past as many nodes as forwarding warps, each warp serves its nodes in ascending order
        // (make_roles). One call site per role keeps the kernel's registers to one copy of each.
        const int owner_warps = fused_combine_owner_warps(num_nodes);
        const int forward_warps = kChannelWarps - owner_warps;
        if (warp >= forward_warps) {
            const Team team{warp - forward_warps, owner_warps, team_progress + forward_warps};
            fused_combine_own(ctx, geo, args, team, channel);
            return;
        }
        int stride;
        const Team team = make_roles(team_progress, warp, forward_warps, num_nodes, &role, &stride);
        for (int n = role; n < num_nodes; n += stride)
            fused_combine_forward(ctx, geo, args, team, channel, n, num_checked);
        return;
    }
    // Team s sends my rows of source rank s.
    int stride;
    const Team team = make_roles(team_progress, warp, kChannelWarps, ctx.num_ranks, &role, &stride);
    for (int s = role; s < ctx.num_ranks; s += stride)
        fused_combine_send(ctx, geo, args, team, channel, s, num_checked);
}

Status check_fused_context(const KernelContext& ctx, int gpus_per_node, const char* what) {
    // Put peers: any rank of another node (put_mask has a bit per rank of the group), none of the own node.
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, what, kFusedMaxRanks, kPutAreaInRegion));
    for (int r = 0; r < ctx.num_ranks && ctx.put_mask != 0 && gpus_per_node > 0; ++r)
        DEEP_EP_REQUIRE_ARG(!put_bit(ctx.put_mask, r) || r / gpus_per_node != ctx.rank / gpus_per_node, what,
                            ": the fused kernels reach the ranks of their own node by pointer, got rank ", r,
                            " as a put peer of rank ", ctx.rank, " (put mask ", ctx.put_mask, ")");
    DEEP_EP_REQUIRE_ARG(gpus_per_node >= 2 && gpus_per_node <= kMaxGpusPerNode && ctx.num_ranks % gpus_per_node == 0 &&
                            ctx.num_ranks / gpus_per_node >= 2 && ctx.num_ranks / gpus_per_node <= kFusedMaxNodes,
                        what, ": GPUs per node must be in [2, ", kMaxGpusPerNode,
                        "] and divide num_ranks into 2 to ", kFusedMaxNodes, " nodes, got ", gpus_per_node, " of ",
                        ctx.num_ranks, " ranks");
    return {};
}

// The layout of this call fits into its half of the buffer; the message names the buffer size that would fit (with
// put peers the kernels' region is the buffer less the put area's header).
Status check_fits(const KernelContext& ctx, const FusedGeometry& geo, const char* what) {
    const bool staged = ctx.put_area == kPutAreaInRegion;
    DEEP_EP_REQUIRE_ARG(geo.region_bytes == ctx.num_nvl_bytes && geo.staged == (staged ? 1 : 0), what,
                        ": the layout must be carved from the context's region (staged ", geo.staged, ", put area ",
                        ctx.put_area, ")");
    const int64_t half = fused_half_bytes(geo.region_bytes);
    const int64_t used = geo.end_offset - geo.rail_rings_offset;
    const int64_t needed = kFusedRingsOffset + 2 * align_up64(used, kBufferAlignment) + (staged ? kPutHeaderBytes : 0);
    DEEP_EP_REQUIRE_ARG(used <= half, what, ": num_rdma_bytes must be >= ", needed, " for ", geo.num_channels,
                        " channels, records of ", geo.record_bytes, " bytes, ", geo.rail_capacity, " rail slots and ",
                        geo.node_capacity, " node slots per ring", staged ? " (with the staging of put peers)" : "",
                        "; got ", staged ? "a kernels' region of " : "", ctx.num_nvl_bytes);
    return {};
}

// The checks a fused dispatch or combine launch makes of its group and grid, before its rows' own checks.
Status check_fused_launch(const KernelContext& ctx, const FusedGeometry& geo, const char* what) {
    DEEP_EP_RETURN_IF_FAILED(check_fused_context(ctx, geo.gpus_per_node, what));
    DEEP_EP_REQUIRE_ARG(geo.num_nodes * geo.gpus_per_node == ctx.num_ranks, what,
                        ": nodes x GPUs per node must equal num_ranks, got ", geo.num_nodes, " x ", geo.gpus_per_node,
                        " for ", ctx.num_ranks);
    DEEP_EP_REQUIRE_ARG(geo.num_channels >= 1 && geo.num_channels <= kMaxChannels, what, ": channels must be in [1, ",
                        kMaxChannels, "], got ", geo.num_channels);
    return check_resident(what, 2 * geo.num_channels);
}

// The checks of a fused launch's top-k and rings: each ring holds two publications, and the rings fit the buffer.
Status check_fused_rings(const KernelContext& ctx, const FusedGeometry& geo, int num_max_rdma_send_tokens,
                         int num_max_nvl_send_tokens, const char* what) {
    DEEP_EP_REQUIRE_ARG(geo.num_topk >= 0 && geo.num_topk <= kMaxTopk, what, ": num_topk must be in [0, ", kMaxTopk,
                        "], got ", geo.num_topk);
    DEEP_EP_REQUIRE_ARG(num_max_rdma_send_tokens >= 1 && geo.rail_capacity >= 2 * num_max_rdma_send_tokens, what,
                        ": num_max_rdma_chunked_recv_tokens (", geo.rail_capacity,
                        ") must be >= 2 * num_max_rdma_chunked_send_tokens (", num_max_rdma_send_tokens, ") >= 2");
    DEEP_EP_REQUIRE_ARG(num_max_nvl_send_tokens >= 1 && geo.node_capacity >= 2 * num_max_nvl_send_tokens, what,
                        ": num_max_nvl_chunked_recv_tokens (", geo.node_capacity,
                        ") must be >= 2 * num_max_nvl_chunked_send_tokens (", num_max_nvl_send_tokens, ") >= 2");
    return check_fits(ctx, geo, what);
}

}  // namespace

Status fused_notify(const KernelContext& ctx, const FusedNotifyArgs& args, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_fused_context(ctx, args.gpus_per_node, "fused notify"));
    DEEP_EP_REQUIRE_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                        "fused notify: channels must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    DEEP_EP_RETURN_IF_FAILED(
        check_notify_counts(ctx, args.num_experts, args.expert_alignment, args.num_tokens, "fused notify"));
    DEEP_EP_REQUIRE_ARG(ctx.num_nvl_bytes >= kFusedRingsOffset, "fused notify: num_rdma_bytes must be >= ",
                        kFusedRingsOffset, ", got ", ctx.num_nvl_bytes);
    fused_notify_kernel<<<1, kNotifyThreads, 0, stream>>>(ctx, args);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status fused_dispatch(const KernelContext& ctx, const FusedGeometry& geo, const FusedDispatchArgs& args,
                      cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_fused_launch(ctx, geo, "fused dispatch"));
    DEEP_EP_REQUIRE_ARG(geo.hidden_bytes > 0 && geo.hidden_bytes % 16 == 0,
                        "fused dispatch: hidden bytes must be a positive multiple of 16, got ", geo.hidden_bytes);
    DEEP_EP_RETURN_IF_FAILED(
        check_fused_rings(ctx, geo, args.num_max_rdma_send_tokens, args.num_max_nvl_send_tokens, "fused dispatch"));
    DEEP_EP_REQUIRE_ARG((args.topk_idx == nullptr) == (args.topk_weights == nullptr) &&
                            (args.topk_idx == nullptr || args.topk_idx_bytes == 4 || args.topk_idx_bytes == 8),
                        "fused dispatch: topk_idx and topk_weights come together, ids of 4 or 8 bytes");
    if (args.topk_idx != nullptr)
        DEEP_EP_REQUIRE_ARG(args.num_experts >= ctx.num_ranks && args.num_experts % ctx.num_ranks == 0,
                            "fused dispatch: num_experts must be a positive multiple of num_ranks, got ",
                            args.num_experts);
    fused_dispatch_kernel<<<2 * geo.num_channels, kChannelThreads, 0, stream>>>(ctx, geo, args);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep

namespace deep_ep {
namespace kernels {

Status fused_combine(const KernelContext& ctx, const FusedGeometry& geo, const FusedCombineArgs& args,
                     cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_fused_launch(ctx, geo, "fused combine"));
    DEEP_EP_REQUIRE_ARG(geo.hidden_bytes > 0 && geo.hidden_bytes % 16 == 0,
                        "fused combine: hidden must be a positive multiple of 8 BF16 elements, got ",
                        geo.hidden_bytes / 2);
    DEEP_EP_RETURN_IF_FAILED(
        check_fused_rings(ctx, geo, args.num_max_rdma_send_tokens, args.num_max_nvl_send_tokens, "fused combine"));
    fused_combine_kernel<<<2 * geo.num_channels, kChannelThreads, 0, stream>>>(ctx, geo, args);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
