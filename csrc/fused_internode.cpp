// Host entry points of the fused internode kernels (kernels/fused_internode.cu): tensors -> pointers, output
// allocation on the caller's current stream, stream ordering, and the host-mapped forwarded-row count.
#include <atomic>
#include <cstdio>

#include "buffer.hpp"
#include "kernels/fused_internode.cuh"
#include "status.hpp"

namespace deep_ep {

namespace {

cudaStream_t as_stream_handle(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

template <typename... Args>
[[noreturn]] void fused_invalid(const char* format, Args... args) {
    char text[512];
    std::snprintf(text, sizeof(text), format, args...);
    throw std::invalid_argument(text);
}

// A CUDA int32 tensor of `rows` x `cols` (cols 0: 1-D of `rows`) on `device`, contiguous.
void check_int_matrix(const char* name, const at::Tensor& t, int64_t rows, int64_t cols, int device) {
    const bool shape_ok = cols == 0 ? (t.dim() == 1 && t.size(0) == rows)
                                    : (t.dim() == 2 && t.size(0) == rows && t.size(1) == cols);
    if (!t.is_cuda() || t.get_device() != device || t.scalar_type() != at::kInt || !t.is_contiguous() || !shape_ok)
        fused_invalid("%s must be a contiguous int32 CUDA tensor of shape [%lld%s%lld] on device %d", name,
                      static_cast<long long>(rows), cols == 0 ? "" : ", ", static_cast<long long>(cols), device);
}

void check_on_device(const char* name, const at::Tensor& t, int device) {
    if (!t.is_cuda() || t.get_device() != device)
        fused_invalid("%s must be a CUDA tensor on device %d, got %s", name, device, t.device().str().c_str());
}

template <typename T = void>
T* ptr(const at::Tensor& t, void* dummy) {
    void* p = t.data_ptr();
    return static_cast<T*>(p != nullptr ? p : dummy);
}

template <typename T = void>
T* ptr(const std::optional<at::Tensor>& t, void* dummy) {
    return t.has_value() ? ptr<T>(*t, dummy) : nullptr;
}

}  // namespace

void Runtime::set_fused(int gpus_per_node) {
    if (gpus_per_node < 2 || num_ranks_ % gpus_per_node != 0 || num_ranks_ / gpus_per_node < 2)
        fused_invalid("gpus_per_node must be >= 2 and divide num_ranks=%d into at least 2 nodes, got %d", num_ranks_,
                      gpus_per_node);
    if (fused_gpus_per_node_ != 0 && fused_gpus_per_node_ != gpus_per_node)
        fused_invalid("gpus_per_node is fixed at %d for this runtime, got %d", fused_gpus_per_node_, gpus_per_node);
    fused_gpus_per_node_ = gpus_per_node;
}

void Runtime::fused_notify(const at::Tensor& num_tokens_per_rank,
                           const std::optional<at::Tensor>& num_tokens_per_rdma_rank,
                           const at::Tensor& num_tokens_per_expert, const at::Tensor& is_token_in_rank,
                           int num_experts, int num_channels, int gpus_per_node, int expert_alignment,
                           bool worst_token_mode, const at::Tensor& rdma_channel_prefix_matrix,
                           const at::Tensor& gbl_channel_prefix_matrix,
                           const at::Tensor& recv_rdma_channel_prefix_matrix,
                           const at::Tensor& recv_rdma_rank_prefix_sum,
                           const at::Tensor& recv_gbl_channel_prefix_matrix,
                           const at::Tensor& recv_gbl_rank_prefix_sum, uintptr_t stream, bool after_current,
                           const std::vector<int64_t>& signature, bool check_signatures) {
    require_available("dispatch");
    set_fused(gpus_per_node);
    if (!signature.empty() && static_cast<int>(signature.size()) != kernels::kSignatureWords)
        fused_invalid("notify: the call signature must have %d words, got %d", kernels::kSignatureWords,
                      static_cast<int>(signature.size()));
    const int num_nodes = num_ranks_ / gpus_per_node;
    check_int_matrix("num_tokens_per_rank", num_tokens_per_rank, num_ranks_, 0, device_id_);
    if (num_tokens_per_rdma_rank.has_value())
        check_int_matrix("num_tokens_per_rdma_rank", *num_tokens_per_rdma_rank, num_nodes, 0, device_id_);
    check_int_matrix("num_tokens_per_expert", num_tokens_per_expert, num_experts, 0, device_id_);
    check_on_device("is_token_in_rank", is_token_in_rank, device_id_);
    check_int_matrix("rdma_channel_prefix_matrix", rdma_channel_prefix_matrix, num_nodes, num_channels, device_id_);
    check_int_matrix("gbl_channel_prefix_matrix", gbl_channel_prefix_matrix, num_ranks_, num_channels, device_id_);
    check_int_matrix("recv_rdma_channel_prefix_matrix", recv_rdma_channel_prefix_matrix, num_nodes, num_channels,
                     device_id_);
    check_int_matrix("recv_rdma_rank_prefix_sum", recv_rdma_rank_prefix_sum, num_nodes, 0, device_id_);
    check_int_matrix("recv_gbl_channel_prefix_matrix", recv_gbl_channel_prefix_matrix, num_ranks_, num_channels,
                     device_id_);
    check_int_matrix("recv_gbl_rank_prefix_sum", recv_gbl_rank_prefix_sum, num_ranks_, 0, device_id_);
    kernels::FusedNotifyArgs args{};
    args.num_tokens_per_rank = ptr<int>(num_tokens_per_rank, workspace_);
    args.num_tokens_per_rdma_rank = ptr<int>(num_tokens_per_rdma_rank, workspace_);
    args.num_tokens_per_expert = ptr<int>(num_tokens_per_expert, workspace_);
    args.is_token_in_rank = ptr<bool>(is_token_in_rank, workspace_);
    args.num_tokens = static_cast<int>(is_token_in_rank.size(0));
    args.num_experts = num_experts;
    args.num_channels = num_channels;
    args.gpus_per_node = gpus_per_node;
    args.expert_alignment = expert_alignment;
    args.rdma_channel_prefix_matrix = ptr<int>(rdma_channel_prefix_matrix, workspace_);
    args.gbl_channel_prefix_matrix = ptr<int>(gbl_channel_prefix_matrix, workspace_);
    args.recv_rdma_channel_prefix_matrix = ptr<int>(recv_rdma_channel_prefix_matrix, workspace_);
    args.recv_rdma_rank_prefix_sum = ptr<int>(recv_rdma_rank_prefix_sum, workspace_);
    args.recv_gbl_channel_prefix_matrix = ptr<int>(recv_gbl_channel_prefix_matrix, workspace_);
    args.recv_gbl_rank_prefix_sum = ptr<int>(recv_gbl_rank_prefix_sum, workspace_);
    arm_notify(args, signature, check_signatures, worst_token_mode);
    if (after_current) order(as_stream_handle(stream), current_stream());
    auto ctx = next_context();
    throw_if_failed(kernels::fused_notify(ctx, args, as_stream_handle(stream)));
}

void Runtime::fused_refuse_notify(const std::vector<int64_t>& signature, int gpus_per_node, uintptr_t stream) {
    require_available("dispatch");
    set_fused(gpus_per_node);
    const int num_nodes = num_ranks_ / gpus_per_node;
    if (fused_refusal_scratch_.empty()) {
        // Made once and kept, as refuse_notify's: stream-ordered refusals share them.
        const auto ints = at::TensorOptions().device(at::kCUDA, device_id_).dtype(at::kInt);
        fused_refusal_scratch_ = {at::zeros({num_ranks_}, ints), at::empty({0, num_ranks_}, ints.dtype(at::kBool)),
                                  at::empty({num_nodes, 1}, ints),  at::empty({num_ranks_, 1}, ints),
                                  at::empty({num_nodes, 1}, ints),  at::empty({num_nodes}, ints),
                                  at::empty({num_ranks_, 1}, ints), at::empty({num_ranks_}, ints)};
    }
    const auto& t = fused_refusal_scratch_;
    // Zero tokens, one local expert, one channel, worst-token mode (nothing is published to the host counters).
    fused_notify(t[0], std::nullopt, t[0], t[1], num_ranks_, 1, gpus_per_node, 1, true, t[2], t[3], t[4], t[5], t[6],
                 t[7], stream, true, signature, false);
}

int Runtime::forward_count() const {
    return static_cast<const volatile int*>(host_counters_)[kernels::kFusedForwardCounter];
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
Runtime::fused_dispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                        const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
                        int num_experts, const at::Tensor& is_token_in_rank, int gpus_per_node,
                        const at::Tensor& recv_rdma_channel_prefix_matrix, const at::Tensor& recv_rdma_rank_prefix_sum,
                        const at::Tensor& recv_gbl_channel_prefix_matrix, const at::Tensor& recv_gbl_rank_prefix_sum,
                        const std::optional<at::Tensor>& send_rdma_head, const std::optional<at::Tensor>& send_nvl_head,
                        const std::optional<at::Tensor>& recv_src_meta, int num_recv_rows, bool worst_token_mode,
                        int num_channels, int num_max_rdma_send_tokens, int num_max_rdma_recv_tokens,
                        int num_max_nvl_send_tokens, int num_max_nvl_recv_tokens, uintptr_t stream,
                        bool after_current, bool current_after, int64_t signature_hash) {
    require_available("dispatch");
    set_fused(gpus_per_node);
    const int num_nodes = num_ranks_ / gpus_per_node;
    if (num_recv_rows < 0) fused_invalid("dispatch: num_recv_rows must be >= 0, got %d", num_recv_rows);
    check_on_device("x", x, device_id_);
    check_on_device("is_token_in_rank", is_token_in_rank, device_id_);
    if (x.dim() != 2 || !x.is_contiguous()) fused_invalid("x must be a contiguous 2-D tensor, got %d dims", x.dim());
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) fused_invalid("x must start at a 16-byte aligned address");
    if (x_scales.has_value()) {
        check_on_device("x_scales", *x_scales, device_id_);
        if (x_scales->element_size() != 4 || x_scales->dim() != 2 || x_scales->size(0) != x.size(0))
            fused_invalid("x_scales must be [%lld, S] of 4-byte elements", static_cast<long long>(x.size(0)));
    }
    if (topk_idx.has_value() != topk_weights.has_value())
        fused_invalid("topk_idx and topk_weights must be given together");
    if (topk_idx.has_value()) {
        check_on_device("topk_idx", *topk_idx, device_id_);
        check_on_device("topk_weights", *topk_weights, device_id_);
        if (!topk_idx->is_contiguous() || !topk_weights->is_contiguous() ||
            topk_weights->scalar_type() != at::kFloat || topk_idx->sizes() != topk_weights->sizes())
            fused_invalid("topk_idx and topk_weights must be contiguous [N, K] tensors, weights float32");
    }
    check_int_matrix("recv_rdma_channel_prefix_matrix", recv_rdma_channel_prefix_matrix, num_nodes, num_channels,
                     device_id_);
    check_int_matrix("recv_rdma_rank_prefix_sum", recv_rdma_rank_prefix_sum, num_nodes, 0, device_id_);
    check_int_matrix("recv_gbl_channel_prefix_matrix", recv_gbl_channel_prefix_matrix, num_ranks_, num_channels,
                     device_id_);
    check_int_matrix("recv_gbl_rank_prefix_sum", recv_gbl_rank_prefix_sum, num_ranks_, 0, device_id_);
    if (send_rdma_head.has_value()) check_int_matrix("send_rdma_head", *send_rdma_head, x.size(0), num_nodes, device_id_);
    if (send_nvl_head.has_value()) {
        check_on_device("send_nvl_head", *send_nvl_head, device_id_);
        if (send_nvl_head->dim() != 2 || send_nvl_head->size(1) != 8)
            fused_invalid("send_nvl_head must be [F, 8] int32");
        check_int_matrix("send_nvl_head", *send_nvl_head, send_nvl_head->size(0), 8, device_id_);
    }
    if (recv_src_meta.has_value()) {
        check_on_device("recv_src_meta", *recv_src_meta, device_id_);
        if (recv_src_meta->numel() != 8LL * num_recv_rows || !recv_src_meta->is_contiguous())
            fused_invalid("recv_src_meta must be a contiguous [%d, 8] uint8 tensor", num_recv_rows);
    }

    const int64_t rows = num_recv_rows;
    at::Tensor recv_x = at::empty({rows, x.size(1)}, x.options());
    std::optional<at::Tensor> recv_x_scales, recv_topk_idx, recv_topk_weights;
    if (x_scales.has_value()) recv_x_scales = at::empty({rows, x_scales->size(1)}, x_scales->options());
    if (topk_idx.has_value()) {
        recv_topk_idx = at::empty({rows, topk_idx->size(1)}, topk_idx->options());
        recv_topk_weights = at::empty({rows, topk_idx->size(1)}, x.options().dtype(at::kFloat));
    }
    const int64_t hidden_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
    const int num_scales = x_scales.has_value() ? static_cast<int>(x_scales->size(1)) : 0;
    const int num_topk = topk_idx.has_value() ? static_cast<int>(topk_idx->size(1)) : 0;
    const auto geometry = kernels::fused_layout(num_nodes, gpus_per_node, num_channels, hidden_bytes, num_scales,
                                                num_topk, num_max_rdma_recv_tokens, num_max_nvl_recv_tokens,
                                                ring_bytes_, put_area_ == kernels::kPutAreaInRegion, false);
    kernels::FusedDispatchArgs args{};
    args.x = ptr(x, workspace_);
    args.x_scales = ptr<const void>(x_scales, workspace_);
    args.scale_token_stride = x_scales.has_value() ? x_scales->stride(0) : 0;
    args.scale_hidden_stride = x_scales.has_value() ? x_scales->stride(1) : 0;
    args.topk_idx = ptr<const void>(topk_idx, workspace_);
    args.topk_weights = ptr<const float>(topk_weights, workspace_);
    args.topk_idx_bytes = topk_idx.has_value() ? static_cast<int>(topk_idx->element_size()) : 8;
    args.num_experts = num_experts;
    args.is_token_in_rank = ptr<bool>(is_token_in_rank, workspace_);
    args.num_tokens = static_cast<int>(x.size(0));
    args.recv_rdma_channel_prefix_matrix = ptr<int>(recv_rdma_channel_prefix_matrix, workspace_);
    args.recv_rdma_rank_prefix_sum = ptr<int>(recv_rdma_rank_prefix_sum, workspace_);
    args.recv_gbl_channel_prefix_matrix = ptr<int>(recv_gbl_channel_prefix_matrix, workspace_);
    args.recv_gbl_rank_prefix_sum = ptr<int>(recv_gbl_rank_prefix_sum, workspace_);
    args.send_rdma_head = ptr<int>(send_rdma_head, workspace_);
    args.send_nvl_head = ptr<int>(send_nvl_head, workspace_);
    args.recv_src_meta = ptr<int>(recv_src_meta, workspace_);
    args.recv_x = ptr(recv_x, workspace_);
    args.recv_x_scales = ptr<float>(recv_x_scales, workspace_);
    args.recv_topk_idx = ptr(recv_topk_idx, workspace_);
    args.recv_topk_weights = ptr<float>(recv_topk_weights, workspace_);
    args.num_recv_rows = num_recv_rows;
    args.worst_token_mode = worst_token_mode ? 1 : 0;
    args.num_max_rdma_send_tokens = num_max_rdma_send_tokens;
    args.num_max_nvl_send_tokens = num_max_nvl_send_tokens;
    args.agreement_gate = send_rdma_head.has_value() ? 1 : 0;
    if (send_rdma_head.has_value() && signature_hash != 0)
        fused_invalid("dispatch: a non-cached call is checked by its notify, got a signature hash");
    if (after_current) order(as_stream_handle(stream), current_stream());
    const bool awaited = arm_checked_call(args, signature_hash, is_capturing(as_stream_handle(stream)));
    auto ctx = next_context();
    throw_if_failed(kernels::fused_dispatch(ctx, geometry, args, as_stream_handle(stream)));
    if (awaited) pending_verdict_ = ctx.call_seq;
    if (current_after) order(current_stream(), as_stream_handle(stream));
    return {recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights};
}

std::pair<at::Tensor, std::optional<at::Tensor>> Runtime::fused_combine(
    const at::Tensor& x, const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias_0,
    const std::optional<at::Tensor>& bias_1, int gpus_per_node, const at::Tensor& recv_rdma_channel_prefix_matrix,
    const at::Tensor& recv_rdma_rank_prefix_sum, const at::Tensor& recv_gbl_channel_prefix_matrix,
    const at::Tensor& recv_gbl_rank_prefix_sum, const at::Tensor& send_rdma_head, const at::Tensor& send_nvl_head,
    int num_channels, int num_max_rdma_send_tokens, int num_max_rdma_recv_tokens, int num_max_nvl_send_tokens,
    int num_max_nvl_recv_tokens, uintptr_t stream, bool after_current, bool current_after, int64_t signature_hash) {
    require_available("combine");
    set_fused(gpus_per_node);
    const int num_nodes = num_ranks_ / gpus_per_node;
    check_on_device("x", x, device_id_);
    if (x.scalar_type() != at::kBFloat16 || x.dim() != 2 || !x.is_contiguous())
        fused_invalid("combine x must be a contiguous 2-D torch.bfloat16 tensor, got %s",
                      c10::toString(x.scalar_type()));
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) fused_invalid("x must start at a 16-byte aligned address");
    const int64_t num_tokens = send_rdma_head.size(0);
    check_int_matrix("handle.send_rdma_head", send_rdma_head, num_tokens, num_nodes, device_id_);
    check_int_matrix("handle.send_nvl_head", send_nvl_head, send_nvl_head.size(0), 8, device_id_);
    check_int_matrix("handle.recv_rdma_channel_prefix_matrix", recv_rdma_channel_prefix_matrix, num_nodes, num_channels,
                     device_id_);
    check_int_matrix("handle.recv_rdma_rank_prefix_sum", recv_rdma_rank_prefix_sum, num_nodes, 0, device_id_);
    check_int_matrix("handle.recv_gbl_channel_prefix_matrix", recv_gbl_channel_prefix_matrix, num_ranks_, num_channels,
                     device_id_);
    check_int_matrix("handle.recv_gbl_rank_prefix_sum", recv_gbl_rank_prefix_sum, num_ranks_, 0, device_id_);
    if (topk_weights.has_value()) {
        check_on_device("topk_weights", *topk_weights, device_id_);
        if (topk_weights->scalar_type() != at::kFloat || !topk_weights->is_contiguous() || topk_weights->dim() != 2 ||
            topk_weights->size(0) != x.size(0))
            fused_invalid("topk_weights must be a contiguous float32 [%lld, K] tensor", static_cast<long long>(x.size(0)));
    }
    for (const auto* bias : {&bias_0, &bias_1}) {
        if (!bias->has_value()) continue;
        check_on_device("bias", **bias, device_id_);
        if ((*bias)->scalar_type() != at::kBFloat16 || !(*bias)->is_contiguous() || (*bias)->dim() != 2 ||
            (*bias)->size(0) != num_tokens || (*bias)->size(1) != x.size(1) ||
            reinterpret_cast<uintptr_t>((*bias)->data_ptr()) % 16 != 0)
            fused_invalid("bias must be a contiguous, 16-byte aligned torch.bfloat16 [%lld, %lld] tensor",
                          static_cast<long long>(num_tokens), static_cast<long long>(x.size(1)));
    }
    at::Tensor combined_x = at::empty({num_tokens, x.size(1)}, x.options());
    std::optional<at::Tensor> combined_topk_weights;
    const int num_topk = topk_weights.has_value() ? static_cast<int>(topk_weights->size(1)) : 0;
    if (topk_weights.has_value()) combined_topk_weights = at::empty({num_tokens, num_topk}, x.options().dtype(at::kFloat));
    const auto geometry = kernels::fused_layout(num_nodes, gpus_per_node, num_channels, x.size(1) * 2, 0, num_topk,
                                                num_max_rdma_recv_tokens, num_max_nvl_recv_tokens, ring_bytes_,
                                                put_area_ == kernels::kPutAreaInRegion, true);
    kernels::FusedCombineArgs args{};
    args.x = ptr(x, workspace_);
    args.topk_weights = ptr<const float>(topk_weights, workspace_);
    args.bias_0 = ptr<const void>(bias_0, workspace_);
    args.bias_1 = ptr<const void>(bias_1, workspace_);
    args.num_tokens = static_cast<int>(num_tokens);
    args.recv_rdma_channel_prefix_matrix = ptr<int>(recv_rdma_channel_prefix_matrix, workspace_);
    args.recv_rdma_rank_prefix_sum = ptr<int>(recv_rdma_rank_prefix_sum, workspace_);
    args.recv_gbl_channel_prefix_matrix = ptr<int>(recv_gbl_channel_prefix_matrix, workspace_);
    args.recv_gbl_rank_prefix_sum = ptr<int>(recv_gbl_rank_prefix_sum, workspace_);
    args.send_rdma_head = ptr<int>(send_rdma_head, workspace_);
    args.send_nvl_head = ptr<int>(send_nvl_head, workspace_);
    args.combined_x = ptr(combined_x, workspace_);
    args.combined_topk_weights = ptr<float>(combined_topk_weights, workspace_);
    args.num_max_rdma_send_tokens = num_max_rdma_send_tokens;
    args.num_max_nvl_send_tokens = num_max_nvl_send_tokens;
    if (after_current) order(as_stream_handle(stream), current_stream());
    const bool awaited = arm_checked_call(args, signature_hash, is_capturing(as_stream_handle(stream)));
    auto ctx = next_context();
    throw_if_failed(kernels::fused_combine(ctx, geometry, args, as_stream_handle(stream)));
    if (awaited) pending_verdict_ = ctx.call_seq;
    if (current_after) order(current_stream(), as_stream_handle(stream));
    return {combined_x, combined_topk_weights};
}

}  // namespace deep_ep
