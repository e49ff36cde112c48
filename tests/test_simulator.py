"""Tests of the SimPy simulator and the ``python -m simulator`` capacity planner (CPU only, no torch)."""
from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import simpy
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deep_ep import layout
from deep_ep.config import (
    Config,
    deepep_rdma_buffer_size_hint,
    fused_buffer_bytes,
    get_combine_config,
    get_dispatch_config,
    nvl_buffer_size_hint,
    rdma_buffer_size_hint,
)
from simulator import Scenario, hardware, rank, run, validate, workload
from simulator.links import FluidNetwork

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simulator", *args], cwd=ROOT, capture_output=True, text=True,
                          check=check, timeout=120)


def _traffic(nodes: int, tokens: int, routing: str = "uniform", seed: int = 0, per_node: int = 8,
             experts: int = 256, mask: bool = False) -> list[workload.SourceTraffic]:
    kind, arg = workload.parse_routing(routing)
    router = workload.Router(kind, arg, experts, 8, nodes, seed)
    return workload.build_traffic(router, nodes * per_node, per_node, tokens, 0, mask_ll=mask)


def _normal_spec(nodes: int, op: str, cfg: Config, per_node: int = 8) -> rank.OpSpec:
    payload = rank.token_bytes(7168, "fp8" if op == "dispatch" else "bf16")
    mode = "internode" if nodes > 1 else "intranode"
    return rank.OpSpec(mode, op, 7168, 8, payload, payload, nodes, per_node, cfg)


# ---------------------------------------------------------------------------------------------------------------
# Fluid network
# ---------------------------------------------------------------------------------------------------------------

def _flow(ports, coefs):
    import numpy as np
    return np.asarray(ports, dtype=np.int64), np.asarray(coefs, dtype=float)


def test_fluid_fair_share_and_release():
    env = simpy.Environment()
    net = FluidNetwork(env, [10.0, 100.0], ["a", "b"])
    done_small = net.transfer("small", 100.0, *_flow([0], [1.0]))
    done_big = net.transfer("big", 300.0, *_flow([0, 1], [1.0, 1.0]))
    env.run()
    # Both get 5 B/us until "small" ends at t=20; then "big" alone gets 10 B/us for its last 200 B.
    assert done_small.value == pytest.approx(20.0)
    assert done_big.value == pytest.approx(40.0)
    assert net.port_bytes[0] == pytest.approx(400.0)
    assert net.port_bytes[1] == pytest.approx(300.0)


def test_fluid_max_min_with_cap_and_coefficients():
    env = simpy.Environment()
    net = FluidNetwork(env, [12.0], ["p"])
    capped = net.transfer("capped", 10.0, *_flow([0], [1.0]), cap=2.0)
    heavy = net.transfer("heavy", 50.0, *_flow([0], [2.0]))  # each byte loads the port twice
    env.run()
    # capped: 2 B/us (its cap); heavy gets the rest: (12 - 2) / 2 = 5 B/us until t=5, then 6 B/us.
    assert capped.value == pytest.approx(5.0)
    assert heavy.value == pytest.approx(5.0 + (50.0 - 25.0) / 6.0)


def test_fluid_rejects_zero_capacity():
    with pytest.raises(ValueError, match="positive capacity"):
        FluidNetwork(simpy.Environment(), [0.0], ["dead"])


# ---------------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------------

def test_uniform_ranks_per_token_matches_closed_form():
    traffic = _traffic(1, 4096)
    mean_ranks = sum(t.num_rows for t in traffic) / sum(t.num_tokens for t in traffic)
    assert mean_ranks == pytest.approx(workload.expected_ranks_per_token(256, 8, 8), rel=0.01)


@pytest.mark.parametrize(("nodes", "expected"), [(2, 1.99), (4, 3.60), (8, 3.99)])
def test_group_limited_nodes_per_token(nodes, expected):
    # DeepEP's internode test routing: groups = nodes, top-min(nodes, 4) groups.
    traffic = _traffic(nodes, 2048, "group-limited")
    per_token = sum(t.num_records for t in traffic[:8]) / sum(t.num_tokens for t in traffic[:8])
    assert per_token == pytest.approx(expected, abs=0.03)


def test_group_limited_never_exceeds_four_nodes():
    router = workload.Router("group-limited", None, 256, 8, 16, seed=3)
    for row in router.rank_rows(0, 500):
        assert len(set(row)) == 8
        assert len({e * 16 // 256 for e in row}) <= workload.MAX_ROUTED_NODES


def test_ll_mask_removes_selections():
    traffic = _traffic(1, 128, mask=True)
    assert all(t.num_selections <= 128 * 8 for t in traffic)
    assert any(t.num_selections < 128 * 8 for t in traffic)


def test_zipf_skews_and_redundant_experts_rebalance():
    skewed = run(Scenario(nodes=2, mode="low-latency", routing="zipf:1.2", redundant_experts=0))
    flat = run(Scenario(nodes=2, mode="low-latency", routing="uniform", redundant_experts=0))
    eplb = run(Scenario(nodes=2, mode="low-latency", routing="zipf:1.2", redundant_experts=32))
    skew_max = max(r.max_time_us for r in skewed.ops)
    assert skew_max > 1.2 * max(r.max_time_us for r in flat.ops)
    assert max(r.max_time_us for r in eplb.ops) < skew_max


def test_replica_placement_fills_every_slot_once():
    popularity = [1.0 / (i + 1) for i in range(64)]
    copies = workload.replica_placement(popularity, 16, 16)
    slots = sorted(s for c in copies for s in c)
    assert slots == list(range(80))
    assert len(copies[0]) == 2 and len(copies[63]) == 1


def test_trace_replay(tmp_path):
    rows = [[[r * 4 + k for k in range(2)] for _ in range(8)] for r in range(4)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"num_experts": 16, "topk_idx": rows}))
    report = run(Scenario(nodes=1, gpus_per_node=4, experts=16, topk=2, tokens=8, routing=f"trace:{path}",
                          mode="low-latency"))
    # Every token of rank r picks experts 4r, 4r+1: both on rank r, so nothing leaves the GPU.
    assert all(r.nvl_gbps == 0 and r.nic_gbps == 0 for r in report.ops)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"topk_idx": [[[0, 1], [2]]]}))
    with pytest.raises(ValueError, match="same top-k"):
        run(Scenario(nodes=1, gpus_per_node=4, experts=16, topk=2, tokens=2, routing=f"trace:{bad}"))


# ---------------------------------------------------------------------------------------------------------------
# Byte accounting
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_normal_byte_conservation(nodes, op):
    traffic = _traffic(nodes, 512, "group-limited", seed=1)
    cfg = (get_dispatch_config if op == "dispatch" else get_combine_config)(nodes * 8, 24)
    spec = _normal_spec(nodes, op, cfg)
    res = rank.simulate_normal(spec, traffic, hardware.H800, hardware.CX7)
    row = rank.normal_row_bytes(spec)
    assert res.port_bytes["nvl_out"] == pytest.approx(res.port_bytes["nvl_in"])
    if nodes > 1:
        assert res.port_bytes["nic_out"] == pytest.approx(res.port_bytes["nic_in"])
        remote = sum(x for s, t in enumerate(traffic) for n, x in enumerate(t.records_to_node) if n != s // 8)
        assert res.port_bytes["nic_out"] == pytest.approx(remote * row)
        # Forwarders copy every row once; every row lands once.
        assert res.port_bytes["sm_fwd"] == pytest.approx(sum(t.num_rows for t in traffic) * row)
        assert sum(res.logical_bytes) == sum(t.num_records for t in traffic) * spec.logical_bytes
    else:
        hops = sum(x for s, t in enumerate(traffic) for d, x in enumerate(t.rows_to_rank) if d != s)
        assert res.port_bytes["nvl_out"] == pytest.approx(hops * row)
    assert sum(res.nvl_logical_bytes) == sum(t.num_rows for t in traffic) * spec.logical_bytes


@pytest.mark.parametrize(("nodes", "allow_nvlink"), [(1, True), (2, True), (2, False)])
def test_low_latency_byte_conservation(nodes, allow_nvlink):
    traffic = _traffic(nodes, 64, mask=True, seed=2)
    msg = 16 + rank.token_bytes(7168, "fp8")
    spec = rank.OpSpec("low-latency", "dispatch", 7168, 8, msg, msg, nodes, 8, None, allow_nvlink=allow_nvlink)
    res = rank.simulate_low_latency(spec, traffic, hardware.H800, hardware.CX7, 256)
    total = sum(t.num_selections for t in traffic) * msg
    local = sum(t.msgs_to_rank[s] for s, t in enumerate(traffic)) * msg
    assert res.port_bytes["sm_ll"] == pytest.approx(total)
    assert res.port_bytes["nvl_out"] + res.port_bytes["nic_out"] == pytest.approx(total - local)
    assert res.port_bytes["nvl_in"] + res.port_bytes["nic_in"] == pytest.approx(total - local)
    if not allow_nvlink:
        assert res.port_bytes["nvl_out"] == 0
    assert sum(res.logical_bytes) == total


def test_logical_bytes_match_deepep_test_counts():
    assert rank.token_bytes(7168, "fp8") == 7392  # FP8 row + per-128 float32 scales (fp8_factor 0.515625 x 2H)
    assert rank.token_bytes(7168, "bf16") == 14336
    assert 7392 == pytest.approx(2 * 7168 * (1 + 4 / 128) / 2)


def test_buffer_bytes_follow_deep_ep_layout():
    report = run(Scenario(nodes=2, num_sms=24))
    scale = report.scales[0]
    cfgs = (get_dispatch_config(16, 24), get_combine_config(16, 24))
    assert scale.num_nvl_bytes == max(nvl_buffer_size_hint(c, 14336, 16) for c in cfgs)
    assert scale.num_rdma_bytes == max(deepep_rdma_buffer_size_hint(c, 14336, 16) for c in cfgs)
    assert scale.num_ll_rdma_bytes == layout.low_latency_rdma_size_hint(128, 7168, 16, 256)
    assert round(scale.num_nvl_bytes / 1e6) == 453 and round(scale.num_rdma_bytes / 1e6) == 110


def test_deep_ep_kernels_buffer_bytes_hold_the_fused_kernels():
    """deep_ep's kernels take deep_ep's hints: at 2 x 8 GPUs the two together are the fused kernels' buffer."""
    scale = run(Scenario(nodes=2, num_sms=24, kernels="deep_ep", mode="normal")).scales[0]
    cfgs = (get_dispatch_config(16, 24), get_combine_config(16, 24))
    assert scale.num_nvl_bytes == max(nvl_buffer_size_hint(c, 14336, 16) for c in cfgs)
    assert scale.num_rdma_bytes == max(rdma_buffer_size_hint(c, 14336, 16) for c in cfgs)
    assert scale.num_nvl_bytes + scale.num_rdma_bytes == max(fused_buffer_bytes(c, 14336, 16) for c in cfgs)


# ---------------------------------------------------------------------------------------------------------------
# Monotonicity and the closed form
# ---------------------------------------------------------------------------------------------------------------

SLACK = 5e-4


@settings(max_examples=12)
@example(nodes=2, op="dispatch", sms=26, tokens=252, seed=0)  # SM:forward -> NVLink: +5.5e-6
@example(nodes=2, op="dispatch", sms=26, tokens=255, seed=0)  # twice the NVLink bandwidth: +1.1e-4
@given(nodes=st.sampled_from([1, 2, 4]), op=st.sampled_from(["dispatch", "combine"]),
       sms=st.integers(2, 31).map(lambda x: 2 * x), tokens=st.integers(64, 1024), seed=st.integers(0, 3))
def test_more_sms_or_bandwidth_is_never_slower(nodes, op, sms, tokens, seed):
    """DeepEP V1's model (``rank.simulate_normal``), within SLACK: its DES shares each port max-min fairly among the
    flows crossing it, so when more capacity moves the bottleneck from one port to another (internode at 2 x 8:
    SM:forward -> NVLink) the flows' phases shift and the makespan can grow by parts in 10^4, never more. deep_ep's
    fused model is a closed form and exactly monotone (test_simulator_fused)."""
    traffic = _traffic(nodes, tokens, "group-limited", seed=seed)
    table = (get_dispatch_config if op == "dispatch" else get_combine_config)(nodes * 8, 24)
    times = []
    for s in (sms, sms + 2):
        cfg = replace(table, num_sms=s)
        times.append(rank.simulate_normal(_normal_spec(nodes, op, cfg), traffic, hardware.H800,
                                          hardware.CX7).max_time_us)
    assert times[1] <= times[0] * (1 + SLACK)
    cfg = replace(table, num_sms=sms)
    spec = _normal_spec(nodes, op, cfg)
    base = rank.simulate_normal(spec, traffic, hardware.H800, hardware.CX7).max_time_us
    fast_gpu = replace(hardware.H800, nvlink_gbps=2 * hardware.H800.nvlink_gbps)
    fast_nic = replace(hardware.CX7, line_gbps=2 * hardware.CX7.line_gbps)
    assert rank.simulate_normal(spec, traffic, fast_gpu, hardware.CX7).max_time_us <= base * (1 + SLACK)
    assert rank.simulate_normal(spec, traffic, hardware.H800, fast_nic).max_time_us <= base * (1 + SLACK)


@pytest.mark.parametrize("nic", ["cx6", "cx7", "cx8"])
def test_faster_nic_is_never_slower_end_to_end(nic):
    order = {"cx6": 0, "cx7": 1, "cx8": 2}
    times = {n: [r.time_us for r in run(Scenario(nodes=2, nic=n, tokens=512)).ops] for n in order}
    for slower, faster in (("cx6", "cx7"), ("cx7", "cx8")):
        assert all(f <= s * (1 + 1e-6) for s, f in zip(times[slower], times[faster]))
    del nic


def test_des_matches_closed_form_for_symmetric_traffic():
    traffic = _traffic(4, 2048, "group-limited")
    spec = _normal_spec(4, "dispatch", get_dispatch_config(32, 24))
    model = rank.normal_model(spec, traffic, hardware.H800, hardware.CX7)
    closed = rank.roofline_us(model, rank.max_load_per_kind(model, 32))
    des = rank.simulate_normal(spec, traffic, hardware.H800, hardware.CX7, model.flows).max_time_us
    assert des == pytest.approx(closed, rel=0.03)


def test_ll_latency_rises_with_ep_and_saturates():
    times = [run(Scenario(nodes=n, mode="low-latency", routing="uniform", redundant_experts=0)).ops[0].time_us
             for n in (1, 2, 4, 8, 16)]
    assert times == sorted(times)
    assert times[-1] / times[-2] < 1.1  # NIC-bound plateau at EP >= 64


# ---------------------------------------------------------------------------------------------------------------
# Determinism, CLI, golden output
# ---------------------------------------------------------------------------------------------------------------

def test_same_seed_same_report_and_seed_matters():
    a = run(Scenario(nodes=2, tokens=256, seed=5)).to_json()
    b = run(Scenario(nodes=2, tokens=256, seed=5)).to_json()
    c = run(Scenario(nodes=2, tokens=256, seed=6)).to_json()
    assert a == b
    assert a != c


def test_json_output_has_per_op_fields():
    data = json.loads(_cli("--nodes", "2", "--tokens", "256", "--json").stdout)
    result = data["results"][0]
    for mode in ("normal", "low-latency"):
        for op in ("dispatch", "combine"):
            entry = result[mode][op]
            assert entry["time_us"] > 0 and entry["logical_gbps"] > 0 and entry["bottleneck"]
    assert result["num_nvl_bytes"] > 0 and result["recommended_num_sms"] % 2 == 0


def test_scenario_rejects_bad_values():
    with pytest.raises(ValueError, match="hidden must be a multiple of 128"):
        Scenario(hidden=200)
    with pytest.raises(TypeError, match="nodes must be an int"):
        Scenario(nodes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu must be one of"):
        Scenario(gpu="a100")


def _child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize(("nodes", "budget_s"), [(8, 2.0), (64, 10.0)])
def test_planner_speed(nodes, budget_s):
    # CPU time of the child (robust to a loaded CI machine); the wall-clock targets are the same numbers.
    before = _child_cpu_seconds()
    _cli("--nodes", str(nodes))
    assert _child_cpu_seconds() - before < budget_s


# ---------------------------------------------------------------------------------------------------------------
# Validation against published measurements (the acceptance criteria)
# ---------------------------------------------------------------------------------------------------------------

def test_validation_errors_within_tolerance():
    outcomes = validate.validate()
    bad = [f"{o.row.set_name} {o.row.label}: {100 * o.error:+.1f}%" for o in outcomes if not o.ok]
    assert not bad, "rows outside tolerance: " + "; ".join(bad)
    assert validate.passed(outcomes), validate.to_text(outcomes)
    # The shipped constants are the calibration's fixed point: its rows are reproduced.
    assert validate.summary(outcomes)["mae_calibration"] < 0.005
    labels = {(o.row.set_name, o.row.label) for o in outcomes}
    assert len(labels) == len(outcomes) and len(outcomes) >= 20 + 5
    assert all(math.isfinite(o.predicted) for o in outcomes)


def test_validate_cli_json():
    proc = _cli("validate", "--json", "--set", "normal-h800", check=False)
    data = json.loads(proc.stdout)
    assert len(data["rows"]) == 8
    assert {"measured", "predicted", "error", "calibration"} <= set(data["rows"][0])
    assert proc.returncode == (0 if all(r["ok"] for r in data["rows"]) else 1)
