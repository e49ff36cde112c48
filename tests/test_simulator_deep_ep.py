"""Tests of the ``--kernels deep_ep`` family of the simulator and its calibration from bench JSON (CPU only).

The family models deep_ep's own kernels (``simulator/deep_ep_kernels.py``); ``python -m simulator.calibrate
--from-bench FILE --check OTHER`` fits it (``simulator/bench_fit.py``) and writes
``simulator/data/calibration_deep_ep.json``; ``python -m simulator predict --json`` writes
``simulator/data/predictions_deep_ep.json``. Every measurement read here is a file of ``simulator/data/``.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from simulator import Scenario, bench_fit, hardware, rank, run, workload
from simulator import deep_ep_kernels as dek

ROOT = Path(__file__).resolve().parents[1]
DATA = dek.DATA_DIR
BENCH_RINGS = DATA / "intranode_rings_h200x2.json"      # rings only, SM sweep 8..48 (an earlier build)
BENCH_RECEIVE = DATA / "intranode_receive_h200x2.json"  # rings and direct-to-output, 8 and 24 SMs
BENCH_VIRTUAL = DATA / "internode_virtual_h200x2.json"  # bench_internode: EP2 and 2 x 1 virtual nodes
# The calibration's runs: direct receive, 8..24 channels x warps (num_sms channels), and bench_internode after it.
BENCH = DATA / "intranode_sweep_h200x2.json"
BENCH_CHECK = DATA / "internode_check_h200x2.json"
BENCH_LL = DATA / "low_latency_h200x2.json"  # bench_low_latency: EP2, T = 1..256
# The LL fit holds these token counts out (T = 1: a peer-late hook receive of 77 us; T = 256: two tokens per CTA).
LL_HOLD_OUT = "1,2,16,32,256"
STORED_PREDICTIONS = DATA / "predictions_deep_ep.json"
# The command that wrote the stored calibration's normal-mode fit (its 'command').
CALIBRATE_ARGS = ("--from-bench", str(BENCH), "--check", str(BENCH_CHECK), "--warps", "best", "--hold-out", "12,20")


def _cli(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          check=check, timeout=120)


def _traffic(nodes: int, per_node: int, tokens: int = 1024, seed: int = 0, experts: int = 256,
             mask: bool = False) -> list[workload.SourceTraffic]:
    router = workload.Router("uniform", None, experts, 8, nodes, seed)
    return workload.build_traffic(router, nodes * per_node, per_node, tokens, 0, mask_ll=mask)


def _spec(nodes: int, per_node: int, op: str, dtype: str) -> rank.OpSpec:
    payload = rank.token_bytes(7168, dtype)
    return rank.OpSpec("internode" if nodes > 1 else "intranode", op, 7168, 8, payload, payload, nodes, per_node,
                       None)


# ---------------------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------------------

def _synthetic_bench(tmp_path: Path, truth: dek.DeepEpProfile) -> Path:
    """A bench_intranode.py-style JSON whose wall times are the closed form of ``truth`` (two identical ranks)."""
    run_ = bench_fit.BenchRun("intranode", "synthetic", "today", "NVIDIA H200 x2", 2, 4096, 7168, 8, 256, ())
    traffic = bench_fit.bench_traffic(run_)
    points = []
    for sms in (8, 16, 24, 32, 48):
        for op_name, (op, dtype, receive), chunk in (("dispatch_fp8", ("dispatch", "fp8", "rings"), 24),
                                                     ("dispatch_bf16", ("dispatch", "bf16", "rings"), 8),
                                                     ("dispatch_bf16_direct", ("dispatch", "bf16", "direct"), 8),
                                                     ("combine_bf16", ("combine", "bf16", "rings"), 4)):
            point = bench_fit.BenchPoint(op, dtype, sms, chunk, 1.0, receive, channels=sms)  # an --uncapped run
            t = bench_fit.predict_point(run_, point, truth, traffic)
            points.append({"op": op_name, "num_sms": sms, "chunk": chunk, "wall_us_mean": t})
    points.append({"op": "nccl_dispatch_bf16", "num_sms": 0, "chunk": 0, "wall_us_mean": 300.0})
    data = {"date": "synthetic", "machine": "NVIDIA H200 x2",
            "args": {"num_processes": 2, "num_tokens": 4096, "hidden": 7168, "num_topk": 8, "num_experts": 256,
                     "uncapped": True},
            "ranks": [{"rank": r, "points": points, "errors": []} for r in range(2)]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_calibration_round_trip_recovers_parameters(tmp_path, monkeypatch):
    truth = replace(dek.DEFAULTS, sm_push_gbps=27.0, sm_local_gbps=60.0, row_ns=40.0, reduce_gbps=110.0,
                    nvl_efficiency=0.9, launch_us=25.0, combine_extra_us=45.0)
    path = _synthetic_bench(tmp_path, truth)
    monkeypatch.setattr(bench_fit, "PRIOR_WEIGHT", 0.0)  # noise-free points: no prior needed
    result = bench_fit.fit(bench_fit.read_bench(path), hold_out=(16, 32))
    for name in dek.INTRANODE_FIT_PARAMS:
        assert getattr(result.profile, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert result.mape(False) < 1e-3 and result.mape(True) < 1e-3
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps({"params": {"ll_fixed_us": {"value": 9.0, "source": "fit: an LL bench"},
                                          "row_ns": {"value": 1.0, "source": "old fit"}}}))
    bench_fit.write_calibration(result, out)  # keeps the parameters this fit does not touch
    loaded = dek.load_profile(out)
    assert loaded.sm_push_gbps == pytest.approx(truth.sm_push_gbps, rel=0.02)
    assert loaded.source_of("sm_push_gbps").startswith("fit: bench.json")
    assert loaded.ll_fixed_us == 9.0 and loaded.source_of("ll_fixed_us") == "fit: an LL bench"
    assert loaded.row_ns == pytest.approx(truth.row_ns, rel=0.02)
    assert loaded.source_of("chunk_sync_us").startswith("assumed")


def test_repo_calibration_predicts_the_check_run():
    # The repository's calibration is the fit of BENCH; the bench_internode run (other chunks, EP2 on the default
    # receive path and 2 x 1 virtual nodes) is held out as a whole; both within 10 % per point.
    prof = dek.load_profile()
    assert prof.source_of("row_ns").startswith("fit: intranode_sweep_h200x2.json")
    assert prof.receive_copies == 0 and prof.source_of("receive_copies").startswith("design: direct-to-output")
    for path, worst in ((BENCH, 0.10), (BENCH_CHECK, 0.10)):
        bench = bench_fit.read_bench(path, warps="best")  # the fit's choice (Buffer runs the tuned warp table)
        traffic = bench_fit.bench_traffic(bench)
        errors = [bench_fit.predict_point(bench, p, prof, traffic) / p.time_us - 1 for p in bench.points]
        assert max(abs(e) for e in errors) < worst, (path.name, errors)
    data = json.loads(dek.CALIBRATION_PATH.read_text())
    assert data["check"] == [str(BENCH_CHECK.relative_to(ROOT))] and data["mape_check"] < 0.05
    assert sum(p["role"] == "check" for p in data["points"]) == 6


def test_rings_calibration_still_fits_its_held_out_points():
    # The rings-only SM sweep: every dispatch point is a ring point, so the ring switch of the model still fits it.
    result = bench_fit.fit(bench_fit.read_bench(BENCH_RINGS), hold_out=(16, 32))
    assert all(p.receive == "rings" for p in result.run.points)
    assert result.mape(True) < 0.05 and result.mape(False) < 0.05


def test_bench_reader_receive_paths_and_warps():
    bench = bench_fit.read_bench(BENCH_RECEIVE)
    labels = [p.label for p in bench.points]
    assert len(labels) == 10 and "24 SMs fp8 dispatch direct" in labels and "24 SMs fp8 dispatch" in labels
    by_label = {p.label: p for p in bench.points}
    assert by_label["8 SMs bf16 dispatch direct"].receive == "direct"
    assert by_label["8 SMs bf16 dispatch"].receive == "rings" and by_label["8 SMs bf16 combine"].receive == "rings"
    # Buffer's default warps (16 dispatch / 8 combine) vs the best swept ones (12 / 6 at 24 SMs).
    assert by_label["24 SMs bf16 combine"].time_us == pytest.approx(249.7, abs=0.1)
    best = {p.label: p for p in bench_fit.read_bench(BENCH_RECEIVE, warps="best").points}
    assert best["24 SMs bf16 combine"].time_us == pytest.approx(221.7, abs=0.1)
    assert best["24 SMs fp8 dispatch direct"].time_us < by_label["24 SMs fp8 dispatch direct"].time_us


def test_bench_reader_internode_run():
    bench = bench_fit.read_bench(BENCH_VIRTUAL)
    assert bench.kind == "internode" and bench.num_ranks == 2
    assert [(p.num_nodes, p.op, p.dtype, p.receive, p.chunk) for p in bench.points] == [
        (1, "dispatch", "fp8", "direct", 24), (1, "dispatch", "bf16", "direct", 16), (1, "combine", "bf16", "rings", 8),
        (2, "dispatch", "fp8", "direct", 24), (2, "dispatch", "bf16", "direct", 16), (2, "combine", "bf16", "rings", 8)]
    # bench_internode's "sim err" compares with the wall time averaged over ranks.
    assert [round(p.time_us, 1) for p in bench.points] == [126.7, 220.8, 248.8, 127.2, 221.4, 249.4]


def test_bench_reader_rejects_unknown_schema(tmp_path):
    path = tmp_path / "ll.json"
    path.write_text(json.dumps({"results": [{"tokens": 128, "dispatch_us": 12.0}]}))
    with pytest.raises(ValueError, match="unknown bench schema"):
        bench_fit.read_bench(path)
    proc = _cli("simulator.calibrate", "--from-bench", str(path), "--no-write", check=False)
    assert proc.returncode == 2 and "unknown bench schema" in proc.stderr


def test_load_profile_rejects_malformed_file(tmp_path):
    assert dek.load_profile(tmp_path / "missing.json") == dek.DEFAULTS
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"params": {"warp_magic": {"value": 1.0}}}))
    with pytest.raises(ValueError, match="unknown parameter 'warp_magic'"):
        dek.load_profile(bad)
    bad.write_text(json.dumps({"params": {"row_ns": {"value": "fast"}}}))
    with pytest.raises(ValueError, match="params.row_ns needs a numeric 'value'"):
        dek.load_profile(bad)


# ---------------------------------------------------------------------------------------------------------------
# Model properties
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("nodes", "per_node", "nic"), [(1, 2, "cx7"), (1, 8, "cx7"), (2, 1, "nvlink-p2p"),
                                                        (4, 1, "cx7")])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("combine_path", ["rings", "copy", "zone"])
def test_more_sms_is_never_slower(nodes, per_node, nic, op, combine_path):
    # Per path: the Buffer's choice between the combine paths by SM budget is a tuning, not a law.
    traffic = _traffic(nodes, per_node, 512)
    spec = _spec(nodes, per_node, op, "bf16")
    prof, gpu, nic_p = dek.profile(), hardware.H200, hardware.get_nic(nic)
    times = []
    for sms in (4, 8, 16, 24, 32, 48, 64):
        work = dek.normal_work(spec, traffic, gpu, nic_p, prof, sms, 8, "bf16", combine_path=combine_path)
        times.append(float(dek.closed_form_times(work, sms, spec.num_ranks).max()))
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times
    if combine_path == "rings":
        des = [dek.simulate_normal(spec, traffic, gpu, nic_p, prof, sms, 8, "bf16").max_time_us for sms in (8, 24)]
        assert des[1] <= des[0]


@pytest.mark.parametrize(("nodes", "per_node", "nic"), [(1, 2, "cx7"), (1, 8, "cx7"), (2, 1, "nvlink-p2p"),
                                                        (17, 4, "cx7")])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_normal_byte_conservation(nodes, per_node, nic, op):
    # 17 x 4: past the fused kernels' 64 ranks, the composed path (tests/test_simulator_fused.py checks the fused
    # kernels' bytes); 8 experts per rank.
    traffic = _traffic(nodes, per_node, 256, seed=1, experts=8 * nodes * per_node)
    spec = _spec(nodes, per_node, op, "fp8" if op == "dispatch" else "bf16")
    nic_p = hardware.get_nic(nic)
    res = dek.simulate_normal(spec, traffic, hardware.H200, nic_p, dek.profile(), 24, 8,
                              "fp8" if op == "dispatch" else "bf16")
    record = (dek.dispatch_record_bytes(7168, "fp8", 8) if op == "dispatch"
              else dek.intranode_combine_record_bytes(7168, 8))
    network_row = record
    if nodes > 1 and per_node > 1:  # the composed path's cached stage records: the payload; its rail is torch rows
        payload = -(-rank.token_bytes(7168, "fp8") // 16) * 16
        if op == "dispatch":
            record = dek.intranode_dispatch_record_bytes(payload, 0, 0)
        network_row = payload if op == "dispatch" else 2 * 7168
    num_ranks = nodes * per_node
    same_node = [(s, d) for s in range(num_ranks) for d in range(num_ranks)
                 if s // per_node == d // per_node and s != d]
    # NVLink rows: every row to another GPU of the forwarder's node that is not the forwarder itself.
    hops = sum(t.rows_to_rank[d] for s, t in enumerate(traffic) for d in range(num_ranks)
               if d % per_node != s % per_node)
    network = sum(x for s, t in enumerate(traffic) for n, x in enumerate(t.records_to_node) if n != s // per_node)
    assert res.port_bytes["nvl_out"] == pytest.approx(res.port_bytes["nvl_in"])
    # The pushing SMs: ring senders, or the zone senders of the Buffer's intranode combine at 24 SMs.
    pusher = "zone_send" if "zone_send" in res.port_bytes else "sm_push"
    if nic_p.shares_nvlink:  # virtual nodes: the network puts ride the NVLink ports
        assert "nic_out" not in res.port_bytes
        assert res.port_bytes["nvl_out"] == pytest.approx((hops + network) * record)
        assert res.port_bytes[pusher] == pytest.approx((hops + network) * record)
    else:
        assert res.port_bytes["nvl_out"] == pytest.approx(hops * record)
        assert res.port_bytes[pusher] == pytest.approx(hops * record)
        if nodes > 1:
            assert res.port_bytes["nic_out"] == pytest.approx(network * network_row)
            assert res.port_bytes["nic_in"] == pytest.approx(network * network_row)
    if nodes == 1:
        assert hops == sum(traffic[s].rows_to_rank[d] for s, d in same_node)
    assert sum(res.nvl_logical_bytes) == sum(t.num_rows for t in traffic) * spec.logical_bytes


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_low_latency_byte_conservation(op):
    traffic = _traffic(1, 4, 64, mask=True, seed=2, experts=288)
    msg = 16 + rank.token_bytes(7168, "fp8") if op == "dispatch" else 2 * 7168
    spec = rank.OpSpec("low-latency", op, 7168, 8, msg, msg, 1, 4, None)
    res = dek.simulate_low_latency(spec, traffic, hardware.H200, hardware.CX7, dek.profile(), "fp8")
    if op == "dispatch":  # one message per (token, destination rank)
        wire = dek.ll_dispatch_message_bytes(7168, "fp8", 8, dek.profile())
        remote = sum(x for s, t in enumerate(traffic) for d, x in enumerate(t.rows_to_rank) if d != s) * wire
    else:  # one BF16 row per (token, expert) selection
        remote = sum(x for s, t in enumerate(traffic) for d, x in enumerate(t.msgs_to_rank) if d != s) * 2 * 7168
    assert res.port_bytes["nvl_out"] == pytest.approx(remote)
    assert res.port_bytes["nvl_in"] == pytest.approx(remote)
    assert res.port_bytes["nic_out"] == 0
    assert sum(res.logical_bytes) == sum(t.num_selections for t in traffic) * msg


def test_ll_dispatch_sends_fewer_bytes_than_deepep():
    a = run(Scenario(nodes=1, gpus_per_node=2, gpu="h200", mode="low-latency", experts=288, routing="uniform",
                     redundant_experts=0, kernels="deep_ep"))
    b = run(replace(a.scenario, kernels="deepep"))
    assert a.ops[0].nvl_gbps * a.ops[0].time_us < 0.5 * b.ops[0].nvl_gbps * b.ops[0].time_us


def test_des_matches_closed_form_and_direct_output_is_faster():
    traffic = _traffic(1, 8, 1024)
    spec = _spec(1, 8, "dispatch", "bf16")
    prof = dek.profile()
    assert prof.receive_copies == 0  # Buffer's default receive path: direct-to-output
    work = dek.normal_work(spec, traffic, hardware.H200, hardware.CX7, prof, 24, 8, "bf16")
    closed = float(dek.closed_form_times(work, 24, 8).max())
    des = dek.simulate_normal(spec, traffic, hardware.H200, hardware.CX7, prof, 24, 8, "bf16").max_time_us
    assert des == pytest.approx(closed, rel=0.03)
    rings = replace(prof, receive_copies=1)
    slower = dek.simulate_normal(spec, traffic, hardware.H200, hardware.CX7, rings, 8, 8, "bf16").max_time_us
    assert slower > dek.simulate_normal(spec, traffic, hardware.H200, hardware.CX7, prof, 8, 8, "bf16").max_time_us
    # The ring path costs one extra local copy per received byte (the receivers' ring -> recv_x copy) and a tail
    # publication every 8 channel tokens instead of one per channel.
    ring_work = dek.normal_work(spec, traffic, hardware.H200, hardware.CX7, rings, 24, 8, "bf16")
    received = sum(t.rows_to_rank[d] for s, t in enumerate(traffic) for d in range(8) if d != s)
    extra = received * rank.token_bytes(7168, "bf16") * 1e-3 / prof.sm_local_gbps
    channels = ring_work.channels
    publishes = 8 * channels * (math.ceil(1024 / channels / 8) - 1)
    extra += publishes * prof.chunk_sync_us
    assert ring_work.serial_sm_us.sum() - work.serial_sm_us.sum() == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_one_gpu_per_virtual_node_is_the_intranode_model(op):
    # deep_ep's internode backend for one GPU per node runs the intranode kernels over NVSHMEM P2P: same work,
    # same fixed cost (no internode_extra_us), same time as intranode EP2 with the same traffic.
    dtype = "fp8" if op == "dispatch" else "bf16"
    traffic = _traffic(2, 1, 1024)
    p2p = hardware.get_nic("nvlink-p2p")
    prof = replace(dek.profile(), internode_extra_us=100.0)
    virtual = dek.normal_work(_spec(2, 1, op, dtype), traffic, hardware.H200, p2p, prof, 24, 8, dtype)
    # That backend's combine keeps the ring senders (CudaBackend.copy_engine_combine is off there).
    intra = dek.normal_work(_spec(1, 2, op, dtype), traffic, hardware.H200, hardware.CX7, prof, 24, 8, dtype,
                            combine_path="rings")
    assert virtual.fixed_us == intra.fixed_us and "nic_out" not in virtual.kinds
    np.testing.assert_allclose(virtual.serial_sm_us, intra.serial_sm_us)
    np.testing.assert_allclose(dek.closed_form_times(virtual, 24, 2), dek.closed_form_times(intra, 24, 2))
    # A real NIC with one GPU per node keeps the internode model (network stage).
    real = dek.normal_work(_spec(2, 1, op, dtype), traffic, hardware.H200, hardware.CX7, prof, 24, 8, dtype)
    assert real.fixed_us == intra.fixed_us + 100.0 and "nic_out" in real.kinds


def test_put_records_keep_the_ring_receive():
    # Direct-to-output is a pointer-path receive: records put over a NIC (one GPU per node) land in the rings and are
    # copied out of them, whatever receive_copies says.
    traffic = _traffic(4, 1, 512)
    spec = _spec(4, 1, "dispatch", "bf16")
    prof = dek.profile()
    times = [float(dek.closed_form_times(dek.normal_work(spec, traffic, hardware.H200, hardware.CX7,
                                                         replace(prof, receive_copies=c), 8, 8, "bf16"), 8, 4).max())
             for c in (0, 1)]
    assert times[0] == times[1]


def test_composed_stage_traffic_conserves_rows():
    # Rail stage: one record per (token, node); node stage: every (token, rank) row, sent by the rank's rail peer.
    from simulator.deep_ep_composed import stage_traffic
    nodes, per_node = 4, 2
    traffic = _traffic(nodes, per_node, 256, seed=3)
    rail, node = stage_traffic(traffic, nodes, per_node)
    for local in range(per_node):
        for n in range(nodes):
            assert rail[local][n].rows_to_rank == traffic[n * per_node + local].records_to_node
    for n in range(nodes):
        for local in range(per_node):
            want = [sum(traffic[m * per_node + local].rows_to_rank[n * per_node + d] for m in range(nodes))
                    for d in range(per_node)]
            assert list(node[n][local].rows_to_rank) == want
    assert sum(t.num_rows for group in node for t in group) == sum(t.num_rows for t in traffic)


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_composed_runs_its_stages_in_turn(op):
    # With free copies and no host cost, a composed op takes the rail stage then the node stage (dispatch) or the
    # node stage then the rail stage (combine), each starting when the slowest rank of its group is ready.
    from simulator import deep_ep_composed as comp
    nodes, per_node = 2, 4
    traffic = _traffic(nodes, per_node, 256, seed=4)
    spec = _spec(nodes, per_node, op, "bf16")
    rail_t, node_t = {}, {}

    def stage(rail):
        def model(s, t, dtype):
            times = [100.0 + 10 * i if rail else 50.0 + i for i in range(len(t))]
            (rail_t if rail else node_t)[len(rail_t if rail else node_t)] = times
            return rank.OpResult(float(np.mean(times)), max(times), times, [], [], {}, {}, "NVLink", 0.0)
        return model

    times, parts = comp.composed_rank_times(spec, traffic, hardware.CX7, "bf16", float("inf"), 0.0, stage(True),
                                            stage(False))
    assert len(parts["rail"]) == per_node and len(parts["node"]) == nodes
    if op == "dispatch":  # node n's stage starts when its ranks' rail stage ends (rail rank n: 100 + 10 n)
        want = [100.0 + 10 * n + 50.0 + local for n in range(nodes) for local in range(per_node)]
    else:  # rail group l starts when its ranks' node stage ends (node rank l: 50 + l)
        want = [50.0 + local + 100.0 + 10 * n for n in range(nodes) for local in range(per_node)]
    assert times.tolist() == pytest.approx(want)
    assert not parts["copy_us"].any()


def test_normal_work_is_not_the_composed_path():
    with pytest.raises(ValueError, match="composed path"):
        dek.normal_work(_spec(2, 4, "dispatch", "bf16"), _traffic(2, 4, 64), hardware.H200, hardware.CX7,
                        dek.profile(), 24, 8, "bf16")


def test_virtual_nodes_share_nvlink_ports():
    # 2 virtual nodes x 4 GPUs on one host: the network puts load the same ports as the NVLink hops, so the
    # per-GPU NVLink bytes exceed what a separate NIC would leave on them.
    sc = Scenario(nodes=2, gpus_per_node=4, gpu="h200", nic="nvlink-p2p", mode="normal", routing="uniform",
                  kernels="deep_ep", tokens=512)
    shared = run(sc).ops[0]
    separate = run(replace(sc, nic="cx8")).ops[0]
    assert shared.nic_gbps == 0 and shared.nvl_gbps * shared.time_us > separate.nvl_gbps * separate.time_us
    with pytest.raises(ValueError, match="modelled only for kernels deep_ep"):
        Scenario(nodes=2, gpus_per_node=8, nic="nvlink-p2p")


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def test_cli_kernels_deep_ep():
    out = _cli("simulator", "--kernels", "deep_ep", "--preset", "h200-ep2").stdout
    assert "kernels deep_ep" in out.splitlines()[0]
    assert "normal      dispatch fp8" in out and "low-latency combine" in out
    data = json.loads(_cli("simulator", "--kernels", "deep_ep", "--nodes", "2", "--gpus-per-node", "1",
                           "--nic", "nvlink-p2p", "--gpu", "h200", "--json").stdout)
    assert data["scenario"]["kernels"] == "deep_ep"
    entry = data["results"][0]["normal"]["dispatch"]
    assert entry["time_us"] > 0 and np.isfinite(entry["logical_gbps"])
    proc = _cli("simulator", "--kernels", "cuda", check=False)
    assert proc.returncode == 2 and "--kernels" in proc.stderr
    proc = _cli("simulator", "--kernels", "deepep", "--nic", "nvlink-p2p", "--nodes", "2", check=False)
    assert proc.returncode == 2 and "modelled only for kernels deep_ep" in proc.stderr


def test_cli_calibrate_from_bench_prints_points(tmp_path):
    out = tmp_path / "cal.json"
    text = _cli("simulator.calibrate", "--from-bench", str(BENCH_RINGS), "--output", str(out)).stdout
    assert "MAPE: fitted points" in text and "hold-out" in text
    assert len([ln for ln in text.splitlines() if ln.endswith(("fit", "hold-out")) and "SMs" in ln]) == 15
    data = json.loads(out.read_text())
    assert data["hold_out_sms"] == [16, 32] and data["mape_hold_out"] < 0.05
    assert set(data["params"]) == set(dek.INTRANODE_FIT_PARAMS)


def test_cli_calibrate_reproduces_the_repo_calibration(tmp_path):
    out = tmp_path / "cal.json"
    text = _cli("simulator.calibrate", *CALIBRATE_ARGS, "--output", str(out)).stdout
    assert "check points" in text and "held-out points" in text and "SM counts [12, 20]" in text
    assert len([ln for ln in text.splitlines() if ln.endswith("check")]) == 6
    ours, repo = json.loads(out.read_text()), json.loads(dek.CALIBRATION_PATH.read_text())
    assert set(ours["params"]) == set(dek.INTRANODE_FIT_PARAMS)
    for name in dek.INTRANODE_FIT_PARAMS:
        assert ours["params"][name]["value"] == pytest.approx(repo["params"][name]["value"], rel=1e-3), name
        assert ours["params"][name]["source"].startswith("fit: intranode_sweep_h200x2.json"), name


def test_cli_predict_lists_every_case(tmp_path):
    data = json.loads(_cli("simulator", "predict", "--json").stdout)
    cases = {(r["case"], r["op"], r["dtype"]) for r in data["rows"]}
    for case in ("intranode EP2", "intranode EP4", "intranode EP8", "internode 2x1 virtual",
                 "internode 2x2 virtual", "internode 2x4 virtual"):
        assert {(case, "dispatch", "fp8"), (case, "dispatch", "bf16"), (case, "combine", "bf16")} <= cases
    for ep in (2, 4, 8):
        assert {(f"low-latency EP{ep}", "dispatch", "fp8"), (f"low-latency EP{ep}", "combine", "bf16")} <= cases
    assert all(r["time_us"] > 0 for r in data["rows"])
    # The measured rows: EP2 and 2 x 1 virtual nodes (bench_internode, default receive path), within 10 %; the two
    # cases' dispatches are the same kernels, so the same prediction. The calibration's combine points are ring runs:
    # the intranode EP2 combine (zone senders at 24 SMs) has none; the 2 x 1 combine keeps the rings.
    measured = {(r["case"], r["op"], r["dtype"]): r for r in data["rows"] if r["measured_us"] is not None}
    assert {case for case, _, _ in measured} == {"intranode EP2", "internode 2x1 virtual", "low-latency EP2"}
    assert ("intranode EP2", "combine", "bf16") not in measured
    assert ("low-latency EP2", "combine", "bf16") in measured and len(measured) == 7
    assert all(abs(r["time_us"] / r["measured_us"] - 1) < 0.1 for r in measured.values())
    # The LL EP2 rows are compared with the fused kernel times of bench_low_latency at T = 128.
    assert measured[("low-latency EP2", "dispatch", "fp8")]["measured_us"] == pytest.approx(21.0, abs=0.05)
    for (case, op, dtype), r in measured.items():
        if case == "internode 2x1 virtual" and op == "dispatch":
            assert r["time_us"] == pytest.approx(measured[("intranode EP2", op, dtype)]["time_us"], rel=0.01)
    # benchmarks/bench_internode.py reads the stored rows on the GPU machine: they must be this output.
    assert json.loads(STORED_PREDICTIONS.read_text()) == data
    # Another calibration file changes the predictions.
    alt = tmp_path / "alt.json"
    alt.write_text(json.dumps({"params": {"sm_push_gbps": {"value": 5.0, "source": "test"}}}))
    slow = json.loads(_cli("simulator", "predict", "--json", "--calibration", str(alt)).stdout)
    assert slow["rows"][0]["time_us"] > data["rows"][0]["time_us"]


# ---------------------------------------------------------------------------------------------------------------
# Low-latency calibration (benchmarks/bench_low_latency.py)
# ---------------------------------------------------------------------------------------------------------------

# Rank-averaged fused kernel µs of BENCH_LL (flushed, the file's summary): T -> (dispatch, combine).
LL_FUSED_US = {1: (19.3, 16.0), 8: (14.5, 14.2), 32: (15.6, 17.0), 64: (16.8, 22.9), 128: (21.0, 33.1),
               256: (29.3, 66.0)}


def test_ll_bench_reader():
    bench = bench_fit.read_bench(BENCH_LL)
    assert bench.kind == "low-latency" and bench.num_ranks == 2 and bench.num_experts == 288 and bench.topk == 8
    assert sorted({p.tokens for p in bench.points}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert len(bench.points) == 9 * 6 and all(p.time_us > 0 for p in bench.points)
    by_key = {(p.tokens, p.op, p.phase): p for p in bench.points}
    for tokens, (dispatch_us, combine_us) in LL_FUSED_US.items():
        assert by_key[(tokens, "dispatch", "fused")].time_us == pytest.approx(dispatch_us, abs=0.05)
        assert by_key[(tokens, "combine", "fused")].time_us == pytest.approx(combine_us, abs=0.05)
    hooks = [by_key[(128, op, phase)].time_us for op in ("dispatch", "combine") for phase in ("send", "recv")]
    assert hooks == pytest.approx([11.0, 10.16, 26.75, 10.0], abs=0.05)
    assert by_key[(128, "dispatch", "fused")].dtype == "fp8" and by_key[(128, "combine", "send")].dtype == "bf16"
    assert by_key[(128, "combine", "recv")].label == "T=128 bf16 combine recv (hook)"
    # The rank average is the bench's own summary.
    summary = {row["tokens"]: row for row in json.loads(BENCH_LL.read_text())["summary"]}
    for p in bench.points:
        key = f"{p.op}_us" if p.phase == "fused" else f"{p.op}_{p.phase}_us"
        assert p.time_us == pytest.approx(summary[p.tokens][key], rel=1e-9), p.label
    # DeepEP's byte counts: every selection is valid (no masked entries), 7408 B per FP8 message, 2H per BF16 row.
    for tokens, op, total in bench.deepep_bytes:
        assert total == 2 * tokens * 8 * (7408 if op == "dispatch" else 2 * 7168)


def test_ll_bench_reader_rejects_bad_points(tmp_path):
    data = json.loads(BENCH_LL.read_text())
    data["per_rank"][1] = data["per_rank"][1][:-1]
    path = tmp_path / "ll.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different token sweeps"):
        bench_fit.read_bench(path)
    data = json.loads(BENCH_LL.read_text())
    data["per_rank"][0][3]["phases_s"]["combine_recv"] = float("nan")
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"T=8 phases_s.combine_recv has no positive"):
        bench_fit.read_bench(path)


def _synthetic_ll_bench(tmp_path: Path, truth: dek.DeepEpProfile) -> Path:
    """A bench_low_latency.py-style JSON whose times are the closed form of ``truth`` (two identical ranks)."""
    sweep = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    points = tuple(bench_fit.BenchPoint(op, dtype, 0, 0, 1.0, tokens=t, phase=phase) for t in sweep
                   for op, dtype in (("dispatch", "fp8"), ("combine", "bf16")) for phase in ("fused", "send", "recv"))
    run_ = bench_fit.BenchRun("low-latency", "synthetic", "today", "NVIDIA H200 x2", 2, 256, 7168, 8, 288, points)
    times = dict(zip(((p.tokens, p.op, p.phase) for p in points),
                     bench_fit.predict_points(run_, points, truth, bench_fit.bench_traffic(run_))))
    rank_points = [{"tokens": t, "dispatch_bytes": 1, "combine_bytes": 1,
                    "kernel_s": {op: times[(t, op, "fused")] * 1e-6 for op in ("dispatch", "combine")},
                    "phases_s": {f"{op}_{ph}": times[(t, op, ph)] * 1e-6 for op in ("dispatch", "combine")
                                 for ph in ("send", "recv")}} for t in sweep]
    path = tmp_path / "ll_bench.json"
    path.write_text(json.dumps({"date": "synthetic", "gpu": "NVIDIA H200", "args": {"num_processes": 2},
                                "per_rank": [rank_points, rank_points]}))
    return path


def test_ll_calibration_round_trip_recovers_parameters(tmp_path, monkeypatch):
    # Dispatch sends SM-bound, combine sends link-bound, both knees inside the sweep: every parameter matters.
    truth = replace(dek.DEFAULTS, ll_fixed_us=15.0, ll_hook_fixed_us=8.0, ll_hook_dispatch_extra_us=2.0,
                    ll_overlap_us=3.0, ll_send_gbps=3.0, ll_expand_gbps=20.0, ll_reduce_gbps=30.0,
                    ll_nvl_efficiency=0.9)
    monkeypatch.setattr(bench_fit, "PRIOR_WEIGHT", 0.0)
    result = bench_fit.fit(bench_fit.read_bench(_synthetic_ll_bench(tmp_path, truth)))
    assert result.hold_out == (2, 4, 16, 32, 128)
    for name in dek.LL_FIT_PARAMS:
        assert getattr(result.profile, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert result.mape(False) < 1e-3 and result.mape(True) < 1e-3


def test_repo_ll_calibration_fits_the_bench():
    # The repository's LL parameters are the fit of BENCH_LL on T in {4, 8, 64, 128} with the link efficiency pinned
    # at 0.92 (340 GB/s per direction, the measured both-ways slope); the other token counts are held out.
    prof = dek.load_profile()
    for name in dek.LL_FIT_PARAMS:
        expected = "fixed by --fix" if name == "ll_nvl_efficiency" else "fit: low_latency_h200x2.json"
        assert prof.source_of(name).startswith(expected), name
    bench = bench_fit.read_bench(BENCH_LL)
    predicted = bench_fit.predict_points(bench, bench.points, prof, bench_fit.bench_traffic(bench))
    errors = {(p.tokens, p.op, p.phase): t / p.time_us - 1 for p, t in zip(bench.points, predicted)}
    # Known misfits: T = 1 (a peer-late hook receive of 77 us, a hook send of 12.3 us against 8.2 at T = 2, a fused
    # dispatch of 19.3 against 15.7 at T = 2) and T = 256's hook receive (two tokens per CTA reduced one after the
    # other; the model's reduction is perfectly parallel).
    for key, bound in {(1, "combine", "recv"): -0.5, (1, "combine", "send"): -0.3, (1, "dispatch", "fused"): -0.2,
                       (256, "combine", "recv"): -0.25}.items():
        assert errors.pop(key) < bound, key
    fused = {k: e for k, e in errors.items() if k[2] == "fused"}
    assert max(abs(e) for e in fused.values()) < 0.13, fused
    assert sum(abs(e) for e in fused.values()) / len(fused) < 0.08
    assert max(abs(e) for e in errors.values()) < 0.16, errors
    section = json.loads(dek.CALIBRATION_PATH.read_text())[bench_fit.LL_SECTION]
    assert section["bench"] == str(BENCH_LL.relative_to(ROOT)) and section["hold_out_tokens"] == [1, 2, 16, 32, 256]
    assert section["mape_hold_out"] < 0.13 and len(section["points"]) == 54
    # The link rate is below the copy-engine ceiling both ways (365 GB/s per GPU).
    assert 300 < hardware.H200.nvlink_gbps * prof.ll_nvl_efficiency < 365
    # No LL parameter is shared with the normal-mode fit: an LL fit leaves normal-mode predictions unchanged.
    assert not set(dek.LL_FIT_PARAMS) & set(dek.INTRANODE_FIT_PARAMS)


def test_cli_calibrate_ll_reproduces_the_repo_calibration_and_keeps_normal_mode(tmp_path):
    out = tmp_path / "cal.json"
    repo = json.loads(dek.CALIBRATION_PATH.read_text())
    out.write_text(json.dumps({k: v for k, v in repo.items() if k != bench_fit.LL_SECTION}))
    text = _cli("simulator.calibrate", "--from-bench", str(BENCH_LL), "--hold-out", LL_HOLD_OUT, "--fix",
                "ll_nvl_efficiency=0.92", "--output", str(out)).stdout
    assert "token counts [1, 2, 16, 32, 256]" in text and "fused kernels" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("T=") and ln.endswith(("fit", "hold-out"))]) == 54
    ours = json.loads(out.read_text())
    for name in dek.LL_FIT_PARAMS:
        assert ours["params"][name]["value"] == pytest.approx(repo["params"][name]["value"], rel=1e-3), name
    # The normal-mode fit (parameters, summary, points) is kept as it was.
    for key in ("bench", "check", "points", "mape_check"):
        assert ours[key] == repo[key], key
    for name in dek.INTRANODE_FIT_PARAMS:
        assert ours["params"][name] == repo["params"][name], name
    assert ours[bench_fit.LL_SECTION]["points"] == repo[bench_fit.LL_SECTION]["points"]
    proc = _cli("simulator.calibrate", "--from-bench", str(BENCH_LL), "--hold-out", "1,2,4,8,16,32,64,128,256",
                "--no-write", check=False)
    assert proc.returncode == 2 and "leaves 0 points" in proc.stderr and "token counts" in proc.stderr


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_ll_des_matches_closed_form(ep, op):
    traffic = _traffic(1, ep, 128, seed=3, experts=288)
    dtype = "fp8" if op == "dispatch" else "bf16"
    msg = 16 + rank.token_bytes(7168, "fp8") if op == "dispatch" else 2 * 7168
    spec = rank.OpSpec("low-latency", op, 7168, 8, msg, msg, 1, ep, None)
    prof = dek.profile()
    closed = dek.ll_phase_times(spec, traffic, hardware.H200, hardware.CX7, prof, dtype)
    res = dek.simulate_low_latency(spec, traffic, hardware.H200, hardware.CX7, prof, dtype)
    assert res.time_us == pytest.approx(float(closed["fused"].mean()), rel=0.03)
    assert res.extra["hook_send_us"] == pytest.approx(float(closed["hook_send"].mean()))
    if ep == 2:  # symmetric pair: hook mode costs two launches, the phases add up to more than the fused kernel
        assert res.extra["hook_send_us"] + res.extra["hook_recv_us"] > res.time_us


def test_ll_fused_combine_skips_own_rows():
    # A fused combine reads the rank's own rows in place; the hook-mode send kernel copies them.
    traffic = _traffic(1, 2, 64, experts=288)
    spec = rank.OpSpec("low-latency", "combine", 7168, 8, 2 * 7168, 2 * 7168, 1, 2, None)
    fused = dek.low_latency_work(spec, traffic, hardware.H200, hardware.CX7, dek.profile(), "bf16")
    hook = dek.low_latency_work(spec, traffic, hardware.H200, hardware.CX7, dek.profile(), "bf16", hook=True)
    assert np.all(np.diag(fused.sent) == 0) and np.all(np.diag(hook.sent) > 0)
    np.testing.assert_allclose(fused.sent.sum() + np.trace(hook.sent), hook.sent.sum())
    assert dek.ll_dispatch_message_bytes(7168, "fp8", 8, dek.profile()) == 80 + 7392


def _measured_run(data: dict) -> bench_fit.BenchRun:
    """The workload of a ``simulator/data`` file of measured points (``args`` as bench_intranode.py writes them)."""
    args = data["args"]
    return bench_fit.BenchRun("intranode", "data", "", data["machine"], args["num_processes"], args["num_tokens"],
                              args["hidden"], args["num_topk"], args["num_experts"], ())


# The zone-sender combine on 2 x H200 at its default 4 sender warps: Buffer-default points (24 CTAs at budgets of 24,
# 32 and 48 SMs; 20 CTAs) and a warp sweep's 4-warp points at 16-24 CTAs, predicted by the profile's zone_*
# parameters within 6 %; the copy-engine combine's chunk-row sweep at 8..24 SMs, by its ce_* parameters within 12 %.
@pytest.mark.parametrize("name, path, count, bound", [("combine_zone_h200x2.json", "zone", 9, 0.06),
                                                      ("combine_copy_h200x2.json", "copy", 16, 0.12)])
def test_combine_send_path_models_predict_their_points(name, path, count, bound):
    data = json.loads((DATA / name).read_text())
    run = _measured_run(data)
    traffic = bench_fit.bench_traffic(run)
    points = [p for p in data["points"] if p.get("sender_warps", 4) == 4]  # copy-engine points have no warps
    assert len(points) == count
    errors = []
    for p in points:
        chunk = p["copy_chunk_rows"] if path == "copy" else 8
        point = bench_fit.BenchPoint("combine", "bf16", p["num_sms"], chunk, p["wall_us"], path, channels=p["num_sms"])
        errors.append(bench_fit.predict_point(run, point, dek.profile(), traffic) / p["wall_us"] - 1)
    assert max(abs(e) for e in errors) < bound, errors


def test_normal_work_rejects_an_unknown_combine_path():
    traffic = _traffic(1, 2, 64)
    spec = _spec(1, 2, "combine", "bf16")
    with pytest.raises(ValueError, match="combine_path must be 'rings', 'copy' or 'zone', got 'sideways'"):
        dek.normal_work(spec, traffic, hardware.H200, hardware.CX7, dek.profile(), 24, 8, "bf16",
                        combine_path="sideways")
    # The next valid call still works.
    work = dek.normal_work(spec, traffic, hardware.H200, hardware.CX7, dek.profile(), 24, 8, "bf16",
                           combine_path="zone")
    assert "zone_send" in work.kinds


def test_more_nodes_than_the_kernels_serve_is_noted():
    # Beyond 24 nodes deep_ep's Buffer runs its torch backend (G = 1) or a torch rail (G > 1): the report says so.
    sc = Scenario(nodes=32, gpus_per_node=1, gpu="h200", mode="normal", kernels="deep_ep", tokens=256)
    def notes(scenario):
        return [note for scale in run(scenario).scales for note in scale.notes]

    assert any("at most 24 nodes" in note and "torch backend" in note for note in notes(sc))
    assert not any("at most 24 nodes" in note for note in notes(replace(sc, nodes=24)))
    # With several GPUs per node past the fused kernels' 64 ranks the node stage stays on the kernels beside a torch
    # rail (NCCL); 32 x 2 is fused.
    assert any("torch rail" in note for note in notes(replace(sc, gpus_per_node=4, tokens=64)))
    assert not any("torch rail" in note for note in notes(replace(sc, gpus_per_node=2, tokens=64)))


def test_torch_backend_model_closed_form():
    """Past NUM_MAX_RING_RANKS nodes of one GPU the op is the torch backend's: per rank the call's host cost, the
    link latency, the slower direction over the link at the p2p efficiency, and the torch copies of every byte sent
    and received; the DES entry point and the closed form agree; combine sends the rows back."""
    from deep_ep.config import NUM_MAX_RING_RANKS

    nodes = NUM_MAX_RING_RANKS + 1
    prof, gpu, nic = dek.profile(), hardware.H200, hardware.get_nic("cx7")
    rows = np.zeros((nodes, nodes), dtype=int)
    rows[0, 1:] = 10   # rank 0 sends 10 rows to every other rank
    rows[2, 0] = 40    # and receives 40 from rank 2
    traffic = [workload.SourceTraffic(64, 64, tuple(int(x) for x in r), tuple(int(x) for x in r),
                                      tuple(int(x) for x in r)) for r in rows]
    for op in ("dispatch", "combine"):
        row = 7168 * 2
        spec = rank.OpSpec("internode", op, 7168, 8, row, row, nodes, 1, None)
        assert dek.torch_served(spec)
        flow = rows if op == "dispatch" else rows.T
        sent, received = flow[0].sum() * row, flow[:, 0].sum() * row
        want = (prof.torch_call_us + nic.latency_us + max(sent, received) / (nic.line_gbps * prof.torch_p2p_efficiency
                * 1e3) + 2 * (sent + received) / (prof.composed_copy_gbps * 1e3))
        res = dek.simulate_normal(spec, traffic, gpu, nic, prof, 24, 16, "bf16")
        closed = dek.closed_form_rank_times(spec, traffic, gpu, nic, prof, 24, 16, "bf16")
        assert res.rank_time_us[0] == pytest.approx(want)
        assert np.allclose(closed, res.rank_time_us)
        assert res.bottleneck.startswith("torch:")
        assert res.port_bytes["nic_out"] == pytest.approx(flow.sum() * row)
    assert not dek.torch_served(replace(spec, num_nodes=NUM_MAX_RING_RANKS))


def test_the_composed_rail_is_torch():
    """With several GPUs per node beyond the fused kernels the torch part is the rail stage only (bottleneck
    'rail:torch:...' at any node count; the node stage keeps an SM recommendation); one GPU per node past the ring
    groups' node count gets none (NCCL brings its own CTAs)."""
    from deep_ep.config import NUM_MAX_RING_RANKS

    # 4 GPUs per node: past the fused kernels' 64 ranks at both node counts.
    sc = Scenario(nodes=NUM_MAX_RING_RANKS + 1, gpus_per_node=4, gpu="h200", mode="normal", kernels="deep_ep",
                  tokens=64)
    for nodes in (NUM_MAX_RING_RANKS + 1, 17):
        result = run(replace(sc, nodes=nodes))
        assert all(op.bottleneck.startswith("rail:torch:") for op in result.ops), [op.bottleneck for op in result.ops]
        assert result.scales[0].recommended_num_sms is not None
    one_gpu = run(replace(sc, gpus_per_node=1))
    assert all(op.bottleneck.startswith("torch:") for op in one_gpu.ops)
    assert one_gpu.scales[0].recommended_num_sms is None
