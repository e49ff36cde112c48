// Host runtime of the intranode normal-mode kernels: allocation, IPC exchange, error record, tensors -> pointers.
#include "buffer.hpp"

#include "kernels/fused_internode.cuh"
#include "status.hpp"

#include <c10/cuda/CUDAStream.h>

#include <cuda.h>  // types of cuStreamWriteValue32 (resolved at run time through the runtime's driver entry point)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#ifndef DEEP_EP_DISABLE_NVSHMEM
#include "kernels/low_latency.cuh"  // the shared NVSHMEM world: bootstrap, symmetric allocation, peer pointers
#endif

namespace deep_ep {

namespace {

// Throws std::runtime_error naming the CUDA call, the error and the location.
void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
    if (status != cudaSuccess) {
        char text[512];
        std::snprintf(text, sizeof(text), "CUDA error %s (%d) in %s at %s:%d", cudaGetErrorString(status),
                      static_cast<int>(status), call, file, line);
        throw std::runtime_error(text);
    }
}
#define DEEP_EP_CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)

// Throws std::invalid_argument (Python ValueError) with a printf-style message.
template <typename... Args>
[[noreturn]] void invalid(const char* format, Args... args) {
    char text[512];
    std::snprintf(text, sizeof(text), format, args...);
    throw std::invalid_argument(text);
}

cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Device address of a tensor's data. An empty tensor may have a null data pointer, which the launchers read as
// "argument absent"; it gets `dummy` (valid, 16-byte aligned device memory that is never accessed for 0 rows).
template <typename T = void>
T* data_of(const at::Tensor& tensor, void* dummy) {
    void* ptr = tensor.data_ptr();
    return static_cast<T*>(ptr != nullptr ? ptr : dummy);
}

// Like data_of, and nullptr when the optional tensor is absent.
template <typename T = void>
T* ptr_or_null(const std::optional<at::Tensor>& tensor, void* dummy) {
    return tensor.has_value() ? data_of<T>(*tensor, dummy) : nullptr;
}

// Every tensor handed to a launcher must live on this runtime's device.
void check_device(const char* name, const at::Tensor& tensor, int device_id) {
    if (!tensor.is_cuda() || tensor.get_device() != device_id)
        invalid("%s must be a CUDA tensor on device %d, got %s", name, device_id, tensor.device().str().c_str());
}

void check_device(const char* name, const std::optional<at::Tensor>& tensor, int device_id) {
    if (tensor.has_value()) check_device(name, *tensor, device_id);
}

// Row data is copied in 16-byte words: the base of every row tensor must be 16-byte aligned.
void check_aligned(const char* name, const at::Tensor& tensor) {
    if (tensor.numel() > 0 && reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 != 0)
        invalid("%s must start at a 16-byte aligned address (rows are copied in 16-byte words), got a view at "
                "offset %lld elements", name, static_cast<long long>(tensor.storage_offset()));
}

void check_aligned(const char* name, const std::optional<at::Tensor>& tensor) {
    if (tensor.has_value()) check_aligned(name, *tensor);
}

const char* kernel_name(int32_t kernel) {
    switch (kernel) {
        case kernels::kKernelNotify: return "notify";
        case kernels::kKernelDispatch: return "dispatch";
        case kernels::kKernelCombine: return "combine";
        case kernels::kKernelBarrier: return "barrier";
        default: return "kernel";
    }
}

}  // namespace

std::string format_error(const kernels::ErrorRecord& r) {
    char text[512];
    // Phase names start with their kernel's name ("dispatch recv wait tail"); an unknown phase gets the kernel's.
    const char* phase = kernels::phase_name(r.phase);
    const bool known_phase = std::strcmp(phase, "unknown phase") != 0;
    std::snprintf(text, sizeof(text),
                  "%s%s%s: rank %d peer %d channel %d expected %lld observed %lld after %.3f s (%s; block %d, "
                  "call %lld)",
                  known_phase ? "" : kernel_name(r.kernel), known_phase ? "" : " ", phase, r.rank, r.peer, r.channel,
                  static_cast<long long>(r.expected), static_cast<long long>(r.observed), r.elapsed_ns * 1e-9,
                  kernels::error_code_name(r.code), r.block, static_cast<long long>(r.call_seq));
    return text;
}

Runtime::Runtime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s, bool symmetric)
    : rank_(rank),
      num_ranks_(num_ranks),
      num_nvl_bytes_(num_nvl_bytes),
      ring_bytes_(num_nvl_bytes),
      timeout_s_(timeout_s),
      symmetric_(symmetric) {
    if (num_ranks < 1 || num_ranks > kernels::kMaxRuntimeRanks)
        invalid("num_ranks must be in [1, %d] for the CUDA runtime, got %d", kernels::kMaxRuntimeRanks, num_ranks);
    if (rank < 0 || rank >= num_ranks) invalid("rank must be in [0, %d), got %d", num_ranks, rank);
    if (num_nvl_bytes <= kernels::kControlBytes || num_nvl_bytes % kernels::kBufferAlignment != 0)
        invalid("num_nvl_bytes must be a multiple of %lld larger than the %lld-byte control region, got %lld",
                static_cast<long long>(kernels::kBufferAlignment), static_cast<long long>(kernels::kControlBytes),
                static_cast<long long>(num_nvl_bytes));
    if (!(timeout_s > 0)) invalid("timeout_s (DEEP_EP_TIMEOUT_S) must be > 0, got %f", timeout_s);

    DEEP_EP_CUDA_CHECK(cudaGetDevice(&device_id_));

    // Scale-up buffer: zeroed once; the kernels keep it consistent from then on (monotonic counters, epochs).
    // A symmetric runtime gets it from the NVSHMEM heap in sync_symmetric().
    if (!symmetric_) {
        DEEP_EP_CUDA_CHECK(cudaMalloc(&local_buffer_, num_nvl_bytes_));
        DEEP_EP_CUDA_CHECK(cudaMemset(local_buffer_, 0, num_nvl_bytes_));
        DEEP_EP_CUDA_CHECK(cudaIpcGetMemHandle(&local_handle_, local_buffer_));
    }

    DEEP_EP_CUDA_CHECK(cudaMalloc(&workspace_, kernels::kWorkspaceBytes));
    DEEP_EP_CUDA_CHECK(cudaMemset(workspace_, 0, kernels::kWorkspaceBytes));

    DEEP_EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_error_), sizeof(kernels::ErrorRecord),
                                     cudaHostAllocMapped));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    DEEP_EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_error_), host_error_, 0));

    // [rows, per expert, pairs] int32, then the signatures [kMaxRuntimeRanks][kSignatureWords] int64 (8-byte
    // aligned), then the verdict word of cached dispatches (int64).
    const size_t counter_bytes = sizeof(int) * kVerdictIntOffset + sizeof(int64_t);
    DEEP_EP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_counters_), counter_bytes, cudaHostAllocMapped));
    for (int i = 0; i <= kernels::kMaxLocalExperts; ++i) host_counters_[i] = -1;
    *reinterpret_cast<int64_t*>(host_counters_ + kVerdictIntOffset) = 0;
    DEEP_EP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_counters_), host_counters_, 0));
    DEEP_EP_CUDA_CHECK(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
    DEEP_EP_CUDA_CHECK(cudaEventCreateWithFlags(&copy_event_, cudaEventDisableTiming));
    DEEP_EP_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    DEEP_EP_CUDA_CHECK(cudaDeviceSynchronize());
}

Runtime::~Runtime() {
    // Without an explicit destroy() the IPC mappings and memory are released here, without a barrier (a peer that
    // still writes into our buffer would then fault). deep_ep.Buffer calls destroy() on every rank instead.
    if (!destroyed_) {
        // Freeing symmetric memory is collective: without destroy() on every rank it is left to process exit.
        if (symmetric_) local_buffer_ = nullptr;
        try {
            destroy();
        } catch (...) {
        }
    }
}

std::string Runtime::get_local_ipc_handle() const {
    return std::string(reinterpret_cast<const char*>(&local_handle_), sizeof(local_handle_));
}

void Runtime::sync(const std::vector<int>& device_ids, const std::vector<std::string>& ipc_handles) {
    if (available_) throw std::runtime_error("Runtime::sync called twice");
    if (symmetric_) throw std::runtime_error("Runtime::sync: a symmetric runtime is synchronised by sync_symmetric");
    if (static_cast<int>(device_ids.size()) != num_ranks_ || static_cast<int>(ipc_handles.size()) != num_ranks_)
        invalid("sync needs one device id and one IPC handle per rank (%d), got %d and %d", num_ranks_,
                static_cast<int>(device_ids.size()), static_cast<int>(ipc_handles.size()));
    peer_buffers_.assign(num_ranks_, nullptr);
    for (int r = 0; r < num_ranks_; ++r) {
        if (ipc_handles[r].size() != sizeof(cudaIpcMemHandle_t))
            invalid("IPC handle of rank %d has %d bytes, expected %d", r, static_cast<int>(ipc_handles[r].size()),
                    static_cast<int>(sizeof(cudaIpcMemHandle_t)));
        if (r == rank_) {
            if (std::memcmp(ipc_handles[r].data(), &local_handle_, sizeof(local_handle_)) != 0)
                invalid("IPC handle of my own rank %d differs from the one exchanged (ranks out of order?)", r);
            peer_buffers_[r] = local_buffer_;
            continue;
        }
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, ipc_handles[r].data(), sizeof(handle));
        void* mapped = nullptr;
        cudaError_t status = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
        if (status != cudaSuccess) {
            char text[256];
            std::snprintf(text, sizeof(text),
                          "rank %d (device %d) cannot map the buffer of rank %d (device %d): %s; the ranks must share "
                          "one NVLink domain",
                          rank_, device_id_, r, device_ids[r], cudaGetErrorString(status));
            throw std::runtime_error(text);
        }
        peer_buffers_[r] = mapped;
    }
    available_ = true;
}

std::vector<int> Runtime::sync_symmetric(const std::string& unique_id) {
    if (available_ || local_buffer_ != nullptr) throw std::runtime_error("Runtime::sync_symmetric called twice");
    if (!symmetric_) throw std::runtime_error("Runtime::sync_symmetric needs a runtime built with symmetric=True");
#ifdef DEEP_EP_DISABLE_NVSHMEM
    (void)unique_id;
    throw std::runtime_error("this build has no NVSHMEM (DEEP_EP_DISABLE_NVSHMEM): no symmetric runtime");
#else
    throw_if_failed(kernels::ll::nvshmem_bootstrap(std::vector<uint8_t>(unique_id.begin(), unique_id.end()), rank_,
                                                   num_ranks_));
    throw_if_failed(kernels::ll::nvshmem_alloc_zeroed(num_nvl_bytes_, &local_buffer_));  // collective over the world
    peer_buffers_ = kernels::ll::nvshmem_peer_pointers(local_buffer_, num_ranks_);
    std::vector<int> unreachable;
    for (int r = 0; r < num_ranks_; ++r)
        if (peer_buffers_[r] == nullptr && r != rank_) unreachable.push_back(r);
    peer_buffers_[rank_] = local_buffer_;  // the kernels' own buffer, and the symmetric address of NVSHMEM calls
    return unreachable;
#endif
}

void Runtime::set_put_peers(const std::vector<int>& put_ranks, int put_area) {
    if (!symmetric_ || local_buffer_ == nullptr || available_ || destroyed_)
        throw std::runtime_error("Runtime::set_put_peers needs a symmetric runtime right after sync_symmetric");
    // The mask has a bit for every rank of the runtime (kMaxRuntimeRanks <= 64, api.cuh); each kernel family's
    // launcher checks its own group limit.
    uint64_t mask = 0;
    for (int r : put_ranks) {
        if (r < 0 || r >= num_ranks_ || r == rank_)
            invalid("put peers must be other ranks in [0, %d), got %d (this rank is %d)", num_ranks_, r, rank_);
        mask |= 1ull << r;
    }
    for (int r = 0; r < num_ranks_; ++r)
        if (peer_buffers_[r] == nullptr && !kernels::put_bit(mask, r))
            invalid("rank %d is not reachable by nvshmem_ptr from rank %d: it must be a put peer", r, rank_);
    if (put_area < kernels::kPutAreaNone || put_area > kernels::kPutAreaInRegion)
        invalid("put_area must be a kernels::PutArea in [0, 2], got %d", put_area);
    if (mask != 0 && put_area == kernels::kPutAreaNone)
        invalid("put peers (rank %d: mask 0x%llx) need the put area", rank_, static_cast<unsigned long long>(mask));
    if (put_area == kernels::kPutAreaMirror) {
        const kernels::PutLayout layout = kernels::put_layout(num_nvl_bytes_);
        if (layout.half <= 0)
            invalid("num_rdma_bytes %lld leaves no room for the rings and the put area of NVSHMEM put peers (need "
                    "more than %lld)", static_cast<long long>(num_nvl_bytes_),
                    static_cast<long long>(kernels::kControlBytes + kernels::kPutHeaderBytes));
        ring_bytes_ = layout.ring_bytes;
    } else if (put_area == kernels::kPutAreaInRegion) {
        if (num_nvl_bytes_ - kernels::kPutHeaderBytes <= kernels::kControlBytes)
            invalid("num_rdma_bytes %lld leaves no room for the kernels' region and the put area of NVSHMEM put peers "
                    "(need more than %lld)", static_cast<long long>(num_nvl_bytes_),
                    static_cast<long long>(kernels::kControlBytes + kernels::kPutHeaderBytes));
        ring_bytes_ = num_nvl_bytes_ - kernels::kPutHeaderBytes;
    }
    put_area_ = put_area;
    for (int r = 0; r < num_ranks_; ++r)
        if (kernels::put_bit(mask, r)) peer_buffers_[r] = nullptr;  // reached through NVSHMEM only
    put_mask_ = mask;
    available_ = true;
}

void Runtime::destroy() {
    if (destroyed_) return;
    destroyed_ = true;
    available_ = false;
    cudaDeviceSynchronize();
    for (int r = 0; r < static_cast<int>(peer_buffers_.size()); ++r)
        if (!symmetric_ && r != rank_ && peer_buffers_[r] != nullptr) cudaIpcCloseMemHandle(peer_buffers_[r]);
    peer_buffers_.clear();
    for (auto& block : pending_blocks_)
        for (cudaEvent_t event : block.events) cudaEventDestroy(event);
    pending_blocks_.clear();
#ifndef DEEP_EP_DISABLE_NVSHMEM
    if (symmetric_ && local_buffer_) kernels::ll::nvshmem_release(local_buffer_);  // collective
#endif
    if (!symmetric_ && local_buffer_) cudaFree(local_buffer_);
    if (workspace_) cudaFree(workspace_);
    if (host_error_) cudaFreeHost(host_error_);
    if (host_counters_) cudaFreeHost(host_counters_);
    if (order_event_) cudaEventDestroy(order_event_);
    if (copy_event_) cudaEventDestroy(copy_event_);
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    order_event_ = copy_event_ = nullptr;
    copy_stream_ = nullptr;
    local_buffer_ = workspace_ = nullptr;
    host_error_ = device_error_ = nullptr;
    host_counters_ = device_counters_ = nullptr;
    refusal_scratch_.clear();
}

void Runtime::require_available(const char* what) const {
    if (destroyed_) invalid("%s: this Buffer was destroyed", what);
    if (!available_) invalid("%s: the Buffer runtime is not synchronised with its peers yet", what);
}

cudaStream_t Runtime::current_stream() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_id_)).stream();
}

void Runtime::order(cudaStream_t waiter, cudaStream_t signaller) {
    if (waiter == signaller) return;
    DEEP_EP_CUDA_CHECK(cudaEventRecord(order_event_, signaller));
    DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(waiter, order_event_, 0));
}

kernels::KernelContext Runtime::next_context() {
    kernels::KernelContext ctx{};
    for (int r = 0; r < kernels::kMaxRuntimeRanks; ++r) ctx.buffers[r] = r < num_ranks_ ? peer_buffers_[r] : nullptr;
    ctx.workspace = workspace_;
    ctx.error = device_error_;
    ctx.num_nvl_bytes = ring_bytes_;  // the kernels' region (a put area follows it when put_mask is set)
    ctx.timeout_ns = static_cast<uint64_t>(timeout_s_ * 1e9);
    ctx.call_seq = ++call_seq_;
    ctx.rank = rank_;
    ctx.num_ranks = num_ranks_;
    ctx.skip_sends = (fault_call_seq_ > 0 && ctx.call_seq >= fault_call_seq_) ? 1 : 0;
    ctx.put_mask = put_mask_;
    ctx.put_area = put_area_;
    return ctx;
}

// ---------------------------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------------------------

std::optional<kernels::ErrorRecord> Runtime::read_error() const {
    if (host_error_ == nullptr) return std::nullopt;
    const volatile kernels::ErrorRecord* record = host_error_;
    if (record->code == kernels::kErrorNone) return std::nullopt;
    // The writer sets `ready` last; give it a moment if we caught it mid-way.
    for (int spin = 0; spin < 1000000 && record->ready == 0; ++spin) std::this_thread::yield();
    std::atomic_thread_fence(std::memory_order_acquire);
    kernels::ErrorRecord copy;
    std::memcpy(&copy, const_cast<const kernels::ErrorRecord*>(host_error_), sizeof(copy));
    return copy;
}

void Runtime::check_error() const {
    auto record = read_error();
    if (record.has_value()) throw DeviceError(format_error(*record));
}

void Runtime::reset(uintptr_t stream) {
    require_available("reset");
    auto ctx = next_context();
    throw_if_failed(kernels::intranode_reset(ctx, as_stream(stream)));
    if (fused_gpus_per_node_ > 0)
        DEEP_EP_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(local_buffer_) + kernels::kControlBytes, 0,
                                           kernels::kFusedControlEnd - kernels::kControlBytes, as_stream(stream)));
    if (fused_gpus_per_node_ > 0)
        DEEP_EP_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(workspace_) + kernels::kWsFusedBase, 0,
                                           kernels::kWsFusedEnd - kernels::kWsFusedBase,
                                           as_stream(stream)));
    DEEP_EP_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    for (int i = 0; i <= kernels::kMaxLocalExperts; ++i) host_counters_[i] = -1;
    pending_verdict_ = 0;
    copy_epoch_ = 0;
    checked_combine_seq_ = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

void Runtime::signal_abort(uintptr_t stream) {
    require_available("signal_abort");
    auto ctx = next_context();
    throw_if_failed(kernels::intranode_signal_abort(ctx, as_stream(stream)));
}

at::Tensor Runtime::get_local_buffer_tensor(at::ScalarType dtype, int64_t offset) const {
    require_available("get_local_buffer_tensor");
    if (offset < 0 || offset > num_nvl_bytes_)
        invalid("offset must be in [0, num_nvl_bytes=%lld], got %lld", static_cast<long long>(num_nvl_bytes_),
                static_cast<long long>(offset));
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    if (offset % itemsize != 0)
        invalid("offset must be a multiple of the dtype size %lld, got %lld", static_cast<long long>(itemsize),
                static_cast<long long>(offset));
    auto options = at::TensorOptions().dtype(dtype).device(at::kCUDA, device_id_);
    return at::from_blob(static_cast<char*>(local_buffer_) + offset, {(num_nvl_bytes_ - offset) / itemsize},
                         options);
}

// ---------------------------------------------------------------------------------------------------------------
// Output pool
// ---------------------------------------------------------------------------------------------------------------

void Runtime::check_pool_block(int64_t offset, int64_t num_bytes) const {
    const int64_t first = kernels::pool_offset(ring_bytes_);
    if (num_bytes <= 0 || offset < first || offset % kernels::kBufferAlignment != 0 ||
        offset + num_bytes > ring_bytes_)
        invalid("pool block [%lld, +%lld) must be 128-byte aligned, non-empty and inside the pool [%lld, %lld)",
                static_cast<long long>(offset), static_cast<long long>(num_bytes), static_cast<long long>(first),
                static_cast<long long>(ring_bytes_));
}

at::Tensor Runtime::pool_block(int64_t offset, int64_t num_bytes) {
    check_pool_block(offset, num_bytes);
    std::shared_ptr<PoolReturnQueue> queue = pool_returns_;
    const cudaStream_t wrapped_on = current_stream();
    const int device = device_id_;
    // Runs on whichever thread drops the last reference; must not throw and must not call into CUDA (it may run
    // during capture or teardown): it only queues the block.
    auto deleter = [queue, offset, wrapped_on, device](void*) {
        cudaStream_t now = wrapped_on;
        try {
            now = c10::cuda::getCurrentCUDAStream(device).stream();
        } catch (...) {
        }
        std::lock_guard<std::mutex> lock(queue->mutex);
        queue->entries.push_back({offset, {wrapped_on, now}});
    };
    auto options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_id_);
    return at::from_blob(static_cast<char*>(local_buffer_) + offset, {num_bytes}, deleter, options);
}

std::vector<int64_t> Runtime::collect_pool_blocks(uintptr_t comm_stream, bool ordered) {
    require_available("collect_pool_blocks");
    {
        std::lock_guard<std::mutex> lock(pool_returns_->mutex);
        for (const auto& entry : pool_returns_->entries)
            pending_blocks_.push_back({entry.offset, {entry.streams[0], entry.streams[1]}, {}});
        pool_returns_->entries.clear();
    }
    const cudaStream_t comm = as_stream(comm_stream), compute = current_stream();
    auto ordered_stream = [&](cudaStream_t s) { return s == comm || s == compute; };
    std::vector<int64_t> ready;
    std::vector<PendingBlock> still_pending;
    for (auto& block : pending_blocks_) {
        bool done = ordered && ordered_stream(block.streams[0]) && ordered_stream(block.streams[1]);
        if (!done && block.events.empty()) {
            // One event per distinct stream that used the block, recorded now (after the tensor's death, so
            // conservative): the block is free once all of them have completed.
            cudaStream_t streams[3] = {block.streams[0], block.streams[1], comm};
            for (int i = 0; i < 3; ++i) {
                if (std::find(streams, streams + i, streams[i]) != streams + i) continue;
                cudaEvent_t event;
                DEEP_EP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
                block.events.push_back(event);
                DEEP_EP_CUDA_CHECK(cudaEventRecord(event, streams[i]));
            }
        }
        if (!done) {
            done = true;
            for (cudaEvent_t event : block.events) {
                const cudaError_t status = cudaEventQuery(event);
                if (status == cudaErrorNotReady) {
                    done = false;
                    break;
                }
                DEEP_EP_CUDA_CHECK(status);
            }
        }
        if (!done) {
            still_pending.push_back(std::move(block));
            continue;
        }
        for (cudaEvent_t event : block.events) DEEP_EP_CUDA_CHECK(cudaEventDestroy(event));
        ready.push_back(block.offset);
    }
    pending_blocks_.swap(still_pending);
    return ready;
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> Runtime::get_dispatch_layout(const at::Tensor& topk_idx,
                                                                            int num_experts, uintptr_t stream,
                                                                            bool after_current, bool current_after) {
    require_available("get_dispatch_layout");
    check_device("topk_idx", topk_idx, device_id_);
    const int num_tokens = static_cast<int>(topk_idx.size(0));
    const auto int_options = topk_idx.options().dtype(at::kInt);
    at::Tensor num_tokens_per_rank = at::empty({num_ranks_}, int_options);
    at::Tensor num_tokens_per_expert = at::empty({num_experts}, int_options);
    at::Tensor is_token_in_rank = at::empty({num_tokens, num_ranks_}, topk_idx.options().dtype(at::kBool));
    if (after_current) order(as_stream(stream), current_stream());
    const int topk_idx_bytes = static_cast<int>(topk_idx.element_size());
    throw_if_failed(kernels::get_dispatch_layout(
        data_of(topk_idx, workspace_), topk_idx_bytes, num_tokens, static_cast<int>(topk_idx.size(1)), num_ranks_,
        num_experts, num_ranks_, data_of<int>(num_tokens_per_rank, workspace_), nullptr,
        data_of<int>(num_tokens_per_expert, workspace_), data_of<bool>(is_token_in_rank, workspace_),
        as_stream(stream)));
    if (current_after) order(current_stream(), as_stream(stream));
    return {num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank};
}

void Runtime::notify_dispatch(const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert,
                              const at::Tensor& is_token_in_rank, int num_experts, int num_channels,
                              int expert_alignment, bool worst_token_mode, const at::Tensor& rank_prefix_matrix,
                              const at::Tensor& channel_prefix_matrix, const at::Tensor& recv_channel_prefix_matrix,
                              uintptr_t stream, bool after_current, const std::vector<int64_t>& signature,
                              bool check_signatures) {
    require_available("dispatch");
    if (!signature.empty() && static_cast<int>(signature.size()) != kernels::kSignatureWords)
        invalid("notify: the call signature must have %d words, got %d", kernels::kSignatureWords,
                static_cast<int>(signature.size()));
    check_device("is_token_in_rank", is_token_in_rank, device_id_);
    check_device("num_tokens_per_rank", num_tokens_per_rank, device_id_);
    check_device("num_tokens_per_expert", num_tokens_per_expert, device_id_);
    kernels::NotifyArgs args{};
    args.num_tokens_per_rank = data_of<int>(num_tokens_per_rank, workspace_);
    args.num_tokens_per_expert = data_of<int>(num_tokens_per_expert, workspace_);
    args.is_token_in_rank = data_of<bool>(is_token_in_rank, workspace_);
    args.num_tokens = static_cast<int>(is_token_in_rank.size(0));
    args.num_experts = num_experts;
    args.num_channels = num_channels;
    args.expert_alignment = expert_alignment;
    args.rank_prefix_matrix = data_of<int>(rank_prefix_matrix, workspace_);
    args.channel_prefix_matrix = data_of<int>(channel_prefix_matrix, workspace_);
    args.recv_channel_prefix_matrix = data_of<int>(recv_channel_prefix_matrix, workspace_);
    arm_notify(args, signature, check_signatures, worst_token_mode);
    if (after_current) order(as_stream(stream), current_stream());
    auto ctx = next_context();
    throw_if_failed(kernels::intranode_notify(ctx, args, as_stream(stream)));
}

void Runtime::refuse_notify(const std::vector<int64_t>& signature, uintptr_t stream) {
    require_available("dispatch");
    if (refusal_scratch_.empty()) {
        // Allocated once and kept: the kernels only read the zeros and write the matrices nobody reads, so refusals
        // (stream-ordered on `stream`) share them.
        const auto ints = at::TensorOptions().device(at::kCUDA, device_id_).dtype(at::kInt);
        refusal_scratch_ = {at::zeros({num_ranks_}, ints), at::empty({0, num_ranks_}, ints.dtype(at::kBool)),
                            at::empty({num_ranks_, num_ranks_}, ints), at::empty({num_ranks_, 1}, ints),
                            at::empty({num_ranks_, 1}, ints)};
    }
    const auto& t = refusal_scratch_;
    // Zero tokens, one local expert, one channel, worst-token mode (nothing is published to the host counters).
    notify_dispatch(t[0], t[0], t[1], num_ranks_, 1, 1, true, t[2], t[3], t[4], stream, true, signature, false);
}

std::pair<int, std::vector<int>> Runtime::wait_recv_counts(int num_local_experts) {
    require_available("dispatch");
    if (num_local_experts < 0 || num_local_experts > kernels::kMaxLocalExperts)
        invalid("num_local_experts must be in [0, %d], got %d", kernels::kMaxLocalExperts, num_local_experts);
    // The kernels' own waits use the same budget; wait a little longer so that a device-side report (which names
    // the missing peer) wins over this host-side one.
    const double budget_s = timeout_s_ * 1.05 + 2.0;
    const auto start = std::chrono::steady_clock::now();
    const volatile int* rows = host_counters_;
    int64_t spins = 0;
    while (true) {
        if (*rows >= 0) break;
        if ((++spins & 1023) == 0) {
            check_error();
            const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > budget_s) {
                check_error();
                char text[256];
                std::snprintf(text, sizeof(text),
                              "dispatch CPU wait for notify counts: rank %d peer -1 channel -1 expected >= 0 rows "
                              "observed %d after %.1f s (timeout; DEEP_EP_TIMEOUT_S=%g)",
                              rank_, *rows, waited, timeout_s_);
                throw HostTimeout(text);
            }
            if (spins > (1 << 20)) std::this_thread::yield();
        }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    check_error();
    const int num_recv_tokens = *rows;
    std::vector<int> per_expert(num_local_experts);
    for (int i = 0; i < num_local_experts; ++i) per_expert[i] = static_cast<const volatile int*>(host_counters_)[1 + i];
    return {num_recv_tokens, per_expert};
}

void Runtime::await_agreement() {
    if (pending_verdict_ == 0) return;
    require_available("dispatch");
    const int64_t target = pending_verdict_;
    pending_verdict_ = 0;
    const double budget_s = timeout_s_ * 1.05 + 2.0;  // the kernel's own waits report first (they name the peer)
    const auto start = std::chrono::steady_clock::now();
    const volatile int64_t* verdict = reinterpret_cast<const volatile int64_t*>(host_counters_ + kVerdictIntOffset);
    for (int64_t spins = 0; *verdict < target; ++spins) {
        if ((spins & 1023) == 1023) {
            if (read_error().has_value()) return;  // the caller raises it
            const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > budget_s) {
                char text[256];
                std::snprintf(text, sizeof(text),
                              "CPU wait for the agreement verdict of a cached dispatch or combine: rank %d peer -1 "
                              "channel -1 expected call %lld observed %lld after %.1f s (timeout; "
                              "DEEP_EP_TIMEOUT_S=%g)",
                              rank_, static_cast<long long>(target), static_cast<long long>(*verdict), waited,
                              timeout_s_);
                throw HostTimeout(text);
            }
            if (spins > (1 << 20)) std::this_thread::yield();
        }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
}

std::vector<int64_t> Runtime::gathered_signatures() const {
    std::vector<int64_t> words(static_cast<size_t>(num_ranks_) * kernels::kSignatureWords);
    const volatile int64_t* source = reinterpret_cast<const volatile int64_t*>(host_counters_ + kSignatureIntOffset);
    for (size_t i = 0; i < words.size(); ++i) words[i] = source[i];
    return words;
}

void Runtime::clear_argument_error(uintptr_t stream) {
    require_available("clear_argument_error");
    auto record = read_error();
    if (!record.has_value() || record->code != kernels::kErrorArgumentMismatch)
        invalid("clear_argument_error: the error record holds no argument mismatch");
    // A combine the ranks disagreed on: every rank continues from the copy epoch after it, whichever send path it
    // took (every rank's kernel freed its landing zones of that epoch).
    if (record->kernel == kernels::kKernelCombine && record->call_seq == checked_combine_seq_ &&
        put_area_ == kernels::kPutAreaNone)
        copy_epoch_ = checked_combine_epoch_ + 1u;
    // The claim word frees the record for the kernels once the stream reaches it; until then no kernel of this rank
    // can claim the record, so it is zeroed here at once.
    DEEP_EP_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(workspace_) + kernels::kWsErrorClaimOffset, 0, 4,
                                       as_stream(stream)));
    std::memset(host_error_, 0, sizeof(kernels::ErrorRecord));
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

std::vector<int64_t> Runtime::pair_counts() const {
    std::vector<int64_t> counts(static_cast<size_t>(num_ranks_) * num_ranks_);
    const volatile int* pairs = host_counters_ + 1 + kernels::kMaxLocalExperts;
    for (size_t i = 0; i < counts.size(); ++i) counts[i] = pairs[i];
    return counts;
}

std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
Runtime::dispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                  const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                  int num_experts, const at::Tensor& is_token_in_rank, const at::Tensor& rank_prefix_matrix,
                  const at::Tensor& channel_prefix_matrix, const at::Tensor& recv_channel_prefix_matrix,
                  const at::Tensor& send_head, int num_recv_rows, const std::optional<at::Tensor>& given_recv_src_idx,
                  int64_t direct_data_offset, int64_t direct_meta_offset, bool worst_token_mode, int num_channels,
                  int num_max_send_tokens, int num_max_recv_tokens, int num_send_warps, uintptr_t stream,
                  bool after_current, bool current_after, int64_t signature_hash) {
    require_available("dispatch");
    if (signature_hash != 0 && !given_recv_src_idx.has_value())
        invalid("dispatch: signature_hash is for cached calls (a non-cached call's notify compares signatures)");
    if (num_recv_rows < 0) invalid("dispatch: num_recv_rows must be >= 0, got %d", num_recv_rows);
    if (direct_meta_offset >= 0 && (direct_data_offset < 0 || given_recv_src_idx.has_value()))
        invalid("dispatch: direct_meta_offset %lld needs direct_data_offset (got %lld) and no handle.recv_src_idx",
                static_cast<long long>(direct_meta_offset), static_cast<long long>(direct_data_offset));
    const int64_t rows = num_recv_rows;
    const int64_t num_scales = x_scales.has_value() ? x_scales->size(1) : 0;
    const int64_t num_topk = topk_idx.has_value() ? topk_idx->size(1) : 0;
    const int topk_idx_bytes = topk_idx.has_value() ? static_cast<int>(topk_idx->element_size()) : 8;
    const auto sections = kernels::dispatch_output_layout(rows, x.size(1) * static_cast<int64_t>(x.element_size()),
                                                          static_cast<int>(num_scales), static_cast<int>(num_topk),
                                                          topk_idx_bytes);
    // Pool blocks become tensors before anything else can throw: from here on, whatever happens, each block goes
    // back to the caller's pool through its tensor's deleter and collect_pool_blocks.
    at::Tensor data_block, meta_block;
    if (direct_meta_offset >= 0) check_pool_block(direct_meta_offset, rows * 4);
    if (direct_data_offset >= 0) data_block = pool_block(direct_data_offset, sections.total);
    if (direct_meta_offset >= 0) meta_block = pool_block(direct_meta_offset, rows * 4);

    check_device("x", x, device_id_);
    check_device("x_scales", x_scales, device_id_);
    check_device("topk_idx", topk_idx, device_id_);
    check_device("topk_weights", topk_weights, device_id_);
    check_device("is_token_in_rank", is_token_in_rank, device_id_);
    check_device("handle.rank_prefix_matrix", rank_prefix_matrix, device_id_);
    check_device("handle.channel_prefix_matrix", channel_prefix_matrix, device_id_);
    check_device("handle.recv_channel_prefix_matrix", recv_channel_prefix_matrix, device_id_);
    check_device("handle.send_head", send_head, device_id_);
    check_aligned("x", x);
    check_device("handle.recv_src_idx", given_recv_src_idx, device_id_);
    at::Tensor recv_x;
    std::optional<at::Tensor> recv_x_scales, recv_topk_idx, recv_topk_weights;
    if (data_block.defined()) {
        // Direct-to-output: the outputs are views of one pool block, whose byte offset the receivers publish to
        // the senders (the kernel's DispatchOutputWord), laid out as dispatch_output_layout says.
        if (x_scales.has_value() && x_scales->element_size() != 4)
            invalid("dispatch: direct-to-output needs 4-byte scales, got %d-byte",
                    static_cast<int>(x_scales->element_size()));
        auto section = [&](int64_t begin, at::ScalarType dtype, int64_t cols) {
            return data_block.narrow(0, begin, rows * cols * c10::elementSize(dtype)).view(dtype).view({rows, cols});
        };
        recv_x = section(0, x.scalar_type(), x.size(1));
        if (x_scales.has_value()) recv_x_scales = section(sections.scales, x_scales->scalar_type(), num_scales);
        if (topk_idx.has_value()) {
            recv_topk_idx = section(sections.topk_idx, topk_idx->scalar_type(), num_topk);
            recv_topk_weights = section(sections.topk_weights, at::kFloat, num_topk);
        }
    } else {
        recv_x = at::empty({rows, x.size(1)}, x.options());
        if (x_scales.has_value()) recv_x_scales = at::empty({rows, num_scales}, x_scales->options());
        if (topk_idx.has_value()) {
            recv_topk_idx = at::empty({rows, num_topk}, topk_idx->options());
            recv_topk_weights = at::empty({rows, num_topk}, x.options().dtype(at::kFloat));
        }
    }
    at::Tensor recv_src_idx;
    if (given_recv_src_idx.has_value())
        recv_src_idx = *given_recv_src_idx;
    else if (meta_block.defined())
        recv_src_idx = meta_block.view(at::kInt);
    else
        recv_src_idx = at::empty({rows}, x.options().dtype(at::kInt));
    check_aligned("recv_x", recv_x);
    kernels::DispatchArgs args{};
    args.x = data_of(x, workspace_);
    args.hidden_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
    args.x_scales = ptr_or_null<const void>(x_scales, workspace_);
    args.num_scales = x_scales.has_value() ? static_cast<int>(x_scales->size(1)) : 0;
    args.scale_token_stride = x_scales.has_value() ? x_scales->stride(0) : 0;
    args.scale_hidden_stride = x_scales.has_value() ? x_scales->stride(1) : 0;
    args.topk_idx = ptr_or_null<const void>(topk_idx, workspace_);
    args.topk_weights = ptr_or_null<const float>(topk_weights, workspace_);
    args.num_topk = topk_idx.has_value() ? static_cast<int>(topk_idx->size(1)) : 0;
    args.topk_idx_bytes = topk_idx.has_value() ? static_cast<int>(topk_idx->element_size())
                                               : (recv_topk_idx.has_value() ? static_cast<int>(recv_topk_idx->element_size()) : 8);
    args.num_experts = num_experts;
    args.is_token_in_rank = data_of<bool>(is_token_in_rank, workspace_);
    args.num_tokens = static_cast<int>(x.size(0));
    args.rank_prefix_matrix = data_of<int>(rank_prefix_matrix, workspace_);
    args.channel_prefix_matrix = data_of<int>(channel_prefix_matrix, workspace_);
    args.recv_channel_prefix_matrix = data_of<int>(recv_channel_prefix_matrix, workspace_);
    args.send_head = data_of<int>(send_head, workspace_);
    args.recv_x = data_of(recv_x, workspace_);
    args.recv_x_scales = ptr_or_null(recv_x_scales, workspace_);
    args.recv_src_idx = data_of<int>(recv_src_idx, workspace_);
    args.recv_topk_idx = ptr_or_null(recv_topk_idx, workspace_);
    args.recv_topk_weights = ptr_or_null<float>(recv_topk_weights, workspace_);
    args.num_recv_rows = static_cast<int>(recv_x.size(0));
    args.worst_token_mode = worst_token_mode ? 1 : 0;
    args.num_channels = num_channels;
    args.num_max_send_tokens = num_max_send_tokens;
    args.num_max_recv_tokens = num_max_recv_tokens;
    args.num_send_warps = num_send_warps;
    args.direct_data_offset = direct_data_offset;
    args.direct_meta_offset = direct_meta_offset;
    args.agreement_gate = given_recv_src_idx.has_value() ? 0 : 1;  // a non-cached dispatch follows its notify
    args.signature_hash = static_cast<uint32_t>(signature_hash);
    args.host_verdict = nullptr;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    DEEP_EP_CUDA_CHECK(cudaStreamIsCapturing(as_stream(stream), &capture));
    const bool verdict = signature_hash != 0 && capture == cudaStreamCaptureStatusNone;
    if (verdict) args.host_verdict = reinterpret_cast<int64_t*>(device_counters_ + kVerdictIntOffset);
    if (after_current) order(as_stream(stream), current_stream());
    auto ctx = next_context();
    throw_if_failed(kernels::intranode_dispatch(ctx, args, as_stream(stream)));
    if (verdict) pending_verdict_ = ctx.call_seq;
    if (current_after) order(current_stream(), as_stream(stream));
    return {recv_x, recv_x_scales, recv_src_idx, recv_topk_idx, recv_topk_weights};
}

bool Runtime::is_capturing(cudaStream_t stream) const {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    DEEP_EP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    return capture != cudaStreamCaptureStatusNone;
}

std::pair<at::Tensor, std::optional<at::Tensor>> Runtime::combine(
    const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias_0,
    const std::optional<at::Tensor>& bias_1, const at::Tensor& rank_prefix_matrix,
    const at::Tensor& recv_channel_prefix_matrix, const at::Tensor& send_head, int num_channels,
    int num_max_send_tokens, int num_max_recv_tokens, int num_send_warps, uintptr_t stream, bool after_current,
    bool current_after, const std::optional<at::Tensor>& channel_prefix_matrix,
    const std::vector<int64_t>& pair_counts, int copy_ctas, int copy_chunk_rows, bool zone,
    int64_t signature_hash) {
    require_available("combine");
    check_device("x", x, device_id_);
    check_device("topk_weights", topk_weights, device_id_);
    check_device("bias[0]", bias_0, device_id_);
    check_device("bias[1]", bias_1, device_id_);
    check_device("handle.rank_prefix_matrix", rank_prefix_matrix, device_id_);
    check_device("handle.recv_channel_prefix_matrix", recv_channel_prefix_matrix, device_id_);
    check_device("handle.send_head", send_head, device_id_);
    check_aligned("x", x);
    check_aligned("bias[0]", bias_0);
    check_aligned("bias[1]", bias_1);
    if (x.scalar_type() != at::kBFloat16) invalid("combine x must be torch.bfloat16, got %s", c10::toString(x.scalar_type()));
    const int64_t num_tokens = send_head.size(0);
    at::Tensor combined_x = at::empty({num_tokens, x.size(1)}, x.options());
    std::optional<at::Tensor> combined_topk_weights;
    if (topk_weights.has_value())
        combined_topk_weights = at::empty({num_tokens, topk_weights->size(1)}, x.options().dtype(at::kFloat));
    check_aligned("combined_x", combined_x);
    kernels::CombineArgs args{};
    args.x = data_of(x, workspace_);
    args.hidden = static_cast<int>(x.size(1));
    args.num_recv_tokens = static_cast<int>(x.size(0));
    args.topk_weights = ptr_or_null<const float>(topk_weights, workspace_);
    args.num_topk = topk_weights.has_value() ? static_cast<int>(topk_weights->size(1)) : 0;
    args.bias_0 = ptr_or_null<const void>(bias_0, workspace_);
    args.bias_1 = ptr_or_null<const void>(bias_1, workspace_);
    args.rank_prefix_matrix = data_of<int>(rank_prefix_matrix, workspace_);
    args.recv_channel_prefix_matrix = data_of<int>(recv_channel_prefix_matrix, workspace_);
    args.send_head = data_of<int>(send_head, workspace_);
    args.num_tokens = static_cast<int>(num_tokens);
    args.combined_x = data_of(combined_x, workspace_);
    args.combined_topk_weights = ptr_or_null<float>(combined_topk_weights, workspace_);
    args.num_channels = num_channels;
    args.num_max_send_tokens = num_max_send_tokens;
    args.num_max_recv_tokens = num_max_recv_tokens;
    args.num_send_warps = num_send_warps;
    args.copy_epoch = copy_epoch_;
    if (after_current) order(as_stream(stream), current_stream());
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    DEEP_EP_CUDA_CHECK(cudaStreamIsCapturing(as_stream(stream), &capture));
    const bool awaited = arm_checked_call(args, signature_hash, capture != cudaStreamCaptureStatusNone);
    // A mismatched ring kernel frees this rank's landing zones of the epoch every rank takes on after it (a captured
    // combine, which takes no landing zones, frees none: its replays would carry the capture's epoch). With a put
    // area no combine goes through landing zones (would_copy), so the copy epoch stays.
    args.mismatch_freed = awaited && put_area_ == kernels::kPutAreaNone ? copy_epoch_ + 1u : 0u;
    const uint32_t epoch_before = copy_epoch_;
    auto ctx = next_context();
    if (copy_ctas > 0 && channel_prefix_matrix.has_value() && capture == cudaStreamCaptureStatusNone &&
        would_copy(pair_counts, args.hidden, args.num_topk)) {
        check_device("handle.channel_prefix_matrix", channel_prefix_matrix, device_id_);
        args.channel_prefix_matrix = data_of<int>(*channel_prefix_matrix, workspace_);
        if (zone) {
            // Zone senders: the same landing zones and epochs, the rows stored by this kernel's own sender warps.
            args.copy_epoch = ++copy_epoch_;
            throw_if_failed(kernels::intranode_combine_landed(ctx, args, copy_ctas, true, as_stream(stream)));
        } else {
            combine_by_copy(ctx, args, pair_counts, copy_ctas, copy_chunk_rows, as_stream(stream));
        }
    } else {
        throw_if_failed(kernels::intranode_combine(ctx, args, as_stream(stream)));
    }
    if (awaited) {
        pending_verdict_ = ctx.call_seq;
        checked_combine_seq_ = ctx.call_seq;
        checked_combine_epoch_ = epoch_before;
    }
    if (current_after) order(current_stream(), as_stream(stream));
    return {combined_x, combined_topk_weights};
}

namespace {

// cuStreamWriteValue32 from the driver the runtime uses (no link against libcuda), or null where it is missing.
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
WriteValue32 driver_write_value32() {
    static const WriteValue32 fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &p, 12000, cudaEnableDefault, &found) !=
                cudaSuccess || found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return static_cast<WriteValue32>(nullptr);
        }
        return reinterpret_cast<WriteValue32>(p);
    }();
    return fn;
}

}  // namespace

void Runtime::publish_landed(const kernels::KernelContext& ctx, const kernels::LandedFlags& flags) {
    // A stream write (with its default memory barrier after the chunk's copies) costs no kernel launch; the flag
    // kernel is the fallback where the driver refuses it.
    WriteValue32 write = stream_writes_ ? driver_write_value32() : nullptr;
    if (write != nullptr) {
        for (int d = 0; d < num_ranks_ && write != nullptr; ++d) {
            if (flags.values[d] == 0u) continue;
            auto* word = static_cast<char*>(peer_buffers_[d]) + kernels::kCombineLandedOffset + 4 * rank_;
            if (write(reinterpret_cast<CUstream>(copy_stream_), reinterpret_cast<CUdeviceptr>(word), flags.values[d],
                      CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
                stream_writes_ = false;  // e.g. stream memory operations disabled: flag kernels from now on
                write = nullptr;
                kernels::LandedFlags rest{};
                for (int r = d; r < num_ranks_; ++r) rest.values[r] = flags.values[r];
                throw_if_failed(kernels::intranode_combine_copy_flag(ctx, rest, copy_stream_));
            }
        }
        return;
    }
    throw_if_failed(kernels::intranode_combine_copy_flag(ctx, flags, copy_stream_));
}

bool Runtime::would_copy(const std::vector<int64_t>& pair_counts, int hidden, int num_topk) const {
    const int R = num_ranks_;
    // Put peers have no pointer to copy into: a world with any combines through the rings on every rank.
    if (R < 2 || put_area_ != kernels::kPutAreaNone || static_cast<int>(pair_counts.size()) != R * R) return false;
    // The landing zone at owner o for source s holds the rows o sent to s.
    for (int o = 0; o < R; ++o)
        for (int s = 0; s < R; ++s)
            if (o != s &&
                !kernels::combine_landing_zone(ring_bytes_, R, s, pair_counts[o * R + s], hidden, num_topk).fits)
                return false;
    return true;
}

void Runtime::combine_by_copy(const kernels::KernelContext& ctx, kernels::CombineArgs& args,
                              const std::vector<int64_t>& pair_counts, int copy_ctas, int chunk_rows,
                              cudaStream_t stream) {
    const int R = num_ranks_, me = rank_;
    args.copy_epoch = ++copy_epoch_;
    // The copies and their flags are enqueued before the reducing kernel that spins on them: streams can share a
    // hardware queue (CUDA_DEVICE_MAX_CONNECTIONS), and work queued behind a spinning kernel would never start.
    DEEP_EP_CUDA_CHECK(cudaEventRecord(copy_event_, stream));
    DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, copy_event_, 0));
    throw_if_failed(kernels::intranode_combine_copy_prepare(ctx, args.copy_epoch, copy_stream_));
    // My receive block from d: x rows [first[d], first[d] + rows[d]), in d's token order; it lands in my zone at d.
    std::vector<int64_t> first(R), rows(R);
    std::vector<kernels::CombineLandingZone> zones(R);
    int64_t acc = 0, most = 0;
    for (int d = 0; d < R; ++d) {
        first[d] = acc;
        rows[d] = pair_counts[d * R + me];
        acc += rows[d];
        if (d != me) most = std::max(most, rows[d]);
        zones[d] = kernels::combine_landing_zone(ring_bytes_, R, me, rows[d], args.hidden, args.num_topk);
    }
    const int64_t row_bytes = static_cast<int64_t>(args.hidden) * 2;
    const char* x = static_cast<const char*>(args.x);
    if (ctx.skip_sends == 0) {
        for (int d = 0; d < R; ++d) {
            if (d == me || rows[d] == 0 || args.num_topk == 0) continue;
            DEEP_EP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(peer_buffers_[d]) + zones[d].weights,
                                               args.topk_weights + first[d] * args.num_topk,
                                               rows[d] * args.num_topk * 4, cudaMemcpyDeviceToDevice, copy_stream_));
        }
        // Chunks grow from 1/8 of chunk_rows so that the reducers start early, then stay at chunk_rows.
        const int64_t full = std::max<int64_t>(chunk_rows, 8);
        int64_t done = 0, chunk = std::max<int64_t>(full / 8, 1);
        while (done < most) {
            const int64_t end = std::min(most, done + chunk);
            kernels::LandedFlags flags{};
            for (int d = 0; d < R; ++d) {
                if (d == me || done >= rows[d]) continue;
                const int64_t stop = std::min(end, rows[d]);
                DEEP_EP_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(peer_buffers_[d]) + zones[d].data + done * row_bytes,
                                                   x + (first[d] + done) * row_bytes, (stop - done) * row_bytes,
                                                   cudaMemcpyDeviceToDevice, copy_stream_));
                flags.values[d] = (args.copy_epoch << kernels::kLandedRowBits) | static_cast<uint32_t>(stop);
            }
            publish_landed(ctx, flags);
            done = end;
            chunk = std::min(full, chunk * 2);
        }
    }
    throw_if_failed(kernels::intranode_combine_landed(ctx, args, copy_ctas, false, stream));
    DEEP_EP_CUDA_CHECK(cudaEventRecord(copy_event_, copy_stream_));
    DEEP_EP_CUDA_CHECK(cudaStreamWaitEvent(stream, copy_event_, 0));
}

void Runtime::barrier(uintptr_t stream) {
    require_available("barrier");
    auto ctx = next_context();
    throw_if_failed(kernels::intranode_barrier(ctx, as_stream(stream)));
}

}  // namespace deep_ep
