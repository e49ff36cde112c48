"""A user script written only against DeepEP V1's documented ``deep_ep.Buffer`` API.

It follows the flow of DeepEP's own intranode and low-latency tests: ``get_dispatch_layout``, ``dispatch`` (BF16,
FP8 with column-major scales, top-k, async events, previous events, worst-token mode, cached dispatch), checks of
the received data through the handle's prefix matrix, ``combine`` (with ``/ #ranks`` recovery), then
``low_latency_dispatch`` / ``low_latency_combine`` with hooks, FP8 casts and zero-copy. It uses constructor
arguments, keyword names and tuple positions exactly as DeepEP V1 does and nothing else from ``deep_ep``.

Run: ``python tests/compat/deepep_v1_script.py --num-processes 4`` (gloo on CPU; ``MASTER_PORT`` optional).
Exits non-zero on any failed assertion.
"""
from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deep_ep


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity measure: 0 when equal (both shifted by 1 first)."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128-channel FP8 cast: data ``x * 448/amax`` and scales ``amax/448`` (DeepEP's test helper)."""
    m, n = x.shape
    blocks = x.float().view(m, -1, 128)
    amax = blocks.abs().amax(dim=2).clamp(1e-4)
    q = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    return q, amax / 448.0


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.int32:
        scales = (scales.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    m, n = q.shape
    return (q.float().view(m, -1, 128) * scales.view(m, -1, 1)).view(m, n).to(torch.bfloat16)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Rows become their distinct non-negative values sorted descending, padded with -1."""
    assert x.dim() == 2
    mask = x < 0
    x_padded = x.masked_fill(mask, num_slots)
    bin_count = torch.zeros((x.size(0), num_slots + 1), dtype=x.dtype)
    bin_count.scatter_add_(1, x_padded, torch.ones_like(x_padded))
    bin_count = bin_count[:, :num_slots]
    sorted_bin_count, sorted_bin_idx = torch.sort(bin_count, dim=-1, descending=True)
    sorted_bin_idx.masked_fill_(sorted_bin_count == 0, -1)
    sorted_bin_idx = torch.sort(sorted_bin_idx, descending=True, dim=-1).values
    x[:, :].fill_(-1)
    valid_len = min(num_slots, x.size(1))
    x[:, :valid_len] = sorted_bin_idx[:, :valid_len]


def check_data(check_x: torch.Tensor, rank_prefix_matrix: torch.Tensor, rank: int) -> None:
    """Rows from source ``i`` are the block ``[P[i-1][rank], P[i][rank])`` and every one equals ``i``."""
    assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
    begin = 0
    for i in range(rank_prefix_matrix.size(0)):
        end = int(rank_prefix_matrix[i][rank])
        assert (check_x[begin:end, :] - i).abs().sum() == 0
        begin = end


def test_intranode(rank: int, num_ranks: int, group: dist.ProcessGroup, buffer: deep_ep.Buffer) -> None:
    num_tokens, hidden, num_topk, num_experts = 64, 256, 4, 4 * num_ranks
    assert num_experts % num_ranks == 0
    torch.manual_seed(rank)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as upstream
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32)
    rank_idx = topk_idx // (num_experts // num_ranks)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)

    # Reference layout, and its global sums.
    num_tokens_per_expert = torch.zeros((num_experts,), dtype=torch.int)
    for i in range(num_experts):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)
    num_tokens_per_rank = torch.empty((num_ranks,), dtype=torch.int)
    token_idx_in_rank = torch.full((num_ranks, num_tokens), -1, dtype=torch.long)
    for i in range(num_ranks):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0]
        count = token_sel.sum().item()
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
        tokens[:count] = torch.sort(tokens[:count])[0]
        token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long)
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    is_token_in_rank = token_idx_in_rank >= 0
    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)

    ref_num_tokens_per_rank, _, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.allclose(ref_num_tokens_per_rank, num_tokens_per_rank)
    assert torch.allclose(ref_num_tokens_per_expert, num_tokens_per_expert)
    assert torch.allclose(ref_is_token_in_rank, is_token_in_rank)

    deep_ep.Buffer.set_num_sms(24)
    config = deep_ep.Config(24, 8, 256)
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    dispatch_args = {'x': current_x, 'num_tokens_per_rank': num_tokens_per_rank,
                                     'is_token_in_rank': is_token_in_rank,
                                     'num_tokens_per_expert': num_tokens_per_expert, 'config': config,
                                     'async_finish': async_mode}
                    if with_topk:
                        dispatch_args.update({'topk_idx': topk_idx, 'topk_weights': topk_weights_pure_rand
                                              if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        dispatch_args.update({'previous_event': buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = \
                        buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    rank_prefix_matrix = handle[0]
                    assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0)
                    assert gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == \
                        recv_num_tokens_per_expert_list
                    if current_x is not x_pure_rand:
                        check_data(recv_x, rank_prefix_matrix, rank)
                    recv_topk_weights_clone = None
                    if with_topk:
                        assert recv_topk_idx.eq(-1).logical_or(
                            recv_topk_idx.ge(0) & recv_topk_idx.lt(num_experts // num_ranks)).all()
                        for i, count in enumerate(recv_num_tokens_per_expert_list):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            recv_topk_weights[recv_topk_idx.eq(-1)] = \
                                recv_topk_weights.amax(dim=1, keepdim=True).expand_as(recv_topk_weights)[
                                    recv_topk_idx.eq(-1)]
                            check_data(recv_topk_weights, rank_prefix_matrix, rank)

                    # Worst-token mode.
                    if with_topk:
                        num_worst_tokens = num_tokens * num_ranks
                        dispatch_args.update({'num_worst_tokens': num_worst_tokens})
                        if previous_mode:
                            dispatch_args.update({'previous_event': buffer.capture()})
                        recv_worst_x, recv_worst_topk_idx, recv_worst_topk_weights, empty_list, _, event = \
                            buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_worst_x = per_token_cast_back(*recv_worst_x) if isinstance(recv_worst_x, tuple) \
                            else recv_worst_x
                        assert len(empty_list) == 0
                        assert num_worst_tokens == recv_worst_x.size(0)
                        assert num_worst_tokens == recv_worst_topk_idx.size(0)
                        assert num_worst_tokens == recv_worst_topk_weights.size(0)
                        assert torch.equal(recv_x, recv_worst_x[:recv_x.size(0)])
                        assert torch.equal(recv_topk_idx, recv_worst_topk_idx[:recv_x.size(0)])
                        assert torch.equal(recv_topk_weights_clone, recv_worst_topk_weights[:recv_x.size(0)])
                        assert torch.all(recv_worst_topk_idx[recv_x.size(0):] == -1).item()

                    # Cached dispatch.
                    if not with_topk:
                        dispatch_args = {'x': current_x, 'handle': handle, 'config': config,
                                         'async_finish': async_mode}
                        if previous_mode:
                            dispatch_args.update({'previous_event': buffer.capture()})
                        recv_x, _, _, _, _, event = buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                        if current_x is not x_pure_rand:
                            check_data(recv_x, rank_prefix_matrix, rank)

                    # Combine.
                    combine_args = {'x': recv_x, 'handle': handle, 'config': config, 'async_finish': async_mode}
                    if with_topk:
                        combine_args.update({'topk_weights': recv_topk_weights})
                    if previous_mode:
                        combine_args.update({'previous_event': buffer.capture()})
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    check_x = combined_x.float() / is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    assert calc_diff(check_x, ref_x) < 5e-6
                    if with_topk:
                        check_topk_weights = combined_topk_weights if current_x is x_pure_rand else \
                            combined_topk_weights / is_token_in_rank.sum(dim=1).unsqueeze(1)
                        ref_topk_weights = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        assert calc_diff(check_topk_weights, ref_topk_weights) < 1e-9
    deep_ep.Buffer.set_num_sms(20)
    assert deep_ep.Buffer.num_sms == 20


def test_low_latency(rank: int, num_ranks: int, group: dist.ProcessGroup, buffer: deep_ep.Buffer,
                     num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int = 0) -> None:
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    assert num_experts % num_ranks == 0
    num_local_experts = num_experts // num_ranks
    rank_offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - rank_offset)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32).abs()
    for _ in range(3):
        topk_idx[random.randint(0, num_tokens - 1), random.randint(0, num_topk - 1)] = -1
    gathered = [torch.empty_like(topk_idx) for _ in range(num_ranks)]
    dist.all_gather(gathered, topk_idx, group=group)  # gloo: list form of all_gather_into_tensor
    all_topk_idx = torch.stack(gathered)

    for return_recv_hook in (False, True):
        for dispatch_use_fp8 in (False, True):
            for round_scale in (False, True) if dispatch_use_fp8 else (False,):
                for use_ue8m0 in (False, True) if round_scale else (False,):
                    for num_times in (1, 2):  # one or two dispatches in a row exercise both buffer halves
                        for _ in range(num_times):
                            cumulative_local_expert_recv_stats = torch.zeros((num_local_experts,), dtype=torch.int)
                            packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                x, topk_idx, num_tokens, num_experts, use_fp8=dispatch_use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                    packed_recv_x = (packed_recv_x[0], packed_recv_x[1].contiguous()) if dispatch_use_fp8 \
                        else packed_recv_x
                    simulated_gemm_x = per_token_cast_back(packed_recv_x[0].view(-1, hidden),
                                                           packed_recv_x[1].view(-1, packed_recv_x[1].size(-1))
                                                           ).view(packed_recv_x[0].shape) \
                        if dispatch_use_fp8 else packed_recv_x.clone()
                    for i in range(num_local_experts):
                        expert_id = rank * num_local_experts + i
                        recv_x = per_token_cast_back(packed_recv_x[0][i], packed_recv_x[1][i]) \
                            if dispatch_use_fp8 else packed_recv_x[i]
                        recv_count, recv_src_info, recv_layout_range = \
                            packed_recv_count[i], handle[0][i], handle[1][i]
                        int_mask = (2 ** 32) - 1
                        num_valid_tokens = recv_count.item()
                        assert cumulative_local_expert_recv_stats[i].item() == num_valid_tokens
                        assert num_valid_tokens == (recv_layout_range & int_mask).sum().item()
                        assert num_valid_tokens == (all_topk_idx == expert_id).sum().item()
                        if num_valid_tokens == 0:
                            continue
                        recv_x = recv_x[:num_valid_tokens]
                        recv_x_amin = recv_x[:, :-128].amin(dim=-1)
                        recv_src_info = recv_src_info[:num_valid_tokens]
                        assert torch.equal(recv_x_amin, recv_x[:, :-128].amax(dim=-1))
                        if round_scale:
                            assert calc_diff(recv_x[:, -1], recv_src_info.view(-1)) < 0.007
                        else:
                            assert (recv_x[:, -128:] - recv_src_info.view(-1, 1) % num_tokens).sum().item() == 0
                        for j in range(num_ranks):
                            begin_idx, count = (recv_layout_range[j] >> 32).item(), \
                                (recv_layout_range[j] & int_mask).item()
                            if not round_scale:
                                assert (recv_x_amin == j - rank_offset).sum().item() == \
                                    (all_topk_idx[j] == expert_id).sum().item()
                                assert (recv_x[begin_idx:begin_idx + count, :-128] - j + rank_offset).sum().item() \
                                    == 0

                    for zero_copy in (False, True):
                        if zero_copy:
                            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
                        out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                        combined_x, event, hook = buffer.low_latency_combine(
                            simulated_gemm_x, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                            zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                        hook() if return_recv_hook else event.current_stream_wait()
                        diff = calc_diff(x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1),
                                         combined_x)
                        assert torch.isnan(combined_x).sum().item() == 0
                        if not round_scale:
                            assert diff < (9e-4 if dispatch_use_fp8 else 1e-5), f'Error: {diff=}, {zero_copy=}'


def worker(local_rank: int, num_local_ranks: int, port: int) -> None:
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', world_size=num_local_ranks,
                            rank=local_rank)
    torch.set_num_threads(1)
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(num_ranks)))

    # Normal mode (buffer sized by DeepEP's hints for this hidden size).
    num_nvl_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(256 * 2, num_ranks), num_nvl_bytes)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    test_intranode(rank, num_ranks, group, buffer)
    buffer.destroy()
    dist.barrier(group)

    # Low-latency mode.
    num_tokens, hidden, num_topk, num_experts = 16, 2048, 4, 2 * num_ranks
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    with deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                        num_qps_per_rank=num_experts // num_ranks, explicitly_destroy=True) as ll_buffer:
        test_low_latency(rank, num_ranks, group, ll_buffer, num_tokens, hidden, num_experts, num_topk)
    dist.barrier(group)
    if rank == 0:
        print('deepep_v1_script: all checks passed', flush=True)
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description='DeepEP V1 API compatibility script (gloo, CPU)')
    parser.add_argument('--num-processes', type=int, default=4)
    parser.add_argument('--port', type=int, default=int(os.environ.get('MASTER_PORT', '29531')))
    args = parser.parse_args()
    mp.spawn(worker, args=(args.num_processes, args.port), nprocs=args.num_processes)
