"""Train a tiny expert-parallel MoE language model for a few steps, on CPU (gloo) or GPUs (NCCL + deep_ep kernels).

    torchrun --nproc-per-node 2 examples/train_tiny_moe.py                 # CPU, gloo, torch backend
    torchrun --nproc-per-node 2 examples/train_tiny_moe.py --device cuda   # GPUs, NCCL, CUDA kernels
    torchrun --nproc-per-node 4 examples/train_tiny_moe.py --fp8 --steps 20

Model: token embedding -> ``--layers`` x [RMSNorm -> ExpertParallelMoE, residual] -> RMSNorm -> LM head. Each rank
owns ``num_experts / world_size`` experts of every MoE layer; the rest is replicated and trained data-parallel. The
synthetic task, predict ``(token * 7 + 3) % vocab`` from ``token``, is learnable: the loss falls well below
``log(vocab)``. The global loss is the mean over ranks of each rank's mean token loss, so every rank back-propagates
``loss_local / world_size``; expert gradients arrive complete through combine/dispatch backward, replicated
parameters get an all-reduce SUM. Each step prints the global loss and its wall time (rank 0); the last line gives
the mean time per step without the first ``--warmup`` steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deep_ep.moe import ExpertParallelMoE, make_buffer  # noqa: E402


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (computed in float32)."""

    def __init__(self, hidden: int, eps: float = 1e-6, **factory: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class TinyMoEModel(nn.Module):
    """Embedding, ``num_layers`` pre-norm residual MoE layers, LM head. Input ``[B, S]`` int64 -> ``[B, S, V]``."""

    def __init__(self, buffer: object, vocab: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 num_layers: int, use_fp8: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.embed = nn.Embedding(vocab, hidden, **factory)
        self.norms = nn.ModuleList(RMSNorm(hidden, **factory) for _ in range(num_layers))
        self.moes = nn.ModuleList(
            ExpertParallelMoE(buffer, hidden, intermediate, num_experts, top_k, use_fp8=use_fp8, **factory)
            for _ in range(num_layers))
        self.final_norm = RMSNorm(hidden, **factory)
        self.head = nn.Linear(hidden, vocab, bias=False, **factory)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return self.head(self.final_norm(h))

    def expert_parameters(self) -> set[nn.Parameter]:
        return {p for moe in self.moes for p in moe.expert_parameters()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo + torch backend; cuda: NCCL + CUDA kernels (one GPU per rank)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the mean time per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter dtype")
    parser.add_argument("--fp8", action="store_true", help="FP8 forward dispatch (needs hidden % 128 == 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq", "vocab", "hidden", "intermediate", "experts_per_rank", "top_k", "layers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0 or args.warmup >= args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    return args


def train(args: argparse.Namespace, group: object, device: torch.device,
          log: Callable[[str], None] = print) -> tuple[list[float], list[float], TinyMoEModel]:
    """Run ``args.steps`` training steps on ``group`` (every rank calls this).

    Returns:
        ``(losses, step_times, model)``: the global mean loss of every step (identical on all ranks), the wall
        time of every step in seconds, and the trained model (its Buffer is already destroyed).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = getattr(torch, args.dtype)

    # Identical replicated parameters on every rank (same seed); expert parameters differ per rank by design.
    torch.manual_seed(args.seed)
    buffer = make_buffer(group, args.hidden, explicitly_destroy=True)
    model = TinyMoEModel(buffer, args.vocab, args.hidden, args.intermediate, args.experts_per_rank * world,
                         args.top_k, args.layers, args.fp8, dtype, device)
    with torch.no_grad():
        for i, moe in enumerate(model.moes):  # distinct experts on every rank
            gen = torch.Generator().manual_seed(args.seed * 1000 + i * 100 + rank)
            for p in moe.expert_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    expert_params = model.expert_parameters()
    replicated = [p for p in model.parameters() if p not in expert_params]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # every rank sees different tokens

    if rank == 0:
        log(f"world={world} device={device.type} dtype={args.dtype} fp8={args.fp8} hidden={args.hidden} "
            f"experts={args.experts_per_rank * world} top_k={args.top_k} layers={args.layers} "
            f"tokens/rank/step={args.batch * args.seq}")
    losses, step_times = [], []
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data_gen).to(device)
        targets = (tokens * 7 + 3) % args.vocab
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()

        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().view(-1, args.vocab), targets.view(-1))
        optimizer.zero_grad(set_to_none=True)
        (loss / world).backward()
        for p in replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        optimizer.step()

        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - start)
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss, group=group)
        losses.append(global_loss.item() / world)
        if rank == 0:
            log(f"step {step:3d}  loss {losses[-1]:.4f}  time {step_times[-1] * 1e3:8.2f} ms")
    timed = step_times[args.warmup:]
    if rank == 0:
        log(f"mean time per step (steps {args.warmup}..{args.steps - 1}): {sum(timed) / len(timed) * 1e3:.2f} ms")
    buffer.destroy()
    return losses, step_times, model


# Set by torchrun for every process it starts; gloo and NCCL's env:// rendezvous read them.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_hint(environ: dict, argv: list[str]) -> str | None:
    """How to launch this script, if ``environ`` lacks what torchrun sets; ``None`` when it is all there."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if not missing:
        return None
    command = " ".join(["torchrun", "--nproc-per-node", "2", "examples/train_tiny_moe.py", *argv])
    return (f"train_tiny_moe.py runs one process per rank and must be started by torchrun ({', '.join(missing)} "
            f"not set). Launch it as:\n    {command}\n(--nproc-per-node is the number of ranks; add --device cuda "
            "for GPUs)")


def main() -> None:
    args = parse_args()
    hint = launch_hint(dict(os.environ), sys.argv[1:])
    if hint is not None:
        raise SystemExit(hint)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA; use --device cpu for the gloo run")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(args, dist.group.WORLD, device, log=lambda line: print(line, flush=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
