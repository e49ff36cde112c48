// Host runtime of the intranode normal-mode kernels (one object per deep_ep.Buffer and rank).
//
// Owns:
//   * the scale-up (NVLink) buffer of `num_nvl_bytes`, allocated with cudaMalloc and shared with the other ranks of
//     the node through CUDA IPC handles (several ranks may share one GPU: IPC works between processes on one device);
//     or, for a `symmetric` runtime (internode groups of one GPU per node), the same
//     bytes on the NVSHMEM symmetric heap, every peer reached through nvshmem_ptr or, where there is none, by NVSHMEM
//     puts and signals (see sync_symmetric and set_put_peers);
//   * the device table of peer buffer pointers (index = rank);
//   * a zeroed device workspace for the kernels' private state (ring shadows, epochs, call sequence words);
//   * host-mapped memory: the error record the kernels fill instead of trapping, and the counters the notify kernel
//     publishes for the CPU (received-token total and per-local-expert counts).
//
// The Python CUDA backend owns the stream protocol (previous_event, async_finish) and passes the raw communication
// stream here. To keep one Python->C++ crossing per kernel, the entry points also allocate the outputs whose shapes
// they know (on the caller's current stream, as torch.empty would) and order the communication stream against the
// caller's current stream when asked (`after_current` / `current_after`, see below).
// Every host wait is bounded by `timeout_s` and reports through a structured exception (see HostTimeout).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
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

// Pool blocks whose tensors died, queued by the tensors' deleters (any thread) for Runtime::collect_pool_blocks.
struct PoolReturnQueue {
    struct Entry {
        int64_t offset;
        cudaStream_t streams[2];  // the current stream when the block was wrapped, and when its tensor died
    };
    std::mutex mutex;
    std::vector<Entry> entries;
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
    // Opaque CUDA IPC handle of this rank's scale-up buffer (empty if num_nvl_bytes == 0).
    std::string get_local_ipc_handle() const;
    // Opens every peer's buffer and uploads the pointer table. `ipc_handles[rank]` must equal our own handle.
    void sync(const std::vector<int>& device_ids, const std::vector<std::string>& ipc_handles);
    // Symmetric runtime only (collective over the whole NVSHMEM world, every PE allocating the same bytes): joins
    // the world of `unique_id` as PE `rank` of `num_ranks` (the group is the world; shared with the low-latency
    // runtime: one world per process), allocates the zeroed buffer on the symmetric heap and maps every rank's copy
    // with nvshmem_ptr. Returns the ranks whose buffer is not load/store reachable (a remote transport). The runtime
    // becomes usable with set_put_peers.
    std::vector<int> sync_symmetric(const std::string& unique_id);
    // Symmetric runtime, after sync_symmetric: the ranks reached by NVSHMEM puts and signals instead of pointers
    // (every unreachable one among them; the caller makes the relation symmetric across ranks). `put_area`
    // (kernels/layout.cuh PutArea): the put area to carve, which every rank of the world must do alike as soon as any
    // pair of it is a put pair (kPutAreaMirror for the ring kernels, kPutAreaInRegion for the fused kernels);
    // required when `put_ranks` is not empty. Any group size of the runtime takes put
    // peers (each kernel family checks its own group limit: the ring kernels' kMaxRanks, the fused kernels'
    // kFusedMaxRanks). Throws std::invalid_argument when num_nvl_bytes leaves no room for the put area.
    void set_put_peers(const std::vector<int>& put_ranks, int put_area);
    // Bit r: rank r is a put peer (a bit for each of up to kMaxRuntimeRanks ranks).
    uint64_t get_put_mask() const { return put_mask_; }
    // Bytes of the kernels' region (control, rings, output pool): num_nvl_bytes, less with a put area after it.
    int64_t get_ring_bytes() const { return ring_bytes_; }
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

    // ---- buffer views ----
    // The local buffer from byte `offset` as a 1-D tensor of (num_nvl_bytes - offset) / itemsize elements.
    at::Tensor get_local_buffer_tensor(at::ScalarType dtype, int64_t offset) const;

    // ---- output pool of direct-to-output dispatch (the bookkeeping is deep_ep/pool.py) ----
    // Byte range [offset, end) of the pool in the local buffer (layout.cuh pool_offset / pool_bytes).
    int64_t get_pool_offset() const { return kernels::pool_offset(ring_bytes_); }
    int64_t get_pool_bytes() const { return kernels::pool_bytes(ring_bytes_); }
    // Offsets of queued blocks (their tensors died) that are safe to reuse for a dispatch about to be enqueued on
    // `comm_stream`. A block is safe when `ordered` (comm_stream waits for all work enqueued so far on the caller's
    // current stream before that dispatch's kernel) and both of its streams are comm_stream or the current stream:
    // the new writes are then stream-ordered after every use, as in torch's caching allocator. Otherwise it is safe
    // once events, recorded at its first collection on its streams and on comm_stream, have completed. Never
    // blocks. Call outside CUDA-graph capture.
    std::vector<int64_t> collect_pool_blocks(uintptr_t comm_stream, bool ordered);

    // ---- kernels; tensors are CUDA tensors on this device, already validated by the Python front ----
    // Stream order: `after_current` makes `stream` wait for the work enqueued so far on the caller's current stream
    // before the launch (the default when no previous_event is given); `current_after` makes the current
    // stream wait for `stream` after the launch (synchronous mode). Both use one reusable event of this runtime.

    // Returns (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool).
    std::tuple<at::Tensor, at::Tensor, at::Tensor> get_dispatch_layout(const at::Tensor& topk_idx, int num_experts,
                                                                       uintptr_t stream, bool after_current,
                                                                       bool current_after);

    // Non-cached notify. Fills rank_prefix_matrix [R, R], channel_prefix_matrix [R, C] and
    // recv_channel_prefix_matrix [R, C] (int32) and, unless in worst-token mode, publishes the counts to the host.
    void notify_dispatch(const at::Tensor& num_tokens_per_rank, const at::Tensor& num_tokens_per_expert,
                         const at::Tensor& is_token_in_rank, int num_experts, int num_channels, int expert_alignment,
                         bool worst_token_mode, const at::Tensor& rank_prefix_matrix,
                         const at::Tensor& channel_prefix_matrix, const at::Tensor& recv_channel_prefix_matrix,
                         uintptr_t stream, bool after_current, const std::vector<int64_t>& signature = {},
                         bool check_signatures = false);

    // The notify of a call this rank refused (its validation failed): zero counts and the refusal `signature`, in
    // worst-token mode, comparing nothing; the peers' notify sees the refusal and the host raises on every rank.
    void refuse_notify(const std::vector<int64_t>& signature, uintptr_t stream);

    // Bounded CPU wait for the counts of the last non-worst notify: (rows received, aligned per-local-expert counts).
    std::pair<int, std::vector<int>> wait_recv_counts(int num_local_experts);
    // After wait_recv_counts: count(s -> d) of the same notify for every pair, row-major [R * R].
    std::vector<int64_t> pair_counts() const;
    // After wait_recv_counts (or once the error record holds an argument mismatch): every rank's call signature of
    // the last notify, row-major [R * kSignatureWords] (the `signature` each rank passed to notify_dispatch).
    std::vector<int64_t> gathered_signatures() const;
    // Zero an error record that holds kErrorArgumentMismatch (a worst-token notify saw the signatures differ: no row
    // moved, no rank aborted, so no reset is needed); the record's claim word is released on `stream`.
    void clear_argument_error(uintptr_t stream);

    // Returns (recv_x [num_recv_rows, H] of x's dtype, recv_x_scales [num_recv_rows, S] of the scales' dtype when
    // x_scales is given, recv_src_idx [num_recv_rows] int32 (the given one, else a new one), recv_topk_idx
    // [num_recv_rows, K] of topk_idx's dtype and recv_topk_weights [num_recv_rows, K] float32 when topk_idx is
    // given). Direct-to-output receive: when direct_data_offset >= 0, recv_x, the scales and the top-k
    // outputs are the sections (layout.cuh dispatch_output_layout) of the output-pool block at that byte offset, and
    // peers write their rows there; when direct_meta_offset >= 0 too, a new recv_src_idx is the pool block at that
    // offset. The pool's bookkeeping (deep_ep/pool.py) chose both blocks; -1 receives through the rings into
    // tensors of torch's allocator. The blocks become tensors before any argument check, so they come back through
    // collect_pool_blocks even when the call throws.
    std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor, std::optional<at::Tensor>,
               std::optional<at::Tensor>>
    dispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales, const std::optional<at::Tensor>& topk_idx,
             const std::optional<at::Tensor>& topk_weights, int num_experts, const at::Tensor& is_token_in_rank,
             const at::Tensor& rank_prefix_matrix, const at::Tensor& channel_prefix_matrix,
             const at::Tensor& recv_channel_prefix_matrix, const at::Tensor& send_head, int num_recv_rows,
             const std::optional<at::Tensor>& recv_src_idx, int64_t direct_data_offset, int64_t direct_meta_offset,
             bool worst_token_mode, int num_channels, int num_max_send_tokens, int num_max_recv_tokens,
             int num_send_warps, uintptr_t stream, bool after_current, bool current_after,
             int64_t signature_hash = 0);
    // After a cached dispatch or a combine given a signature_hash outside CUDA-graph capture: bounded CPU wait until
    // its kernel has compared the ranks' hashes (not for its rows), so that a disagreement is in the error record
    // when this returns. A no-op when no such call is pending.
    void await_agreement();

    // Returns (combined_x [N, H] BF16, combined_topk_weights [N, K] float32 when topk_weights is given), N being
    // send_head's rows. signature_hash != 0: a checked combine, whose kernel compares the hash with every peer's
    // before any row moves (CombineArgs::signature_hash); outside CUDA-graph capture the next call awaits the verdict
    // (await_agreement).
    std::pair<at::Tensor, std::optional<at::Tensor>> combine(
        const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias_0,
        const std::optional<at::Tensor>& bias_1, const at::Tensor& rank_prefix_matrix,
        const at::Tensor& recv_channel_prefix_matrix, const at::Tensor& send_head, int num_channels,
        int num_max_send_tokens, int num_max_recv_tokens, int num_send_warps, uintptr_t stream, bool after_current,
        bool current_after, const std::optional<at::Tensor>& channel_prefix_matrix = std::nullopt,
        const std::vector<int64_t>& pair_counts = {}, int copy_ctas = 0, int copy_chunk_rows = 0, bool zone = false,
        int64_t signature_hash = 0);
    // Copy-engine combine (csrc/kernels/intranode_combine_landed.cu): with the handle's channel_prefix_matrix, the
    // dispatch's pair counts ([R * R], pair_counts()) and copy_ctas > 0, the rows travel by the copy engine instead
    // of ring-sender warps whenever every landing zone fits (would_copy) and the stream is not capturing;
    // copy_ctas CTAs reduce. Every rank must make the same choice: same counts, same copy_ctas > 0 decision.
    // zone: the rows are stored into the landing zones by num_send_warps sender warps of each of those CTAs instead
    // (no copy engine).
    bool would_copy(const std::vector<int64_t>& pair_counts, int hidden, int num_topk) const;
    // Copy-engine combines so far (0 after reset).
    int64_t get_copy_epoch() const { return copy_epoch_; }

    // ---- fused internode kernels (csrc/fused_internode.cpp, kernels/fused_internode.cu) ----
    // For a runtime over the whole group of N nodes x `gpus_per_node` ranks, every peer reached by pointer. The
    // first call fixes gpus_per_node; reset() then also zeroes the fused counters.
    // Non-cached notify: fills the six int32 prefix tensors of the internode handle (shapes in FusedNotifyArgs)
    // and, unless in worst-token mode, publishes the counts to the host (wait_recv_counts, forward_count) and every
    // rank's call signature (gathered_signatures; `signature` empty: none sent, none compared).
    void fused_notify(const at::Tensor& num_tokens_per_rank, const std::optional<at::Tensor>& num_tokens_per_rdma_rank,
                      const at::Tensor& num_tokens_per_expert, const at::Tensor& is_token_in_rank, int num_experts,
                      int num_channels, int gpus_per_node, int expert_alignment, bool worst_token_mode,
                      const at::Tensor& rdma_channel_prefix_matrix, const at::Tensor& gbl_channel_prefix_matrix,
                      const at::Tensor& recv_rdma_channel_prefix_matrix, const at::Tensor& recv_rdma_rank_prefix_sum,
                      const at::Tensor& recv_gbl_channel_prefix_matrix, const at::Tensor& recv_gbl_rank_prefix_sum,
                      uintptr_t stream, bool after_current, const std::vector<int64_t>& signature,
                      bool check_signatures);
    // The fused notify of a call this rank refused (refuse_notify's counterpart for a fused runtime: the fused
    // notify has slots of its own).
    void fused_refuse_notify(const std::vector<int64_t>& signature, int gpus_per_node, uintptr_t stream);
    // After wait_recv_counts: the rows this rank forwards (send_nvl_head's rows) of the same notify.
    int forward_count() const;
    // Returns (recv_x [num_recv_rows, H], recv_x_scales [num_recv_rows, S] when x_scales is given, recv_topk_idx
    // [num_recv_rows, K] and recv_topk_weights [num_recv_rows, K] float32 when topk_idx is given). The handle's
    // send_rdma_head [T, N], send_nvl_head [F, 8] and recv_src_meta [num_recv_rows, 8] uint8 are written when given
    // (non-cached calls). signature_hash != 0 in a cached call: a checked call, as fused_combine's
    // (FusedDispatchArgs::signature_hash).
    std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
    fused_dispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                   const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                   int num_experts, const at::Tensor& is_token_in_rank, int gpus_per_node,
                   const at::Tensor& recv_rdma_channel_prefix_matrix, const at::Tensor& recv_rdma_rank_prefix_sum,
                   const at::Tensor& recv_gbl_channel_prefix_matrix, const at::Tensor& recv_gbl_rank_prefix_sum,
                   const std::optional<at::Tensor>& send_rdma_head, const std::optional<at::Tensor>& send_nvl_head,
                   const std::optional<at::Tensor>& recv_src_meta, int num_recv_rows, bool worst_token_mode,
                   int num_channels, int num_max_rdma_send_tokens, int num_max_rdma_recv_tokens,
                   int num_max_nvl_send_tokens, int num_max_nvl_recv_tokens, uintptr_t stream, bool after_current,
                   bool current_after, int64_t signature_hash = 0);

    // Returns (combined_x [T, H] BF16, combined_topk_weights [T, K] float32 when topk_weights is given), T being
    // send_rdma_head's rows; the handle tensors are the dispatch's. signature_hash != 0: a checked combine, as
    // combine()'s (FusedCombineArgs::signature_hash; put peers too).
    std::pair<at::Tensor, std::optional<at::Tensor>> fused_combine(
        const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias_0,
        const std::optional<at::Tensor>& bias_1, int gpus_per_node, const at::Tensor& recv_rdma_channel_prefix_matrix,
        const at::Tensor& recv_rdma_rank_prefix_sum, const at::Tensor& recv_gbl_channel_prefix_matrix,
        const at::Tensor& recv_gbl_rank_prefix_sum, const at::Tensor& send_rdma_head, const at::Tensor& send_nvl_head,
        int num_channels, int num_max_rdma_send_tokens, int num_max_rdma_recv_tokens, int num_max_nvl_send_tokens,
        int num_max_nvl_recv_tokens, uintptr_t stream, bool after_current, bool current_after,
        int64_t signature_hash = 0);

    // Bounded cross-rank barrier kernel on `stream`.
    void barrier(uintptr_t stream);

   private:
    int rank_, num_ranks_;
    int64_t num_nvl_bytes_;
    int64_t ring_bytes_;      // the kernels' region [0, ring_bytes_): num_nvl_bytes_, or less with a put area after it
    uint64_t put_mask_ = 0;   // bit r: rank r is reached by NVSHMEM puts (KernelContext::put_mask)
    int put_area_ = 0;        // kernels::PutArea: with put pairs in the world the buffer ends with a put area
    double timeout_s_;
    int device_id_ = -1;
    bool symmetric_ = false;
    bool available_ = false;
    bool destroyed_ = false;
    int fused_gpus_per_node_ = 0;  // set by the first fused call; reset() then zeroes the fused counters
    void set_fused(int gpus_per_node);
    int64_t call_seq_ = 0;
    int64_t fault_call_seq_ = 0;

    void* local_buffer_ = nullptr;          // num_nvl_bytes_ of device memory, IPC-exported (or symmetric)
    cudaIpcMemHandle_t local_handle_{};
    std::vector<void*> peer_buffers_;        // [num_ranks_]; own rank = local_buffer_, others IPC-opened
    void* workspace_ = nullptr;              // kernels::kWorkspaceBytes of zeroed device memory

    kernels::ErrorRecord* host_error_ = nullptr;    // host-mapped error record
    kernels::ErrorRecord* device_error_ = nullptr;  // its device alias
    // host-mapped [1 + kMaxLocalExperts + kMaxRanks^2] int32 (rows, per expert, pairs), then from int32 index
    // kSignatureIntOffset the int64 [kMaxRuntimeRanks][kSignatureWords] signatures of the last notify, then from
    // kVerdictIntOffset one int64: the call_seq of the last cached dispatch whose hashes were compared
    static constexpr int kSignatureIntOffset =
        (1 + kernels::kMaxLocalExperts + kernels::kMaxRanks * kernels::kMaxRanks + 1) / 2 * 2;
    static constexpr int kVerdictIntOffset =
        kSignatureIntOffset + 2 * kernels::kMaxRuntimeRanks * kernels::kSignatureWords;
    int64_t pending_verdict_ = 0;  // call_seq of a checked call whose verdict the host has not awaited, or 0
    // The last checked combine: its call_seq and copy_epoch_ before it. When the ranks disagreed on
    // it, clearing the record moves copy_epoch_ to that + 1 on every rank without a put area (the ranks may have
    // taken different send paths; every rank's kernel wrote `freed` = that + 1).
    int64_t checked_combine_seq_ = 0;
    uint32_t checked_combine_epoch_ = 0;
    int* host_counters_ = nullptr;
    std::vector<at::Tensor> refusal_scratch_;  // refuse_notify's zero counts and unread outputs, made once
    std::vector<at::Tensor> fused_refusal_scratch_;  // the same for fused_refuse_notify
    int* device_counters_ = nullptr;
    // A notify's agreement and host fields (NotifyArgs, FusedNotifyArgs): the call signature, where the kernel
    // leaves every rank's signature, and, outside worst-token mode, the host-mapped counters it fills (reset to -1
    // first: the previous non-worst notify was waited for before its call returned, so nothing writes there now).
    template <typename Args>
    void arm_notify(Args& args, const std::vector<int64_t>& signature, bool check_signatures, bool worst_token_mode) {
        for (size_t w = 0; w < signature.size(); ++w) args.signature[w] = signature[w];
        args.check_signatures = check_signatures && !signature.empty() ? 1 : 0;
        args.host_signatures = reinterpret_cast<int64_t*>(device_counters_ + kSignatureIntOffset);
        args.host_counters = nullptr;
        if (!worst_token_mode) {
            host_counters_[0] = -1;
            std::atomic_thread_fence(std::memory_order_seq_cst);
            args.host_counters = device_counters_;
        }
    }
    bool is_capturing(cudaStream_t stream) const;  // whether `stream` is capturing a CUDA graph
    // The agreement fields (signature_hash, host_verdict) of a combine's CombineArgs or FusedCombineArgs, or a fused
    // cached dispatch's FusedDispatchArgs: a call with signature_hash != 0 is checked (numbered on the device, so a
    // call captured in a CUDA graph is checked at each replay). Returns whether the host awaits its verdict (not under
    // capture: a replay would write the capture's call_seq); once that kernel is launched, the caller leaves its
    // verdict pending.
    template <typename Args>
    bool arm_checked_call(Args& args, int64_t signature_hash, bool capturing) {
        const bool awaited = signature_hash != 0 && !capturing;
        args.signature_hash = static_cast<uint32_t>(signature_hash);
        args.host_verdict = awaited ? reinterpret_cast<int64_t*>(device_counters_ + kVerdictIntOffset) : nullptr;
        return awaited;
    }
    cudaEvent_t order_event_ = nullptr;             // reused by order(): a wait snapshots the event's last record
    cudaStream_t copy_stream_ = nullptr;            // copy-engine combine: copies and their flags
    cudaEvent_t copy_event_ = nullptr;              // joins copy_stream_ back into the call's stream
    uint32_t copy_epoch_ = 0;                       // copy-engine combines so far (their flags' epoch)
    bool stream_writes_ = true;                     // landed words by cuStreamWriteValue32 (false: flag kernel)

    // Output pool: blocks queued by deleters, then blocks whose events are recorded and not yet complete.
    struct PendingBlock {
        int64_t offset;
        cudaStream_t streams[2];          // as queued by the deleter
        std::vector<cudaEvent_t> events;  // empty until the first collection that cannot reuse it by stream order
    };
    std::shared_ptr<PoolReturnQueue> pool_returns_ = std::make_shared<PoolReturnQueue>();
    std::vector<PendingBlock> pending_blocks_;

    // The pool block [offset, offset + num_bytes) of the local buffer as a uint8 tensor. When the last tensor
    // sharing its storage dies, its deleter queues the block with the stream current now and the one current then.
    at::Tensor pool_block(int64_t offset, int64_t num_bytes);
    void check_pool_block(int64_t offset, int64_t num_bytes) const;  // invalid() unless inside the pool, aligned
    // The copy-engine combine of combine(): reducing kernel on `stream`, copies and flags on copy_stream_.
    void combine_by_copy(const kernels::KernelContext& ctx, kernels::CombineArgs& args,
                         const std::vector<int64_t>& pair_counts, int copy_ctas, int chunk_rows, cudaStream_t stream);
    // The landed words of one chunk of copies, on copy_stream_: stream writes, or the flag kernel.
    void publish_landed(const kernels::KernelContext& ctx, const kernels::LandedFlags& flags);
    // Context of the next launch; increments the call counter.
    kernels::KernelContext next_context();
    void require_available(const char* what) const;
    // The caller's current stream on this runtime's device.
    cudaStream_t current_stream() const;
    // Makes `waiter` wait for the work enqueued so far on `signaller`.
    void order(cudaStream_t waiter, cudaStream_t signaller);
};

// Human-readable text of a filled error record: "<kernel> <phase>: rank R peer P channel C expected E observed O
// after T s (<code>)".
std::string format_error(const kernels::ErrorRecord& record);

}  // namespace deep_ep
