"""Hardware profiles: GPUs (NVLink domain, SMs, kernel overheads) and NICs (scale-out ports).

Every parameter carries its unit in its name (``_gbps`` = GB/s = 1e9 bytes/s, ``_us`` = microseconds,
``_ns`` = nanoseconds) and a source string, one of:

* ``spec sheet`` / ``spec:``: vendor numbers and protocol standards (link counts and rates, headers, message rates);
* ``measured``: a probe of one 2 x H200 NVLink machine (SM stores between the GPUs);
* ``fit:``: solved by ``python -m simulator.calibrate`` on one DeepEP README row or one DeepEP V1 measurement on
  2 x H200 (``simulator.validate``); every other row is a hold-out;
* ``design:``: what the kernels do by construction; ``assumed``: an estimate with no measurement behind it.

Link rates follow the spec sheets times one measured store efficiency; per-SM and per-message costs are SM90 fits
shared by every SM90 part. The named mechanisms: per-peer rings (``ring_row_ns``), the low-latency fixed cost from
its parts (:meth:`GpuProfile.ll_fixed_us`) and the NIC's wire, message-rate and window limits (:meth:`NicProfile.rate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

# NVLink stores reach this fraction of the nominal per-direction rate: 370 GB/s with 16-byte SM stores from 132 SMs
# over NV18 (18 x 26.5625 = 478 GB/s nominal) on 2 x H200 (simulator/data/nvlink_sm_h200x2.json); applied to every
# NVLink generation.
NVLINK_STORE_EFFICIENCY = 370.0 / (18 * 26.5625)


def nvlink_gbps(links: int, link_gbps: float) -> float:
    """Achievable NVLink rate per direction (GB/s): spec-sheet links x per-link rate x the measured store
    efficiency."""
    return links * link_gbps * NVLINK_STORE_EFFICIENCY


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type inside its scale-up (NVLink) domain.

    Attributes:
        name: short lower-case key (``h800``, ``h100``, ``h200``, ``b200``).
        num_device_sms: streaming multiprocessors on the device.
        nvlink_gbps: achievable NVLink bandwidth per direction per GPU with SM stores (GB/s): :func:`nvlink_gbps`
            of the spec-sheet link count and rate.
        nvl_ring_efficiency: fraction of ``nvlink_gbps`` the normal kernels' ring protocol achieves (tail/head
            flag traffic, a few warps per peer, row-sized stores).
        hbm_gbps: HBM bandwidth (GB/s), caps local unpack/reduce copies.
        sm_copy_gbps: byte rate of one SM streaming token rows (push over NVLink or local copy), GB/s per SM.
        ring_row_ns: per-peer rings: latency per row of one ring's warp group (rows of a ring are copied and
            published in order), ns. An SM serving ``R`` rings overlaps them, so a row costs ``ring_row_ns / R`` of
            SM-time and an SM-bound op moves more per SM at a larger EP size.
        combine_tail_us: extra fixed cost of a normal combine kernel (the receiver's last reductions wait for
            every source's final chunk, then the head/tail reset), µs.
        fwd_sm_gbps: byte rate of one forwarder SM in normal internode mode (RDMA buffer -> NVLink ring, or the
            reverse with a reduction), GB/s per SM. Bound by polling memory the NIC writes (latency of the NIC
            path), so it is held equal across GPU generations.
        launch_us: fixed cost of a normal data kernel (launch, cooperative grid start, barrier, tail), µs.
        notify_us: notify kernel (barrier + count exchange) plus the CPU poll of the received count, µs.
        cached_notify_us: cached notify kernel (barrier + metadata reset), µs; part of intranode wall time.
        nvl_latency_us: one-way NVLink store-to-flag latency (credit round trip is twice this), µs.
        ll_launch_us: low-latency fixed cost, launch part: cooperative launch of the whole grid, grid barrier,
            buffer clean-up for the next call, µs.
        ll_nvl_signal_us: low-latency fixed cost, per NVLink peer: the count store and flag wait of each peer
            reached by NVLink stores, µs per peer.
        ll_rdma_signal_us: low-latency fixed cost when some peers are reached over RDMA: completion of the last
            puts and the remote count atomics (one NIC round trip), µs.
        ll_rdma_peer_us: low-latency fixed cost, per RDMA peer (count atomics posted per peer, the receiver's
            wait for the slowest peer), µs per peer.
        ll_pack_ns: low-latency fixed cost, per-expert packing: each expert's warp group scans the top-k table
            (32 entries per pass) to count and place its tokens; ns per pass.
    """

    name: str
    num_device_sms: int
    nvlink_gbps: float
    nvl_ring_efficiency: float
    hbm_gbps: float
    sm_copy_gbps: float
    ring_row_ns: float
    combine_tail_us: float
    fwd_sm_gbps: float
    launch_us: float
    notify_us: float
    cached_notify_us: float
    nvl_latency_us: float
    ll_launch_us: float
    ll_nvl_signal_us: float
    ll_rdma_signal_us: float
    ll_rdma_peer_us: float
    ll_pack_ns: float
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, param: str) -> str:
        return dict(self.sources).get(param, "assumed")

    def ll_fixed_us(self, nvlink_peers: int, rdma_peers: int, tokens: int, topk: int) -> float:
        """Low-latency fixed cost from its parts: launch + per-peer signalling (NVLink peers; one NIC round trip
        plus a cost per RDMA peer) + per-expert packing (``ceil(tokens * topk / 32)`` scan passes)."""
        rdma = self.ll_rdma_signal_us + rdma_peers * self.ll_rdma_peer_us if rdma_peers > 0 else 0.0
        packing = math.ceil(tokens * topk / 32) * self.ll_pack_ns * 1e-3
        return self.ll_launch_us + nvlink_peers * self.ll_nvl_signal_us + rdma + packing


# IB packet overhead per MTU packet (bytes): LRH 8 + BTH 12 + RETH 16 + ICRC 4 + VCRC 2 (InfiniBand spec).
IB_HEADER_BYTES = 42
# RoCEv2 packet overhead: Ethernet 14 + FCS 4 + preamble/IFG 20 + IPv4 20 + UDP 8 + BTH 12 + RETH 16 + ICRC 4.
ROCE_HEADER_BYTES = 98


@dataclass(frozen=True)
class NicProfile:
    """One scale-out NIC per GPU (rail-optimised fabric, non-blocking switch).

    The rate a NIC sustains for messages of ``m`` bytes (:meth:`rate`) is the least of three limits, so it never
    exceeds the line rate: the wire (``line x m / (m + packets(m) x header)``), the message rate (``msg_rate x m``)
    and the outstanding-request window (``qps x window_msgs x m / round trip``, each QP capped at ``qp_gbps``);
    times an efficiency <= 1 (``normal_efficiency`` for the chunked normal-mode puts).

    Attributes:
        name: short key (``cx7``, ``cx6``, ``cx8``, ``eth200``).
        line_gbps: line rate per direction (GB/s).
        mtu_bytes / header_bytes: payload per packet and headers per packet (bytes).
        msg_rate_mpps: messages per second the NIC processes (millions).
        window_msgs: outstanding requests per QP (send-queue credits) before the requester waits for
            completions.
        qp_gbps: most one QP moves per direction (one NIC processing engine), GB/s.
        normal_efficiency: fraction of the wire rate the chunked normal-mode puts achieve (chunk staging,
            tail atomics between chunks).
        latency_us: one-way RDMA put latency including the GPU-side work-request post (µs).
        shares_nvlink: the "network" is NVLink P2P between GPUs of one host (virtual nodes): scale-out traffic
            uses the GPUs' NVLink ports, so it shares them with the scale-up traffic; the rates above are unused.
    """

    name: str
    line_gbps: float
    mtu_bytes: int
    header_bytes: int
    msg_rate_mpps: float
    window_msgs: int
    qp_gbps: float
    normal_efficiency: float
    latency_us: float
    shares_nvlink: bool = False
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, param: str) -> str:
        return dict(self.sources).get(param, "assumed")

    def wire_gbps(self, msg_bytes: float) -> float:
        """Line rate less the per-packet headers of ``msg_bytes`` messages (GB/s)."""
        packets = max(math.ceil(msg_bytes / self.mtu_bytes), 1)
        return self.line_gbps * msg_bytes / (msg_bytes + packets * self.header_bytes)

    def window_gbps(self, msg_bytes: float, num_qps: int) -> float:
        """What ``num_qps`` queue pairs move with ``window_msgs`` requests in flight each over one round trip."""
        per_qp = min(self.window_msgs * msg_bytes / (2 * self.latency_us) * 1e-3, self.qp_gbps)
        return max(num_qps, 1) * per_qp

    def rate(self, msg_bytes: float, num_qps: int, efficiency: float = 1.0) -> float:
        """Sustained GB/s per direction for ``msg_bytes`` messages over ``num_qps`` active QPs (<= line rate)."""
        if msg_bytes <= 0:
            raise ValueError(f"msg_bytes must be > 0, got {msg_bytes}")
        limits = (self.wire_gbps(msg_bytes), self.msg_rate_mpps * 1e6 * msg_bytes * 1e-9,
                  self.window_gbps(msg_bytes, num_qps))
        return min(limits) * min(efficiency, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# GPU profiles. Link rates from spec sheets x the measured store efficiency; per-SM and per-message costs are SM90
# fits (DeepEP V1 on 2 x H200 and the DeepEP README tables; see simulator.calibrate) shared by every SM90 part.
# ---------------------------------------------------------------------------------------------------------------

_FIT_H200 = "fit: DeepEP V1 on 2 x H200 (DeepEP's own test scripts; simulator.validate h200 / h200-sweep rows)"
_FIT_README = "fit: DeepEP README (H800, CX7) row "
_SM90_SOURCES = (
    ("num_device_sms", "spec sheet"),
    ("hbm_gbps", "spec sheet"),
    ("sm_copy_gbps", _FIT_H200 + ", EP2 intranode SM sweep at 8 SMs, FP8 vs BF16 dispatch"),
    ("ring_row_ns", _FIT_H200 + ", EP2 intranode SM sweep at 8 SMs, FP8 vs BF16 dispatch"),
    ("combine_tail_us", _FIT_H200 + ", EP2 intranode BF16 combine at 24 SMs"),
    ("fwd_sm_gbps", _FIT_README + "normal EP16 dispatch"),
    ("launch_us", "assumed: kernel launch + cooperative grid barrier"),
    ("notify_us", "assumed: notify kernel + CPU poll (reported separately, not in kernel time)"),
    ("cached_notify_us", "assumed"),
    ("nvl_latency_us", "assumed: NVLink store + flag"),
    ("ll_launch_us", _FIT_H200 + ", EP2 LL dispatch (its only peer is an NVLink peer)"),
    ("ll_nvl_signal_us", _FIT_README + "LL EP8 dispatch (7 NVLink peers)"),
    ("ll_rdma_signal_us", _FIT_README + "LL EP16 dispatch"),
    ("ll_rdma_peer_us", _FIT_README + "pure-RDMA LL EP256 dispatch"),
    ("ll_pack_ns", "assumed: one dependent L2 load per pass over 32 top-k entries"),
)

H200 = GpuProfile(
    name="h200", num_device_sms=132,
    nvlink_gbps=nvlink_gbps(18, 26.5625),
    nvl_ring_efficiency=0.8186,
    hbm_gbps=4800.0,
    sm_copy_gbps=45.04, ring_row_ns=239.4, combine_tail_us=47.41,
    fwd_sm_gbps=12.569,
    launch_us=8.0, notify_us=45.0, cached_notify_us=8.0, nvl_latency_us=1.5,
    ll_launch_us=13.97, ll_nvl_signal_us=2.516, ll_rdma_signal_us=5.538, ll_rdma_peer_us=0.0775, ll_pack_ns=50.0,
    sources=_SM90_SOURCES + (
        ("nvlink_gbps", "spec sheet: NVLink4 x18, 26.56 GB/s per link per direction, x the measured store "
                        "efficiency (NVLINK_STORE_EFFICIENCY, simulator/data/nvlink_sm_h200x2.json)"),
        ("nvl_ring_efficiency", _FIT_H200 + ", EP2 intranode BF16 dispatch at 48 SMs"),
    ))

H800 = replace(
    H200, name="h800", nvlink_gbps=nvlink_gbps(8, 25.0), nvl_ring_efficiency=0.9128, hbm_gbps=3350.0,
    sources=_SM90_SOURCES + (
        ("nvlink_gbps", "spec sheet: NVLink4 x8 (200 GB/s per direction), x the measured store efficiency"),
        ("nvl_ring_efficiency", _FIT_README + "normal EP8 dispatch"),
    ))

H100 = replace(H200, name="h100", hbm_gbps=3350.0,
               sources=_SM90_SOURCES + (
                   ("nvlink_gbps", "spec sheet: NVLink4 x18, as H200"),
                   ("nvl_ring_efficiency", "assumed equal to H200 (same NVLink4 x18 and ring protocol)")))

B200 = replace(H200, name="b200", num_device_sms=148, nvlink_gbps=nvlink_gbps(18, 50.0), hbm_gbps=8000.0,
               sources=_SM90_SOURCES + (
                   ("num_device_sms", "spec sheet"),
                   ("nvlink_gbps", "spec sheet: NVLink5 x18, 50 GB/s per link per direction, x the measured store "
                                   "efficiency"),
                   ("nvl_ring_efficiency", "assumed equal to H200"),
                   ("sm_copy_gbps", "assumed equal to SM90: no per-SM copy measurement on SM100"),
                   ("fwd_sm_gbps", "assumed equal to SM90: the forwarders wait on NIC-written memory"),
                   ("ll_launch_us", "assumed equal to SM90"),
               ))

GPUS: dict[str, GpuProfile] = {g.name: g for g in (H800, H100, H200, B200)}

# ---------------------------------------------------------------------------------------------------------------
# NIC profiles. Line rate, MTU, headers and message rate from spec sheets; the efficiencies are CX7 fits on the
# DeepEP README rows, shared by every NIC of the same protocol.
# ---------------------------------------------------------------------------------------------------------------

_IB_SOURCES = (
    ("mtu_bytes", "spec: InfiniBand 4096-byte MTU"),
    ("header_bytes", "spec: InfiniBand packet headers (IB_HEADER_BYTES)"),
    ("window_msgs", "assumed: 128 outstanding work requests per QP (GPU-initiated send queue)"),
    ("qp_gbps", "assumed: one QP reaches half the line rate"),
    ("normal_efficiency", _FIT_README + "normal EP32 dispatch"),
    ("latency_us", "assumed: GPU work-request post + 1-3 switch hops"),
)

CX7 = NicProfile(
    name="cx7", line_gbps=50.0, mtu_bytes=4096, header_bytes=IB_HEADER_BYTES, msg_rate_mpps=330.0,
    window_msgs=128, qp_gbps=25.0, normal_efficiency=0.9125, latency_us=3.0,
    sources=_IB_SOURCES + (("line_gbps", "spec sheet: ConnectX-7 400 Gb/s"),
                           ("msg_rate_mpps", "spec sheet: ConnectX-7, 330 M messages/s")))

CX6 = replace(CX7, name="cx6", line_gbps=25.0, msg_rate_mpps=215.0, qp_gbps=12.5,
              sources=_IB_SOURCES + (("line_gbps", "spec sheet: ConnectX-6 200 Gb/s"),
                                     ("msg_rate_mpps", "spec sheet: ConnectX-6, 215 M messages/s"),
                                     ("qp_gbps", "assumed: half the line rate")))
CX8 = replace(CX7, name="cx8", line_gbps=100.0, qp_gbps=50.0,
              sources=_IB_SOURCES + (("line_gbps", "spec sheet: ConnectX-8 800 Gb/s"),
                                     ("msg_rate_mpps", "assumed: as ConnectX-7"),
                                     ("qp_gbps", "assumed: half the line rate")))
ETH200 = replace(CX7, name="eth200", line_gbps=25.0, header_bytes=ROCE_HEADER_BYTES, msg_rate_mpps=215.0,
                 qp_gbps=12.5, latency_us=5.0,
                 sources=_IB_SOURCES + (("line_gbps", "spec sheet: 200 GbE RoCEv2"),
                                        ("header_bytes", "spec: RoCEv2 over Ethernet (ROCE_HEADER_BYTES)"),
                                        ("msg_rate_mpps", "assumed: a ConnectX-6-class NIC"),
                                        ("qp_gbps", "assumed: half the line rate"),
                                        ("latency_us", "assumed: RoCE switch hops")))

# The virtual-node test setup: "2 nodes x G GPUs" on one NVLink host, NVSHMEM puts over P2P. Not a NIC:
# the scale-out traffic rides the same NVLink ports as the scale-up traffic (modelled as one port per direction).
NVLINK_P2P = NicProfile(
    name="nvlink-p2p", line_gbps=H200.nvlink_gbps, mtu_bytes=1 << 30, header_bytes=0, msg_rate_mpps=1e6,
    window_msgs=1 << 20, qp_gbps=H200.nvlink_gbps, normal_efficiency=1.0,
    latency_us=H200.nvl_latency_us, shares_nvlink=True,
    sources=(("line_gbps", "measured: H200 SM-store NVLink peak; virtual-node test setup, "
                           "shares the GPU's NVLink ports"),
             ("mtu_bytes", "design: P2P stores, no packets"), ("header_bytes", "design: P2P stores, no packets"),
             ("msg_rate_mpps", "design: no NIC message processing"), ("window_msgs", "design: no queue pairs"),
             ("qp_gbps", "design: no queue pairs"),
             ("normal_efficiency", "assumed: P2P puts are SM stores, no NIC protocol overhead"),
             ("latency_us", "assumed: NVLink store + flag, as H200.nvl_latency_us")))

NICS: dict[str, NicProfile] = {n.name: n for n in (CX7, CX6, CX8, ETH200, NVLINK_P2P)}


def get_gpu(name: str) -> GpuProfile:
    key = name.lower() if isinstance(name, str) else name
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {name!r}")
    return GPUS[key]


def get_nic(name: str) -> NicProfile:
    key = name.lower() if isinstance(name, str) else name
    if key not in NICS:
        raise ValueError(f"nic must be one of {sorted(NICS)}, got {name!r}")
    return NICS[key]


def describe_profile(profile: GpuProfile | NicProfile) -> list[tuple[str, object, str]]:
    """``(parameter, value, source)`` rows of a profile."""
    return [(f.name, getattr(profile, f.name), profile.source_of(f.name))
            for f in fields(profile) if f.name not in ("name", "sources")]
