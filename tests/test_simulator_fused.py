"""The simulator's model of deep_ep's fused internode kernels (simulator/deep_ep_fused.py): which groups it serves,
the bytes it puts on the NIC and NVLink, its rates and its parameters' sources."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from simulator import Scenario, bench_fit, hardware, rank, run, workload
from simulator import deep_ep_fused as fused
from simulator import deep_ep_kernels as dek
from simulator.deep_ep_composed import is_composed


def _traffic(nodes: int, per_node: int, tokens: int = 512, seed: int = 0) -> list[workload.SourceTraffic]:
    router = workload.Router("group-limited", None, 256, 8, nodes, seed)
    redundant = (-256) % (nodes * per_node)  # replicas that make the experts divide over the ranks
    return workload.build_traffic(router, nodes * per_node, per_node, tokens, redundant, mask_ll=False)


def _spec(nodes: int, per_node: int, op: str) -> rank.OpSpec:
    payload = rank.token_bytes(7168, "fp8" if op == "dispatch" else "bf16")
    return rank.OpSpec("internode", op, 7168, 8, payload, payload, nodes, per_node, None)


def _dtype(op: str) -> str:
    return "fp8" if op == "dispatch" else "bf16"


@pytest.mark.parametrize(("nodes", "per_node", "want"), [(2, 8, True), (3, 8, True), (2, 2, True), (12, 2, True),
                                                         (16, 2, True), (8, 4, True), (8, 8, True), (16, 4, True),
                                                         (32, 2, True), (9, 8, False), (33, 2, False),
                                                         (2, 1, False), (1, 8, False)])
def test_fused_serves_the_kernels_groups_and_the_composed_path_the_rest(nodes, per_node, want):
    # The kernels' limit: at most 64 ranks.
    spec = _spec(nodes, per_node, "dispatch")
    assert fused.is_fused(spec) == want
    assert is_composed(spec) == (nodes > 1 and per_node > 1 and not want)
    assert not fused.is_fused(replace(spec, mode="low-latency"))


def test_scenario_runs_fused_up_to_the_rank_limit_and_composed_beyond():
    sc = Scenario(nodes=2, mode="normal", kernels="deep_ep", tokens=256)
    within, beyond = run(sc), run(replace(sc, nodes=9))
    assert not any(op.bottleneck.startswith(("rail:", "node:", "copies")) for op in within.ops)
    assert all(op.bottleneck.startswith(("rail:", "node:", "copies")) for op in beyond.ops)
    with pytest.raises(ValueError, match="not a fused-kernel group"):
        fused.fused_model(_spec(9, 8, "dispatch"), _traffic(9, 8, 64), hardware.H800, hardware.CX7, dek.profile(),
                          24, "fp8")


def _hops_and_network(traffic: list[workload.SourceTraffic], per_node: int) -> tuple[int, int]:
    """Rows a forwarder stores into another GPU of its node, and records that cross to another node."""
    num_ranks = len(traffic)
    hops = sum(t.rows_to_rank[d] for s, t in enumerate(traffic) for d in range(num_ranks)
               if d % per_node != s % per_node)
    network = sum(x for s, t in enumerate(traffic) for n, x in enumerate(t.records_to_node) if n != s // per_node)
    return hops, network


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize(("nodes", "per_node"), [(2, 8), (3, 4), (6, 2)])
def test_fused_moves_each_token_node_pair_over_the_nic_once_and_nvlink_carries_the_forwarders_copies(op, nodes,
                                                                                                    per_node):
    traffic = _traffic(nodes, per_node, 256, seed=3)
    res = fused.simulate_fused(_spec(nodes, per_node, op), traffic, hardware.H800, hardware.CX7, dek.profile(), 24,
                               _dtype(op))
    record = fused.fused_record_bytes(op, 7168, _dtype(op), 8)
    hops, network = _hops_and_network(traffic, per_node)
    assert network > 0 and hops > 0
    # One record per (token, remote node) leaves the NIC of its sender (dispatch) or of the forwarder (combine).
    assert res.port_bytes["nic_out"] == pytest.approx(network * record)
    assert res.port_bytes["nic_in"] == pytest.approx(network * record)
    # NVLink carries the forwarders' copies (dispatch) or the rows the node's GPUs send their forwarder (combine),
    # never a row to the forwarder itself.
    assert res.port_bytes["nvl_out"] == pytest.approx(hops * record)
    assert res.port_bytes["nvl_in"] == pytest.approx(hops * record)


def test_fused_on_virtual_nodes_puts_the_network_records_on_nvlink():
    traffic = _traffic(2, 4, 256, seed=1)
    res = fused.simulate_fused(_spec(2, 4, "dispatch"), traffic, hardware.H200, hardware.NVLINK_P2P, dek.profile(),
                               24, "fp8")
    hops, network = _hops_and_network(traffic, 4)
    assert "nic_out" not in res.port_bytes
    assert res.port_bytes["nvl_out"] == pytest.approx((hops + network) * fused.fused_record_bytes("dispatch", 7168,
                                                                                                  "fp8", 8))


def test_fused_record_layout():
    # [7168 FP8][56 float32 scales = 224][mask + 8 ids + 8 weights = 68 -> 80]; combine [14336 BF16][32 weights].
    assert fused.fused_record_bytes("dispatch", 7168, "fp8", 8) == 7168 + 224 + 80
    assert fused.fused_record_bytes("dispatch", 7168, "bf16", 8) == 14336 + 80
    assert fused.fused_record_bytes("combine", 7168, "bf16", 8) == 14336 + 32


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_fused_time_grows_with_tokens_and_the_planner_uses_the_same_times(op):
    times = []
    for tokens in (128, 512, 2048):
        traffic = _traffic(2, 8, tokens)
        spec = _spec(2, 8, op)
        res = dek.simulate_normal(spec, traffic, hardware.H800, hardware.CX7, dek.profile(), 24, 8, _dtype(op))
        closed = dek.closed_form_rank_times(spec, traffic, hardware.H800, hardware.CX7, dek.profile(), 24, 8,
                                            _dtype(op))
        assert list(closed) == pytest.approx(res.rank_time_us, rel=1e-12)
        # The data phase is the busiest port's bytes at its capacity.
        model, _ = fused.fused_model(spec, traffic, hardware.H800, hardware.CX7, dek.profile(), 24, _dtype(op))
        busiest = max(rank.max_load_per_kind(model, 16)[k] / model.caps[k] for k in model.kinds)
        assert res.max_time_us == pytest.approx(model.fixed_us + max(busiest, max(f[0] for f in model.flows)
                                                                     / model.window_cap), rel=1e-9)
        times.append(res.max_time_us)
    assert times[0] < times[1] < times[2]


@settings(max_examples=25, deadline=None)
@given(nodes=st.sampled_from([2, 3, 4, 8]), per_node=st.sampled_from([2, 4, 8]),
       op=st.sampled_from(["dispatch", "combine"]), sms=st.integers(1, 31).map(lambda x: 2 * x),
       tokens=st.integers(32, 1024), seed=st.integers(0, 3))
def test_fused_more_sms_or_bandwidth_is_never_slower(nodes, per_node, op, sms, tokens, seed):
    # The fused times are maxima of bytes over capacities, each capacity non-decreasing in SMs, NVLink and NIC
    # rate: exact monotonicity, no slack.
    assume(nodes * per_node <= 64)
    traffic, spec, prof = _traffic(nodes, per_node, tokens, seed), _spec(nodes, per_node, op), dek.profile()

    def time(num_sms: int, gpu: hardware.GpuProfile = hardware.H800, nic: hardware.NicProfile = hardware.CX7,
             ) -> float:
        return fused.simulate_fused(spec, traffic, gpu, nic, prof, num_sms, _dtype(op)).max_time_us
    base = time(sms)
    assert time(sms + 2) <= base * (1 + 1e-12)
    assert time(sms, gpu=replace(hardware.H800, nvlink_gbps=2 * hardware.H800.nvlink_gbps)) <= base * (1 + 1e-12)
    assert time(sms, nic=replace(hardware.CX7, line_gbps=2 * hardware.CX7.line_gbps)) <= base * (1 + 1e-12)


def test_fused_roles_use_every_warp_of_their_ctas():
    # 2 x 2 (the kernels' header comment): dispatch sender, forwarder and receiver teams of 8 warps; combine
    # forwarder teams of 11, an owner team of 10, sender teams of 8.
    assert fused.team_sizes(32, 3) == [11, 11, 10]
    assert fused.role_warps("dispatch", 2, 4) == {"send": (16, 2), "forward": (16, 2), "receive": (32, 4)}
    assert fused.role_warps("combine", 2, 4) == {"send": (32, 4), "forward": (22, 2), "receive": (10, 1)}
    for nodes, per_node in [(2, 8), (3, 8), (6, 4), (12, 2), (16, 2), (8, 8), (16, 4), (17, 2), (32, 2)]:
        ranks = nodes * per_node
        dispatch, combine = fused.role_warps("dispatch", nodes, ranks), fused.role_warps("combine", nodes, ranks)
        assert dispatch["send"][0] + dispatch["forward"][0] == fused.CTA_WARPS
        assert combine["forward"][0] + combine["receive"][0] == fused.CTA_WARPS
        # One ring per source rank: every warp of the CTA, in teams, or past 32 ranks each warp serving several.
        assert dispatch["receive"] == combine["send"] == (fused.CTA_WARPS, ranks)
        # Past 16 nodes (dispatch) and 24 (combine) each sender or forwarder warp serves several nodes in turn; the
        # combine's owner keeps at least 8 warps (with an even share it would limit the combine from 8 nodes on).
        assert dispatch["send"][1] == dispatch["forward"][1] == combine["forward"][1] == nodes
        assert combine["receive"][1] == 1 and min(w for w, _ in (*dispatch.values(), *combine.values())) >= 1
        assert combine["receive"][0] == max(fused.CTA_WARPS // (nodes + 1), fused.COMBINE_OWNER_WARPS)
    assert fused.role_warps("dispatch", 17, 34)["send"] == (16, 17)
    assert fused.role_warps("combine", 8, 64) == {"send": (32, 64), "forward": (24, 8), "receive": (8, 1)}
    assert fused.role_warps("combine", 32, 64) == {"send": (32, 64), "forward": (24, 32), "receive": (8, 1)}
    with pytest.raises(ValueError, match="num_teams"):
        fused.team_sizes(32, 33)


def test_fused_team_warps_take_whole_records():
    # Each warp a whole record (bytes and control cost), so a team of w warps is w warps but for the chunk publish,
    # one per team.
    record, chunk = 14416.0, 8

    def rate(warps: float, row_ns: float = 2000.0, chunk_us: float = 4.0) -> float:
        return fused.team_rate(warps, 1.5, row_ns, record, chunk_us, chunk)
    assert rate(8, chunk_us=0.0) == pytest.approx(8 * rate(1, chunk_us=0.0))
    assert rate(16) < 2 * rate(8)
    # The per-record cost adds to each warp's record time: without it a team moves at its warps' byte rate.
    assert rate(8, 0.0, 0.0) == pytest.approx(8 * 1.5 * 1e3)
    assert rate(8, 2000.0, 0.0) < rate(8, 0.0, 0.0)
    # A warp serving two rings in turn gives each half its rate.
    assert rate(0.5) == pytest.approx(rate(1) / 2)


def test_fused_roles_are_capped_by_their_sm_share():
    # With fast warps and no per-record cost the teams do not bind: the time is the SM shares' (and the links'),
    # so fewer SMs (fewer channels) are slower and faster warps change nothing.
    traffic, spec = _traffic(2, 8, 512), _spec(2, 8, "combine")
    prof = replace(dek.profile(), warp_push_gbps=100.0, warp_local_gbps=100.0, fused_row_ns=0.0, fused_chunk_us=0.0)

    def time(p: dek.DeepEpProfile, num_sms: int = 24) -> float:
        return fused.simulate_fused(spec, traffic, hardware.H800, hardware.CX7, p, num_sms, "bf16").max_time_us
    base = time(prof)
    faster = replace(prof, warp_push_gbps=200.0, warp_local_gbps=200.0)
    assert time(faster) == pytest.approx(base, rel=0.02)
    assert time(prof, 12) > 1.3 * base


def test_fused_network_is_deepeps():
    # The NIC ports run at DeepEP V1's chunked-put rate for the same record, chunk, rings and forwarder rate.
    traffic, spec, prof = _traffic(2, 8, 256), _spec(2, 8, "dispatch"), dek.profile()
    model, _ = fused.fused_model(spec, traffic, hardware.H800, hardware.CX7, prof, 24, "fp8")
    cfg = fused.fused_config("dispatch", 16, 24)
    record = fused.fused_record_bytes("dispatch", 7168, "fp8", 8)
    wire = rank.rdma_ring_rate(hardware.CX7, record, cfg.num_max_rdma_chunked_send_tokens, 10**9, 12, 1e12)
    assert model.caps["nic_out"] <= wire * (1 + 1e-9)
    assert wire == pytest.approx(rank.nic_rate(hardware.CX7, cfg.num_max_rdma_chunked_send_tokens * record, 12,
                                               hardware.CX7.normal_efficiency)
                                 * 1 / (1 + rank.NIC_MESSAGE_OVERHEAD_BYTES
                                        / (cfg.num_max_rdma_chunked_send_tokens * record)))


def test_calibrate_show_lists_the_fused_parameters_with_their_measurements():
    out = subprocess.run([sys.executable, "-m", "simulator.calibrate", "--show"], capture_output=True, text=True,
                         check=True).stdout
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    # The chunk turn-around is not separable on these points (the fit would drive it to its floor): it keeps its
    # assumed value, fixed on the fit's command line.
    assert "fixed by --fix" in lines["fused_chunk_us"]
    for name in ("warp_push_gbps", *(n for n in dek.FUSED_FIT_PARAMS if n != "fused_chunk_us")):
        assert "fit: benchmarks/results/fused_h200x1.json" in lines[name], lines[name]
        assert "least squares on its 9 fused-phase points at SM counts [8, 16, 24] (held out [12]" in lines[name]
        assert "fp8 dispatch 810.2, bf16 dispatch 1495.9, bf16 combine 1351.5 at 24 SMs" in lines[name], lines[name]
    assert "one GPU: pushes are local copies" in lines["warp_push_gbps"]


FUSED_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "fused_h200x1.json"


def test_fused_bench_reads_the_fused_phase_and_the_calibration_reproduces_it():
    run_ = bench_fit.read_bench(FUSED_BENCH)
    assert run_.kind == "fused" and run_.num_ranks == 4 and run_.num_tokens == 4096
    # Wall µs averaged over the four ranks, the chunk most ranks chose, at 8, 12, 16 and 24 SMs.
    got = {(p.num_sms, p.op, p.dtype): (round(p.time_us, 1), p.chunk, p.num_nodes) for p in run_.points}
    assert len(got) == 12 and {sms for sms, _, _ in got} == {8, 12, 16, 24}
    assert got[(24, "dispatch", "fp8")] == (810.2, 16, 2) and got[(12, "combine", "bf16")] == (1860.4, 4, 2)
    predicted = bench_fit.predict_points(run_, run_.points, dek.profile(), bench_fit.bench_traffic(run_))
    errors = [abs(t - pt.time_us) / pt.time_us for pt, t in zip(run_.points, predicted)]
    # The fit's own figures: every point within 15 %, 12 SMs held out, mean error near 5 %.
    assert max(errors) < 0.15 and sum(errors) / len(errors) < 0.07, errors
    # Each fitted parameter binds: off by 2x, some point is off by more than 10 %.
    for name in (n for n in dek.FUSED_FIT_PARAMS if n != "fused_chunk_us"):
        off = replace(dek.profile(), **{name: 2 * getattr(dek.profile(), name)})
        moved = bench_fit.predict_points(run_, run_.points, off, bench_fit.bench_traffic(run_))
        assert max(abs(a - b) / b for a, b in zip(moved, predicted)) > 0.1, name
    # Where all four ranks share the GPU's HBM the times flatten: 16 and 24 SMs within 10 % of each other.
    for op, dtype in (("dispatch", "fp8"), ("dispatch", "bf16")):
        assert got[(24, op, dtype)][0] > 0.9 * got[(16, op, dtype)][0]


def test_shared_gpu_splits_the_hbm_and_pushes_are_local():
    gpu = fused.shared_gpu(hardware.H200, 4)
    assert gpu.hbm_gbps == hardware.H200.hbm_gbps / 4 and gpu.nvlink_gbps == hardware.H200.hbm_gbps / 8
    prof = fused.on_one_gpu(dek.profile())
    assert prof.warp_push_gbps == prof.warp_local_gbps and prof.sm_push_gbps == prof.sm_local_gbps
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        fused.shared_gpu(hardware.H200, 0)


def test_report_says_when_the_fused_rows_model_puts_behind_a_nic():
    """Behind a NIC the fused kernels (up to 64 ranks, 8 x 8 included) put their rail hops; the note says so, and
    that the rows model them with DeepEP's chunked puts."""
    sc = Scenario(nodes=2, gpus_per_node=4, gpu="h200", mode="normal", kernels="deep_ep", tokens=64)

    def notes(s: Scenario) -> str:
        return " ".join(run(s).scales[0].notes)
    puts = "fused kernels make their rail hops NVSHMEM puts"
    assert puts in notes(sc) and "composed path" not in notes(sc)
    assert puts in notes(replace(sc, nodes=8, gpus_per_node=8))
    assert puts not in notes(replace(sc, nic="nvlink-p2p"))
    assert puts not in notes(replace(sc, nodes=17))
    # 32 x 2: past the ring kernels' 24 nodes but fused, so no torch-rail note.
    wide = notes(replace(sc, nodes=32, gpus_per_node=2, nic="nvlink-p2p"))
    assert "torch rail" not in wide and "serve at most" not in wide, wide
    assert "torch rail" in notes(replace(sc, nodes=32, gpus_per_node=4, nic="nvlink-p2p"))
    # 12 x 8: within the ring kernels' 24 nodes but past the fused kernels' 64 ranks: the composition's torch rail.
    assert "torch rail" in notes(replace(sc, nodes=12, gpus_per_node=8, nic="nvlink-p2p"))


def test_fused_fit_writes_its_section_and_parameters_and_keeps_the_rest(tmp_path):
    stored = dek.CALIBRATION_PATH
    path = tmp_path / "calibration.json"
    path.write_text(stored.read_text())
    run_ = bench_fit.read_bench(FUSED_BENCH)
    prof = replace(dek.profile(), warp_local_gbps=2.5, fused_row_ns=1000.0, fused_chunk_us=3.0, warp_push_gbps=2.5)
    result = bench_fit.FitResult(run_, prof, dek.FUSED_FIT_PARAMS, (), [400.0 + i for i in range(len(run_.points))],
                                 1, ())
    bench_fit.write_calibration(result, path, "python -m simulator.calibrate --from-bench x.json")
    before, after = json.loads(stored.read_text()), json.loads(path.read_text())
    assert after["params"]["fused_row_ns"]["value"] == 1000.0 and after["params"]["warp_push_gbps"]["value"] == 2.5
    assert {k: v for k, v in after["params"].items() if k not in (*dek.FUSED_FIT_PARAMS, "warp_push_gbps")} == \
        {k: v for k, v in before["params"].items() if k not in (*dek.FUSED_FIT_PARAMS, "warp_push_gbps")}
    # The top level (the intranode fit) and the low-latency section stay; the fused section holds its points.
    assert {k: v for k, v in after.items() if k not in ("params", "fused")} == \
        {k: v for k, v in before.items() if k not in ("params", "fused")}
    section = after["fused"]
    assert section["bench"] == str(FUSED_BENCH) and section["hold_out_sms"] == []
    assert [p["measured_us"] for p in section["points"]] == [round(p.time_us, 2) for p in run_.points]
    assert len(section["points"]) == 12 and section["points"][0]["predicted_us"] == 400.0
    assert dek.load_profile(path).fused_chunk_us == 3.0
