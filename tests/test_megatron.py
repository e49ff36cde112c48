"""A real client: Megatron-core's DeepEP path, unmodified, on the torch backend (gloo ranks).

Megatron-core 0.19.0 comes from PyPI as a wheel (it declares Python >= 3.12; the code used here runs on 3.11), unpacked
with triton (which ``import megatron.core`` loads) into ``build/test-clients/``, once; without the cache and without
the package index the test skips. One pool of 4 ranks in 2 virtual nodes; each case runs on the 2 ranks of each node
and on all 4:

* ``fused_dispatch`` -> toy experts -> ``fused_combine``, forward and backward, synchronous and with Megatron's
  ``EventOverlap(EventHandle())`` events, against the same function computed on one process by autograd;
* ``MoEFlexTokenDispatcher`` (deepep backend) against Megatron's ``MoEAllGatherTokenDispatcher`` on the same tokens,
  router output and expert weights: outputs and the gradients of tokens, router scores and expert weights.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import dist
import pytest
import torch

MEGATRON_REQUIREMENT = "megatron-core==0.19.0"
TRITON_REQUIREMENT = "triton==3.9.0"
CACHE = Path(__file__).resolve().parent.parent / "build" / "test-clients" / "megatron-core-0.19.0"


def _download(requirement: str, into: Path, extra: list[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(into),
           *extra, requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"cannot download {requirement} from the package index: {proc.stderr.strip()[-400:]}")
    name = requirement.split("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def megatron_site() -> Path:
    """A folder holding ``megatron/`` and ``triton/``, unpacked from their wheels on first use."""
    done = CACHE / ".complete"
    if not done.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="deep_ep_wheels_") as tmp:
            wheels = [_download(MEGATRON_REQUIREMENT, Path(tmp), ["--python-version", "3.12"]),
                      _download(TRITON_REQUIREMENT, Path(tmp), [])]
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(CACHE)
        done.write_text(f"{MEGATRON_REQUIREMENT} {TRITON_REQUIREMENT}\n")
    return CACHE


@pytest.fixture(scope="module")
def site() -> str:
    return str(megatron_site())


# One pool of 4 ranks in 2 virtual nodes of 2 (Megatron's import dominates the cost: paid once). Cases on groups of
# 2 run in each node's pair of ranks at once (intranode); cases on all 4 span both nodes (internode).
# Megatron wraps its flex dispatcher's preprocessing in torch.compile; TORCHDYNAMO_DISABLE runs it eagerly, sparing a
# C++ build per process.
WORLD_SIZE, RANKS_PER_NODE = 4, 2
POOL_ENV = {"DEEP_EP_GPUS_PER_NODE": str(RANKS_PER_NODE), "TORCHDYNAMO_DISABLE": "1"}


@dataclass(frozen=True)
class Case:
    site: str
    seed: int
    num_tokens: int = 24
    hidden: int = 64
    experts_per_rank: int = 2
    topk: int = 3
    async_finish: bool = False
    group_size: int = WORLD_SIZE

    def describe(self) -> str:
        return repr(self)


def _member(ctx, case: Case):
    """This rank's view of the case's group: the whole pool, or the block of ``case.group_size`` consecutive
    ranks holding this rank (every block runs the case at once)."""
    if case.group_size == ctx.world_size:
        return ctx
    if ("blocks", case.group_size) not in ctx.cache:  # new_group is collective: every rank creates every block
        blocks = [torch.distributed.new_group(list(range(first, first + case.group_size)))
                  for first in range(0, ctx.world_size, case.group_size)]
        ctx.cache[("blocks", case.group_size)] = blocks
    group = ctx.cache[("blocks", case.group_size)][ctx.rank // case.group_size]
    return dist.WorkerContext(group.rank(), group.size(), group)


def _import_megatron(site_dir: str):
    if site_dir not in sys.path:
        sys.path.insert(0, site_dir)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import fused_a2a, token_dispatcher
    assert fused_a2a.HAVE_DEEP_EP, "Megatron did not find deep_ep"
    return fused_a2a, token_dispatcher


def _routing(case: Case, rank: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens ``[N, H]``, top-k expert ids ``[N, K]`` (distinct per row, a few -1) and probabilities."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + rank)
    x = torch.randn(case.num_tokens, case.hidden, generator=gen).to(torch.bfloat16)
    scores = torch.rand(case.num_tokens, num_experts, generator=gen)
    probs, idx = scores.topk(case.topk, dim=1)
    dropped = torch.rand(case.num_tokens, case.topk, generator=gen) < 0.15
    return x, idx.masked_fill(dropped, -1), probs.softmax(dim=1).masked_fill(dropped, 0.0)


def expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    return 0.5 + global_expert.to(torch.float32) / 4.0


def run_fused(ctx, case: Case) -> None:
    """fused_dispatch -> experts -> fused_combine; outputs and gradients against one-process autograd."""
    fused_a2a, _ = _import_megatron(case.site)
    import deep_ep
    ctx = _member(ctx, case)
    num_experts = case.experts_per_rank * ctx.world_size
    x, idx, probs = _routing(case, ctx.rank, num_experts)
    weight_out = torch.randn(case.num_tokens, case.hidden, generator=torch.Generator().manual_seed(ctx.rank + 7))

    x_in, probs_in = x.clone().requires_grad_(), probs.clone().requires_grad_()
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x_in, idx.to(deep_ep.topk_idx_t), probs_in, num_experts, ctx.group, async_finish=case.async_finish,
        allocate_on_comm_stream=case.async_finish)
    first_local = ctx.rank * case.experts_per_rank
    local_valid = recv_idx >= 0
    factor = (recv_probs * expert_scale(recv_idx.clamp(min=0) + first_local) * local_valid).sum(1, keepdim=True)
    combined, _ = fused_a2a.fused_combine((recv_x * factor).to(torch.bfloat16), ctx.group, handle,
                                          async_finish=case.async_finish, allocate_on_comm_stream=case.async_finish)
    (combined * weight_out).sum().backward()

    expected_counts = torch.zeros(case.experts_per_rank, dtype=torch.int64)
    for peer in range(ctx.world_size):
        _, peer_idx, _ = _routing(case, peer, num_experts)
        local = peer_idx[(peer_idx >= first_local) & (peer_idx < first_local + case.experts_per_rank)]
        expected_counts += torch.bincount(local - first_local, minlength=case.experts_per_rank)
    assert tokens_per_expert.tolist() == expected_counts.tolist(), (tokens_per_expert, expected_counts)

    # The reference runs in float32 on the BF16 inputs; the client's path rounds expert outputs, the combined sum
    # and the gradients to BF16 (relative error 2**-8 each).
    x_ref, probs_ref = x.float().requires_grad_(), probs.clone().requires_grad_()
    valid = idx >= 0
    combined_ref = x_ref * (probs_ref * expert_scale(idx.clamp(min=0)) * valid).sum(1, keepdim=True)
    (combined_ref * weight_out).sum().backward()
    assert combined.dtype == torch.bfloat16 and x_in.grad.dtype == torch.bfloat16
    torch.testing.assert_close(combined.float(), combined_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x_in.grad.float(), x_ref.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(probs_in.grad, probs_ref.grad, rtol=2e-2, atol=5e-2)


class ToyExperts(torch.nn.Module):
    """Expert ``e`` computes ``prob * gelu(x @ w[e])``, over rows grouped by expert as Megatron's experts get them."""

    def __init__(self, weights: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weights.clone())

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(tokens, tokens_per_expert.tolist())
        chunk_probs = torch.split(probs, tokens_per_expert.tolist())
        outs = [(torch.nn.functional.gelu(chunk @ self.weight[e].to(chunk.dtype)) * p.unsqueeze(1)).to(chunk.dtype)
                for e, (chunk, p) in enumerate(zip(chunks, chunk_probs))]
        return torch.cat(outs) if outs else tokens.new_zeros(0, tokens.size(1))


def _moe_pass(token_dispatcher, kind: str, ctx, case: Case, tokens: torch.Tensor, scores: torch.Tensor,
              weights: torch.Tensor):
    """One forward and backward of ``kind``'s dispatcher with the toy experts; returns output and gradients."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=case.hidden, num_attention_heads=1,
                               num_moe_experts=case.experts_per_rank * ctx.world_size, moe_router_topk=case.topk,
                               moe_token_dispatcher_type=kind, moe_flex_dispatcher_backend="deepep",
                               moe_router_dtype="fp32", add_bias_linear=False)
    pg_collection = ProcessGroupCollection(ep=ctx.group, expt_tp=None, tp_ep=ctx.group)
    local_experts = list(range(ctx.rank * case.experts_per_rank, (ctx.rank + 1) * case.experts_per_rank))
    cls = token_dispatcher.MoEFlexTokenDispatcher if kind == "flex" else token_dispatcher.MoEAllGatherTokenDispatcher
    dispatcher = cls(case.experts_per_rank, local_experts, config=config, pg_collection=pg_collection)
    experts = ToyExperts(weights[local_experts[0]:local_experts[-1] + 1])

    hidden = tokens.clone().requires_grad_()
    router_scores = scores.clone().requires_grad_()
    top_values, top_idx = router_scores.topk(case.topk, dim=1)
    probs = torch.zeros_like(router_scores).scatter(1, top_idx, top_values.softmax(dim=1))
    routing_map = torch.zeros_like(router_scores, dtype=torch.bool).scatter(1, top_idx, True)

    h, p = dispatcher.dispatch_preprocess(hidden.view(-1, 1, case.hidden), routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    y = experts(h, tokens_per_expert, p)
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    out = dispatcher.combine_postprocess(y).view(-1, case.hidden)
    weight_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(ctx.rank + 11)).to(out.dtype)
    (out * weight_out).sum().backward()
    return out.detach(), hidden.grad, router_scores.grad, experts.weight.grad


def run_flex_against_allgather(ctx, case: Case) -> None:
    """Megatron's flex dispatcher on deep_ep and its allgather dispatcher agree, forward and backward."""
    _, token_dispatcher = _import_megatron(case.site)
    ctx = _member(ctx, case)
    num_experts = case.experts_per_rank * ctx.world_size
    gen = torch.Generator().manual_seed(case.seed * 1000 + ctx.rank)
    tokens = torch.randn(case.num_tokens, case.hidden, generator=gen).to(torch.bfloat16)
    scores = torch.randn(case.num_tokens, num_experts, generator=gen)
    weights = torch.randn(num_experts, case.hidden, case.hidden, generator=torch.Generator().manual_seed(case.seed))
    weights /= case.hidden ** 0.5
    flex = _moe_pass(token_dispatcher, "flex", ctx, case, tokens, scores, weights)
    # Megatron's allgather dispatcher allocates its gather outputs on ``torch.cuda.current_device()`` (through its
    # global memory buffer for the tokens): on this CPU-only process that device is the CPU.
    from megatron.core import parallel_state
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    with mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")):
        allgather = _moe_pass(token_dispatcher, "allgather", ctx, case, tokens, scores, weights)
    for name, got, want in zip(("output", "token grad", "router grad", "expert weight grad"), flex, allgather):
        # Both paths round the same BF16 values; only the order of the per-token sums differs.
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("group_size", [2, WORLD_SIZE], ids=["2-ranks", "2x2-virtual-nodes"])
def test_megatron_deepep_path(site, pools, group_size):
    pool = pools.get(WORLD_SIZE, POOL_ENV)
    for seed, async_finish in ((1, False), (2, True)):
        pool.check("test_megatron", "run_fused", Case(site, seed, async_finish=async_finish, group_size=group_size),
                   timeout_s=300)
    for seed, num_tokens in ((3, 24), (4, 1)):
        pool.check("test_megatron", "run_flex_against_allgather",
                   Case(site, seed, num_tokens=num_tokens, group_size=group_size), timeout_s=300)
