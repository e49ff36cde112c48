// Host runtime of the low-latency (LL) kernels: NVSHMEM world and symmetric buffer, workspace, host-mapped error
// record, shrink mask; turns tensors into pointers for csrc/kernels/low_latency.cuh. One object per deep_ep.Buffer.
//
// The Python low-latency backend owns the double-buffer parity, the receive hook and the
// asynchronous-call bookkeeping. To keep the host path to one Python->C++ crossing per call, `dispatch` / `combine`
// allocate their outputs (at::empty on the current stream, as torch.empty would) and do the plain stream waits of
// the protocol with one reusable event. Construction is collective (every rank, same sizes).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/low_latency.cuh"

namespace deep_ep {

// 128-byte NVSHMEM unique id of a new world (rank 0 makes it; the others receive it through the process group).
std::string ll_unique_id();

class LowLatencyRuntime {
   public:
    // put_only: reach every other rank through NVSHMEM put-with-signal (the RDMA path), even where nvshmem_ptr
    // resolves it (tests and benchmarks run that path on one host).
    LowLatencyRuntime(int rank, int num_ranks, int64_t num_rdma_bytes, double timeout_s, bool enable_shrink,
                      const std::string& unique_id, bool put_only = false);
    ~LowLatencyRuntime();
    LowLatencyRuntime(const LowLatencyRuntime&) = delete;
    LowLatencyRuntime& operator=(const LowLatencyRuntime&) = delete;

    bool all_p2p() const { return all_p2p_; }
    int num_blocks() const { return num_blocks_; }
    // Bytes the kernels need for (T, H, E); throws std::invalid_argument when num_rdma_bytes is too small.
    int64_t required_bytes(int num_max_tokens, int hidden, int num_experts) const;

    // Launches the phases `phases` (1 send, 2 receive, 3 both). `comm_stream` == 0: on the current stream, no
    // waits (the receive hook's launches). Otherwise on `comm_stream`, after it waited for the current stream; then,
    // with `current_after`, the current stream waits for it (a synchronous call).
    // Outputs: `outputs` empty allocates them; else they are the ones a send launch returned (receive hook).
    // `signature_hash`: the call's signature hash (DispatchArgs::signature_hash; the same for both launches).
    // Returns (recv_x, recv_scales or None, packed_recv_count, src_info, layout_range).
    std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> dispatch(
        const at::Tensor& x, const at::Tensor& topk_idx, int num_max_tokens, int num_experts,
        const std::optional<at::Tensor>& cumulative_stats, const std::optional<at::Tensor>& wait_stats, bool use_fp8,
        bool round_scale, bool use_ue8m0, int half, int phases, uintptr_t comm_stream, bool current_after,
        const std::vector<at::Tensor>& outputs, uint32_t signature_hash);
    // Same streams as dispatch; `out` absent allocates the [N, H] BF16 output. Returns it.
    // `signature_hash`: the call's signature hash (CombineArgs::signature_hash; the same for both launches).
    at::Tensor combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                       const at::Tensor& src_info, const at::Tensor& layout_range, int num_max_tokens, int num_experts,
                       bool use_logfmt, bool zero_copy, const std::optional<at::Tensor>& out,
                       const std::optional<at::Tensor>& wait_stats, int half, int phases, uintptr_t comm_stream,
                       bool current_after, uint32_t signature_hash);
    // This rank refused a combine of (T, H, E) that its peers make: tells every peer (on the current stream) and
    // records the refusal, so that no rank waits for its rows and every rank's LL calls raise until clean.
    void refuse_combine(int num_max_tokens, int hidden, int num_experts, uint32_t signature_hash);
    // BF16 [L, R*T, H] view (row stride H + H/64) of the combine send area of `half`.
    at::Tensor combine_buffer(int num_max_tokens, int hidden, int num_experts, int half);
    // Bounded barrier, zero every control word and the workspace, bounded barrier (on `stream`); the call numbers
    // of error records restart (the ranks may have made different numbers of calls before a clean).
    void clean(int num_max_tokens, int hidden, int num_experts, uintptr_t stream);
    void barrier(uintptr_t stream);

    // Shrink mask (device int32 [R]); operations run on `stream`.
    void update_mask(int rank, bool mask, uintptr_t stream);
    void query_mask(const at::Tensor& out, uintptr_t stream) const;
    void clean_mask(uintptr_t stream);

    std::optional<kernels::ErrorRecord> read_error() const;
    // After an error: zero the control words, workspace and abort word, then the error record (no barrier: every
    // rank calls it between two host barriers, with no LL kernel in flight); the call numbers restart, as in clean.
    void reset(int num_max_tokens, int hidden, int num_experts, uintptr_t stream);
    // Zero an error record that holds kErrorArgumentMismatch (no rank aborted) and, on `stream`, the claim and
    // mismatch words, so that the LL kernels run again; after `clean` (which puts the arrival bases back in step).
    void clear_argument_error(uintptr_t stream);
    void destroy();

   private:
    int rank_, num_ranks_;
    int64_t num_rdma_bytes_;
    double timeout_s_;
    bool enable_shrink_;
    int device_id_ = -1;
    int num_blocks_ = 0;
    bool all_p2p_ = true;
    bool destroyed_ = false;
    int64_t call_seq_ = 0;  // LL calls since construction, the last clean or reset (error records' call number)
    void* sym_ = nullptr;
    void** peers_ = nullptr;  // device [R]
    void* workspace_ = nullptr;
    int* mask_ = nullptr;
    kernels::ErrorRecord* host_error_ = nullptr;
    kernels::ErrorRecord* device_error_ = nullptr;
    cudaEvent_t order_event_ = nullptr;  // reused by order(): a wait snapshots the event's last record
    kernels::ll::Layout layout_{};       // carving of the last (T, H, E) a call used
    // The launches that read or rewrite the kernels' record of receives awaiting release (low_latency_device.cuh):
    // those with a send phase, and the hooked receives that leave their half to the next send. Stream of the last
    // one, and the half of the last launch with a send phase (nullptr / -1: none since construction, clean, reset).
    cudaStream_t last_ordered_stream_ = nullptr;
    int last_send_half_ = -1;
    bool has_layout_ = false;

    kernels::ll::Context context(int num_max_tokens, int hidden, int num_experts);
    // Throws DeviceError when a kernel error is pending (the Python layer turns the record into its exception).
    void require_no_error() const;
    const kernels::ll::Layout& layout(int num_max_tokens, int hidden, int num_experts);
    void require_alive(const char* what) const;
    cudaStream_t current_stream() const;
    // Stream order before / after a launch on `comm` (no-op when comm == 0, i.e. a launch on the current stream).
    cudaStream_t enter(uintptr_t comm);
    void leave(cudaStream_t launched_on, bool current_after);
    // Before a launch of `phases` on half `half` on `stream` (`after_current`: `stream` already waits for the
    // current stream). Returns, for a receive launch, its release_by_next_send: 1 when the last send issued is its
    // own call's (same half), else 0 (the rank's next call was issued before the hook). The launches that touch the
    // record (see last_ordered_stream_) run in the order they are issued: a fused or hooked receive is released by
    // the next send at its start, so that send must follow its end. When the previous one ran on a stream that
    // `stream` does not follow already (a hooked call after an asynchronous one, calls on different streams),
    // `stream` waits for it.
    int order_launch(cudaStream_t stream, int half, int phases, bool after_current);
};

// "<phase>: rank R peer P token/channel C expected E observed O after T s (<code>)".
std::string format_ll_error(const kernels::ErrorRecord& record);

}  // namespace deep_ep
