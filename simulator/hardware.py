"""Hardware profiles: GPUs (NVLink domain, SMs, kernel overheads) and NICs (scale-out ports).

Every parameter carries its unit in its name (``_gbps`` = GB/s = 1e9 bytes/s, ``_us`` = microseconds,
``_ns`` = nanoseconds) and a source string. Sources are one of:

* ``datasheet``: vendor numbers (link counts, line rates);
* ``measured``: a probe of one 2 x H200 NVLink machine (SM stores and copy-engine copies between the GPUs);
* ``fit``: calibrated by ``python -m simulator.calibrate`` on the calibration subset of the rows of
  ``simulator.validate``; the hold-out rows are never used for fitting;
* ``assumed``: an engineering estimate with no direct measurement, used only for what-if profiles (H100, B200, non-CX7
  NICs) that have no published DeepEP numbers to check against.

The parameters are *effective* rates, i.e. what DeepEP-style kernels achieve, not datasheet peaks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type inside its scale-up (NVLink) domain.

    Attributes:
        name: short lower-case key (``h800``, ``h100``, ``h200``, ``b200``).
        num_device_sms: streaming multiprocessors on the device.
        nvlink_gbps: achievable NVLink bandwidth per direction per GPU with SM stores (GB/s); the low-latency
            kernels' direct warp copies reach it.
        nvl_ring_efficiency: fraction of ``nvlink_gbps`` the normal kernels' ring protocol achieves (tail/head
            flag traffic, a few warps per peer, row-sized stores).
        hbm_gbps: HBM bandwidth (GB/s), caps local unpack/reduce copies.
        sm_copy_gbps: byte rate of one SM streaming token rows (push over NVLink or local copy), GB/s per SM.
        sm_token_ns: fixed SM cost per token row handled by a copy role (index math, flags, metadata), ns.
        combine_tail_us: extra fixed cost of a normal combine kernel (the receiver's last reductions wait for
            every source's final chunk, then the head/tail reset), µs.
        fwd_sm_gbps: byte rate of one forwarder SM in normal internode mode (RDMA buffer -> NVLink ring, or the
            reverse with a reduction), GB/s per SM.
        launch_us: fixed cost of a normal data kernel (launch, cooperative grid start, barrier, tail), µs.
        notify_us: notify kernel (barrier + count exchange) plus the CPU poll of the received count, µs.
        cached_notify_us: cached notify kernel (barrier + metadata reset), µs; part of intranode wall time.
        nvl_latency_us: one-way NVLink store-to-flag latency (credit round trip is twice this), µs.
        ll_fixed_us: fixed part of a low-latency kernel when all peers are NVLink peers (launch, grid sync,
            count signals, receive unpack start), µs.
        ll_rdma_extra_us: added to ``ll_fixed_us`` when some peers are reached over RDMA (IBGDA put completion,
            remote atomics for counts/flags), µs.
    """

    name: str
    num_device_sms: int
    nvlink_gbps: float
    nvl_ring_efficiency: float
    hbm_gbps: float
    sm_copy_gbps: float
    sm_token_ns: float
    combine_tail_us: float
    fwd_sm_gbps: float
    launch_us: float
    notify_us: float
    cached_notify_us: float
    nvl_latency_us: float
    ll_fixed_us: float
    ll_rdma_extra_us: float
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, param: str) -> str:
        return dict(self.sources).get(param, "assumed")


@dataclass(frozen=True)
class NicProfile:
    """One scale-out NIC per GPU (rail-optimised fabric, non-blocking switch).

    Attributes:
        name: short key (``cx7``, ``cx6``, ``cx8``, ``eth200``).
        line_gbps: line rate per direction (GB/s).
        normal_efficiency: fraction of line rate the chunked normal-mode puts achieve (payload + metadata).
        ll_dispatch_efficiency / ll_combine_efficiency: fraction of line rate achieved by low-latency
            one-message-per-selection puts (7.4 KB FP8 / 14 KB BF16 messages).
        qp_derate_per_doubling: relative slowdown per doubling of active remote peers beyond 8 (QP-context cache
            pressure): effective rate = rate / (1 + k * log2(peers / 8)).
        latency_us: one-way RDMA put latency including the GPU-side work-request post (µs).
        shares_nvlink: the "network" is NVLink P2P between GPUs of one host (virtual nodes): scale-out traffic
            uses the GPUs' NVLink ports, so it shares them with the scale-up traffic; the rates above are unused.
    """

    name: str
    line_gbps: float
    normal_efficiency: float
    ll_dispatch_efficiency: float
    ll_combine_efficiency: float
    qp_derate_per_doubling: float
    latency_us: float
    shares_nvlink: bool = False
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, param: str) -> str:
        return dict(self.sources).get(param, "assumed")


# ---------------------------------------------------------------------------------------------------------------
# GPU profiles. H800 and H200 are calibrated (see docs/simulator.md); H100 and B200 are derived what-ifs.
# ---------------------------------------------------------------------------------------------------------------

_SM90_SOURCES = (
    ("sm_copy_gbps", "fit: DeepEP V1 on 2 x H200, EP2 intranode SM sweep, FP8 vs BF16"),
    ("sm_token_ns", "fit: DeepEP V1 on 2 x H200, EP2 intranode SM sweep, FP8 vs BF16"),
    ("combine_tail_us", "fit: DeepEP V1 on 2 x H200, EP2 intranode BF16 combine at 24 SMs"),
    ("num_device_sms", "datasheet"),
)

H800 = GpuProfile(
    name="h800", num_device_sms=132,
    nvlink_gbps=160.0,          # 8 links x 25 GB/s = 200 nominal; ~160 achievable (DeepEP's maintainers)
    nvl_ring_efficiency=0.8845, # fit: normal EP8 intranode dispatch (153 GB/s logical)
    hbm_gbps=3350.0,
    sm_copy_gbps=45.0, sm_token_ns=118.5, combine_tail_us=46.9,
    fwd_sm_gbps=12.57,          # fit: normal EP16 dispatch (43 GB/s logical RDMA)
    launch_us=8.0, notify_us=45.0, cached_notify_us=8.0, nvl_latency_us=1.5,
    ll_fixed_us=34.6,           # fit: LL EP8 dispatch (NVLink only)
    ll_rdma_extra_us=11.24,     # fit: LL EP16/EP32 dispatch
    sources=_SM90_SOURCES + (
        ("nvlink_gbps", "DeepEP's maintainers: ~160 GB/s achievable of 200 nominal (8 NVLink4 links)"),
        ("nvl_ring_efficiency", "fit: DeepEP README normal EP8 dispatch row"),
        ("hbm_gbps", "datasheet"),
        ("fwd_sm_gbps", "fit: DeepEP README normal EP16 dispatch row"),
        ("launch_us", "assumed: kernel launch + cooperative grid barrier"),
        ("notify_us", "assumed: notify kernel + CPU poll (reported separately, not in kernel time)"),
        ("cached_notify_us", "assumed"),
        ("nvl_latency_us", "assumed: NVLink store + flag"),
        ("ll_fixed_us", "fit: DeepEP README LL EP8 dispatch row"),
        ("ll_rdma_extra_us", "fit: DeepEP README LL EP16 and EP32 dispatch rows"),
    ))

H200 = GpuProfile(
    name="h200", num_device_sms=132,
    nvlink_gbps=370.0,          # measured: SM-store peak over NV18 at 132 SMs; copy engine 394
    nvl_ring_efficiency=0.824,  # fit: H200 EP2 BF16 dispatch at 48 SMs
    hbm_gbps=4800.0,
    sm_copy_gbps=45.0, sm_token_ns=118.5, combine_tail_us=46.9,
    fwd_sm_gbps=12.57,
    launch_us=8.0,
    notify_us=45.0, cached_notify_us=8.0, nvl_latency_us=1.5,
    ll_fixed_us=18.1,           # fit: H200 EP2 LL dispatch kernel time
    ll_rdma_extra_us=11.24,
    sources=_SM90_SOURCES + (
        ("nvlink_gbps", "measured: 16-byte SM stores, 132 blocks, GPU0->GPU1"),
        ("nvl_ring_efficiency", "fit: DeepEP V1 on 2 x H200, EP2 intranode BF16 dispatch at 48 SMs"),
        ("hbm_gbps", "datasheet"),
        ("fwd_sm_gbps", "assumed equal to H800 (same SM90 core)"),
        ("launch_us", "assumed equal to H800"),
        ("ll_fixed_us", "fit: DeepEP V1 on 2 x H200, EP2 LL dispatch"),
        ("ll_rdma_extra_us", "assumed equal to H800"),
    ))

H100 = replace(H200, name="h100", hbm_gbps=3350.0, ll_fixed_us=H800.ll_fixed_us,
               sources=_SM90_SOURCES + (("nvlink_gbps", "assumed: same NVLink4 x18 as H200"),
                                        ("ll_fixed_us", "assumed equal to H800"),
                                        ("hbm_gbps", "datasheet")))

B200 = replace(H200, name="b200", num_device_sms=148, nvlink_gbps=740.0, hbm_gbps=8000.0, sm_copy_gbps=60.0,
               fwd_sm_gbps=17.0, ll_fixed_us=H800.ll_fixed_us,
               sources=(("nvlink_gbps", "assumed: NVLink5 900 GB/s nominal x 370/478 (the H200 SM-store ratio)"),
                        ("sm_copy_gbps", "assumed: SM100 ~1.33x SM90 per-SM copy rate"),
                        ("fwd_sm_gbps", "assumed: scaled like sm_copy_gbps"),
                        ("num_device_sms", "datasheet"), ("hbm_gbps", "datasheet")))

GPUS: dict[str, GpuProfile] = {g.name: g for g in (H800, H100, H200, B200)}

# ---------------------------------------------------------------------------------------------------------------
# NIC profiles. CX7 is calibrated on published H800 rows; the others scale its efficiencies.
# ---------------------------------------------------------------------------------------------------------------

CX7 = NicProfile(
    name="cx7", line_gbps=50.0,
    normal_efficiency=0.905,       # fit: normal EP32 dispatch row
    ll_dispatch_efficiency=1.078,   # fit: LL EP16/EP32 dispatch rows
    ll_combine_efficiency=1.0715,   # fit: LL EP16/EP32 combine rows
    qp_derate_per_doubling=0.011,  # fit: drift of the pure-RDMA LL table (EP8 -> EP256)
    latency_us=3.0,
    sources=(("line_gbps", "datasheet: ConnectX-7 400 Gb/s"),
             ("normal_efficiency", "fit: DeepEP README normal EP32 dispatch row"),
             ("ll_dispatch_efficiency", "fit: DeepEP README LL EP16/EP32 dispatch rows"),
             ("ll_combine_efficiency", "fit: DeepEP README LL EP16/EP32 combine rows"),
             ("qp_derate_per_doubling", "fit: DeepEP pure-RDMA LL table, EP8..EP256"),
             ("latency_us", "assumed: IBGDA post + 1-3 switch hops")))

CX6 = replace(CX7, name="cx6", line_gbps=25.0, sources=(("line_gbps", "datasheet: ConnectX-6 200 Gb/s"),))
CX8 = replace(CX7, name="cx8", line_gbps=100.0, sources=(("line_gbps", "datasheet: ConnectX-8 800 Gb/s"),))
ETH200 = replace(CX7, name="eth200", line_gbps=25.0, normal_efficiency=0.8, latency_us=5.0,
                 sources=(("line_gbps", "datasheet: 200 GbE RoCE"),
                          ("normal_efficiency", "assumed: RoCE with congestion control")))

# The virtual-node test setup: "2 nodes x G GPUs" on one NVLink host, NVSHMEM puts over P2P. Not a NIC:
# the scale-out traffic rides the same NVLink ports as the scale-up traffic (modelled as one port per direction).
NVLINK_P2P = NicProfile(
    name="nvlink-p2p", line_gbps=H200.nvlink_gbps, normal_efficiency=1.0, ll_dispatch_efficiency=1.0,
    ll_combine_efficiency=1.0, qp_derate_per_doubling=0.0, latency_us=H200.nvl_latency_us, shares_nvlink=True,
    sources=(("line_gbps", "measured: H200 SM-store NVLink peak; virtual-node test setup, "
                           "shares the GPU's NVLink ports"),
             ("normal_efficiency", "assumed: P2P puts are SM stores, no NIC protocol overhead"),
             ("ll_dispatch_efficiency", "assumed: as normal_efficiency"),
             ("ll_combine_efficiency", "assumed: as normal_efficiency"),
             ("qp_derate_per_doubling", "assumed: no queue pairs over P2P"),
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
