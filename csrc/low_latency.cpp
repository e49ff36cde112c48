// Host runtime of the low-latency kernels (see low_latency.hpp).
#include "low_latency.hpp"

#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "buffer.hpp"  // DeviceError
#include "status.hpp"

#ifndef DEEP_EP_DISABLE_NVSHMEM

// Checks of this file: std::invalid_argument built from the streamed parts, and std::runtime_error
// "CUDA error <name>: <text> at <file>:<line> '<expr>'".
#define DEEP_EP_CHECK_ARG(cond, ...)                                                 \
    do {                                                                             \
        if (!(cond)) throw_if_failed(kernels::invalid_argument_status(__VA_ARGS__)); \
    } while (0)
#define DEEP_EP_CUDA_CHECK(expr) throw_if_failed(kernels::cuda_status((expr), #expr, __FILE__, __LINE__))

namespace deep_ep {

namespace ll = kernels::ll;

namespace {

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

template <typename T = void>
T* ptr(const at::Tensor& t) {
    return static_cast<T*>(t.data_ptr());
}

template <typename T = void>
T* ptr_or_null(const std::optional<at::Tensor>& t) {
    return t.has_value() ? static_cast<T*>(t->data_ptr()) : nullptr;
}

const char* code_name(int32_t code) { return kernels::error_code_name(code); }

}  // namespace

std::string ll_unique_id() {
    std::vector<uint8_t> id;
    throw_if_failed(ll::nvshmem_unique_id(&id));
    return std::string(id.begin(), id.end());
}

std::string format_ll_error(const kernels::ErrorRecord& r) {
    char text[512];
    const bool token_wait = r.phase == ll::kPhaseLlCombineWaitToken;
    std::snprintf(text, sizeof(text),
                  "%s: rank %d peer %d %s %d expected %lld observed %lld after %.3f s (%s; block %d, call %lld)",
                  ll::ll_phase_name(r.phase), r.rank, r.peer, token_wait ? "token" : "channel", r.channel,
                  static_cast<long long>(r.expected), static_cast<long long>(r.observed), r.elapsed_ns * 1e-9,
                  code_name(r.code), r.block, static_cast<long long>(r.call_seq));
    return text;
}

LowLatencyRuntime::LowLatencyRuntime(int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s,
                                     bool enable_shrink, const std::string& unique_id, bool put_only)
    : rank_(rank), num_ranks_(num_ranks), num_rdma_bytes_(num_rdma_bytes), timeout_s_(timeout_s),
      enable_shrink_(enable_shrink) {
    DEEP_EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= ll::kMaxRanks, "num_ranks must be in [1, ", ll::kMaxRanks,
                      "] for the low-latency kernels, got ", num_ranks);
    DEEP_EP_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank must be in [0, ", num_ranks, "), got ", rank);
    DEEP_EP_CHECK_ARG(num_rdma_bytes > 0 && num_rdma_bytes % 128 == 0,
                      "num_rdma_bytes must be a positive multiple of 128, got ", num_rdma_bytes);
    DEEP_EP_CHECK_ARG(timeout_s > 0, "timeout_s (DEEP_EP_TIMEOUT_S) must be > 0, got ", timeout_s);
    DEEP_EP_CUDA_CHECK(cudaGetDevice(&device_id_));
    int sms = 0;
    DEEP_EP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_id_));
    num_blocks_ = std::min(sms, ll::kMaxBlocks);
    DEEP_EP_CHECK_ARG(num_blocks_ >= 16, "the low-latency kernels need a GPU with >= 16 SMs, got ", sms);

    throw_if_failed(ll::nvshmem_bootstrap(std::vector<uint8_t>(unique_id.begin(), unique_id.end()), rank, num_ranks));
    throw_if_failed(ll::nvshmem_alloc_zeroed(num_rdma_bytes, &sym_));
    auto peers = ll::nvshmem_peer_pointers(sym_, num_ranks);  // the low-latency group is the whole NVSHMEM world
    if (put_only)
        for (int r = 0; r < num_ranks; ++r)
            if (r != rank) peers[r] = nullptr;
    for (void* p : peers) all_p2p_ &= p != nullptr;
    // make_layout gives a one-rank world no dispatch staging: its only peer (itself) must be reachable by pointer,
    // otherwise the dispatch would stage messages past the end of a half.
    if (num_ranks == 1 && peers[0] == nullptr)
        throw std::runtime_error("nvshmem_ptr returned no local pointer for this PE in a one-rank world");
    DEEP_EP_CUDA_CHECK(cudaMalloc(&peers_, sizeof(void*) * num_ranks));
    DEEP_EP_CUDA_CHECK(cudaMemcpy(peers_, peers.data(), sizeof(void*) * num_ranks, cudaMemcpyHostToDevice));
    const int64_t ws = ll::workspace_bytes(num_ranks);
    DEEP_EP_CUDA_CHECK(cudaMalloc(&workspace_, ws));
    DEEP_EP_CUDA_CHECK(cudaMemset(workspace_, 0, ws));
    if (enable_shrink) {
        DEEP_EP_CUDA_CHECK(cudaMalloc(&mask_, sizeof(int) * num_ranks));
        DEEP_EP_CUDA_CHECK(cudaMemset(mask_, 0, sizeof(int) * num_ranks));
    }
    DEEP_EP_CUDA_CHECK(cudaHostAlloc(&host_error_, sizeof(kernels::ErrorRecord), cudaHostAllocMapped));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    DEEP_EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_error_), host_error_, 0));
    DEEP_EP_CUDA_CHECK(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
    throw_if_failed(ll::configure_kernels());
    DEEP_EP_CUDA_CHECK(cudaDeviceSynchronize());
}

LowLatencyRuntime::~LowLatencyRuntime() {
    // Without an explicit destroy() (a collective), only the local allocations can be released safely.
    if (!destroyed_) {
        cudaFree(peers_);
        cudaFree(workspace_);
        cudaFree(mask_);
        cudaFreeHost(host_error_);
    }
    if (order_event_ != nullptr) cudaEventDestroy(order_event_);
}

void LowLatencyRuntime::require_alive(const char* what) const {
    if (destroyed_) throw std::runtime_error(std::string(what) + ": the low-latency runtime was destroyed");
}

int64_t LowLatencyRuntime::required_bytes(int num_max_tokens, int hidden, int num_experts) const {
    ll::Layout layout{};
    throw_if_failed(ll::make_layout(num_ranks_, num_max_tokens, hidden, num_experts, INT64_MAX, &layout));
    return layout.total_bytes;
}

const ll::Layout& LowLatencyRuntime::layout(int num_max_tokens, int hidden, int num_experts) {
    if (!has_layout_ || layout_.num_tokens_max != num_max_tokens || layout_.hidden != hidden ||
        layout_.num_experts != num_experts) {
        throw_if_failed(ll::make_layout(num_ranks_, num_max_tokens, hidden, num_experts, num_rdma_bytes_, &layout_));
        has_layout_ = true;
    }
    return layout_;
}

ll::Context LowLatencyRuntime::context(int num_max_tokens, int hidden, int num_experts) {
    require_alive("low-latency call");
    ll::Context ctx{};
    ctx.sym = sym_;
    ctx.peers = peers_;
    ctx.workspace = workspace_;
    ctx.error = device_error_;
    ctx.mask = mask_;
    ctx.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
    ctx.call_seq = ++call_seq_;
    ctx.rank = rank_;
    ctx.num_ranks = num_ranks_;
    ctx.num_blocks = num_blocks_;
    ctx.all_p2p = all_p2p_ ? 1 : 0;
    ctx.layout = layout(num_max_tokens, hidden, num_experts);
    return ctx;
}

cudaStream_t LowLatencyRuntime::current_stream() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_id_)).stream();
}

cudaStream_t LowLatencyRuntime::enter(uintptr_t comm) {
    const cudaStream_t current = current_stream();
    if (comm == 0) return current;
    const cudaStream_t stream = as_stream(comm);
    if (stream != current) {
        DEEP_EP_CUDA_CHECK(cudaEventRecord(order_event_, current));
        DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(stream, order_event_, 0));
    }
    return stream;
}

void LowLatencyRuntime::require_no_error() const {
    if (reinterpret_cast<volatile kernels::ErrorRecord*>(host_error_)->ready != 0)
        throw DeviceError("a low-latency kernel error is pending (read_error() has it)");
}

void LowLatencyRuntime::leave(cudaStream_t launched_on, bool current_after) {
    const cudaStream_t current = current_stream();
    if (!current_after || launched_on == current) return;
    DEEP_EP_CUDA_CHECK(cudaEventRecord(order_event_, launched_on));
    DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(current, order_event_, 0));
}

int LowLatencyRuntime::order_launch(cudaStream_t stream, int half, int phases, bool after_current) {
    const bool send = (phases & ll::kPhaseSend) != 0;
    const int by_next_send = !send && half == last_send_half_ ? 1 : 0;
    if (!send && by_next_send == 0) return 0;  // releases its half at its end; touches no record
    const cudaStream_t previous = last_ordered_stream_;
    last_ordered_stream_ = stream;
    if (send) last_send_half_ = half;
    if (previous == nullptr || previous == stream || (after_current && previous == current_stream()))
        return by_next_send;
    // A stream capture cannot wait for work outside it (nor the reverse): a graph's first such launch follows, when
    // replayed, what ran before the replay on its stream.
    cudaStreamCaptureStatus mine = cudaStreamCaptureStatusNone, theirs = cudaStreamCaptureStatusNone;
    DEEP_EP_CUDA_CHECK(cudaStreamIsCapturing(stream, &mine));
    DEEP_EP_CUDA_CHECK(cudaStreamIsCapturing(previous, &theirs));
    if (mine == theirs) {
        DEEP_EP_CUDA_CHECK(cudaEventRecord(order_event_, previous));
        DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(stream, order_event_, 0));
    }
    return by_next_send;
}

std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> LowLatencyRuntime::dispatch(
    const at::Tensor& x, const at::Tensor& topk_idx, int num_max_tokens, int num_experts,
    const std::optional<at::Tensor>& cumulative_stats, const std::optional<at::Tensor>& wait_stats, bool use_fp8,
    bool round_scale, bool use_ue8m0, int half, int phases, uintptr_t comm_stream, bool current_after,
    const std::vector<at::Tensor>& outputs, uint32_t signature_hash) {
    const int hidden = static_cast<int>(x.size(1));
    require_alive("low_latency_dispatch");
    require_no_error();
    auto ctx = context(num_max_tokens, hidden, num_experts);
    DEEP_EP_CHECK_ARG(half == 0 || half == 1, "half must be 0 or 1, got ", half);
    at::Tensor recv_x, count, src_info, layout_range;
    std::optional<at::Tensor> scales;
    if (outputs.empty()) {
        const int64_t num_local = ctx.layout.num_local, rows = int64_t(num_ranks_) * num_max_tokens;
        const auto int_options = x.options().dtype(at::kInt);
        recv_x = at::empty({num_local, rows, hidden}, x.options().dtype(use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
        if (use_fp8) {
            // Column-major scales: allocated [L, S, R*T], returned as the [L, R*T, S] transpose.
            const int64_t cols = hidden / ll::kFp8Block / (use_ue8m0 ? 4 : 1);
            scales = at::empty({num_local, cols, rows}, use_ue8m0 ? int_options : x.options().dtype(at::kFloat))
                         .transpose(1, 2);
        }
        count = at::empty({num_local}, int_options);
        src_info = at::empty({num_local, rows}, int_options);
        layout_range = at::empty({num_local, num_ranks_}, x.options().dtype(at::kLong));
    } else {
        DEEP_EP_CHECK_ARG(outputs.size() == (use_fp8 ? 5u : 4u), "outputs must be the ", use_fp8 ? 5 : 4,
                          " tensors of the send launch, got ", outputs.size());
        recv_x = outputs[0];
        count = outputs[1];
        src_info = outputs[2];
        layout_range = outputs[3];
        if (use_fp8) scales = outputs[4];
    }
    ll::DispatchArgs a{};
    a.x = x.data_ptr();
    a.topk_idx = topk_idx.data_ptr();
    a.topk_idx_bytes = static_cast<int>(topk_idx.element_size());
    a.num_tokens = static_cast<int>(x.size(0));
    a.num_topk = static_cast<int>(topk_idx.size(1));
    a.use_fp8 = use_fp8;
    a.round_scale = round_scale;
    a.use_ue8m0 = use_ue8m0;
    a.recv_x = recv_x.data_ptr();
    a.recv_scales = ptr_or_null(scales);
    a.src_info = ptr<int>(src_info);
    a.layout_range = ptr<int64_t>(layout_range);
    a.packed_recv_count = ptr<int>(count);
    a.cumulative_stats = ptr_or_null<int>(cumulative_stats);
    a.wait_stats = ptr_or_null<int64_t>(wait_stats);
    a.half = half;
    a.phases = phases;
    a.signature_hash = signature_hash;
    const cudaStream_t stream = enter(comm_stream);
    a.release_by_next_send = order_launch(stream, half, phases, comm_stream != 0);
    throw_if_failed(ll::dispatch(ctx, a, stream));
    leave(stream, current_after);
    return {recv_x, scales, count, src_info, layout_range};
}

at::Tensor LowLatencyRuntime::combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                                      const at::Tensor& src_info, const at::Tensor& layout_range, int num_max_tokens,
                                      int num_experts, bool use_logfmt, bool zero_copy,
                                      const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& wait_stats,
                                      int half, int phases, uintptr_t comm_stream, bool current_after,
                                      uint32_t signature_hash) {
    const int hidden = static_cast<int>(x.size(2));
    require_alive("low_latency_combine");
    require_no_error();
    auto ctx = context(num_max_tokens, hidden, num_experts);
    DEEP_EP_CHECK_ARG(half == 0 || half == 1, "half must be 0 or 1, got ", half);
    const at::Tensor combined = out.has_value() ? *out : at::empty({topk_idx.size(0), hidden}, x.options());
    ll::CombineArgs a{};
    a.x = x.data_ptr();
    a.topk_idx = topk_idx.data_ptr();
    a.topk_weights = ptr<float>(topk_weights);
    a.topk_idx_bytes = static_cast<int>(topk_idx.element_size());
    a.num_tokens = static_cast<int>(topk_idx.size(0));
    a.num_topk = static_cast<int>(topk_idx.size(1));
    a.src_info = ptr<int>(src_info);
    a.layout_range = ptr<int64_t>(layout_range);
    a.use_logfmt = use_logfmt;
    a.zero_copy = zero_copy;
    a.out = combined.data_ptr();
    a.wait_stats = ptr_or_null<int64_t>(wait_stats);
    a.half = half;
    a.phases = phases;
    a.signature_hash = signature_hash;
    const cudaStream_t stream = enter(comm_stream);
    a.release_by_next_send = order_launch(stream, half, phases, comm_stream != 0);
    throw_if_failed(ll::combine(ctx, a, stream));
    leave(stream, current_after);
    return combined;
}

void LowLatencyRuntime::refuse_combine(int num_max_tokens, int hidden, int num_experts, uint32_t signature_hash) {
    require_alive("low_latency_combine");
    require_no_error();
    throw_if_failed(
        ll::refuse_combine(context(num_max_tokens, hidden, num_experts), signature_hash, current_stream()));
}

at::Tensor LowLatencyRuntime::combine_buffer(int num_max_tokens, int hidden, int num_experts, int half) {
    require_alive("get_next_low_latency_combine_buffer");
    const auto& lay = layout(num_max_tokens, hidden, num_experts);
    char* base = static_cast<char*>(sym_) + lay.half_offset[half] + lay.csend_off;
    const int64_t rows = int64_t(num_ranks_) * num_max_tokens, slot = lay.cmsg / 2;
    return at::from_blob(base, {lay.num_local, rows, hidden}, {rows * slot, slot, 1},
                         at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, device_id_));
}

void LowLatencyRuntime::barrier(uintptr_t stream) {
    auto ctx = context(1, ll::kMinHidden, num_ranks_);
    throw_if_failed(ll::barrier(ctx, as_stream(stream)));
}

void LowLatencyRuntime::clean(int num_max_tokens, int hidden, int num_experts, uintptr_t stream) {
    auto ctx = context(num_max_tokens, hidden, num_experts);
    throw_if_failed(ll::barrier(ctx, as_stream(stream)));
    throw_if_failed(ll::clean(ctx, as_stream(stream)));
    throw_if_failed(ll::barrier(ctx, as_stream(stream)));
    last_ordered_stream_ = nullptr;  // the clean zeroed the release counts and the record of unreleased halves
    last_send_half_ = -1;
    call_seq_ = 0;  // every rank numbers its calls from here alike, whatever calls it made before
}

void LowLatencyRuntime::update_mask(int rank, bool mask, uintptr_t stream) {
    DEEP_EP_CHECK_ARG(mask_ != nullptr, "Shrink mode must be enabled");
    DEEP_EP_CHECK_ARG(rank >= 0 && rank < num_ranks_, "rank_to_mask must be in [0, ", num_ranks_, "), got ", rank);
    const int value = mask ? 1 : 0;
    DEEP_EP_CUDA_CHECK(cudaMemcpyAsync(mask_ + rank, &value, sizeof(int), cudaMemcpyHostToDevice, as_stream(stream)));
    DEEP_EP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
}

void LowLatencyRuntime::query_mask(const at::Tensor& out, uintptr_t stream) const {
    DEEP_EP_CHECK_ARG(mask_ != nullptr, "Shrink mode must be enabled");
    DEEP_EP_CHECK_ARG(out.is_cuda() && out.numel() == num_ranks_ && out.scalar_type() == at::kInt && out.is_contiguous(),
                      "mask_status must be a contiguous CUDA int32 tensor of ", num_ranks_, " elements");
    DEEP_EP_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), mask_, sizeof(int) * num_ranks_, cudaMemcpyDeviceToDevice,
                                       as_stream(stream)));
}

void LowLatencyRuntime::clean_mask(uintptr_t stream) {
    DEEP_EP_CHECK_ARG(mask_ != nullptr, "Shrink mode must be enabled");
    DEEP_EP_CUDA_CHECK(cudaMemsetAsync(mask_, 0, sizeof(int) * num_ranks_, as_stream(stream)));
}

std::optional<kernels::ErrorRecord> LowLatencyRuntime::read_error() const {
    if (host_error_ == nullptr) return std::nullopt;
    volatile kernels::ErrorRecord* v = host_error_;
    if (v->ready == 0) return std::nullopt;
    std::atomic_thread_fence(std::memory_order_acquire);
    kernels::ErrorRecord r;
    std::memcpy(&r, const_cast<kernels::ErrorRecord*>(host_error_), sizeof(r));
    return r;
}

void LowLatencyRuntime::reset(int num_max_tokens, int hidden, int num_experts, uintptr_t stream) {
    auto ctx = context(num_max_tokens, hidden, num_experts);
    throw_if_failed(ll::clean(ctx, as_stream(stream)));
    last_ordered_stream_ = nullptr;
    last_send_half_ = -1;
    call_seq_ = 0;
    DEEP_EP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

void LowLatencyRuntime::clear_argument_error(uintptr_t stream) {
    auto record = read_error();
    DEEP_EP_CHECK_ARG(record.has_value() && record->code == kernels::kErrorArgumentMismatch,
                      "clear_argument_error: the error record holds no argument mismatch");
    // Claim word (0) and mismatch word (16) of the workspace; no kernel of this rank claims the record meanwhile.
    DEEP_EP_CUDA_CHECK(cudaMemsetAsync(workspace_, 0, 4, as_stream(stream)));
    DEEP_EP_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(workspace_) + 16, 0, 4, as_stream(stream)));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

void LowLatencyRuntime::destroy() {
    if (destroyed_) return;
    DEEP_EP_CUDA_CHECK(cudaDeviceSynchronize());
    ll::nvshmem_release(sym_);
    sym_ = nullptr;
    cudaFree(peers_);
    cudaFree(workspace_);
    cudaFree(mask_);
    cudaFreeHost(host_error_);
    peers_ = nullptr;
    workspace_ = nullptr;
    mask_ = nullptr;
    host_error_ = device_error_ = nullptr;
    destroyed_ = true;
}

}  // namespace deep_ep

#endif  // DEEP_EP_DISABLE_NVSHMEM
