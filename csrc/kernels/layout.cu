// get_dispatch_layout: per-rank, per-node and per-expert token counts and the [N, R] routing mask.
//
// The count outputs are zeroed with cudaMemsetAsync, then layout_count_kernel walks the tokens (one thread per token,
// grid-stride), builds block-local histograms in shared memory and adds them to the outputs with atomics. A token
// counts once per rank (and once per node) however many of its top-k entries land there, and once per (token, k)
// pair for the expert counts. Entries outside [0, E) (including -1) are ignored.
#include <cstdint>

#include "api.cuh"
#include "status.cuh"

namespace deep_ep {
namespace kernels {

namespace {

template <typename IdxT>
__global__ void __launch_bounds__(kLayoutThreads) layout_count_kernel(const IdxT* topk_idx, int num_tokens,
                                                                      int num_topk, int num_ranks, int num_experts,
                                                                      int ranks_per_node, int* num_tokens_per_rank,
                                                                      int* num_tokens_per_rdma_rank,
                                                                      int* num_tokens_per_expert,
                                                                      bool* is_token_in_rank) {
    // Shared histograms: [E] experts, [R] ranks, [R / ranks_per_node] nodes.
    extern __shared__ int shared_counts[];
    const int num_nodes = num_tokens_per_rdma_rank != nullptr ? num_ranks / ranks_per_node : 0;
    int* expert_counts = shared_counts;
    int* rank_counts = expert_counts + num_experts;
    int* node_counts = rank_counts + num_ranks;
    for (int i = threadIdx.x; i < num_experts + num_ranks + num_nodes; i += blockDim.x) shared_counts[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        const IdxT* row = topk_idx + static_cast<int64_t>(t) * num_topk;
        bool* mask = is_token_in_rank + static_cast<int64_t>(t) * num_ranks;
        for (int r = 0; r < num_ranks; ++r) mask[r] = false;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = static_cast<int64_t>(row[k]);
            if (e < 0 || e >= num_experts) continue;
            atomicAdd(&expert_counts[e], 1);
            const int r = static_cast<int>(e) / experts_per_rank;
            // First entry of this token on rank r (resp. node) counts the token there.
            bool first_rank = true, first_node = true;
            for (int k2 = 0; k2 < k; ++k2) {
                const int64_t e2 = static_cast<int64_t>(row[k2]);
                if (e2 < 0 || e2 >= num_experts) continue;
                const int r2 = static_cast<int>(e2) / experts_per_rank;
                first_rank &= (r2 != r);
                if (num_nodes > 0) first_node &= (r2 / ranks_per_node != r / ranks_per_node);
            }
            if (first_rank) {
                mask[r] = true;
                atomicAdd(&rank_counts[r], 1);
            }
            if (num_nodes > 0 && first_node) atomicAdd(&node_counts[r / ranks_per_node], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
        if (expert_counts[i] != 0) atomicAdd(&num_tokens_per_expert[i], expert_counts[i]);
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
        if (rank_counts[i] != 0) atomicAdd(&num_tokens_per_rank[i], rank_counts[i]);
    for (int i = threadIdx.x; i < num_nodes; i += blockDim.x)
        if (node_counts[i] != 0) atomicAdd(&num_tokens_per_rdma_rank[i], node_counts[i]);
}

}  // namespace

Status get_dispatch_layout(const void* topk_idx, int topk_idx_bytes, int num_tokens, int num_topk, int num_ranks,
                           int num_experts, int ranks_per_node, int* num_tokens_per_rank,
                           int* num_tokens_per_rdma_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                           cudaStream_t stream) {
    DEEP_EP_REQUIRE_ARG(topk_idx_bytes == 4 || topk_idx_bytes == 8, "topk_idx element size must be 4 or 8 bytes, got ",
                        topk_idx_bytes);
    DEEP_EP_REQUIRE_ARG(num_tokens >= 0, "num_tokens must be >= 0, got ", num_tokens);
    DEEP_EP_REQUIRE_ARG(num_topk >= 0 && num_topk <= 32, "num_topk must be in [0, 32], got ", num_topk);
    DEEP_EP_REQUIRE_ARG(num_ranks >= 1, "num_ranks must be >= 1, got ", num_ranks);
    DEEP_EP_REQUIRE_ARG(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts must be in [1, ", kMaxExperts,
                        "], got ", num_experts);
    DEEP_EP_REQUIRE_ARG(num_experts % num_ranks == 0, "num_experts must be divisible by num_ranks, got ", num_experts,
                        " and ", num_ranks);
    int num_nodes = 0;
    if (num_tokens_per_rdma_rank != nullptr) {
        DEEP_EP_REQUIRE_ARG(ranks_per_node >= 1 && num_ranks % ranks_per_node == 0,
                            "ranks_per_node must divide num_ranks, got ", ranks_per_node, " and ", num_ranks);
        num_nodes = num_ranks / ranks_per_node;
        DEEP_EP_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(num_tokens_per_rdma_rank, 0, sizeof(int) * num_nodes, stream));
    }
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int) * num_ranks, stream));
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(num_tokens_per_expert, 0, sizeof(int) * num_experts, stream));
    if (num_tokens == 0) return {};

    int device = 0, num_sms = 0;
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    const int needed = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
    const int grid = needed < num_sms * 2 ? needed : num_sms * 2;
    const size_t smem = sizeof(int) * static_cast<size_t>(num_experts + num_ranks + num_nodes);
    if (topk_idx_bytes == 8) {
        if (smem > 48 * 1024)
            DEEP_EP_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(layout_count_kernel<int64_t>,
                                                              cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        layout_count_kernel<int64_t><<<grid, kLayoutThreads, smem, stream>>>(
            static_cast<const int64_t*>(topk_idx), num_tokens, num_topk, num_ranks, num_experts, ranks_per_node,
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank);
    } else {
        if (smem > 48 * 1024)
            DEEP_EP_RETURN_IF_CUDA_ERROR(cudaFuncSetAttribute(layout_count_kernel<int32_t>,
                                                              cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        layout_count_kernel<int32_t><<<grid, kLayoutThreads, smem, stream>>>(
            static_cast<const int32_t*>(topk_idx), num_tokens, num_topk, num_ranks, num_experts, ranks_per_node,
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank);
    }
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

}  // namespace kernels
}  // namespace deep_ep
