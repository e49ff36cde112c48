// Low-latency runtime pieces: the carving of the symmetric buffer (make_layout), the bounded barrier and the clean
// kernels, the kernels' shared-memory configuration, and the NVSHMEM host side (bootstrap from a unique id,
// symmetric allocation, peer pointers).
#include <algorithm>
#include <cstring>
#include <mutex>

#include "low_latency_device.cuh"

namespace deep_ep {
namespace kernels {
namespace ll {

namespace {
int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
}  // namespace

int64_t workspace_bytes(int num_ranks) { return workspace_end(num_ranks); }

Status make_layout(int num_ranks, int num_tokens_max, int hidden, int num_experts, int64_t num_rdma_bytes,
                   Layout* layout) {
    DEEP_EP_REQUIRE_ARG(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks must be in [1, ", kMaxRanks, "], got ",
                        num_ranks);
    DEEP_EP_REQUIRE_ARG(hidden % kFp8Block == 0 && hidden >= kMinHidden && hidden <= kMaxHidden,
                        "hidden must be a multiple of 128 in [", kMinHidden, ", ", kMaxHidden, "], got ", hidden);
    DEEP_EP_REQUIRE_ARG(num_tokens_max >= 1 && num_tokens_max <= kMaxTokens,
                        "num_max_dispatch_tokens_per_rank must be in [1, ", kMaxTokens, "], got ", num_tokens_max);
    DEEP_EP_REQUIRE_ARG(num_experts >= 1 && num_experts <= kMaxExperts && num_experts % num_ranks == 0,
                        "num_experts must be a multiple of num_ranks (", num_ranks, ") and <= ", kMaxExperts, ", got ",
                        num_experts);
    Layout l{};
    l.num_ranks = num_ranks;
    l.num_tokens_max = num_tokens_max;
    l.hidden = hidden;
    l.num_experts = num_experts;
    l.num_local = num_experts / num_ranks;
    l.num_topk_max = kMaxTopk;
    const int64_t num_scales = hidden / kFp8Block;
    l.cmsg = num_scales * 4 + int64_t(hidden) * 2;
    l.header_bytes = align_up(kHeaderInts * 4, 16);
    l.dmsg = l.header_bytes + std::max<int64_t>(int64_t(hidden) * 2, hidden + num_scales * 4);
    const int64_t R = num_ranks, T = num_tokens_max, E = num_experts, L = l.num_local;
    l.count_off = 0;
    l.darrive_off = l.count_off + R * (L + 1) * 8;
    l.carrive_off = l.darrive_off + R * 8;
    l.data_off = align_up(l.carrive_off + T * R * 8, kAlign);
    l.csend_off = l.data_off;
    l.crecv_off = l.csend_off + align_up(E * T * l.cmsg, kAlign);
    const int64_t combine_end = l.crecv_off + E * T * int64_t(hidden) * 2;  // (expert, token) words: csend tails
    l.drecv_off = l.data_off;
    l.dstage_off = l.drecv_off + R * T * l.dmsg;
    // A world of one rank has no remote peer (nvshmem_ptr resolves the rank itself), so no dispatch staging.
    const int64_t dispatch_end = l.dstage_off + (R > 1 ? T * l.dmsg : 0);
    const int64_t half = align_up(std::max(combine_end, dispatch_end), kAlign);
    l.half_offset[0] = kGlobalBytes;
    l.half_offset[1] = kGlobalBytes + half;
    l.total_bytes = kGlobalBytes + 2 * half;
    DEEP_EP_REQUIRE_ARG(l.total_bytes <= num_rdma_bytes, "num_rdma_bytes (", num_rdma_bytes,
                        ") is too small for the CUDA low-latency kernels: num_max_dispatch_tokens_per_rank=",
                        num_tokens_max, ", hidden=", hidden, ", num_experts=", num_experts, ", num_ranks=", num_ranks,
                        " need ", l.total_bytes, " bytes");
    *layout = l;
    return {};
}

const char* ll_phase_name(int32_t phase) {
    switch (phase) {
        case kPhaseLlDispatchWaitCounts: return "low_latency_dispatch wait counts";
        case kPhaseLlDispatchWaitData: return "low_latency_dispatch wait data";
        case kPhaseLlCombineWaitToken: return "low_latency_combine wait token";
        case kPhaseLlBarrierWait: return "low_latency barrier wait";
        case kPhaseLlBadRouting: return "low_latency_dispatch bad routing";
        case kPhaseLlDispatchAgreement: return "low_latency_dispatch agreement";
        case kPhaseLlHalfRelease: return "low_latency wait peer release of buffer half";
        case kPhaseLlCombineAgreement: return "low_latency_combine agreement";
        case kPhaseLlCombineToldDisagreement: return "low_latency_combine agreement (told by a peer)";
        case kPhaseLlCombineRefused: return "low_latency_combine refused";
        default: return "unknown phase";
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Barrier and clean
// ---------------------------------------------------------------------------------------------------------------

__global__ void ll_barrier_kernel(Context ctx) {
    const int tid = threadIdx.x;
    for (int r = tid; r < ctx.num_ranks; r += blockDim.x)
        if (!is_masked(ctx, r)) signal_add(ctx, r, kBarrierOffset, 1);
    __syncthreads();
    if (tid != 0) return;
    int alive = 0;
    for (int r = 0; r < ctx.num_ranks; ++r) alive += is_masked(ctx, r) ? 0 : 1;
    auto* base = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsBarrierBase);
    const uint64_t target = *base + uint64_t(alive);
    uint64_t seen = 0, elapsed = 0;
    uint64_t* word = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kBarrierOffset);
    const WaitResult res =
        wait_word(ctx, word, [target](uint64_t v) { return int64_t(v - target) >= 0; }, &seen, &elapsed);
    if (res == kWaitOk) {
        *base = target;
    } else {
        on_wait_failure(ctx, res == kWaitTimeout ? kWaitTimeout : res, kKernelLlBarrier, kPhaseLlBarrierWait, -1, -1,
                        target, seen, elapsed);
        *base = seen;  // keep later barriers meaningful for the ranks that did arrive
    }
}

__global__ void ll_refuse_combine_kernel(Context ctx, uint32_t signature_hash) {
    tell_disagreement(ctx, kKernelLlCombine, kPhaseLlCombineRefused, -1, -1, signature_hash, signature_hash);
}

__global__ void ll_clean_kernel(Context ctx) {
    const Layout& lay = ctx.layout;
    const int64_t ctrl_words = lay.data_off / 8;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int h = 0; h < 2; ++h) {
        uint64_t* ctrl = reinterpret_cast<uint64_t*>(half_base(ctx, ctx.sym, h));
        for (int64_t i = first; i < ctrl_words; i += stride) ctrl[i] = 0;
    }
    auto* ws = reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.workspace) + kWsEpochs);
    const int64_t ws_words = (workspace_end(ctx.num_ranks) - kWsEpochs) / 8;
    for (int64_t i = first; i < ws_words; i += stride) ws[i] = 0;
    if (first == 0) *reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kAbortOffset) = 0;
    if (first == 0) *reinterpret_cast<uint64_t*>(static_cast<char*>(ctx.sym) + kDisagreementOffset) = 0;
    if (first == 0) *reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsClaim) = 0;
    if (first == 0) *reinterpret_cast<unsigned int*>(static_cast<char*>(ctx.workspace) + kWsMismatch) = 0;
}

Status configure_kernels() {
    DEEP_EP_RETURN_IF_FAILED(configure_dispatch_kernels());
    DEEP_EP_RETURN_IF_FAILED(configure_combine_kernels());
    return {};
}

Status barrier(const Context& ctx, cudaStream_t stream) {
    ll_barrier_kernel<<<1, 256, 0, stream>>>(ctx);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status refuse_combine(const Context& ctx, uint32_t signature_hash, cudaStream_t stream) {
    ll_refuse_combine_kernel<<<1, 1, 0, stream>>>(ctx, signature_hash);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

Status clean(const Context& ctx, cudaStream_t stream) {
    ll_clean_kernel<<<64, 256, 0, stream>>>(ctx);
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaGetLastError());
    return {};
}

// ---------------------------------------------------------------------------------------------------------------
// NVSHMEM host side
// ---------------------------------------------------------------------------------------------------------------

namespace {
std::mutex g_init_mutex;
int g_init_rank = -1, g_init_ranks = 0;
}  // namespace

Status nvshmem_unique_id(std::vector<uint8_t>* unique_id) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) != 0) return runtime_error_status("nvshmemx_get_uniqueid failed");
    unique_id->assign(reinterpret_cast<const uint8_t*>(&id), reinterpret_cast<const uint8_t*>(&id) + sizeof(id));
    return {};
}

Status nvshmem_bootstrap(const std::vector<uint8_t>& unique_id, int rank, int num_ranks) {
    std::lock_guard<std::mutex> lock(g_init_mutex);
    if (g_init_ranks != 0) {
        DEEP_EP_REQUIRE_ARG(g_init_rank == rank && g_init_ranks == num_ranks,
                            "NVSHMEM is already initialised in this process as PE ", g_init_rank, " of ", g_init_ranks,
                            "; a low-latency Buffer for rank ", rank, " of ", num_ranks, " cannot join another world");
        return {};
    }
    nvshmemx_uniqueid_t id;
    DEEP_EP_REQUIRE_ARG(unique_id.size() == sizeof(id), "the NVSHMEM unique id must have ", sizeof(id),
                        " bytes, got ", unique_id.size());
    std::memcpy(&id, unique_id.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0)
        return runtime_error_status("nvshmemx_set_attr_uniqueid_args failed");
    if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
        return runtime_error_status("nvshmemx_init_attr failed");
    if (nvshmem_my_pe() != rank || nvshmem_n_pes() != num_ranks)
        return runtime_error_status("NVSHMEM initialised as PE ", nvshmem_my_pe(), " of ", nvshmem_n_pes(),
                                    ", expected ", rank, " of ", num_ranks);
    g_init_rank = rank;
    g_init_ranks = num_ranks;
    return {};
}

std::pair<int, int> nvshmem_world() {
    std::lock_guard<std::mutex> lock(g_init_mutex);
    return {g_init_rank, g_init_ranks};
}

Status nvshmem_alloc_zeroed(int64_t bytes, void** allocation) {
    void* ptr = nvshmem_align(128, static_cast<size_t>(bytes));
    if (ptr == nullptr) return runtime_error_status("nvshmem_align of ", bytes, " bytes failed");
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaMemset(ptr, 0, static_cast<size_t>(bytes)));
    DEEP_EP_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
    nvshmem_barrier_all();
    *allocation = ptr;
    return {};
}

void nvshmem_release(void* ptr) {
    if (ptr != nullptr) nvshmem_free(ptr);
}

std::vector<void*> nvshmem_peer_pointers(void* ptr, int num_pes) {
    std::vector<void*> out(num_pes);
    for (int pe = 0; pe < num_pes; ++pe) out[pe] = nvshmem_ptr(ptr, pe);
    return out;
}

}  // namespace ll
}  // namespace kernels
}  // namespace deep_ep
