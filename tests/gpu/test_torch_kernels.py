"""The torch backend's named row-copy kernels (deep_ep/backends/torch_kernels.py) on CUDA tensors: they copy what
tensor indexing copies, at any alignment, and a profile of CUDA activity alone shows one kernel of each low-latency
operation, named as DeepEP's are (``dispatch``, ``combine``)::

    python -m pytest -q tests/gpu/test_torch_kernels.py
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("num_rows", "src_bytes", "offset", "row_bytes"), [
    (1, 16, 0, 16), (37, 14352, 16, 14336), (5, 1040, 16, 1024), (9, 331, 3, 250), (64, 4, 0, 4)])
def test_copy_rows_matches_indexing(num_rows, src_bytes, offset, row_bytes):
    from deep_ep.backends.torch_kernels import _kernel, copy_rows
    if _kernel("dispatch", torch.device("cuda", torch.cuda.current_device())) is None:
        pytest.skip("this torch has no NVRTC kernels (torch.cuda._compile_kernel)")
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    src = torch.randint(0, 256, (num_rows, src_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    rows = torch.randperm(2 * num_rows, device="cuda", generator=gen)[:num_rows]
    for kind in ("dispatch", "combine"):
        got = torch.zeros(2 * num_rows, row_bytes, dtype=torch.uint8, device="cuda")
        want = got.clone()
        copy_rows(kind, src, offset, got, rows)
        want[rows] = src[:, offset:offset + row_bytes]
        assert torch.equal(got, want), kind


def test_low_latency_calls_show_one_named_kernel_each_in_a_cuda_profile(monkeypatch, tmp_path):
    """One rank, DEEP_EP_BACKEND=torch: a profile with CUDA activity only has exactly one table row whose name holds
    ``dispatch`` and one with ``combine`` (with and without receive hooks), as DeepEP's test scripts require."""
    import torch.distributed as dist
    monkeypatch.setenv("DEEP_EP_BACKEND", "torch")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29700 + os.getpid() % 200))
    import deep_ep
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        tokens, hidden, experts = 16, 1024, 8
        buffer = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
            tokens, hidden, 1, experts), low_latency_mode=True, num_qps_per_rank=experts)
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        topk_idx = torch.randint(0, experts, (tokens, 2), device="cuda").to(deep_ep.topk_idx_t)
        weights = torch.rand(tokens, 2, device="cuda")

        def round_trip(hook: bool) -> None:
            recv, _, handle, _, dispatch_hook = buffer.low_latency_dispatch(x, topk_idx, tokens, experts,
                                                                            use_fp8=False, return_recv_hook=hook)
            if hook:
                dispatch_hook()
            _, _, combine_hook = buffer.low_latency_combine(recv, topk_idx, weights, handle, return_recv_hook=hook)
            if hook:
                combine_hook()

        for hook in (False, True):
            round_trip(hook)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    round_trip(hook)
                torch.cuda.synchronize()
            lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
            trace = os.path.join(str(tmp_path), f"trace{int(hook)}.json")
            prof.export_chrome_trace(trace)
            with open(trace) as f:
                names = [event.get("name", "") for event in json.load(f)["traceEvents"]]
            for name in ("dispatch", "combine"):
                assert sum(name in line for line in lines) == 1, (hook, name, "\n".join(lines))
                # DeepEP's scripts time a hooked call's kernels from the trace's events named "...::<name>", in
                # periods of two (send and receive): at least one event per call, an even count over four calls
                count = sum(f"::{name}" in n for n in names)
                assert count >= 4 and count % 2 == 0, (hook, name, [n for n in names if name in n])
    finally:
        dist.destroy_process_group()
