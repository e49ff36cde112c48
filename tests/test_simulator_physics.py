"""The simulator's physical mechanisms, one test each, and the validation against the published rows.

Per-peer rings (both kernel families), the low-latency fixed cost from its parts, the NIC's wire, message-rate and
outstanding-window limits, link rates from spec sheets, utilisation at most 1 (in the report and its text columns),
the calibration rows and the leave-one-group-out check (``validate`` within its tolerances: ``test_simulator.py``).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from simulator import calibrate, hardware, rank, validate
from simulator import deep_ep_kernels as dek
from simulator.scenario import Scenario, run


def _op(report, mode: str, op: str):
    return next(r for r in report.ops if r.mode == mode and r.op == op)


def _intranode(gpus: int, **kw) -> Scenario:
    return Scenario(nodes=1, gpus_per_node=gpus, gpu="h200", mode="normal", tokens=4096, routing="uniform",
                    num_sms=24, redundant_experts=0, **kw)


# -- per-peer rings ------------------------------------------------------------------------------------------------

def test_ring_row_cost_shrinks_with_the_rings_an_sm_serves():
    gpu = hardware.H200
    rates = [rank.row_rate(gpu, 7500, 16, rings) for rings in (1, 2, 4, 8)]
    assert rates == sorted(rates) and rates[-1] > 1.3 * rates[1]
    # Rows that go through no ring (low-latency messages) pay only the byte rate.
    assert rank.row_rate(gpu, 7500) == pytest.approx(gpu.sm_copy_gbps * 1e3)
    # Without the ring latency the SM rate no longer depends on the peers.
    flat = replace(gpu, ring_row_ns=0.0)
    assert rank.row_rate(flat, 7500, 16, 8) == pytest.approx(rank.row_rate(flat, 7500, 16, 2))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_deepep_sm_bound_ep8_moves_more_than_ep2_at_equal_sms(dtype, monkeypatch):
    # A GPU whose NVLink never binds: both EP sizes are SM-bound, so the difference is the rings alone.
    wide = replace(hardware.H200, nvlink_gbps=1e5)
    monkeypatch.setitem(hardware.GPUS, "h200", wide)
    ep2 = _op(run(_intranode(2, dispatch_dtype=dtype)), "normal", "dispatch")
    ep8 = _op(run(_intranode(8, dispatch_dtype=dtype)), "normal", "dispatch")
    assert ep2.bottleneck.startswith("SM") and ep8.bottleneck.startswith("SM")
    assert ep8.logical_gbps > 1.2 * ep2.logical_gbps
    monkeypatch.setitem(hardware.GPUS, "h200", replace(wide, ring_row_ns=0.0))
    flat2 = _op(run(_intranode(2, dispatch_dtype=dtype)), "normal", "dispatch")
    flat8 = _op(run(_intranode(8, dispatch_dtype=dtype)), "normal", "dispatch")
    assert flat8.logical_gbps < 1.1 * flat2.logical_gbps


def test_deepep_h200_ep8_fp8_dispatch_above_ep2_at_24_sms():
    ep2 = _op(run(_intranode(2)), "normal", "dispatch")
    ep8 = _op(run(_intranode(8)), "normal", "dispatch")
    assert ep8.logical_gbps > 1.1 * ep2.logical_gbps


def test_deep_ep_publications_cover_every_ring_at_once():
    # One publisher lane per peer: the publications of a sender depend on its tokens and channels, not its peers.
    from simulator.workload import SourceTraffic
    for ranks in (2, 4, 8):
        traffic = [SourceTraffic(1024, 8192, (800,) * ranks, (1024,) * ranks, (1024,)) for _ in range(ranks)]
        hop = np.ones((ranks, ranks)) - np.eye(ranks)
        rings = dek._publishes(traffic, hop, 12, 8, rings=True)
        assert list(rings) == [12 * math.ceil(1024 / 12 / 8)] * ranks
        assert list(dek._publishes(traffic, hop, 12, 8, rings=False)) == [12] * ranks


# -- low-latency fixed cost --------------------------------------------------------------------------------------

def test_ll_fixed_cost_grows_with_peers_and_tokens():
    gpu = hardware.H800
    nvl = [gpu.ll_fixed_us(p, 0, 128, 8) for p in (1, 3, 7)]
    assert nvl == sorted(nvl) and nvl[2] - nvl[0] == pytest.approx(6 * gpu.ll_nvl_signal_us)
    rdma = [gpu.ll_fixed_us(7, p, 128, 8) for p in (0, 8, 248)]
    assert rdma[1] - rdma[0] == pytest.approx(gpu.ll_rdma_signal_us + 8 * gpu.ll_rdma_peer_us)
    assert rdma[2] > rdma[1] > rdma[0]
    assert gpu.ll_fixed_us(7, 0, 1, 8) < gpu.ll_fixed_us(7, 0, 256, 8)
    assert gpu.ll_fixed_us(0, 0, 0, 8) == gpu.ll_launch_us


def test_ll_time_of_a_tiny_batch_grows_with_ep_size():
    times = []
    for nodes in (1, 2, 8, 32):
        sc = Scenario(nodes=nodes, mode="low-latency", ll_tokens=1, routing="uniform", redundant_experts=0)
        times.append(_op(run(sc), "low-latency", "dispatch").time_us)
    assert times == sorted(times) and times[-1] > times[0] + 10


# -- NIC ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nic", sorted(hardware.NICS))
def test_nic_rate_never_exceeds_the_line_rate(nic):
    profile = hardware.NICS[nic]
    for msg in (16, 256, 4096, 7408, 14336, 1 << 20):
        for qps in (1, 8, 1024):
            assert 0 < profile.rate(msg, qps) <= profile.line_gbps


def test_nic_window_limits_small_messages_over_few_qps():
    cx7 = hardware.CX7
    few, many = cx7.rate(512, 1), cx7.rate(512, 64)
    assert few < 0.5 * many
    assert few == pytest.approx(cx7.window_msgs * 512 / (2 * cx7.latency_us) * 1e-3)
    # Large messages over one QP stop at the per-QP limit, many QPs at the wire.
    assert cx7.rate(1 << 20, 1) == pytest.approx(cx7.qp_gbps)
    assert cx7.rate(1 << 20, 64) == pytest.approx(cx7.wire_gbps(1 << 20))


def test_nic_message_rate_and_headers():
    cx7 = hardware.CX7
    assert cx7.rate(32, 10_000) == pytest.approx(cx7.msg_rate_mpps * 1e6 * 32 * 1e-9)
    assert cx7.wire_gbps(4096) == pytest.approx(50.0 * 4096 / (4096 + 42))
    assert hardware.ETH200.wire_gbps(4096) / hardware.ETH200.line_gbps < cx7.wire_gbps(4096) / cx7.line_gbps
    with pytest.raises(ValueError, match="msg_bytes"):
        cx7.rate(0, 1)


def test_ll_nic_rate_is_the_physical_limit_not_a_fitted_efficiency():
    # The LL rows' NIC rate comes from the wire limit of a 7.4 KB message, at most the line rate.
    sc = Scenario(nodes=4, mode="low-latency", routing="uniform", redundant_experts=0)
    d = _op(run(sc), "low-latency", "dispatch")
    assert d.nic_gbps <= hardware.CX7.line_gbps
    assert d.bottleneck == "RDMA"


# -- link and forwarding limits per GPU --------------------------------------------------------------------------

def test_nvlink_rates_come_from_the_spec_sheet_and_one_measurement():
    eff = hardware.NVLINK_STORE_EFFICIENCY
    assert hardware.H200.nvlink_gbps == pytest.approx(370.0)
    assert hardware.H800.nvlink_gbps == pytest.approx(200.0 * eff)
    assert hardware.B200.nvlink_gbps == pytest.approx(900.0 * eff)
    assert hardware.H100.nvlink_gbps == hardware.H200.nvlink_gbps


def test_internode_forwarding_limit_does_not_scale_with_the_gpu_generation():
    assert hardware.B200.fwd_sm_gbps == hardware.H800.fwd_sm_gbps == hardware.H200.fwd_sm_gbps
    sc = Scenario(nodes=2, mode="normal", routing="group-limited", redundant_experts=0)
    h800 = _op(run(sc), "normal", "dispatch")
    b200 = _op(run(replace(sc, gpu="b200")), "normal", "dispatch")
    assert b200.logical_gbps == pytest.approx(h800.logical_gbps, rel=0.1)


def test_every_profile_parameter_names_its_source():
    for profile in [*hardware.GPUS.values(), *hardware.NICS.values()]:
        explicit = dict(profile.sources)
        for name, _value, _source in hardware.describe_profile(profile):
            if name == "shares_nvlink":
                continue
            assert name in explicit, (profile.name, name)
            assert explicit[name].startswith(("spec sheet", "spec:", "measured", "fit:", "assumed", "design:")), (
                profile.name, name, explicit[name])


# -- utilisation -------------------------------------------------------------------------------------------------

UTILISATION_SCENARIOS = [
    *(Scenario(nodes=n, gpus_per_node=g, ll_tokens=t, kernels=k) for k in ("deepep", "deep_ep")
      for n, g, t in ((1, 8, 1), (2, 8, 1), (8, 8, 128), (1, 2, 512), (2, 1, 1))),
    Scenario(gpus_per_node=2, mode="low-latency", kernels="deep_ep"),  # stores overlap the fixed cost
    Scenario(gpus_per_node=8, gpu="b200", mode="low-latency", kernels="deep_ep"),
    Scenario(nodes=8, mode="normal", nic="eth200", routing="uniform", kernels="deepep"),  # batched completions
    Scenario(gpus_per_node=2, mode="normal", tokens=4096, routing="uniform", kernels="deepep"),
]


@pytest.mark.parametrize("sc", UTILISATION_SCENARIOS, ids=lambda sc: f"{sc.kernels}-{sc.mode}-{sc.nodes}x"
                         f"{sc.gpus_per_node}-{sc.gpu}-{sc.nic}-ll{sc.ll_tokens}")
def test_utilisation_never_exceeds_one(sc):
    report = run(sc)
    for op in report.ops:
        assert 0.0 <= op.nvl_util <= 1 + 1e-9 and 0.0 <= op.nic_util <= 1 + 1e-9, (op.mode, op.op)
    for line in report.to_text().splitlines()[3:3 + len(report.ops)]:  # the NVL% and NIC% columns
        assert all(int(x) <= 100 for x in line.split()[11:13]), line


def test_utilisation_is_the_average_load_over_the_op_and_busy_time_the_bytes_at_full_rate():
    import simpy

    from simulator.links import FluidNetwork
    env = simpy.Environment()
    net = FluidNetwork(env, [10.0, 10.0], ["a", "b"])

    def late():
        yield env.timeout(100.0)
        yield net.transfer("late", 50.0, np.array([1]), np.array([1.0]))

    net.transfer("early", 100.0, np.array([0]), np.array([1.0]))
    env.process(late())
    env.run()
    # Port a runs at full rate for 10 us, port b for 5 us, within an op of 105 us.
    assert net.busy_us() == pytest.approx([10.0, 5.0])
    assert net.utilization(105.0) == pytest.approx([100.0 / 1050.0, 50.0 / 1050.0])


# -- validation --------------------------------------------------------------------------------------------------

def test_calibration_rows_are_the_calibrations_first_candidates():
    assert set(validate.CALIBRATION) == set(calibrate.calibration_rows())


def test_leave_one_group_out_reports_every_group_and_restores_the_fit():
    before = (dict(hardware.GPUS), dict(hardware.NICS), validate.WALL_OVERHEAD_US)
    checks = calibrate.leave_one_group_out()
    assert (dict(hardware.GPUS), dict(hardware.NICS), validate.WALL_OVERHEAD_US) == before
    assert [c.group for c in checks] == ["normal-h800", "ll-h800", "ll-rdma-h800", "h200", "h200-sweep"]
    by_group = {c.group: c for c in checks}
    # Rows are predicted by a fit that never saw them: the README's LL EP128/256 rows go with the pure-RDMA table.
    assert {o.row.label for o in by_group["ll-h800"].outcomes} == {f"EP{ep} {op}" for ep in (8, 16, 32, 64)
                                                                    for op in ("dispatch", "combine")}
    assert "SM90.fwd_sm_gbps" in by_group["normal-h800"].priors
    for c in checks:
        assert c.max_abs_error < 0.2, validate.logo_to_text(checks)
    text = validate.to_text(validate.validate(validate.all_rows()[:2]), checks)
    assert "leave-one-group-out" in text and "ll-rdma-h800" in text
    data = validate.to_json(validate.validate(validate.all_rows()[:2]), checks)
    assert '"leave_one_group_out"' in data and '"priors"' in data
    with pytest.raises(ValueError, match="groups"):
        calibrate.leave_one_group_out(["nope"])


def test_deep_ep_ll_fixed_cost_grows_with_peers_beyond_the_calibrated_ep2():
    def spec(nodes: int, gpus: int) -> rank.OpSpec:
        return rank.OpSpec("low-latency", "dispatch", 7168, 8, 7472, 7472, nodes, gpus, None)
    gpu = hardware.H200
    assert dek.ll_peer_signal_us(spec(1, 2), gpu, hardware.CX7) == 0.0
    assert dek.ll_peer_signal_us(spec(1, 8), gpu, hardware.CX7) == pytest.approx(6 * gpu.ll_nvl_signal_us)
    assert dek.ll_peer_signal_us(spec(4, 8), gpu, hardware.CX7) == pytest.approx(
        6 * gpu.ll_nvl_signal_us + 24 * gpu.ll_rdma_peer_us)
    # Virtual nodes on one host reach every peer by NVLink.
    assert dek.ll_peer_signal_us(spec(4, 1), gpu, hardware.NVLINK_P2P) == pytest.approx(2 * gpu.ll_nvl_signal_us)


def test_rdma_credits_limit_a_small_scale_out_ring():
    from deep_ep.config import Config
    from simulator.workload import SourceTraffic
    traffic = [SourceTraffic(64, 512, (8,) * 16, (32,) * 16, (64, 64)) for _ in range(16)]

    def nic_cap(num_sms: int, nr: int) -> float:
        spec = rank.OpSpec("internode", "dispatch", 7168, 8, 7392, 7392, 2, 8, Config(num_sms, 6, 256, 4, nr))
        return rank.normal_model(spec, traffic, hardware.H800, hardware.CX7).caps["nic_out"] / 1e3
    assert nic_cap(2, 8) < 0.5 * nic_cap(2, 256)
    assert nic_cap(24, 8) == pytest.approx(nic_cap(24, 256))  # twelve channels' credits cover the round trip
    assert nic_cap(2, 256) <= hardware.CX7.line_gbps


def test_nvlink_store_efficiency_is_the_stored_measurement():
    import json
    data = json.loads((dek.DATA_DIR / "nvlink_sm_h200x2.json").read_text())
    best = data["columns"].index("store16_1024thr_4inflight")
    rows = {r[0]: r[best] for r in data["rows"]}
    assert hardware.NVLINK_STORE_EFFICIENCY == pytest.approx(rows[132] / data["nominal_gbps_per_direction"])
    assert rows[1] == pytest.approx(46.0)  # one SM: the prior of sm_copy_gbps, close to its fit
    assert hardware.H200.sm_copy_gbps == pytest.approx(rows[1], rel=0.05)
