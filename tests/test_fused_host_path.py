"""The host path of the fused internode backend (``deep_ep.backends.fused_internode``) on CPU.

A subprocess installs the fake extension (``tests/fake_cuda.py``) whose fused entry points follow the C++
signatures of ``csrc/buffer.hpp`` and fill their outputs with what ``reference`` computes for rank 0 of a 2 x 2
group whose ranks all hold the same inputs (``all_gather`` returns four copies). The backend must assemble the
internode handle, the results, the cached dispatch and the combine from those outputs exactly as the reference
has them, pass the notify's tensors on to the kernels, use ``config.num_sms // 2`` channels, raise
``ArgumentMismatchError`` before the dispatch kernel when the notify's gathered call signatures differ, send a
refusal through the fused notify, serve up to 32 nodes and 64 ranks, and name the peer's node in a kernel's timeout.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fake_cuda import PROBE_HEAD, ROOT, probe_env, run_probe

pytest.importorskip("torch")


_PROBE = PROBE_HEAD + r"""
import reference
import deep_ep
from deep_ep.backends.base import CombineRequest, DispatchRequest, LayoutRequest
from deep_ep.config import Topology

topo, num_experts, num_sms = Topology(4, 2), 8, 6
channels = num_sms // 2
x, x_fp8, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 40, 256, 3, num_experts)
mask = reference.get_dispatch_layout(topk_idx, num_experts, topo).is_token_in_rank
use_fp8 = os.environ["PROBE_FP8"] == "1"
payload = x_fp8 if use_fp8 else x
ref = reference.dispatch([payload] * 4, [mask] * 4, topo, topk_idx=[topk_idx] * 4, topk_weights=[topk_weights] * 4,
                         num_experts=num_experts, num_channels=channels)
mine = ref[0]
handle_fields = mine.handle._asdict()
seen = {}

class Fused(ext.Runtime):
    def get_dispatch_layout(self, topk_idx, num_experts, *streams):
        lay = reference.get_dispatch_layout(topk_idx, num_experts, topo)
        return lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank
    def fused_notify(self, per_rank, per_node, per_expert, in_rank, experts, num_channels, per_node_gpus, alignment,
                     worst, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, stream,
                     after_current, words, check):
        assert (num_channels, per_node_gpus, experts, worst, check) == (channels, 2, num_experts, False, True)
        seen["words"] = list(words)
        for name, out in (("rdma_channel_prefix_matrix", rdma_cpm), ("gbl_channel_prefix_matrix", gbl_cpm),
                          ("recv_rdma_channel_prefix_matrix", recv_rdma_cpm),
                          ("recv_rdma_rank_prefix_sum", recv_rdma_rps),
                          ("recv_gbl_channel_prefix_matrix", recv_gbl_cpm),
                          ("recv_gbl_rank_prefix_sum", recv_gbl_rps)):
            out.copy_(handle_fields[name])
        seen["notify"] = [t.data_ptr() for t in (recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps)]
    def gathered_signatures(self):  # rank 3 sends seen["disagree"] when set
        words = seen["words"]
        rows = [words] * 3 + [seen.get("disagree") or words]
        return [w for row in rows for w in row]
    def wait_recv_counts(self, num_local_experts):
        return mine.handle.recv_src_meta.size(0), list(mine.num_recv_tokens_per_expert_list)
    def forward_count(self):
        return handle_fields["send_nvl_head"].size(0)
    def fused_refuse_notify(self, words, gpus_per_node, stream):
        seen["refused"] = [list(words), gpus_per_node]
    def fused_dispatch(self, data, scales, topk, weights, experts, in_rank, per_node_gpus, recv_rdma_cpm,
                       recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps, send_rdma_head, send_nvl_head, recv_src_meta, rows,
                       worst, num_channels, rdma_send, rdma_recv, nvl_send, nvl_recv, stream, after_current,
                       current_after, signature_hash):
        assert num_channels == channels and rdma_recv % rdma_send == 0 and nvl_recv >= 2 * nvl_send
        assert signature_hash == 0, "one rank: no checked call"
        seen.setdefault("dispatch", []).append(
            [t.data_ptr() for t in (recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm, recv_gbl_rps)])
        for name, out in (("send_rdma_head", send_rdma_head), ("send_nvl_head", send_nvl_head),
                          ("recv_src_meta", recv_src_meta)):
            if out is not None:
                out.copy_(handle_fields[name])
        recv = mine.recv_x
        recv_x, recv_scales = (recv[0].clone(), recv[1].contiguous().clone()) if use_fp8 else (recv.clone(), None)
        if topk is None:
            return recv_x, recv_scales, None, None
        return recv_x, recv_scales, mine.recv_topk_idx.clone(), mine.recv_topk_weights.clone()
    def fused_combine(self, x, weights, bias_0, bias_1, per_node_gpus, recv_rdma_cpm, recv_rdma_rps, recv_gbl_cpm,
                      recv_gbl_rps, send_rdma_head, send_nvl_head, num_channels, *rest):
        seen["combine"] = [torch.equal(a, handle_fields[n]) for a, n in (
            (recv_rdma_cpm, "recv_rdma_channel_prefix_matrix"), (recv_rdma_rps, "recv_rdma_rank_prefix_sum"),
            (recv_gbl_cpm, "recv_gbl_channel_prefix_matrix"), (recv_gbl_rps, "recv_gbl_rank_prefix_sum"),
            (send_rdma_head, "send_rdma_head"), (send_nvl_head, "send_nvl_head"))]
        ys = [x] + [torch.zeros(r.handle.recv_src_meta.size(0), x.size(1), dtype=x.dtype) for r in ref[1:]]
        out = reference.combine(ys, [r.handle for r in ref], topo, bias=[bias_0] * 4)[0]
        return out.combined_x, None
ext.Runtime = Fused

from deep_ep.backends.fused_internode import FusedInternodeCuda  # noqa: E402
config = deep_ep.Config(num_sms, 8, 256)
report = {}
with fake.patched(torch, cuda_tensors=True):
    backend = FusedInternodeCuda(0, topo, 1 << 30, 1, False, all_gather=lambda obj: [obj] * 4)
    report["channels"] = backend.num_channels(config)
    layout = backend.get_dispatch_layout(LayoutRequest(topk_idx, num_experts))
    report["layout_rdma"] = torch.equal(layout.num_tokens_per_rdma_rank,
                                        reference.get_dispatch_layout(topk_idx, num_experts, topo)
                                        .num_tokens_per_rdma_rank)
    out = backend.dispatch(DispatchRequest(payload, None, layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank,
                                           layout.is_token_in_rank, layout.num_tokens_per_expert, topk_idx,
                                           topk_weights, config=config))
    report["handle"] = {f: torch.equal(getattr(out.handle, f), handle_fields[f]) for f in handle_fields}
    report["per_expert"] = list(out.num_recv_tokens_per_expert_list) == list(mine.num_recv_tokens_per_expert_list)
    report["topk"] = torch.equal(out.recv_topk_idx, mine.recv_topk_idx)
    report["kernel_args"] = seen["dispatch"][0] == seen["notify"]
    cached = backend.dispatch(DispatchRequest(payload, out.handle, config=config))
    report["cached_args"] = seen["dispatch"][1] == [t.data_ptr() for t in (
        out.handle.recv_rdma_channel_prefix_matrix, out.handle.recv_rdma_rank_prefix_sum,
        out.handle.recv_gbl_channel_prefix_matrix, out.handle.recv_gbl_rank_prefix_sum)]
    report["cached_x"] = torch.equal((cached.recv_x[0] if use_fp8 else cached.recv_x).view(torch.uint8),
                                     (mine.recv_x[0] if use_fp8 else mine.recv_x).view(torch.uint8))
    y = torch.randn(mine.handle.recv_src_meta.size(0), 256).to(torch.bfloat16)
    bias = torch.randn(40, 256).to(torch.bfloat16)
    combined = backend.combine(CombineRequest(y, out.handle, bias=(bias,), config=config))
    report["combine_args"] = seen["combine"]
    ys = [y] + [torch.zeros(r.handle.recv_src_meta.size(0), 256, dtype=torch.bfloat16) for r in ref[1:]]
    report["combined"] = torch.equal(combined.combined_x,
                                     reference.combine(ys, [r.handle for r in ref], topo, bias=[bias] * 4)[0]
                                     .combined_x)
    from deep_ep.backends.agreement import Signature
    request = DispatchRequest(payload, None, layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank,
                              layout.is_token_in_rank, layout.num_tokens_per_expert, topk_idx, topk_weights,
                              config=config, signature=Signature("dispatch", (("x.size(1) (hidden)", 256),)))
    launched = len(seen["dispatch"])
    backend.dispatch(request)
    report["agree"] = len(seen["dispatch"]) == launched + 1 and len(seen["words"]) > 0
    seen["disagree"] = Signature("dispatch", (("x.size(1) (hidden)", 512),)).values()
    try:
        backend.dispatch(request)
        report["disagree"] = "accepted"
    except deep_ep.ArgumentMismatchError as exc:
        report["disagree"] = str(exc) if len(seen["dispatch"]) == launched + 1 else "the kernel was launched"
    refusal = Signature("dispatch", (("refused", 1),))
    backend.refuse_dispatch(refusal)
    report["refuse"] = seen.get("refused") == [list(refusal.values()), 2]
    reason = FusedInternodeCuda.unsupported_reason
    report["limits"] = {f"{n}x{g}": reason(Topology(n * g, g), 1 << 30) for n, g in
                        ((16, 2), (8, 4), (8, 8), (16, 4), (32, 2), (33, 2), (16, 8))}
    errors = [{"code": "timeout", "message": "dispatch recv wait tail: rank 0 peer 3 channel 1", "peer": 3}]
    backend.runtime.read_error = lambda: errors[0]
    try:
        backend.check_errors()
        report["timeout"] = "none"
    except deep_ep.CommTimeoutError as exc:
        report["timeout"] = str(exc)
    backend.runtime.read_error = lambda: None
    try:
        backend.dispatch(DispatchRequest(payload, out.handle, config=deep_ep.Config(2 * num_sms, 8, 256)))
        report["channel_check"] = "accepted"
    except ValueError as exc:
        report["channel_check"] = str(exc)
print(json.dumps(report))
"""


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_backend_assembles_reference_results(use_fp8):
    report = run_probe(_PROBE, PROBE_FP8="1" if use_fp8 else "0", DEEP_EP_GPUS_PER_NODE="2")
    assert report["channels"] == 3
    assert report["layout_rdma"]
    assert all(report["handle"].values()) and len(report["handle"]) == 10, report["handle"]
    assert report["per_expert"] and report["topk"]
    assert report["kernel_args"], "the dispatch kernel must get the notify's prefix tensors"
    assert report["cached_args"], "a cached dispatch must pass the handle's prefix tensors"
    assert report["cached_x"]
    assert report["combine_args"] == [True] * 6, report["combine_args"]
    assert report["combined"]
    assert "channels" in report["channel_check"], report["channel_check"]
    assert report["agree"], "a dispatch whose ranks agree runs its kernel"
    assert "ranks [3]" in report["disagree"], report["disagree"]
    assert report["refuse"], "a refused dispatch reaches the peers through the fused notify's slots"
    limits = report["limits"]
    assert all(limits[k] is None for k in ("16x2", "8x4", "8x8", "16x4", "32x2")), limits
    assert "66 ranks exceed" in limits["33x2"] and "128 ranks exceed" in limits["16x8"], limits
    assert "peer 3 channel 1" in report["timeout"] and "node 1, local 1" in report["timeout"], report["timeout"]


_PUT_PROBE = PROBE_HEAD + r"""
import deep_ep
import deep_ep.testing
from deep_ep.backends.cuda_internode import UnsupportedTopology
from deep_ep.config import Topology

calls = []

class Fused(ext.Runtime):  # every rank reports the same unreachable ranks (all_gather returns copies)
    def set_put_peers(self, ranks, put_area):
        calls.append(["set_put_peers", list(ranks), put_area])
        super().set_put_peers(ranks, put_area)
    def destroy(self):
        calls.append(["destroy"])
ext.Runtime = Fused

from deep_ep.backends.fused_internode import FusedInternodeCuda  # noqa: E402
report = {}
for name, unreachable, put_only in (("pointer", [], False), ("rail", [2, 3], False), ("near", [1], False),
                                    ("forced", [], True)):
    Fused.unreachable = unreachable
    calls.clear()
    with fake.patched(torch, cuda_tensors=True), deep_ep.testing.overrides(internode_put_only=put_only):
        try:
            backend = FusedInternodeCuda(0, Topology(4, 2), 1 << 30, 1, False, all_gather=lambda obj: [obj] * 4)
            report[name] = {"put_peers": list(backend.put_peers), "calls": list(calls)}
        except UnsupportedTopology as exc:
            report[name] = {"refused": str(exc), "calls": list(calls)}
print(json.dumps(report))
"""


def test_fused_backend_accepts_rail_put_peers_only():
    """Put peers of other nodes (or internode_put_only, which forces exactly those) are served by the fused kernels
    with a put area; a put pair inside a node is refused (and the buffer released) so that the composed path takes
    over."""
    report = run_probe(_PUT_PROBE, DEEP_EP_GPUS_PER_NODE="2")
    # The fused kernels' put area is the header alone (PUT_AREA_IN_REGION = 2): they stage inside their region.
    assert report["pointer"] == {"put_peers": [], "calls": [["set_put_peers", [], 0]]}, report["pointer"]
    assert report["rail"] == {"put_peers": [2, 3], "calls": [["set_put_peers", [2, 3], 2]]}, report["rail"]
    assert report["forced"] == {"put_peers": [2, 3], "calls": [["set_put_peers", [2, 3], 2]]}, report["forced"]
    near = report["near"]
    assert "inside a node" in near.get("refused", "") and "rank 0 reaches [1]" in near["refused"], near
    assert near["calls"] == [["set_put_peers", [1], 2], ["destroy"]], near


_WIDE_PUT_PROBE = PROBE_HEAD + r"""
import deep_ep
from deep_ep.backends import selection
from deep_ep.config import Topology

class Comm:  # every rank reports what this one does
    def __init__(self, size):
        self.size = size
    def allgather(self, obj):
        return [obj] * self.size
    def Barrier(self):
        pass

report = {}
for num_nodes, per_node in ((16, 2), (8, 4), (8, 8), (32, 2)):
    ranks = num_nodes * per_node
    for rank in (0, ranks - 1):  # the ranks of other nodes are behind a NIC
        ext.Runtime.unreachable = [r for r in range(ranks) if r // per_node != rank // per_node]
        spec = selection.BufferSpec(rank, ranks, Topology(ranks, per_node), 1 << 20, 1 << 30, False, 1, True, False,
                                    False)
        with fake.patched(torch, cuda_tensors=True), warnings.catch_warnings():
            warnings.simplefilter("error")
            backend = selection._fused_internode(spec, None, Comm(ranks))
        report[f"{num_nodes}x{per_node}/{rank}"] = [type(backend).__name__, list(backend.put_peers),
                                                    backend.runtime.get_put_mask()]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def wide_put_report() -> dict:
    """The wide-group probe's report (one subprocess for every shape)."""
    return run_probe(_WIDE_PUT_PROBE)


@pytest.mark.parametrize("shape", ["16x2", "8x4", "8x8", "32x2"])
def test_selection_serves_wide_groups_with_rail_put_peers(wide_put_report, shape):
    """Nodes behind a NIC in groups past the ring kernels' 24 ranks, up to the fused kernels' 64: the fused kernels
    serve them (no fallback to the composed path), the ranks of every other node are put peers and the runtime's
    mask has their bits, past bit 31 too."""
    num_nodes, per_node = map(int, shape.split("x"))
    ranks = num_nodes * per_node
    for rank in (0, ranks - 1):
        peers = [r for r in range(ranks) if r // per_node != rank // per_node]
        assert wide_put_report[f"{shape}/{rank}"] == ["FusedInternodeCuda", peers, sum(1 << r for r in peers)], \
            (shape, rank, wide_put_report[f"{shape}/{rank}"])


class _Unsupported(RuntimeError):
    pass


class _FakeFused:
    """Stands in for ``FusedInternodeCuda`` in the selection: serves unless ``refuse`` is set."""

    refuse = False
    options: dict = {}

    @staticmethod
    def unsupported_reason(topology, num_rdma_bytes):
        return None if num_rdma_bytes > 0 else "num_rdma_bytes is 0"

    @classmethod
    def from_group(cls, group, topology, **options):
        if cls.refuse:
            raise _Unsupported("NVSHMEM put peers inside a node (rank 0 reaches [1] only by puts)")
        cls.options = options
        return cls()


@pytest.mark.parametrize("override, refuse, rdma, chosen", [
    (None, False, 1 << 20, True),          # the automatic choice for N x G, G > 1
    ("composed", False, 1 << 20, False),   # the two-stage composition on request
    ("torch", False, 1 << 20, False),
    (None, True, 1 << 20, False),          # put peers inside a node: the composed path takes over, silently
    (None, False, 0, False),               # no RDMA buffer
    ("fused", True, 1 << 20, False),       # asked for but refused: a warning names why
])
def test_selection_prefers_fused_kernels(monkeypatch, override, refuse, rdma, chosen):
    import types
    import warnings

    import deep_ep.testing
    from deep_ep.backends import selection
    from deep_ep.config import Topology

    fake_module = types.ModuleType("deep_ep.backends.cuda_internode")
    fake_module.UnsupportedTopology = _Unsupported
    monkeypatch.setitem(sys.modules, "deep_ep.backends.cuda_internode", fake_module)
    monkeypatch.setattr(selection, "_import_cuda", lambda module, name: (_FakeFused, None))
    monkeypatch.setattr(selection.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_FakeFused, "refuse", refuse)
    spec = selection.BufferSpec(0, 4, Topology(4, 2), 1 << 20, rdma, False, 1, True, False, False)
    with deep_ep.testing.overrides(internode=override), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = selection._fused_internode(spec, object(), None)
    assert isinstance(got, _FakeFused) == chosen
    if chosen:  # the fused kernels' one symmetric buffer holds both of the Buffer's sizes
        assert _FakeFused.options["num_rdma_bytes"] == (1 << 20) + rdma, _FakeFused.options
    assert any("puts" in str(w.message) for w in caught) == (override == "fused"), [str(w.message) for w in caught]
    one_node = spec._replace(topology=Topology(4, 4))
    with deep_ep.testing.overrides(internode=override):
        assert selection._fused_internode(one_node, object(), None) is None


def test_internode_heap_bytes():
    """What the normal-mode internode kernels take on the NVSHMEM heap (the low-latency backend of the same Buffer
    sizes the heap for it): nothing within one node, num_rdma_bytes with one GPU per node, num_nvl_bytes +
    num_rdma_bytes for the fused kernels."""
    from deep_ep.backends import selection
    from deep_ep.config import Topology
    spec = selection.BufferSpec(0, 8, Topology(8, 8), 3 << 20, 5 << 20, True, 1, True, False, False)
    assert selection._internode_heap_bytes(spec) == 0
    assert selection._internode_heap_bytes(spec._replace(topology=Topology(8, 1))) == 5 << 20
    assert selection._internode_heap_bytes(spec._replace(topology=Topology(8, 2))) == 8 << 20


_PUT_MASK_PROGRAM = r"""
#include <cstdio>
#include "fused_internode.cuh"
using namespace deep_ep::kernels;
int main() {
    KernelContext ctx{};
    std::printf("%d %d %d\n", kFusedMaxRanks, kMaxRuntimeRanks, static_cast<int>(8 * sizeof(ctx.put_mask)));
    const unsigned long long mask = (1ull << 0) | (1ull << 24) | (1ull << 31) | (1ull << 32) | (1ull << 63);
    for (int r = -1; r <= 64; ++r) std::printf("%d", put_bit(mask, r) ? 1 : 0);
    std::printf("\n");
    return 0;
}
"""


def _cuda_include() -> str | None:
    """A CUDA toolkit's include directory (the kernels' headers include cuda_runtime.h), or None."""
    import os
    import shutil
    nvcc = shutil.which("nvcc")
    for root in (os.environ.get("CUDA_HOME"), nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                 "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "include")
    return None


def _run_host_program(tmp_path, name: str, program: str, stdin: str | None = None) -> str:
    """Builds ``program`` with g++ against the kernels' headers and returns what it prints (given ``stdin``);
    skips without a host C++ compiler or the CUDA headers."""
    import shutil

    from fake_cuda import ROOT
    include = _cuda_include()
    if shutil.which("g++") is None or include is None:
        pytest.skip("needs a host C++ compiler and the CUDA headers")
    source, binary = tmp_path / f"{name}.cpp", tmp_path / name
    source.write_text(program)
    subprocess.run(["g++", "-std=c++17", "-I", f"{ROOT}/csrc/kernels", "-I", include, str(source), "-o", str(binary)],
                   check=True)
    return subprocess.run([str(binary)], input=stdin, check=True, capture_output=True, text=True).stdout


def test_put_mask_mirror_matches_cpp(tmp_path):
    """The kernels' put mask (KernelContext::put_mask, put_bit) has a bit for every rank of a fused group and of a
    runtime, as deep_ep/config.py and the fake extension's runtime (tests/fake_cuda.py) assume."""
    from deep_ep import config
    lines = _run_host_program(tmp_path, "put_mask", _PUT_MASK_PROGRAM).split()
    fused, runtime, bits = map(int, lines[:3])
    assert (fused, runtime) == (config.NUM_MAX_FUSED_RANKS, config.NUM_MAX_RUNTIME_RANKS)
    assert bits >= max(fused, runtime)
    import fake_cuda
    import torch
    assert fake_cuda.make_fake_extension(torch).MAX_RUNTIME_RANKS == runtime
    assert lines[3] == "".join("1" if r in (0, 24, 31, 32, 63) else "0" for r in range(-1, 65))


_OWNER_PROGRAM = r"""
#include <cstdio>
#include "fused_internode.cuh"
using namespace deep_ep::kernels;
int main() {
    std::printf("%d %d\n", kChannelWarps, kFusedCombineOwnerWarps);
    for (int n = 2; n <= kFusedMaxNodes; ++n) std::printf("%d ", fused_combine_owner_warps(n));
    std::printf("\n");
    return 0;
}
"""


def test_combine_owner_warps_mirror_matches_cpp(tmp_path):
    """The simulator's fused combine roles (``role_warps``) split a channel's even CTA as the kernels do
    (``fused_combine_owner_warps``): the owner team's warps for every node count the kernels serve."""
    from simulator import deep_ep_fused as fused
    lines = _run_host_program(tmp_path, "owner", _OWNER_PROGRAM).splitlines()
    assert list(map(int, lines[0].split())) == [fused.CTA_WARPS, fused.COMBINE_OWNER_WARPS]
    owners = list(map(int, lines[1].split()))
    assert owners == [fused.role_warps("combine", n, 2 * n)["receive"][0] for n in range(2, 2 + len(owners))]
    assert owners[:2] == [10, 8] and owners[6] == 8  # 2 and 3 nodes: the even share; 8 nodes: the floor


_RINGS_PROGRAM = r"""
#include <cstdio>
#include "fused_internode.cuh"
using namespace deep_ep::kernels;
int main() {
    std::printf("%lld %lld %lld\n", (long long)kControlBytes, (long long)kPutHeaderBytes, (long long)kFusedRingsOffset);
    long long n; int put, nodes, gpus, channels, scales, topk, rail, node, combine; long long hidden;
    while (std::scanf("%lld %d %d %d %d %lld %d %d %d %d %d", &n, &put, &nodes, &gpus, &channels, &hidden, &scales,
                      &topk, &rail, &node, &combine) == 11) {
        const long long ring = put ? n - kPutHeaderBytes : n;
        const FusedGeometry g = fused_layout(nodes, gpus, channels, hidden, scales, topk, rail, node, ring, put != 0,
                                             combine != 0);
        std::printf("%lld %lld %lld %lld\n", ring, (long long)fused_half_bytes(g.region_bytes),
                    (long long)(g.end_offset - g.rail_rings_offset), (long long)g.record_bytes);
    }
    return 0;
}
"""


def _rings_cases() -> list[tuple]:
    """(num_rdma_bytes, put area, N, G, channels, hidden bytes, scales, top-k, rail slots, node slots, combine):
    the benchmark's 2 x 2 geometry (12 channels of 7168-BF16 records, top-8) around the smallest buffers that hold
    it, with and without put peers (their staging), FP8 with scales, a combine, and wide groups."""
    from deep_ep import layout
    bf16 = (2, 2, 12, 14336, 0, 8, 258, 256, 0)
    record = layout.intranode_dispatch_record_bytes(14336, 0, 8)
    cases = []
    for put in (0, 1):
        least = layout.fused_min_rdma_bytes(layout.fused_ring_bytes(2, 2, 12, record, 258, 256, bool(put)), bool(put))
        cases += [(n, put, *bf16) for n in (least - 128, least, 10**9 // 128 * 128, 256 << 20, 1 << 30, 3 << 30)]
    cases += [(1 << 30, 1, 2, 2, 12, 7168, 56, 8, 258, 256, 0), (1 << 30, 1, 2, 2, 12, 14336, 0, 8, 258, 256, 1),
              (480 << 20, 1, 8, 8, 6, 512, 4, 8, 256, 256, 0), (384 << 20, 0, 32, 2, 4, 256, 0, 4, 256, 256, 1)]
    return cases


def test_fused_rings_mirror_matches_cpp(tmp_path):
    """deep_ep.layout's put area and fused ring sizes (Buffer's check before a fused call) are the kernels'
    (kPutHeaderBytes, fused_layout, fused_half_bytes): the same region, half and ring bytes for each case, and the
    smallest buffer fused_min_rdma_bytes names holds the rings where 128 bytes less does not."""
    from deep_ep import layout
    cases = _rings_cases()
    stdin = "\n".join(" ".join(str(v) for v in case) for case in cases)
    lines = _run_host_program(tmp_path, "rings", _RINGS_PROGRAM, stdin).splitlines()
    control, header, rings_offset = map(int, lines[0].split())
    assert (control, header, rings_offset) == (layout.intranode_control_bytes(), layout.put_header_bytes(),
                                               layout.fused_rings_offset())
    assert len(lines) == len(cases) + 1
    for case, line in zip(cases, lines[1:]):
        n, put, nodes, gpus, channels, hidden, scales, topk, rail, node, combine = case
        ring, half, used, record = map(int, line.split())
        want_record = (layout.intranode_combine_record_bytes(hidden // 2, topk) if combine else
                       layout.intranode_dispatch_record_bytes(hidden, scales, topk))
        assert ring == layout.put_region_bytes(n, layout.PUT_AREA_IN_REGION if put else layout.PUT_AREA_NONE), case
        assert half == layout.fused_half_bytes(ring), case
        assert (used, record) == (layout.fused_ring_bytes(nodes, gpus, channels, want_record, rail, node, bool(put)),
                                  want_record), case
    bench = {(case[0], case[1]): int(line.split()[1]) >= int(line.split()[2]) for case, line in zip(cases, lines[1:])
             if case[2:] == (2, 2, 12, 14336, 0, 8, 258, 256, 0)}
    record = layout.intranode_dispatch_record_bytes(14336, 0, 8)
    for put in (0, 1):
        least = layout.fused_min_rdma_bytes(layout.fused_ring_bytes(2, 2, 12, record, 258, 256, bool(put)), bool(put))
        assert bench[(least, put)] and not bench[(least - 128, put)], (put, least)
    # Put peers' staging adds the rail rings' bytes only: the benchmark's 1e9-byte buffer holds its 12 channels
    # either way, 256 MiB holds them in neither.
    assert bench[(10**9 // 128 * 128, 0)] and bench[(10**9 // 128 * 128, 1)]
    assert not bench[(256 << 20, 1)] and not bench[(256 << 20, 0)] and bench[(1 << 30, 1)]


# A probe's check of one call's rings: "ok", or the ValueError's message.
_ATTEMPT = r"""
def attempt(backend, kind, hidden_bytes, num_scales, num_topk, config):
    try:
        backend.check_rings(kind, hidden_bytes, num_scales, num_topk, config)
        return "ok"
    except ValueError as exc:
        return str(exc)
"""

_CHECK_RINGS_PROBE = PROBE_HEAD + r"""
import deep_ep
import deep_ep.testing
from deep_ep.config import Topology
from deep_ep.backends.fused_internode import FusedInternodeCuda

launched = []
class Fused(ext.Runtime):
    def fused_notify(self, *args):
        launched.append("notify")
    def fused_dispatch(self, *args):
        launched.append("dispatch")
ext.Runtime = Fused
""" + _ATTEMPT + r"""
bench = deep_ep.Config(24, 8, 512)  # 12 channels; 256 node ring slots per source at 2 nodes
report = {}
for name, num_bytes, put_only in (("put 1e9", 10**9 // 128 * 128, True), ("put 256M", 256 << 20, True),
                                  ("put least", int(sys.argv[2]), True), ("pointer 1e9", 10**9 // 128 * 128, False)):
    with fake.patched(torch, cuda_tensors=True), deep_ep.testing.overrides(internode_put_only=put_only):
        backend = FusedInternodeCuda(0, Topology(4, 2), num_bytes, 1, False, all_gather=lambda obj: [obj] * 4)
        report[name] = [backend.put_area, attempt(backend, "dispatch", 14336, 0, 8, bench),
                        attempt(backend, "dispatch", 7168, 56, 0, bench),
                        attempt(backend, "combine", 14336, 0, 8, bench),
                        attempt(backend, "dispatch", 256, 0, 4, deep_ep.Config(2, 8, 256)),
                        attempt(backend, "dispatch", 14336, 0, 8, deep_ep.Config(48, 8, 512)),
                        attempt(backend, "dispatch", 256, 0, 4, deep_ep.Config(2, 1, 3))]
report["launched"] = launched
print(json.dumps(report))
"""


def test_fused_rings_that_do_not_fit_raise_before_any_launch():
    """The fused kernels' rings have the Config's capacities whatever the buffer (node rings: the nvl recv tokens
    shared by the source nodes), and NVSHMEM put peers add the rail rings' staging: 12 channels of 7168-BF16 records
    at 258 rail / 256 node slots fit a 1e9-byte buffer with or without put peers, 24 channels fit neither way, 256 MiB
    holds none. check_rings (Buffer's validation) raises ValueError naming the smallest num_nvl_bytes +
    num_rdma_bytes that holds the call, and launches nothing."""
    from deep_ep import layout
    record = layout.intranode_dispatch_record_bytes(14336, 0, 8)
    least = layout.fused_min_rdma_bytes(layout.fused_ring_bytes(2, 2, 12, record, 258, 256, True), True)
    done = subprocess.run([sys.executable, "-c", _CHECK_RINGS_PROBE, ROOT, str(least)], cwd=ROOT,
                          env=probe_env(DEEP_EP_GPUS_PER_NODE="2"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["launched"] == []
    put, bf16, fp8, combine, small, wide, chunks = report["put 1e9"]
    assert put and [bf16, fp8, combine, small] == ["ok"] * 4, report["put 1e9"]
    wide_put = layout.fused_min_rdma_bytes(layout.fused_ring_bytes(2, 2, 24, record, 258, 256, True), True)
    assert f"num_nvl_bytes + num_rdma_bytes >= {wide_put}" in wide and "num_rdma_bytes=1000000000" in wide, wide
    assert "24 channels" in wide and "staging of NVSHMEM put peers" in wide and "dispatch" in wide, wide
    assert "num_max_nvl_chunked_recv_tokens >= 2 * num_nodes" in chunks and "got 3 for 2 nodes" in chunks, chunks
    tight = report["put 256M"]
    assert tight[1].startswith("num_nvl_bytes + num_rdma_bytes=268435456 is too small") and ">= " in tight[1], tight
    assert "combine" in tight[3] and ">= " in tight[3] and tight[4] == "ok", tight
    assert report["put least"][:5] == [True, "ok", "ok", "ok", "ok"], report["put least"]
    pointer = report["pointer 1e9"]
    assert pointer[:5] == [False, "ok", "ok", "ok", "ok"], pointer
    wide_least = layout.fused_min_rdma_bytes(layout.fused_ring_bytes(2, 2, 24, record, 258, 256, False), False)
    assert f"num_rdma_bytes >= {wide_least}" in pointer[5] and "staging" not in pointer[5], pointer[5]


_HINTS_PROBE = PROBE_HEAD + r"""
import deep_ep
import deep_ep.testing
from deep_ep.backends.fused_internode import FusedInternodeCuda
from deep_ep.config import Topology, get_combine_config, get_dispatch_config
""" + _ATTEMPT + r"""
hidden = 7168
report = {}
for num_ranks in (16, 64):
    dispatch, combine = get_dispatch_config(num_ranks), get_combine_config(num_ranks)
    hints = (max(c.get_nvl_buffer_size_hint(2 * hidden, num_ranks) for c in (dispatch, combine))
             + max(c.get_rdma_buffer_size_hint(2 * hidden, num_ranks) for c in (dispatch, combine)))
    for name, num_bytes, put_only in (("put", hints, True), ("pointer", hints, False),
                                      ("put less", hints - 128, True)):
        with fake.patched(torch, cuda_tensors=True), deep_ep.testing.overrides(internode_put_only=put_only):
            backend = FusedInternodeCuda(0, Topology(num_ranks, 8), num_bytes, 1, False,
                                         all_gather=lambda obj: [obj] * num_ranks)
            report[f"{num_ranks} {name}"] = [
                backend.put_area, attempt(backend, "dispatch", 2 * hidden, 0, 32, dispatch),
                attempt(backend, "dispatch", hidden, hidden // 128, 32, dispatch),
                attempt(backend, "combine", 2 * hidden, 0, 32, combine),
                attempt(backend, "dispatch", 2 * hidden, 0, 8, dispatch)]
print(json.dumps(report))
"""


def test_a_buffer_of_the_size_hints_holds_the_fused_calls():
    """A fused backend of 2 x 8 and 8 x 8 GPUs on a buffer of the two size hints' sum (DeepEP's recipe: each the max
    over the default dispatch and combine configs, 7168-BF16 rows) accepts the default dispatch (BF16 or FP8, top-k
    32 or 8) and combine (top-k 32), with NVSHMEM put peers or without; 128 bytes less refuses the BF16 top-32
    dispatch with put peers (the hints hold exactly its buffer) and names the hints as the sizes to use."""
    from deep_ep.config import get_dispatch_config
    report = run_probe(_HINTS_PROBE, DEEP_EP_GPUS_PER_NODE="8")
    for num_ranks in (16, 64):
        assert report[f"{num_ranks} put"] == [True, "ok", "ok", "ok", "ok"], report[f"{num_ranks} put"]
        assert report[f"{num_ranks} pointer"] == [False, "ok", "ok", "ok", "ok"], report[f"{num_ranks} pointer"]
        less = report[f"{num_ranks} put less"]
        assert less[0] and "is too small for this fused internode dispatch" in less[1], less
        # The refusal names the dispatch config's size hints, whose sum holds the call.
        config = get_dispatch_config(num_ranks)
        hints = config.get_nvl_buffer_size_hint(14336, num_ranks) + config.get_rdma_buffer_size_hint(14336, num_ranks)
        assert f"config.get_rdma_buffer_size_hint(14336, {num_ranks})" in less[1], less[1]
        assert hints >= int(less[1].split(">= ")[1].split(" ")[0]), less[1]
        assert less[4] == "ok", less


_BUFFER_CHECK_PROBE = PROBE_HEAD + r"""
import deep_ep
from deep_ep.backends.cuda_intranode import CudaBackend

seen, refuse = [], []
def check_rings(self, kind, hidden_bytes, num_scales, num_topk, config):
    seen.append([kind, hidden_bytes, num_scales, num_topk, config.num_sms])
    if refuse:
        raise ValueError("num_rdma_bytes is too small (test)")
CudaBackend.check_rings = check_rings

os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(29400 + os.getpid() % 500)
dist.init_process_group("gloo", rank=0, world_size=1)
group = dist.new_group([0])
import reference
from deep_ep.config import Topology
x, x_fp8, topk_idx, topk_weights = fake.scenario(torch, deep_ep, 16, 256, 4, 8)
real = reference.get_dispatch_layout(topk_idx, 8, Topology(1, 1))
report = {}
with fake.patched(torch, cuda_tensors=True):
    os.environ["DEEP_EP_BACKEND"] = "cuda"
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 30)
    runtime = buffer.runtime.runtime
    runtime.num_recv = int(real.is_token_in_rank.sum())
    runtime.per_expert = real.num_tokens_per_expert.tolist()
    counts = dict(num_tokens_per_rank=real.num_tokens_per_rank, is_token_in_rank=real.is_token_in_rank,
                  num_tokens_per_expert=real.num_tokens_per_expert)
    config = deep_ep.Config(6, 8, 256)
    first = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **counts)
    buffer.dispatch(x_fp8, handle=first.handle, config=config)
    buffer.combine(first.recv_x, first.handle, topk_weights=first.recv_topk_weights, config=config)
    report["seen"] = list(seen)
    refuse.append(True)
    before = list(runtime.launches)
    for name, call in (("dispatch", lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                            config=config, **counts)),
                       ("cached", lambda: buffer.dispatch(x, handle=first.handle, config=config)),
                       ("combine", lambda: buffer.combine(first.recv_x, first.handle, config=config))):
        try:
            call()
            report[name] = "accepted"
        except ValueError as exc:
            report[name] = str(exc)
    report["launched"] = runtime.launches[len(before):]
    refuse.clear()
    report["after"] = list(buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config,
                                           **counts).recv_x.shape)
    buffer._release()
dist.destroy_process_group()
print(json.dumps(report))
"""


def test_buffer_checks_rings_before_the_kernels():
    """Buffer asks the backend's check_rings inside each dispatch's and combine's validation, with the row bytes,
    scales and top-k the kernels will carve records for (FP8: one byte per element and its scales; a cached
    dispatch carries no top-k); a failing check raises before any kernel and the Buffer stays usable."""
    report = run_probe(_BUFFER_CHECK_PROBE)
    assert report["seen"] == [["dispatch", 512, 0, 4, 6], ["dispatch", 256, 2, 0, 6], ["combine", 512, 0, 4, 6]], \
        report["seen"]
    for name in ("dispatch", "cached", "combine"):
        assert report[name] == "num_rdma_bytes is too small (test)", (name, report[name])
    assert report["launched"] == [], report["launched"]
    assert report["after"][1] == 256, report["after"]
