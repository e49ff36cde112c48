// Notify (non-cached dispatch only): every rank writes its per-destination, per-expert and per-channel counts and
// its call signature into every rank's notify slot of the call's parity, waits for every source's slot of this
// epoch, and builds the handle's prefix matrices (and the host-mapped counters and signatures) from them; every rank
// compares every source's signature with its own (NotifyArgs::check_signatures). One CTA; no barrier, no zeroing.
#include <cstdint>

#include "intranode_common.cuh"

namespace deep_ep {
namespace kernels {

namespace {

// kPut: some peers are NVSHMEM put peers (put.cuh): their counts are staged in this rank's put area and put with the
// flag as signal.
template <bool kPut>
__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_counts_kernel(const __grid_constant__ KernelContext ctx, const __grid_constant__ NotifyArgs args) {
    __shared__ int channel_counts[kMaxRanks][kMaxChannels];  // my tokens to d in channel c
    __shared__ int rank_totals[kMaxRanks];
    __shared__ int all_counts[kMaxRanks][kMaxRanks];           // count(s -> d) gathered from every source
    __shared__ int mismatch_source;  // the first source whose signature differs from mine, or kMaxRanks

    const int num_ranks = ctx.num_ranks, rank = ctx.rank, num_channels = args.num_channels;
    const int num_local_experts = args.num_experts / num_ranks;
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
    const int num_warps = static_cast<int>(blockDim.x) / 32;

    // 1. My per-(destination, channel) token counts from is_token_in_rank.
    for (int pair = warp; pair < num_ranks * num_channels; pair += num_warps) {
        const int d = pair / num_channels, c = pair % num_channels;
        int begin, end;
        channel_range(args.num_tokens, num_channels, c, &begin, &end);
        int count = 0;
        for (int t = begin + lane; t < end; t += 32)
            count += args.is_token_in_rank[static_cast<int64_t>(t) * num_ranks + d] ? 1 : 0;
        count = warp_sum(count);
        if (lane == 0) channel_counts[d][c] = count;
    }
    __syncthreads();

    // 2. Totals, sender-side channel prefix, and the check against the caller's num_tokens_per_rank.
    if (threadIdx.x < num_ranks) {
        const int d = static_cast<int>(threadIdx.x);
        int total = 0;
        for (int c = 0; c < num_channels; ++c) {
            total += channel_counts[d][c];
            args.channel_prefix_matrix[d * num_channels + c] = total;
        }
        rank_totals[d] = total;
        const int claimed = args.num_tokens_per_rank[d];
        if (claimed != total) {
            report_error(ctx, kErrorCountMismatch, Site{kKernelNotify, kPhaseNotifyCheckCounts, d, -1}, claimed,
                         total, 0);
        }
    }
    const uint32_t epoch = *workspace_u32(ctx, kWsNotifyEpochOffset) + 1;
    const int parity = static_cast<int>(epoch & 1u);
    if (threadIdx.x == 0) mismatch_source = kMaxRanks;
    __syncthreads();

    // 3. Write my counts into every rank's notify slot [parity][me]: [R totals][L expert counts of d][C channels]
    // [my signature].
    const int* my_signature = reinterpret_cast<const int*>(args.signature);
    const int slot_ints = kNotifyInts;
    const int per_dst = num_ranks + num_local_experts + num_channels + kSignatureInts;
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks * per_dst; i += static_cast<int>(blockDim.x)) {
        const int d = i / per_dst, k = i % per_dst;
        int* slot = kPut && is_ring_put_peer(ctx, d)
            ? reinterpret_cast<int*>(own_buffer(ctx) + ctx.num_nvl_bytes + kPutNotifyStageOffset) + d * slot_ints
            : reinterpret_cast<int*>(buffer_u32(ctx.buffers[d], kNotifyDataOffset)) +
                  (static_cast<int64_t>(parity) * kMaxRanks + rank) * slot_ints;
        int value, pos;
        if (k < num_ranks) {
            value = rank_totals[k];
            pos = k;
        } else if (k < num_ranks + num_local_experts) {
            value = args.num_tokens_per_expert[d * num_local_experts + (k - num_ranks)];
            pos = kMaxRanks + (k - num_ranks);
        } else if (k < num_ranks + num_local_experts + num_channels) {
            value = channel_counts[d][k - num_ranks - num_local_experts];
            pos = kMaxRanks + kMaxLocalExperts + (k - num_ranks - num_local_experts);
        } else {
            const int w = k - num_ranks - num_local_experts - num_channels;
            value = my_signature[w];
            pos = kNotifySignaturePos + w;
        }
        reinterpret_cast<volatile int*>(slot)[pos] = value;
    }
    __threadfence_system();
    __syncthreads();
    const int64_t my_slot = (static_cast<int64_t>(parity) * kMaxRanks + rank);
    if (threadIdx.x < num_ranks && !(kPut && is_ring_put_peer(ctx, static_cast<int>(threadIdx.x)))) {
        const int d = static_cast<int>(threadIdx.x);
        fence_acq_rel_sys();
        st_release_sys(buffer_u32(ctx.buffers[d], kNotifyFlagOffset) + parity * kMaxRanks + rank, epoch);
    }
    // Put peer d: warp d puts my staged counts for d into my slot at d, with the flag as signal.
    if (kPut && warp < num_ranks && is_ring_put_peer(ctx, warp)) {
        __syncwarp();  // the lanes of warp 0 that stored pointer peers' flags join first
        put_block_with_flag(ctx, own_buffer(ctx) + ctx.num_nvl_bytes + kPutNotifyStageOffset +
                                     static_cast<int64_t>(warp) * slot_ints * 4,
                            kNotifyDataOffset + my_slot * slot_ints * 4, static_cast<int64_t>(slot_ints) * 4, warp,
                            kNotifyFlagOffset + my_slot * 4, epoch);
    }

    // 4. Wait until every source's counts of this epoch are here.
    if (threadIdx.x < num_ranks) {
        const int s = static_cast<int>(threadIdx.x);
        const int64_t flag = kNotifyFlagOffset + 4 * (static_cast<int64_t>(parity) * kMaxRanks + s);
        uint32_t seen;
        // On failure the error is reported; the outputs below are then garbage but every write stays in bounds.
        uint32_t* word = buffer_u32(ctx.buffers[rank], kNotifyFlagOffset) + parity * kMaxRanks + s;
        if (wait_geq(ctx, peer_word<kPut>(ctx, word, flag, s), epoch,
                     Site{kKernelNotify, kPhaseNotifyWaitCounts, s, -1}, &seen))
            after_peer_wait<kPut>(ctx, flag, s);
    }
    __syncthreads();

    // 5. Prefix matrices and received counts (garbage, but bounded, if a wait failed).
    const volatile int* data = reinterpret_cast<const volatile int*>(buffer_u32(ctx.buffers[rank], kNotifyDataOffset)) +
                               static_cast<int64_t>(parity) * kMaxRanks * slot_ints;
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks * num_ranks; i += static_cast<int>(blockDim.x))
        all_counts[i / num_ranks][i % num_ranks] = data[(i / num_ranks) * slot_ints + (i % num_ranks)];
    __syncthreads();
    if (threadIdx.x < num_ranks) {
        const int d = static_cast<int>(threadIdx.x);
        int prefix = 0;
        for (int s = 0; s < num_ranks; ++s) {
            prefix += all_counts[s][d];
            args.rank_prefix_matrix[s * num_ranks + d] = prefix;
        }
    }
    for (int i = static_cast<int>(threadIdx.x); i < num_ranks; i += static_cast<int>(blockDim.x)) {
        const int s = i;
        int prefix = 0;
        for (int c = 0; c < num_channels; ++c) {
            args.recv_channel_prefix_matrix[s * num_channels + c] = prefix;
            prefix += data[s * slot_ints + kMaxRanks + kMaxLocalExperts + c];
        }
    }
    // 6. Every source's signature: to the host, and compared with mine (once per call; the hot kernels do not).
    notify_agreement(ctx, args, data + kNotifySignaturePos, slot_ints, my_signature, &mismatch_source);
    if (args.host_counters != nullptr) {
        notify_expert_counts(args, data + kMaxRanks, slot_ints, num_ranks, num_local_experts);
        // Then count(s -> d) of every pair (row-major [R][R]): the host sizes copy-engine combines with them.
        for (int i = static_cast<int>(threadIdx.x); i < num_ranks * num_ranks; i += static_cast<int>(blockDim.x))
            reinterpret_cast<volatile int*>(args.host_counters)[1 + kMaxLocalExperts + i] =
                all_counts[i / num_ranks][i % num_ranks];
        __threadfence_system();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (args.host_counters != nullptr) {
            int total = 0;
            for (int s = 0; s < num_ranks; ++s) total += all_counts[s][rank];
            reinterpret_cast<volatile int*>(args.host_counters)[0] = total;
            __threadfence_system();
        }
        *workspace_u32(ctx, kWsNotifyEpochOffset) = epoch;
    }
}

}  // namespace

Status intranode_notify(const KernelContext& ctx, const NotifyArgs& args, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "notify"));
    DEEP_EP_REQUIRE_ARG(args.num_channels >= 1 && args.num_channels <= kMaxChannels,
                        "notify: config.num_sms must be in [1, ", kMaxChannels, "], got ", args.num_channels);
    DEEP_EP_RETURN_IF_FAILED(
        check_notify_counts(ctx, args.num_experts, args.expert_alignment, args.num_tokens, "notify"));
    if (ctx.put_mask != 0)
        notify_counts_kernel<true><<<1, kNotifyThreads, 0, stream>>>(ctx, args);
    else
        notify_counts_kernel<false><<<1, kNotifyThreads, 0, stream>>>(ctx, args);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
