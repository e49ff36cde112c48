"""Tests of the ``--kernels deep_ep`` family of the simulator and its calibration from bench JSON (CPU only).

The family models deep_ep's own kernels (``simulator/deep_ep_kernels.py``); ``python -m simulator.calibrate
--from-bench FILE --check OTHER`` fits it (``simulator/bench_fit.py``) and writes
``simulator/calibration_deep_ep.json``; ``python -m simulator predict --json`` writes
``benchmarks/results/simulator_predict_deep_ep.json``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from simulator import Scenario, bench_fit, hardware, rank, run, workload
from simulator import deep_ep_kernels as dek

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCH_RINGS = RESULTS / "intranode_h200x2_2026-11-30.json"          # rings only, SM sweep 8..48 (older kernels)
BENCH = RESULTS / "intranode_h200x2_2026-11-30_receive.json"        # rings and direct-to-output, 8 and 24 SMs
BENCH_VIRTUAL = RESULTS / "internode_h200x2_2026-11-30_virtual.json"  # bench_internode: EP2 and 2 x 1 virtual nodes
STORED_PREDICTIONS = RESULTS / "simulator_predict_deep_ep.json"
# The calibration command of docs/simulator.md.
CALIBRATE_ARGS = ("--from-bench", str(BENCH), "--check", str(BENCH_VIRTUAL), "--fix", "nvl_efficiency=0.9731",
                  "--fix", "sm_push_gbps=46")


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
            point = bench_fit.BenchPoint(op, dtype, sms, chunk, 1.0, receive)
            t = bench_fit.predict_point(run_, point, truth, traffic)
            points.append({"op": op_name, "num_sms": sms, "chunk": chunk, "wall_us_mean": t})
    points.append({"op": "nccl_dispatch_bf16", "num_sms": 0, "chunk": 0, "wall_us_mean": 300.0})
    data = {"date": "synthetic", "machine": "NVIDIA H200 x2",
            "args": {"num_processes": 2, "num_tokens": 4096, "hidden": 7168, "num_topk": 8, "num_experts": 256},
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
    # receive path and 2 x 1 virtual nodes) is held out as a whole and must stay within 8 % per point.
    prof = dek.load_profile()
    assert prof.source_of("row_ns").startswith("fit: intranode_h200x2_2026-11-30_receive.json")
    assert prof.receive_copies == 0 and prof.source_of("receive_copies").startswith("design: direct-to-output")
    for path, worst in ((BENCH, 0.10), (BENCH_VIRTUAL, 0.08)):
        bench = bench_fit.read_bench(path)
        traffic = bench_fit.bench_traffic(bench)
        errors = [bench_fit.predict_point(bench, p, prof, traffic) / p.time_us - 1 for p in bench.points]
        assert max(abs(e) for e in errors) < worst, (path.name, errors)
    data = json.loads(dek.CALIBRATION_PATH.read_text())
    assert data["check"] == [str(BENCH_VIRTUAL.relative_to(ROOT))] and data["mape_check"] < 0.05
    assert sum(p["role"] == "check" for p in data["points"]) == 6


def test_rings_calibration_still_fits_its_held_out_points():
    # The rings-only SM sweep: every dispatch point is a ring point, so the ring switch of the model still fits it.
    result = bench_fit.fit(bench_fit.read_bench(BENCH_RINGS), hold_out=(16, 32))
    assert all(p.receive == "rings" for p in result.run.points)
    assert result.mape(True) < 0.05 and result.mape(False) < 0.05


def test_bench_reader_receive_paths_and_warps():
    bench = bench_fit.read_bench(BENCH)
    labels = [p.label for p in bench.points]
    assert len(labels) == 10 and "24 SMs fp8 dispatch direct" in labels and "24 SMs fp8 dispatch" in labels
    by_label = {p.label: p for p in bench.points}
    assert by_label["8 SMs bf16 dispatch direct"].receive == "direct"
    assert by_label["8 SMs bf16 dispatch"].receive == "rings" and by_label["8 SMs bf16 combine"].receive == "rings"
    # Buffer's default warps (16 dispatch / 8 combine) vs the best swept ones (12 / 6 at 24 SMs).
    assert by_label["24 SMs bf16 combine"].time_us == pytest.approx(249.7, abs=0.1)
    best = {p.label: p for p in bench_fit.read_bench(BENCH, warps="best").points}
    assert best["24 SMs bf16 combine"].time_us == pytest.approx(221.7, abs=0.1)
    assert best["24 SMs fp8 dispatch direct"].time_us < by_label["24 SMs fp8 dispatch direct"].time_us
    # The diagnostic skipcopy ops are not read.
    d2o = bench_fit.read_bench(RESULTS / "intranode_h200x2_2026-11-30_d2o_branch.json")
    assert len(d2o.points) == 10 and not any("skipcopy" in p.label for p in d2o.points)


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

@pytest.mark.parametrize(("nodes", "per_node", "nic"), [(1, 2, "cx7"), (1, 8, "cx7"), (2, 2, "nvlink-p2p"),
                                                        (2, 8, "cx7")])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_more_sms_is_never_slower(nodes, per_node, nic, op):
    traffic = _traffic(nodes, per_node, 512)
    spec = _spec(nodes, per_node, op, "bf16")
    prof, gpu, nic_p = dek.profile(), hardware.H200, hardware.get_nic(nic)
    times = []
    for sms in (4, 8, 16, 24, 32, 48, 64):
        work = dek.normal_work(spec, traffic, gpu, nic_p, prof, sms, 8, "bf16")
        times.append(float(dek.closed_form_times(work, sms, spec.num_ranks).max()))
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:])), times
    des = [dek.simulate_normal(spec, traffic, gpu, nic_p, prof, sms, 8, "bf16").max_time_us for sms in (8, 24)]
    assert des[1] <= des[0]


@pytest.mark.parametrize(("nodes", "per_node", "nic"), [(1, 2, "cx7"), (1, 8, "cx7"), (2, 1, "nvlink-p2p"),
                                                        (2, 4, "cx7")])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_normal_byte_conservation(nodes, per_node, nic, op):
    traffic = _traffic(nodes, per_node, 256, seed=1)
    spec = _spec(nodes, per_node, op, "fp8" if op == "dispatch" else "bf16")
    nic_p = hardware.get_nic(nic)
    res = dek.simulate_normal(spec, traffic, hardware.H200, nic_p, dek.profile(), 24, 8,
                              "fp8" if op == "dispatch" else "bf16")
    record = (dek.dispatch_record_bytes(7168, "fp8", 8) if op == "dispatch"
              else dek.intranode_combine_record_bytes(7168, 8))
    num_ranks = nodes * per_node
    same_node = [(s, d) for s in range(num_ranks) for d in range(num_ranks)
                 if s // per_node == d // per_node and s != d]
    # NVLink rows: every row to another GPU of the forwarder's node that is not the forwarder itself.
    hops = sum(t.rows_to_rank[d] for s, t in enumerate(traffic) for d in range(num_ranks)
               if d % per_node != s % per_node)
    network = sum(x for s, t in enumerate(traffic) for n, x in enumerate(t.records_to_node) if n != s // per_node)
    assert res.port_bytes["nvl_out"] == pytest.approx(res.port_bytes["nvl_in"])
    if nic_p.shares_nvlink:  # virtual nodes: the network puts ride the NVLink ports
        assert "nic_out" not in res.port_bytes
        assert res.port_bytes["nvl_out"] == pytest.approx((hops + network) * record)
        assert res.port_bytes["sm_push"] == pytest.approx((hops + network) * record)
    else:
        assert res.port_bytes["nvl_out"] == pytest.approx(hops * record)
        assert res.port_bytes["sm_push"] == pytest.approx(hops * record)
        if nodes > 1:
            assert res.port_bytes["nic_out"] == pytest.approx(network * record)
            assert res.port_bytes["nic_in"] == pytest.approx(network * record)
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
    # The ring path costs one extra local copy per received byte (the receivers' ring -> recv_x copy).
    ring_work = dek.normal_work(spec, traffic, hardware.H200, hardware.CX7, rings, 24, 8, "bf16")
    received = sum(t.rows_to_rank[d] for s, t in enumerate(traffic) for d in range(8) if d != s)
    extra = received * rank.token_bytes(7168, "bf16") * 1e-3 / prof.sm_local_gbps
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
    intra = dek.normal_work(_spec(1, 2, op, dtype), traffic, hardware.H200, hardware.CX7, prof, 24, 8, dtype)
    assert virtual.fixed_us == intra.fixed_us and virtual.alias == {} and "nic_out" not in virtual.kinds
    np.testing.assert_allclose(virtual.serial_sm_us, intra.serial_sm_us)
    np.testing.assert_allclose(dek.closed_form_times(virtual, 24, 2), dek.closed_form_times(intra, 24, 2))
    # A real NIC with one GPU per node, and virtual nodes of 2 GPUs, keep the internode model (network stage).
    real = dek.normal_work(_spec(2, 1, op, dtype), traffic, hardware.H200, hardware.CX7, prof, 24, 8, dtype)
    assert real.fixed_us == intra.fixed_us + 100.0 and "nic_out" in real.kinds
    wide = dek.normal_work(_spec(2, 2, op, dtype), _traffic(2, 2, 1024), hardware.H200, p2p, prof, 24, 8, dtype)
    assert wide.fixed_us == intra.fixed_us + 100.0 and wide.alias == {"nic_out": "nvl_out", "nic_in": "nvl_in"}


def test_internode_forwarded_rows_keep_the_ring_receive():
    # Direct-to-output is an intranode receive path: the rows a forwarder stores into its node's rings (G > 1) are
    # still copied out of the rings, whatever receive_copies says.
    traffic = _traffic(2, 4, 512)
    spec = _spec(2, 4, "dispatch", "bf16")
    prof = dek.profile()
    times = [float(dek.closed_form_times(dek.normal_work(spec, traffic, hardware.H200, hardware.CX7,
                                                         replace(prof, receive_copies=c), 8, 8, "bf16"), 8, 8).max())
             for c in (0, 1)]
    assert times[0] == times[1]


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
    proc = _cli("simulator", "--nic", "nvlink-p2p", "--nodes", "2", check=False)
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
    assert "check points" in text and "held-out points none in the file" in text
    assert len([ln for ln in text.splitlines() if ln.endswith("check")]) == 6
    ours, repo = json.loads(out.read_text()), json.loads(dek.CALIBRATION_PATH.read_text())
    assert ours["params"].keys() == repo["params"].keys()
    for name, entry in repo["params"].items():
        assert ours["params"][name]["value"] == pytest.approx(entry["value"], rel=1e-3), name
    assert ours["params"]["nvl_efficiency"]["source"] == "fixed by --fix at 0.9731"


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
    # cases are the same kernels, so the same prediction.
    measured = {(r["case"], r["op"], r["dtype"]): r for r in data["rows"] if r["measured_us"] is not None}
    assert {case for case, _, _ in measured} == {"intranode EP2", "internode 2x1 virtual"} and len(measured) == 6
    assert all(abs(r["time_us"] / r["measured_us"] - 1) < 0.1 for r in measured.values())
    for (case, op, dtype), r in measured.items():
        if case == "internode 2x1 virtual":
            assert r["time_us"] == pytest.approx(measured[("intranode EP2", op, dtype)]["time_us"], rel=0.01)
    # benchmarks/bench_internode.py reads the stored rows on the GPU machine: they must be this output.
    assert json.loads(STORED_PREDICTIONS.read_text()) == data
    # Another calibration file changes the predictions.
    alt = tmp_path / "alt.json"
    alt.write_text(json.dumps({"params": {"sm_push_gbps": {"value": 5.0, "source": "test"}}}))
    slow = json.loads(_cli("simulator", "predict", "--json", "--calibration", str(alt)).stdout)
    assert slow["rows"][0]["time_us"] > data["rows"][0]["time_us"]
