// Host runtime of the intranode normal-mode kernels (one object per deep_ep.Buffer and rank).
//
// Owns:
//   * the scale-up (NVLink) buffer of `num_nvl_bytes`, allocated with cudaMalloc and shared with the other ranks of
//     the node through CUDA IPC handles (several ranks may share one GPU: IPC works between processes on one device);
//     or, for a `symmetric` runtime (internode groups of one GPU per node, deep_ep/cuda_internode.py), the same
//     bytes on the NVSHMEM symmetric heap, every peer reached through nvshmem_ptr (see sync_symmetric);
//   * the device table of peer buffer pointers (index = rank);
//   * a zeroed device workspace for the kernels' private state (ring shadows, epochs, call sequence words);
//   * host-mapped memory: the error record the kernels fill instead of trapping, and the counters the notify kernel
//     publishes for the CPU (received-token total and per-local-expert counts).
//
// It never allocates output tensors and never touches streams other than the one it is given: the Python side
// (deep_ep/cuda_backend.py) owns allocation and the stream protocol of the spec, and passes raw streams here.
// Every host wait is bounded by `timeout_s` and reports through a structured exception (see HostTimeout).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/api.cuh"

namespace deep_ep {

// Thrown by host-side bounded waits; python_api.cpp maps it to a Python exception type. `what()` names rank, phase
// and the awaited values.
class HostTimeout : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

// Thrown when the device error record is set (a kernel-side wait timed out, a peer aborted, or routing was bad).
class DeviceError : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

class Runtime {
   public:
    // `symmetric`: the buffer comes from the NVSHMEM symmetric heap in sync_symmetric() instead of cudaMalloc + IPC.
    Runtime(int rank, int num_ranks, int64_t num_nvl_bytes, double timeout_s, bool symmetric = false);
    ~Runtime();
    Runtime(const Runtime&) = delete;
    Runtime& operator=(const Runtime&) = delete;

    // ---- bootstrap (collective through the Python process group) ----
    int get_local_device_id() const { return device_id_; }
    int get_num_device_sms() const { return num_device_sms_; }
    int get_rank() const { return rank_; }
    int get_num_ranks() const { return num_ranks_; }
    int64_t get_num_nvl_bytes() const { return num_nvl_bytes_; }
    // Opaque CUDA IPC handle of this rank's scale-up buffer (empty if num_nvl_bytes == 0).
    std::string get_local_ipc_handle() const;
    // Opens every peer's buffer and uploads the pointer table. `ipc_handles[rank]` must equal our own handle.
    void sync(const std::vector<int>& device_ids, const std::vector<std::string>& ipc_handles);
    // Symmetric runtime only (collective over the NVSHMEM world of all ranks, PE = rank): joins the world of
    // `unique_id` (shared with the low-latency runtime: one world per process), allocates the zeroed buffer on the
    // symmetric heap and maps every peer's copy with nvshmem_ptr. Returns the ranks whose buffer is not load/store
    // reachable (a remote transport; the put path is not implemented); the runtime is usable only if none, else
    // the caller agrees with its peers and calls destroy() on every rank.
    std::vector<int> sync_symmetric(const std::string& unique_id);
    bool is_symmetric() const { return symmetric_; }
    bool is_available() const { return available_; }
    // Releases the IPC mappings and allocations. Call after a cross-rank barrier so no peer still writes here.
    void destroy();

    // ---- errors ----
    // Returns the filled error record, or nothing. Never blocks (reads host-mapped memory).
    std::optional<kernels::ErrorRecord> read_error() const;
    // Throws DeviceError (message naming rank, peer, channel, phase, expected, observed) if the record is set.
    void check_error() const;
    // Zeroes this rank's control region and workspace on `stream`, waits for it, and clears the error record.
    // Collective: every rank calls it between two host barriers, with no kernel of this Buffer in flight.
    void reset(uintptr_t stream);
    // Sets the abort word of every rank (after a host-side failure, so peers stop waiting early).
    void signal_abort(uintptr_t stream);
    // Test hook: from host call number `call_seq` on (>= 1), this rank's kernels skip their sends (0 = off).
    void set_fault_injection(int64_t call_seq) { fault_call_seq_ = call_seq; }
    int64_t get_call_seq() const { return call_seq_; }

    // ---- buffer views ----
    // The local buffer from byte `offset` as a 1-D tensor of (num_nvl_bytes - offset) / itemsize elements.
    at::Tensor get_local_buffer_tensor(at::ScalarType dtype, int64_t offset) const;

    // ---- kernels; tensors are CUDA tensors on this device, already validated by the Python front ----
    void get_dispatch_layout(const at::Tensor& topk_idx, int num_experts, const at::Tensor& num_tokens_per_rank,
                             const at::Tensor& num_tokens_per_expert, const at::Tensor& is_token_in_rank,
                             uintptr_t stream);

    // Non-cached notify. Fills rank_prefix_matrix [R, R], channel_prefix_matrix [R, C] and
    // recv_channel_prefix_matrix [R, C] (int32) and, unless in worst-token mode, publishes the counts to the host.
    void notify_dispatch(const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert,
                         const at::Tensor& is_token_in_rank, int num_experts, int num_channels, int expert_alignment,
                         bool worst_token_mode, const at::Tensor& rank_prefix_matrix,
                         const at::Tensor& channel_prefix_matrix, const at::Tensor& recv_channel_prefix_matrix,
                         uintptr_t stream);

    // Bounded CPU wait for the counts of the last non-worst notify: (rows received, aligned per-local-expert counts).
    std::pair<int, std::vector<int>> wait_recv_counts(int num_local_experts);

    void dispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                  const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                  int num_experts, const at::Tensor& is_token_in_rank, const at::Tensor& rank_prefix_matrix,
                  const at::Tensor& recv_channel_prefix_matrix, const at::Tensor& send_head, const at::Tensor& recv_x,
                  const std::optional<at::Tensor>& recv_x_scales, const at::Tensor& recv_src_idx,
                  const std::optional<at::Tensor>& recv_topk_idx, const std::optional<at::Tensor>& recv_topk_weights,
                  bool worst_token_mode, int num_channels, int num_max_send_tokens, int num_max_recv_tokens,
                  int num_send_warps, uintptr_t stream);

    void combine(const at::Tensor& x, const std::optional<at::Tensor>& topk_weights,
                 const std::optional<at::Tensor>& bias_0, const std::optional<at::Tensor>& bias_1,
                 const at::Tensor& rank_prefix_matrix, const at::Tensor& recv_channel_prefix_matrix,
                 const at::Tensor& send_head, const at::Tensor& combined_x,
                 const std::optional<at::Tensor>& combined_topk_weights, int num_channels, int num_max_send_tokens,
                 int num_max_recv_tokens, int num_send_warps, uintptr_t stream);

    // Bounded cross-rank barrier kernel on `stream`.
    void barrier(uintptr_t stream);

   private:
    int rank_, num_ranks_;
    int64_t num_nvl_bytes_;
    double timeout_s_;
    int device_id_ = -1;
    int num_device_sms_ = 0;
    bool symmetric_ = false;
    bool available_ = false;
    bool destroyed_ = false;
    int64_t call_seq_ = 0;
    int64_t fault_call_seq_ = 0;

    void* local_buffer_ = nullptr;          // num_nvl_bytes_ of device memory, IPC-exported (or symmetric)
    cudaIpcMemHandle_t local_handle_{};
    std::vector<void*> peer_buffers_;        // [num_ranks_]; own rank = local_buffer_, others IPC-opened
    void* workspace_ = nullptr;              // kernels::kWorkspaceBytes of zeroed device memory

    kernels::ErrorRecord* host_error_ = nullptr;    // host-mapped error record
    kernels::ErrorRecord* device_error_ = nullptr;  // its device alias
    int* host_counters_ = nullptr;                  // host-mapped [1 + kMaxLocalExperts]: rows, then per expert
    int* device_counters_ = nullptr;

    // Context of the next launch; increments the call counter.
    kernels::KernelContext next_context();
    void require_available(const char* what) const;
};

// Human-readable text of a filled error record: "<kernel> <phase>: rank R peer P channel C expected E observed O
// after T s (<code>)".
std::string format_error(const kernels::ErrorRecord& record);

}  // namespace deep_ep
