"""Expert-parallel MoE layer (``deep_ep.moe``) against Hugging Face's Mixtral sparse MoE block.

* single process: the router and grouped experts reproduce ``MixtralTopKRouter`` / ``MixtralExperts`` in float32 to
  ``FP32_RTOL`` (forward and gradients); bad input is rejected with the argument named;
* exact autograd on 2 and 4 gloo ranks: with small-integer data (exact in BF16 and in every sum) the forward and
  both backward passes of ``dispatch``/``combine`` equal their closed forms bit for bit;
* the transformers comparison on 2 and 4 gloo ranks: a random ``MixtralSparseMoeBlock`` (:func:`hf_job`) split over
  the ranks into ``ExpertParallelMoE`` (``load_from_hf``) must match its outputs and every gradient.

Tolerances (relative L2 error, and per token row for outputs and input gradients): ``WIRE_RTOL = 1e-2`` for float32
and bfloat16 parameters and for FP8 dispatch (the layer sends BF16, unit roundoff 2^-8; measured <= 3.3e-3), and
``ROW_RTOL = 2e-2`` for the worst row (measured <= 4.4e-3). The GPU variants run the same workers on 2 GPUs over
NCCL with the CUDA kernels.
"""
from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import dist
import pytest
import torch

from deep_ep import moe

FP32_RTOL = 1e-5
WIRE_RTOL = 1e-2
ROW_RTOL = 2e-2
MODULE = "test_moe_layer"
# Per-case budget: the first case on a fresh pool also imports torch + transformers in every rank, which takes
# minutes when the 2-core CI machine is oversubscribed.
CASE_TIMEOUT_S = 400.0


# ---------------------------------------------------------------------------------------------------------------
# Cases and shared helpers (run in the driver and in the workers)
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoECase:
    """One comparison: block shape, tokens per rank (one entry per rank), dtypes and device."""

    seed: int
    tokens_per_rank: tuple[int, ...]
    hidden: int = 128
    intermediate: int = 64
    num_experts: int = 8
    top_k: int = 2
    dtype: str = "float32"
    use_fp8: bool = False
    device: str = "cpu"
    gpus_per_node: int = 0  # > 0: emulate nodes of this many ranks (internode path); 0: the default topology

    def describe(self) -> str:
        nodes = f", {self.gpus_per_node} ranks/node" if self.gpus_per_node else ""
        return (f"MoECase(seed={self.seed}, tokens={self.tokens_per_rank}, H={self.hidden}, I={self.intermediate}, "
                f"E={self.num_experts}, K={self.top_k}, dtype={self.dtype}, fp8={self.use_fp8}, {self.device}{nodes})")


def _hf_mixtral() -> tuple[Any, Any]:
    """``(MixtralConfig, MixtralSparseMoeBlock)`` from transformers (the test extra); skips when it is missing.

    Only the pytest driver imports transformers: the rank workers get the block's weights and results in the job,
    which keeps every rank's start-up short.
    """
    # transformers >= 5 has the fused Mixtral experts (gate_up_proj / down_proj) and the 3-output router used here.
    pytest.importorskip("transformers", minversion="5.0",
                        reason="the MoE comparison needs the test extra `transformers>=5`")
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    return MixtralConfig, MixtralSparseMoeBlock


def make_block(case: MoECase) -> Any:
    """A random-initialised ``MixtralSparseMoeBlock`` on the CPU (CPU generator seeded by the case)."""
    mixtral_config, mixtral_block = _hf_mixtral()
    config = mixtral_config(hidden_size=case.hidden, intermediate_size=case.intermediate,
                            num_local_experts=case.num_experts, num_experts_per_tok=case.top_k,
                            router_jitter_noise=0.0)
    block = mixtral_block(config)
    gen = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        # Router std 0.2 spreads the logits (no near-ties in top-k); experts 0.02 as in HF's initializer_range.
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=gen) * 0.2)
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return block.to(dtype=getattr(torch, case.dtype))


def make_batch(case: MoECase) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch ``X`` ``[T, H]`` and output gradient ``G`` ``[T, H]`` (T = all ranks' tokens)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    total = sum(case.tokens_per_rank)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(total, case.hidden, generator=gen).to(dtype)
    g = torch.randn(total, case.hidden, generator=gen).to(dtype)
    return x, g


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are empty or zero)."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def row_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst per-row relative error (rows with a zero reference use an absolute floor of 1e-6)."""
    if actual.numel() == 0:
        return 0.0
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    return ((a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-6)).max().item()


def reference_block_forward(block: Any, x: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    """The HF block on ``x [T, H]``; with ``use_fp8`` its experts see the FP8 round trip of ``x`` (straight-through
    gradient), exactly what the layer's FP8 dispatch computes on."""
    if not use_fp8:
        return block(x.unsqueeze(0)).squeeze(0)
    from deep_ep.numerics import per_token_cast_back, per_token_cast_to_fp8

    _, top_k_weights, top_k_index = block.gate(x)
    x_fp8 = per_token_cast_back(*per_token_cast_to_fp8(x.detach())).to(x.dtype)
    x_ste = x + (x_fp8 - x).detach()
    return block.experts(x_ste, top_k_index, top_k_weights)


@dataclasses.dataclass(frozen=True)
class HFJob:
    """A :class:`MoECase` plus the HF block's weights, batch and results (CPU tensors, computed in the driver).

    Weights: ``gate_weight [E, H]``, ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``. Batch: ``x``, ``grad_out``
    ``[T, H]`` for all ranks' tokens. Results: ``topk_idx [T, K]`` (HF router), ``out``, ``grad_x`` ``[T, H]``, and
    the weight gradients ``grad_gate_weight``, ``grad_gate_up_proj``, ``grad_down_proj``.
    """

    case: MoECase
    tensors: dict

    def describe(self) -> str:
        return self.case.describe()


def hf_job(case: MoECase) -> HFJob:
    """Run the HF block forward and backward on the whole batch (loss ``sum(out * grad_out)``)."""
    block = make_block(case)
    x_all, g_all = make_batch(case)
    x = x_all.clone().requires_grad_(True)
    out = reference_block_forward(block, x, case.use_fp8)
    (out.float() * g_all.float()).sum().backward()
    logits, _, topk_idx = block.gate(x_all)
    # Well-posed routing: the K-th and (K+1)-th router probabilities must not (nearly) tie, or rounding-level
    # differences between the block and the layer could legitimately pick different experts.
    if case.top_k < case.num_experts and x_all.size(0) > 0:
        probs = torch.softmax(logits.detach().float(), dim=-1).sort(dim=-1, descending=True).values
        gap = ((probs[:, case.top_k - 1] - probs[:, case.top_k]) / probs[:, case.top_k - 1]).min().item()
        min_gap = 1e-4 if case.dtype == "float32" else 3e-2
        assert gap > min_gap, f"{case.describe()}: router near-tie (relative gap {gap:.2e}); pick another seed"
    tensors = {
        "gate_weight": block.gate.weight, "gate_up_proj": block.experts.gate_up_proj,
        "down_proj": block.experts.down_proj, "x": x_all, "grad_out": g_all, "topk_idx": topk_idx, "out": out,
        "grad_x": x.grad, "grad_gate_weight": block.gate.weight.grad,
        "grad_gate_up_proj": block.experts.gate_up_proj.grad, "grad_down_proj": block.experts.down_proj.grad}
    return HFJob(case, {name: t.detach().clone() for name, t in tensors.items()})


def _buffer(ctx: Any, hidden: int, gpus_per_node: int = 0) -> Any:
    """One Buffer per (process, hidden, topology), reused across cases.

    ``gpus_per_node > 0`` builds the Buffer with ``DEEP_EP_GPUS_PER_NODE`` set to it, so that 4 CPU ranks act as 2
    nodes of 2 and the internode (two-level) path runs; the variable is only read while the Buffer is built.
    """
    key = ("moe_buffer", hidden, gpus_per_node)
    if key not in ctx.cache:
        saved = os.environ.get("DEEP_EP_GPUS_PER_NODE")
        if gpus_per_node:
            os.environ["DEEP_EP_GPUS_PER_NODE"] = str(gpus_per_node)
        try:
            ctx.cache[key] = moe.make_buffer(ctx.group, hidden)
        finally:
            if saved is None:
                os.environ.pop("DEEP_EP_GPUS_PER_NODE", None)
            else:
                os.environ["DEEP_EP_GPUS_PER_NODE"] = saved
    return ctx.cache[key]


# ---------------------------------------------------------------------------------------------------------------
# Workers (run on every rank through tests/dist.py, or the NCCL launcher below)
# ---------------------------------------------------------------------------------------------------------------


def compare_with_hf_worker(ctx: Any, job: HFJob) -> str | None:
    """ExpertParallelMoE (this rank's tokens and experts) vs the HF block's results on the whole batch."""
    case, ref = job.case, job.tensors
    rank, world = ctx.rank, ctx.world_size
    assert len(case.tokens_per_rank) == world, case.describe()
    dev, dtype = torch.device(case.device), getattr(torch, case.dtype)
    hf_block = SimpleNamespace(gate=SimpleNamespace(weight=ref["gate_weight"]),
                               experts=SimpleNamespace(gate_up_proj=ref["gate_up_proj"], down_proj=ref["down_proj"]))
    buffer = _buffer(ctx, case.hidden, case.gpus_per_node)
    layer = moe.ExpertParallelMoE(buffer, case.hidden, case.intermediate, case.num_experts, case.top_k,
                                  use_fp8=case.use_fp8, dtype=dtype, device=dev).load_from_hf(hf_block)
    start = sum(case.tokens_per_rank[:rank])
    mine = slice(start, start + case.tokens_per_rank[rank])
    x = ref["x"][mine].to(dev).requires_grad_(True)

    # Routing must agree before numbers can: compare the top-k selection with the block's router.
    with torch.no_grad():
        ep_idx, _ = moe.route_topk(layer.gate(x), case.top_k)
    if not torch.equal(ep_idx.cpu(), ref["topk_idx"][mine].to(ep_idx.dtype)):
        return (f"rank {rank}: top-k selection differs from the HF router: {ep_idx.tolist()} vs "
                f"{ref['topk_idx'][mine].tolist()}")

    out = layer(x)
    (out.float() * ref["grad_out"][mine].to(dev).float()).sum().backward()
    router_grad = layer.gate.weight.grad.clone()
    torch.distributed.all_reduce(router_grad, group=ctx.group)  # replicated router: sum of per-rank shares

    with torch.no_grad():  # serving path: same numbers without autograd
        out_no_grad = layer(x.detach())

    experts = slice(layer.local_expert_range.start, layer.local_expert_range.stop)
    errors = {
        "output": rel_err(out, ref["out"][mine]),
        "grad x": rel_err(x.grad, ref["grad_x"][mine]),
        "grad router": rel_err(router_grad, ref["grad_gate_weight"]),
        "grad gate_up_proj": rel_err(layer.experts.gate_up_proj.grad, ref["grad_gate_up_proj"][experts]),
        "grad down_proj": rel_err(layer.experts.down_proj.grad, ref["grad_down_proj"][experts]),
    }
    row_errors = {"output rows": row_rel_err(out, ref["out"][mine]),
                  "grad x rows": row_rel_err(x.grad, ref["grad_x"][mine])}
    problems = [f"{name} rel err {err:.3e} > {WIRE_RTOL}" for name, err in errors.items() if not err <= WIRE_RTOL]
    problems += [f"{name} worst rel err {err:.3e} > {ROW_RTOL}" for name, err in row_errors.items()
                 if not err <= ROW_RTOL]
    if out.shape != x.shape or out.dtype != x.dtype:
        problems.append(f"output shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(x.shape)} {x.dtype}")
    if not torch.equal(out_no_grad, out.detach()):
        problems.append("forward under torch.no_grad differs from the autograd forward")
    if problems:
        return f"rank {rank}: " + "; ".join(problems) + f" (all: { {k: f'{v:.2e}' for k, v in errors.items()} })"
    return None


@dataclasses.dataclass(frozen=True)
class AdjointCase:
    """Exact autograd check of ``moe.dispatch``/``moe.combine`` with small-integer data."""

    seed: int
    tokens_per_rank: tuple[int, ...]
    hidden: int = 64
    num_experts: int = 8
    top_k: int = 3
    device: str = "cpu"
    gpus_per_node: int = 0

    def describe(self) -> str:
        nodes = f", {self.gpus_per_node} ranks/node" if self.gpus_per_node else ""
        return (f"AdjointCase(seed={self.seed}, tokens={self.tokens_per_rank}, E={self.num_experts}, "
                f"K={self.top_k}{nodes})")


def _pattern(*keys: int, hidden: int, modulo: int = 7) -> torch.Tensor:
    """``[hidden]`` float32 small integers in ``[-(modulo // 2), modulo // 2]``, a fixed function of the keys."""
    base = sum((31 ** i) * k for i, k in enumerate(keys))
    return ((torch.arange(hidden) + base) % modulo - modulo // 2).float()


def adjoint_worker(ctx: Any, case: AdjointCase) -> str | None:
    """Forward and backward of dispatch/combine equal their closed forms exactly (no rounding anywhere)."""
    rank, world = ctx.rank, ctx.world_size
    dev, hidden, num_experts, top_k = torch.device(case.device), case.hidden, case.num_experts, case.top_k
    local = num_experts // world
    gen = torch.Generator().manual_seed(case.seed)
    xs, idxs, ws = [], [], []
    for n in case.tokens_per_rank:  # every rank's inputs, regenerated identically everywhere
        xs.append(torch.randint(-3, 4, (n, hidden), generator=gen).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n)]) if n else \
            torch.zeros(0, top_k, dtype=torch.int64)
        idx[torch.rand(n, top_k, generator=gen) < 0.2] = -1
        idxs.append(idx)
        ws.append(torch.randint(-8, 9, (n, top_k), generator=gen).float() / 8)
    owner = [torch.where(i >= 0, i // local, -1) for i in idxs]
    holds = [torch.stack([(o == d).any(1) for d in range(world)], dim=1) for o in owner]  # [n_s, R]

    x = xs[rank].to(dev).requires_grad_(True)
    w = ws[rank].to(dev).requires_grad_(True)
    buffer = _buffer(ctx, hidden, case.gpus_per_node)
    recv_x, recv_idx, recv_w, state = moe.dispatch(x, idxs[rank].to(dev).to(moe.topk_idx_dtype()), w, buffer,
                                                   num_experts)
    rows = [(s, t) for s in range(world) for t in range(case.tokens_per_rank[s]) if holds[s][t, rank]]
    problems = []

    # Forward of dispatch: rows ordered by (source rank, token), local expert ids, foreign weights zeroed.
    exp_x = torch.stack([xs[s][t] for s, t in rows]) if rows else torch.zeros(0, hidden, dtype=torch.bfloat16)
    exp_idx = torch.stack([torch.where(owner[s][t] == rank, idxs[s][t] - rank * local, -1) for s, t in rows]) \
        if rows else torch.zeros(0, top_k, dtype=torch.int64)
    exp_w = torch.stack([torch.where(owner[s][t] == rank, ws[s][t], 0.0) for s, t in rows]) \
        if rows else torch.zeros(0, top_k)
    if not torch.equal(recv_x.cpu(), exp_x):
        problems.append("dispatch recv_x differs from the source rows")
    if not torch.equal(recv_idx.cpu().long(), exp_idx) or not torch.equal(recv_w.detach().cpu(), exp_w):
        problems.append("dispatch recv_topk_idx/recv_topk_weights differ from the local-expert rewrite")

    # Backward of dispatch = combine: grad rows of every holder summed per token; weight grads of local slots.
    grad_recv_x = torch.stack([_pattern(rank, s, t, hidden=hidden) for s, t in rows]) if rows else \
        torch.zeros(0, hidden)
    grad_recv_w = torch.stack([_pattern(rank, s, t, 1, hidden=top_k, modulo=9) / 4 for s, t in rows]) if rows else \
        torch.zeros(0, top_k)
    ((recv_x.float() * grad_recv_x.to(dev)).sum() + (recv_w * grad_recv_w.to(dev)).sum()).backward()
    n = case.tokens_per_rank[rank]
    exp_gx = torch.zeros(n, hidden)
    exp_gw = torch.zeros(n, top_k)
    for t in range(n):
        for d in range(world):
            if holds[rank][t, d]:
                exp_gx[t] += _pattern(d, rank, t, hidden=hidden)
                exp_gw[t] += torch.where(owner[rank][t] == d, _pattern(d, rank, t, 1, hidden=top_k, modulo=9) / 4,
                                         0.0)
    if not torch.equal(x.grad.float().cpu(), exp_gx):
        problems.append("grad x (combine of grad recv_x) differs from the per-token sum over holders")
    if not torch.equal(w.grad.cpu(), exp_gw):
        problems.append("grad topk_weights differs from the holders' gradients of their local slots")

    # Combine forward (plain sum, no weighting) and its backward (cached dispatch of the output gradient).
    y = (recv_x.detach().float() * (rank + 1)).requires_grad_(True)
    out = moe.combine(y, state)
    exp_out = torch.stack([xs[rank][t].float() * sum(d + 1 for d in range(world) if holds[rank][t, d])
                           for t in range(n)]) if n else torch.zeros(0, hidden)
    if out.dtype != torch.bfloat16 or not torch.equal(out.float().cpu(), exp_out):
        problems.append(f"combine output differs from sum over holders ({out.dtype})")
    grad_out = torch.stack([_pattern(rank, t, 2, hidden=hidden) for t in range(n)]) if n else torch.zeros(0, hidden)
    (out.float() * grad_out.to(dev)).sum().backward()
    exp_gy = torch.stack([_pattern(s, t, 2, hidden=hidden) for s, t in rows]) if rows else torch.zeros(0, hidden)
    if y.grad.dtype != torch.float32 or not torch.equal(y.grad.cpu(), exp_gy):
        problems.append("grad of combine input differs from the cached dispatch of the output gradient")
    return f"rank {rank}: " + "; ".join(problems) if problems else None


@dataclasses.dataclass(frozen=True)
class ExampleCase:
    """A few steps of ``examples/train_tiny_moe.py`` with these command-line arguments."""

    argv: tuple[str, ...]
    device: str = "cpu"

    def describe(self) -> str:
        return f"ExampleCase({' '.join(self.argv)}, {self.device})"


def _load_example() -> Any:
    """``examples/train_tiny_moe.py`` as a module (``examples/`` is not a package)."""
    import importlib.util

    path = dist.REPO_ROOT / "examples" / "train_tiny_moe.py"
    spec = importlib.util.spec_from_file_location("train_tiny_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_training_worker(ctx: Any, case: ExampleCase) -> str | None:
    """The example's training loop learns, and its data-parallel bookkeeping keeps replicated weights identical."""
    example = _load_example()
    args = example.parse_args(list(case.argv))
    losses, _, model = example.train(args, ctx.group, torch.device(case.device), log=lambda line: None)
    problems = []
    if not losses[-1] < losses[0] - 0.5:
        problems.append(f"the loss did not fall by 0.5 in {len(losses)} steps: {[round(v, 3) for v in losses]}")
    expert_params = model.expert_parameters()
    # Stays on the parameters' device: an NCCL group cannot all-gather CPU tensors.
    replicated = torch.cat([p.detach().float().flatten() for p in model.parameters() if p not in expert_params])
    everyone = [torch.empty_like(replicated) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(everyone, replicated, group=ctx.group)
    if not all(torch.equal(everyone[0], other) for other in everyone[1:]):
        problems.append("replicated parameters diverged across ranks (gradient all-reduce bookkeeping)")
    return f"rank {ctx.rank}: " + "; ".join(problems) if problems else None


# ---------------------------------------------------------------------------------------------------------------
# CPU tests: single process
# ---------------------------------------------------------------------------------------------------------------


def test_router_matches_hf() -> None:
    case = MoECase(seed=3, tokens_per_rank=(40,))
    block = make_block(case)
    x, _ = make_batch(case)
    _, hf_weights, hf_idx = block.gate(x)
    idx, weights = moe.route_topk(torch.nn.functional.linear(x, block.gate.weight), case.top_k)
    assert idx.dtype == moe.topk_idx_dtype()
    assert torch.equal(idx, hf_idx.to(idx.dtype))
    assert rel_err(weights, hf_weights) <= FP32_RTOL


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_match_hf_experts_fp32(top_k: int) -> None:
    """One rank owning every expert: the grouped local experts equal ``MixtralExperts`` (forward and gradients)."""
    case = MoECase(seed=5 + top_k, tokens_per_rank=(33,), top_k=top_k)
    block = make_block(case)
    x, g = make_batch(case)
    _, weights, idx = block.gate(x)
    weights = weights.detach()
    idx = idx.clone()
    idx[::5, 0] = -1  # some slots served elsewhere
    # HF drops a -1 slot by hitting the extra one-hot class; give it weight 0 so both sides skip it.
    weights = torch.where(idx >= 0, weights, 0.0)

    x_hf = x.clone().requires_grad_(True)
    w_hf = weights.clone().requires_grad_(True)
    hf_idx = torch.where(idx >= 0, idx, case.num_experts)
    ref = block.experts(x_hf, hf_idx, w_hf)
    (ref * g).sum().backward()

    gate_up = block.experts.gate_up_proj.detach().clone().requires_grad_(True)
    down = block.experts.down_proj.detach().clone().requires_grad_(True)
    x_ep = x.clone().requires_grad_(True)
    w_ep = weights.clone().requires_grad_(True)
    counts = torch.bincount(idx[idx >= 0], minlength=case.num_experts).tolist()
    out = moe.grouped_expert_forward(x_ep, idx, w_ep, counts, gate_up, down)
    (out * g).sum().backward()

    assert rel_err(out, ref) <= FP32_RTOL
    assert rel_err(x_ep.grad, x_hf.grad) <= FP32_RTOL
    valid = idx >= 0
    assert rel_err(w_ep.grad[valid], w_hf.grad[valid]) <= FP32_RTOL
    assert rel_err(gate_up.grad, block.experts.gate_up_proj.grad) <= FP32_RTOL
    assert rel_err(down.grad, block.experts.down_proj.grad) <= FP32_RTOL


def test_grouped_experts_reject_wrong_counts() -> None:
    idx = torch.tensor([[0, 1], [1, -1]])
    x, w = torch.randn(2, 8), torch.rand(2, 2)
    gate_up, down = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    with pytest.raises(ValueError, match="num_recv_tokens_per_expert_list sums to 4"):
        moe.grouped_expert_forward(x, idx, w, [2, 2], gate_up, down)
    with pytest.raises(ValueError, match="one per local expert"):
        moe.grouped_expert_forward(x, idx, w, [1, 1, 1], gate_up, down)
    # Experts with no rows still run and their gradients are zeros, not None.
    gate_up.requires_grad_(True)
    moe.grouped_expert_forward(x, torch.tensor([[1, -1], [1, -1]]), w, [0, 2], gate_up, down).sum().backward()
    assert gate_up.grad is not None and gate_up.grad[0].abs().sum() == 0 and gate_up.grad[1].abs().sum() > 0


def test_layer_argument_validation() -> None:
    fake = SimpleNamespace(rank=0, group_size=4)
    with pytest.raises(ValueError, match="num_experts must be a multiple of the group size 4, got 6"):
        moe.ExpertParallelMoE(fake, 16, 8, 6, 2)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        moe.ExpertParallelMoE(fake, 16, 8, 8, 9)
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        moe.ExpertParallelMoE(fake, 0, 8, 8, 2)
    with pytest.raises(ValueError, match="use_fp8=True needs hidden_size % 128 == 0, got hidden_size=64"):
        moe.ExpertParallelMoE(fake, 64, 8, 8, 2, use_fp8=True)
    with pytest.raises(TypeError, match="buffer must be a deep_ep.Buffer"):
        moe.ExpertParallelMoE(object(), 16, 8, 8, 2)
    layer = moe.ExpertParallelMoE(SimpleNamespace(rank=1, group_size=4), 16, 8, 8, 2)
    assert layer.local_expert_range == range(2, 4)
    assert tuple(layer.experts.gate_up_proj.shape) == (2, 16, 16)
    with pytest.raises(ValueError, match="hidden_states.size\\(-1\\) must be hidden_size=16"):
        layer(torch.randn(3, 15))
    block = make_block(MoECase(seed=0, tokens_per_rank=(1,), hidden=16, intermediate=4, num_experts=8))
    with pytest.raises(ValueError, match="experts.gate_up_proj slice has shape \\(2, 8, 16\\)"):
        layer.load_from_hf(block)


def test_load_from_per_expert_mlps() -> None:
    """The pre-5.0 transformers layout (one MLP per expert: w1 gate, w3 up, w2 down) loads like the fused one."""
    layer = moe.ExpertParallelMoE(SimpleNamespace(rank=1, group_size=2), 16, 4, 4, 2)
    mlps = [SimpleNamespace(w1=torch.nn.Linear(16, 4, bias=False), w3=torch.nn.Linear(16, 4, bias=False),
                            w2=torch.nn.Linear(4, 16, bias=False)) for _ in range(4)]
    block = SimpleNamespace(gate=torch.nn.Linear(16, 4, bias=False), experts=mlps)
    layer.load_from_hf(block)
    assert torch.equal(layer.gate.weight, block.gate.weight)
    for j, e in enumerate(layer.local_expert_range):
        assert torch.equal(layer.experts.gate_up_proj[j], torch.cat([mlps[e].w1.weight, mlps[e].w3.weight]))
        assert torch.equal(layer.experts.down_proj[j], mlps[e].w2.weight)


def test_dispatch_argument_validation() -> None:
    fake = SimpleNamespace(rank=0, group_size=2)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    w = torch.ones(4, 2)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16 or torch.float32"):
        moe.dispatch(torch.zeros(4, 8, dtype=torch.int32), idx, w, fake, 4)
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        moe.dispatch(torch.zeros(4, 8), idx, w.double(), fake, 4)
    with pytest.raises(ValueError, match="must both be \\[N, K\\] with N = x.size\\(0\\) = 3"):
        moe.dispatch(torch.zeros(3, 8), idx, w, fake, 4)
    with pytest.raises(ValueError, match="use_fp8=True needs hidden % 128 == 0, got hidden=8"):
        moe.dispatch(torch.zeros(4, 8), idx, w, fake, 4, use_fp8=True)
    with pytest.raises(ValueError, match="state must come from a completed"):
        moe.combine(torch.zeros(4, 8), moe.DispatchState(buffer=fake))


# ---------------------------------------------------------------------------------------------------------------
# CPU tests: 2 and 4 gloo ranks
# ---------------------------------------------------------------------------------------------------------------


HF_CASES_2 = [
    MoECase(seed=11, tokens_per_rank=(7, 12)),
    MoECase(seed=12, tokens_per_rank=(9, 0), top_k=3),
    MoECase(seed=13, tokens_per_rank=(8, 11), dtype="bfloat16"),
    MoECase(seed=14, tokens_per_rank=(10, 6), use_fp8=True),
]
HF_CASES_4 = [
    MoECase(seed=21, tokens_per_rank=(5, 9, 0, 7)),
    MoECase(seed=27, tokens_per_rank=(6, 4, 8, 3), dtype="bfloat16", num_experts=16, top_k=4),
    MoECase(seed=28, tokens_per_rank=(7, 5, 0, 9), top_k=3, gpus_per_node=2),
]


@pytest.mark.parametrize("case", HF_CASES_2 + HF_CASES_4, ids=lambda c: c.describe())
def test_layer_matches_hf_block(pools, case: MoECase) -> None:
    job = hf_job(case)
    pools.get(len(case.tokens_per_rank)).check(MODULE, "compare_with_hf_worker", job, timeout_s=CASE_TIMEOUT_S)


ADJOINT_CASES = [
    AdjointCase(seed=31, tokens_per_rank=(6, 9)),
    AdjointCase(seed=32, tokens_per_rank=(4, 0, 7, 5)),
    AdjointCase(seed=34, tokens_per_rank=(5, 8, 3, 0), gpus_per_node=2),
]


@pytest.mark.parametrize("case", ADJOINT_CASES, ids=lambda c: c.describe())
def test_dispatch_combine_autograd_exact(pools, case: AdjointCase) -> None:
    pools.get(len(case.tokens_per_rank)).check(MODULE, "adjoint_worker", case, timeout_s=CASE_TIMEOUT_S)


@pytest.mark.parametrize("world, case", [
    (2, ExampleCase(("--steps", "6", "--warmup", "1"))),
    (4, ExampleCase(("--steps", "6", "--warmup", "1", "--fp8", "--experts-per-rank", "1"))),
], ids=lambda v: v.describe() if hasattr(v, "describe") else f"{v} ranks")
def test_example_training_step(pools, world: int, case: ExampleCase) -> None:
    pools.get(world).check(MODULE, "example_training_worker", case, timeout_s=CASE_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------------------------
# GPU tests: 2 GPUs, NCCL, CUDA kernels (same workers)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.multi_gpu(2)
def test_layer_matches_hf_block_on_2_gpus() -> None:
    cases = [("compare_with_hf_worker", hf_job(dataclasses.replace(c, device="cuda")))
             for c in HF_CASES_2 + [MoECase(seed=15, tokens_per_rank=(512, 384), hidden=256, intermediate=128,
                                            use_fp8=True)]]
    cases.append(("adjoint_worker", AdjointCase(seed=33, tokens_per_rank=(64, 40), device="cuda")))
    cases.append(("example_training_worker", ExampleCase(("--steps", "6", "--warmup", "1"), device="cuda")))
    pool = dist.RankPool(2, {"DEEP_EP_TIMEOUT_S": "60"}, backend="nccl")
    try:
        for worker, job in cases:
            pool.check(MODULE, worker, job, timeout_s=300.0)
    finally:
        pool.close()
