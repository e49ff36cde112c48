// Collective utilities of the ring kernels: the bounded barrier, the reset of this rank's control region and
// workspace, and the abort signal after a host-side failure.
#include <cstdint>

#include "intranode_common.cuh"

namespace deep_ep {
namespace kernels {

namespace {

// Thread r signals rank r (an NVSHMEM signal for a put peer) and waits for r's arrival here.
__global__ void barrier_kernel(const __grid_constant__ KernelContext ctx) {
    const int r = static_cast<int>(threadIdx.x);
    const uint32_t epoch = *workspace_u32(ctx, kWsBarrierEpochOffset) + 1;
    const int64_t my_arrival = kBarrierOffset + 4 * ctx.rank, its_arrival = kBarrierOffset + 4 * r;
    if (r < ctx.num_ranks) {
        if (is_put_peer(ctx, r))
            put_signal(ctx, my_arrival, r, 1u, true);
        else
            red_add_release_sys(buffer_u32(ctx.buffers[r], my_arrival), 1u);
    }
    if (r < ctx.num_ranks) {  // a put peer's arrival is the low half of the word's signal twin
        uint32_t seen;
        const uint32_t* arrival = is_put_peer(ctx, r) ? reinterpret_cast<uint32_t*>(signal_twin(ctx, its_arrival))
                                                      : buffer_u32(ctx.buffers[ctx.rank], its_arrival);
        if (wait_geq(ctx, arrival, epoch, Site{kKernelBarrier, kPhaseBarrierWait, r, -1}, &seen) &&
            is_put_peer(ctx, r))
            put_wait_consistency(signal_twin(ctx, its_arrival));
    }
    __syncthreads();
    if (r == 0) *workspace_u32(ctx, kWsBarrierEpochOffset) = epoch;
}

__global__ void reset_state_kernel(const __grid_constant__ KernelContext ctx) {
    uint32_t* control = buffer_u32(ctx.buffers[ctx.rank], 0);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kControlBytes / 4;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        control[i] = 0;
    uint32_t* ws = workspace_u32(ctx, 0);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kWsUsedBytes / 4;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
        ws[i] = 0;
    if (ctx.put_mask != 0) {  // the signal twins of the control region (put.cuh)
        uint64_t* twins = signal_twin(ctx, 0);
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < kControlBytes / 4;
             i += static_cast<int64_t>(gridDim.x) * blockDim.x)
            twins[i] = 0;
    }
}

__global__ void signal_abort_kernel(const __grid_constant__ KernelContext ctx) {
    const uint32_t word = (static_cast<uint32_t>(kErrorPeerAborted) << 8) | static_cast<uint32_t>(ctx.rank + 1);
    for (int r = static_cast<int>(threadIdx.x); r < ctx.num_ranks; r += static_cast<int>(blockDim.x))
        raise_abort(ctx, r, word);
}

}  // namespace

Status intranode_barrier(const KernelContext& ctx, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "barrier", kMaxRuntimeRanks, -1));
    barrier_kernel<<<1, kMaxRuntimeRanks, 0, stream>>>(ctx);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status intranode_reset(const KernelContext& ctx, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "reset", kMaxRuntimeRanks, -1));
    reset_state_kernel<<<16, 256, 0, stream>>>(ctx);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status intranode_signal_abort(const KernelContext& ctx, cudaStream_t stream) {
    DEEP_EP_RETURN_IF_FAILED(check_context(ctx, "signal_abort", kMaxRuntimeRanks, -1));
    signal_abort_kernel<<<1, 32, 0, stream>>>(ctx);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
