"""CPU demo: MoE dispatch -> expert -> combine on several processes, written against DeepEP V1's ``deep_ep.Buffer``.

``--num-processes`` ranks (4) form one gloo group on this machine. Each rank holds ``--num-tokens`` BF16 tokens of
``--hidden`` channels and routes each to ``--num-topk`` of ``--num-experts`` experts (a few selections dropped,
``-1``, as a capacity-limited router would); the experts are spread evenly over the ranks. Each rank then runs
``get_dispatch_layout`` (tokens per rank and expert), ``dispatch`` (each token once to every rank hosting one of its
experts), its local experts (expert ``e`` multiplies a token by ``expert_scale(e)``; a received token's output is the
top-k-weighted sum over its experts on this rank) and ``combine`` (outputs back, summed per original token).

The check: every token comes back as ``x * sum_k(w_k * expert_scale(e_k))`` over its valid selections (within BF16
rounding), received counts equal what the peers reported sending, per-expert counts equal the global totals. Each
rank prints tokens and bytes sent/received per peer and tokens per local expert; the exit status is 0 only if every
rank's check passed. Run: ``python examples/cpu_demo.py`` (``--gpus-per-node 2`` makes 4 ranks act as 2 nodes of 2
and exercises the internode path).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if importlib.util.find_spec("deep_ep") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import deep_ep  # noqa: E402

SEED = 2024
DROP_PROBABILITY = 0.1  # chance that a top-k selection is dropped (-1)


@dataclass(frozen=True)
class DemoArgs:
    num_processes: int
    num_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    gpus_per_node: int
    store_path: str


def expert_scale(expert: torch.Tensor) -> torch.Tensor:
    """The toy expert ``e`` computes ``x * expert_scale(e)``; ``expert`` is any integer tensor of global ids."""
    return 1.0 + expert.to(torch.float32) / 8.0


def make_inputs(rank: int, args: DemoArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens and routing, from a per-rank seed.

    Returns:
        x: ``[N, H]`` bfloat16 tokens.
        topk_idx: ``[N, K]`` ``deep_ep.topk_idx_t`` global expert ids, distinct per row, ``-1`` = dropped.
        topk_weights: ``[N, K]`` float32 router weights (softmax over the selected scores), 0 where dropped.
    """
    gen = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn(args.num_tokens, args.hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(args.num_tokens, args.num_experts, generator=gen)
    top_scores, topk_idx = scores.topk(args.num_topk, dim=1)
    topk_weights = top_scores.softmax(dim=1)
    dropped = torch.rand(args.num_tokens, args.num_topk, generator=gen) < DROP_PROBABILITY
    topk_idx = topk_idx.masked_fill(dropped, -1).to(deep_ep.topk_idx_t)
    topk_weights = topk_weights.masked_fill(dropped, 0.0)
    return x, topk_idx, topk_weights


def run_experts(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                rank: int, num_local_experts: int) -> torch.Tensor:
    """Toy expert layer on received tokens.

    Args:
        recv_x: ``[M, H]`` bfloat16 received tokens.
        recv_topk_idx: ``[M, K]`` local expert ids on this rank, ``-1`` for experts elsewhere.
        recv_topk_weights: ``[M, K]`` float32 weights, 0 where ``recv_topk_idx`` is -1.
    Returns:
        ``[M, H]`` bfloat16: ``recv_x * sum_k(w_k * expert_scale(global id of local expert k))``.
    """
    valid = recv_topk_idx >= 0
    global_ids = recv_topk_idx.clamp(min=0) + rank * num_local_experts
    factor = (recv_topk_weights * expert_scale(global_ids) * valid).sum(dim=1, keepdim=True)  # [M, 1]
    return (recv_x.to(torch.float32) * factor).to(torch.bfloat16)


def demo_rank(rank: int, args: DemoArgs) -> None:
    """Body of one rank; raises if a check fails."""
    if args.gpus_per_node:
        os.environ["DEEP_EP_GPUS_PER_NODE"] = str(args.gpus_per_node)
    dist.init_process_group("gloo", init_method=f"file://{args.store_path}", rank=rank,
                            world_size=args.num_processes)
    group = dist.group.WORLD
    try:
        report, ok = exchange(rank, args, group)
        reports: list = [None] * args.num_processes
        dist.all_gather_object(reports, (report, ok), group=group)
        if rank == 0:
            print("\n".join(text for text, _ in reports), flush=True)
            passed = sum(1 for _, good in reports if good)
            print(f"\ncheck: {passed} of {args.num_processes} ranks passed "
                  f"({'OK' if passed == args.num_processes else 'FAILED'})", flush=True)
        if not all(good for _, good in reports):
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def exchange(rank: int, args: DemoArgs, group) -> tuple[str, bool]:
    """Dispatch, expert, combine and checks on this rank; returns (printable report, passed)."""
    num_ranks = args.num_processes
    num_local_experts = args.num_experts // num_ranks
    x, topk_idx, topk_weights = make_inputs(rank, args)

    # DeepEP-style sizing: the larger of the dispatch and combine hints for BF16 tokens.
    hidden_bytes = args.hidden * max(x.element_size(), 2)
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
                        for config in (deep_ep.Buffer.get_dispatch_config(num_ranks),
                                       deep_ep.Buffer.get_combine_config(num_ranks)))
    num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)
                         for config in (deep_ep.Buffer.get_dispatch_config(num_ranks),
                                        deep_ep.Buffer.get_combine_config(num_ranks)))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes if args.gpus_per_node < num_ranks else 0,
                            explicitly_destroy=True)
    try:
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
         is_token_in_rank, _) = buffer.get_dispatch_layout(topk_idx, args.num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert)
        expert_out = run_experts(recv_x, recv_topk_idx, recv_topk_weights, rank, num_local_experts)
        combined_x, _, _ = buffer.combine(expert_out, handle)
    finally:
        buffer.destroy()

    # What every rank said it sends to every rank, and its per-expert counts (for the checks only).
    sent_matrix = [torch.zeros(num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
    dist.all_gather(sent_matrix, num_tokens_per_rank.to(torch.int32), group=group)
    expert_totals = [torch.zeros(args.num_experts, dtype=torch.int32) for _ in range(num_ranks)]
    dist.all_gather(expert_totals, num_tokens_per_expert.to(torch.int32), group=group)
    received_from = [int(sent_matrix[src][rank]) for src in range(num_ranks)]
    expert_total = torch.stack(expert_totals).sum(dim=0)[rank * num_local_experts:(rank + 1) * num_local_experts]

    # Expected combine output: each token scaled by its weighted expert scales (dropped selections add nothing).
    valid = topk_idx >= 0
    factor = (topk_weights * expert_scale(topk_idx.clamp(min=0)) * valid).sum(dim=1, keepdim=True)
    expected = x.to(torch.float32) * factor
    error = (combined_x.to(torch.float32) - expected).abs().max().item() if x.numel() else 0.0
    # BF16 rounding of the expert output, of each rank's partial sum and of the result: well under 1% of the largest
    # value; a wrong routing or reduction is off by whole multiples of a token.
    largest = expected.abs().max().item() if expected.numel() else 0.0
    tolerance = 0.01 * max(largest, 1.0) + 0.01

    failures = []
    if recv_x.size(0) != sum(received_from):
        failures.append(f"received {recv_x.size(0)} tokens, peers reported sending {sum(received_from)}")
    if list(num_recv_tokens_per_expert_list) != expert_total.tolist():
        failures.append(f"per-expert counts {list(num_recv_tokens_per_expert_list)} != global totals "
                        f"{expert_total.tolist()}")
    if not error <= tolerance:
        failures.append(f"combine max |error| {error:.4g} > {tolerance:.4g}")

    row_bytes = args.hidden * x.element_size() + args.num_topk * (topk_idx.element_size() + 4)
    lines = [f"rank {rank}: {args.num_tokens} tokens, experts {rank * num_local_experts}.."
             f"{(rank + 1) * num_local_experts - 1}"]
    lines.append(f"  bytes = tokens x {row_bytes} (bf16 hidden + top-k indices + top-k weights)")
    lines.append(f"  {'peer':>6} {'sent tok':>9} {'sent bytes':>11} {'recv tok':>9} {'recv bytes':>11}")
    for peer in range(num_ranks):
        sent, received = int(num_tokens_per_rank[peer]), received_from[peer]
        lines.append(f"  {peer:>6} {sent:>9} {sent * row_bytes:>11} {received:>9} {received * row_bytes:>11}")
    lines.append(f"  tokens per local expert: {list(num_recv_tokens_per_expert_list)}")
    lines.append(f"  combine: max |combined - x * sum_k w_k * scale(e_k)| = {error:.3g} (tolerance {tolerance:.3g})")
    lines.append("  check: " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    return "\n".join(lines), not failures


def parse_args(argv: list[str] | None = None) -> DemoArgs:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=4, help="ranks (processes) in the gloo group")
    parser.add_argument("--num-tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256,
                        help="channels per token (hidden * 2 must be a multiple of 16)")
    parser.add_argument("--num-experts", type=int, default=16, help="experts in total, a multiple of ranks")
    parser.add_argument("--num-topk", type=int, default=4, help="experts per token")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="ranks per virtual node (DEEP_EP_GPUS_PER_NODE); 0 keeps the default of 8")
    ns = parser.parse_args(argv)
    if ns.num_processes < 1:
        parser.error(f"--num-processes must be >= 1, got {ns.num_processes}")
    if ns.num_tokens < 0:
        parser.error(f"--num-tokens must be >= 0, got {ns.num_tokens}")
    if ns.hidden < 1:
        parser.error(f"--hidden must be >= 1, got {ns.hidden}")
    if ns.num_experts % ns.num_processes != 0:
        parser.error(f"--num-experts ({ns.num_experts}) must be a multiple of --num-processes ({ns.num_processes})")
    if not 1 <= ns.num_topk <= ns.num_experts:
        parser.error(f"--num-topk must be in [1, --num-experts], got {ns.num_topk}")
    if ns.gpus_per_node < 0 or (ns.gpus_per_node and ns.num_processes % ns.gpus_per_node != 0):
        parser.error(f"--gpus-per-node must divide --num-processes ({ns.num_processes}), got {ns.gpus_per_node}")
    # gloo's FileStore creates the file; it lives in a fresh private folder that main() removes.
    store_path = os.path.join(tempfile.mkdtemp(prefix="deep_ep_demo_"), "store")
    return DemoArgs(ns.num_processes, ns.num_tokens, ns.hidden, ns.num_experts, ns.num_topk, ns.gpus_per_node,
                    store_path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"deep_ep CPU demo: {args.num_processes} gloo ranks, {args.num_tokens} tokens x hidden {args.hidden} "
          f"(bf16) per rank, {args.num_experts} experts, top-{args.num_topk}"
          + (f", {args.gpus_per_node} ranks per virtual node" if args.gpus_per_node else ""), flush=True)
    try:
        mp.spawn(demo_rank, args=(args,), nprocs=args.num_processes, join=True)
    except mp.ProcessExitedException as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(os.path.dirname(args.store_path), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
