"""Scenario (what to simulate) and :func:`run` (simulate it and return a :class:`~simulator.report.Report`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from deep_ep import layout
from deep_ep.config import (
    NUM_MAX_FUSED_RANKS,
    NUM_MAX_LL_TOPK,
    NUM_MAX_RING_RANKS,
    NUM_MAX_SCALEUP_RANKS,
    NUM_MAX_TOPK,
    SUPPORTED_NORMAL_RANKS,
    Config,
    deepep_rdma_buffer_size_hint,
    get_combine_config,
    get_dispatch_config,
    nvl_buffer_size_hint,
    rdma_buffer_size_hint,
)
from simulator import deep_ep_fused, deep_ep_kernels, hardware, rank, workload
from simulator.report import OpRow, Report, ScaleRow

MODES = ("normal", "low-latency", "both")
# Kernel families: DeepEP V1's kernels (simulator.rank, validated on published rows) or deep_ep's own
# (simulator.deep_ep_kernels, calibrated on our bench JSON).
KERNELS = ("deepep", "deep_ep")
DTYPES = ("fp8", "bf16")
# Default token counts: DeepEP's normal-mode benchmark (prefill/training) and low-latency benchmark (decode).
DEFAULT_NORMAL_TOKENS = 4096
DEFAULT_LL_TOKENS = 128
# Limits of the low-latency kernels, as deep_ep.validate states them (that module imports torch): tokens per rank
# (num_max_dispatch_tokens_per_rank; a per-peer token count must stay below the finish tag 1024) and hidden sizes.
LL_MAX_TOKENS = 1024
LL_MIN_HIDDEN = 1024
LL_MAX_HIDDEN = 16384
# Candidate chunk sizes, as DeepEP's tuning sweeps them (dispatch Sn 4..32, combine Sn 1..16; Sr 4..32).
DISPATCH_NVL_CHUNKS = (4, 6, 8, 12, 16, 20, 24, 28, 32)
COMBINE_NVL_CHUNKS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
RDMA_CHUNKS = (4, 6, 8, 12, 16, 20, 24, 28, 32)
# A recommended SM count is the smallest even count within this factor of the best time.
SM_RECOMMEND_SLACK = 1.05


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass(frozen=True)
class Scenario:
    """One deployment to plan; defaults describe DeepSeek-V3 on H800 + CX7 (DeepEP's benchmark settings).

    Attributes:
        nodes: scale-out domains; ``gpus_per_node`` GPUs each (EP size = nodes * gpus_per_node).
        mode: ``normal``, ``low-latency`` or ``both``.
        tokens: tokens per rank for normal mode (default 4096) and, unless ``ll_tokens`` is set, for LL, capped
            at ``LL_MAX_TOKENS`` there in mode ``both`` (mode ``low-latency`` rejects more).
        ll_tokens: tokens per rank for low-latency mode (default 128, DeepEP's LL benchmark; at most
            ``LL_MAX_TOKENS``).
        hidden, topk, experts: model shape (DeepSeek-V3: 7168, 8, 256 routed experts).
        dispatch_dtype: ``fp8`` (e4m3 + per-128 float32 scales) or ``bf16``; combine is always BF16.
        gpu, nic: hardware profile keys (``simulator.hardware``).
        num_sms: SMs of the normal kernels (even).
        routing: ``uniform``, ``group-limited``, ``zipf:A`` or ``trace:FILE``.
        seed: seed of every random draw.
        redundant_experts: EPLB replicas of the hottest experts (experts + redundant must divide by EP size);
            ``None`` picks the fewest that make ``experts + redundant`` divisible by the EP size.
        ll_mask: mask 10 random top-k entries to -1 in LL mode, as DeepEP's LL test does.
        ll_allow_nvlink: LL mode uses NVLink for same-node peers (DeepEP's default).
        kernels: ``deepep`` (DeepEP V1's kernels) or ``deep_ep`` (ours: ``simulator.deep_ep_kernels``).
    """

    nodes: int = 1
    gpus_per_node: int = 8
    mode: str = "both"
    tokens: int | None = None
    ll_tokens: int | None = None
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    dispatch_dtype: str = "fp8"
    gpu: str = "h800"
    nic: str = "cx7"
    num_sms: int = 24
    routing: str = "group-limited"
    seed: int = 0
    redundant_experts: int | None = None
    ll_mask: bool = False
    ll_allow_nvlink: bool = True
    kernels: str = "deepep"

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        _check_int("nodes", self.nodes, 1, 1024)
        _check_int("gpus_per_node", self.gpus_per_node, 1, NUM_MAX_SCALEUP_RANKS)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.tokens is not None:
            _check_int("tokens", self.tokens, 1, 65536)
        if self.ll_tokens is not None:
            _check_int("ll_tokens", self.ll_tokens, 1, LL_MAX_TOKENS)
        elif self.mode == "low-latency" and self.tokens is not None and self.tokens > LL_MAX_TOKENS:
            raise ValueError(f"tokens must be <= {LL_MAX_TOKENS} in low-latency mode (the kernels' "
                             f"num_max_dispatch_tokens_per_rank limit), got {self.tokens}")
        _check_int("hidden", self.hidden, 128)
        if self.hidden % 128 != 0:
            raise ValueError(f"hidden must be a multiple of 128 (one FP8 scale per 128 channels), got {self.hidden}")
        _check_int("topk", self.topk, 1, NUM_MAX_TOPK)
        if self.mode != "normal" and self.topk > NUM_MAX_LL_TOPK:
            raise ValueError(f"topk must be <= {NUM_MAX_LL_TOPK} in low-latency mode, got {self.topk}")
        if self.mode != "normal" and not LL_MIN_HIDDEN <= self.hidden <= LL_MAX_HIDDEN:
            raise ValueError(f"hidden must be in [{LL_MIN_HIDDEN}, {LL_MAX_HIDDEN}] in low-latency mode, "
                             f"got {self.hidden}")
        _check_int("experts", self.experts, 1)
        if self.topk > self.experts:
            raise ValueError(f"topk must be <= experts ({self.experts}), got {self.topk}")
        if self.dispatch_dtype not in DTYPES:
            raise ValueError(f"dispatch_dtype must be one of {DTYPES}, got {self.dispatch_dtype!r}")
        gpu = hardware.get_gpu(self.gpu)
        if hardware.get_nic(self.nic).shares_nvlink and self.kernels != "deep_ep":
            raise ValueError(f"nic {self.nic} (virtual nodes on one NVLink host) is modelled only for kernels "
                             f"deep_ep, got kernels {self.kernels!r}")
        _check_int("num_sms", self.num_sms, 2, gpu.num_device_sms)
        if self.num_sms % 2 != 0:
            raise ValueError(f"num_sms must be even (a channel is a pair of SMs), got {self.num_sms}")
        _check_int("seed", self.seed, 0)
        if self.redundant_experts is not None:
            _check_int("redundant_experts", self.redundant_experts, 0)
        physical = self.experts + self.num_redundant_experts
        if physical % self.num_ranks != 0:
            raise ValueError(f"experts + redundant_experts ({physical}) must be divisible by the EP size "
                             f"nodes * gpus_per_node ({self.num_ranks})")
        kind, _ = workload.parse_routing(self.routing)
        if kind == "group-limited" and self.nodes > 1:
            smallest_group = self.experts // self.nodes
            if min(self.nodes, workload.MAX_ROUTED_NODES) * smallest_group < self.topk:
                raise ValueError(f"routing group-limited needs at least topk ({self.topk}) experts on "
                                 f"{workload.MAX_ROUTED_NODES} nodes, got {self.experts} experts on {self.nodes} nodes")

    @property
    def num_ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def num_redundant_experts(self) -> int:
        if self.redundant_experts is None:
            return (-self.experts) % self.num_ranks
        return self.redundant_experts

    @property
    def normal_tokens(self) -> int:
        return self.tokens if self.tokens is not None else DEFAULT_NORMAL_TOKENS

    @property
    def low_latency_tokens(self) -> int:
        if self.ll_tokens is not None:
            return self.ll_tokens
        return min(self.tokens, LL_MAX_TOKENS) if self.tokens is not None else DEFAULT_LL_TOKENS

    def describe(self) -> str:
        return "Scenario(" + ", ".join(f"{k}={v!r}" for k, v in asdict(self).items()) + ")"


# Named scenarios (``python -m simulator --preset NAME``); explicit flags override their fields.
PRESETS: dict[str, Scenario] = {
    # DeepSeek-V3 training/prefill-style EP64 on H800 + CX7 (DeepEP's published configuration).
    "v3-ep64": Scenario(nodes=8),
    # One 2 x H200 machine: EP2 over NV18, DeepEP's test routing.
    "h200-ep2": Scenario(nodes=1, gpus_per_node=2, gpu="h200", routing="uniform"),
    # Decode on 4 nodes: low-latency only, 128 tokens per rank.
    "decode-ep32": Scenario(nodes=4, mode="low-latency"),
}


def _table_ranks(num_ranks: int) -> int:
    """Rank count whose default chunk table row applies (the nearest supported one for what-if sizes)."""
    if num_ranks in SUPPORTED_NORMAL_RANKS:
        return num_ranks
    larger = [r for r in SUPPORTED_NORMAL_RANKS if r >= num_ranks]
    return min(larger) if larger else max(SUPPORTED_NORMAL_RANKS)


def _with_chunks(cfg: Config, nvl_send: int | None = None, rdma_send: int | None = None) -> Config | None:
    try:
        return Config(cfg.num_sms,
                      nvl_send if nvl_send is not None else cfg.num_max_nvl_chunked_send_tokens,
                      cfg.num_max_nvl_chunked_recv_tokens,
                      rdma_send if rdma_send is not None else cfg.num_max_rdma_chunked_send_tokens,
                      cfg.num_max_rdma_chunked_recv_tokens)
    except ValueError:
        return None


def _router(sc: Scenario, num_experts: int) -> workload.Router:
    kind, arg = workload.parse_routing(sc.routing)
    trace = None
    if kind == "trace":
        trace_experts, trace = workload.load_trace(str(arg))
        if trace_experts is not None and trace_experts != num_experts:
            raise ValueError(f"routing trace:{arg}: num_experts {trace_experts} != experts {num_experts}")
        top = workload.trace_max_expert(trace)
        if top >= num_experts:
            raise ValueError(f"routing trace:{arg}: expert index {top} >= experts ({num_experts})")
        width = len(trace[0][0]) if trace[0] else sc.topk
        if width != sc.topk:
            raise ValueError(f"routing trace:{arg}: top-k of the trace ({width}) != topk ({sc.topk})")
    return workload.Router(kind, arg, num_experts, sc.topk, sc.nodes, sc.seed, trace)


def _best_normal(spec: rank.OpSpec, traffic: list[workload.SourceTraffic], gpu: hardware.GpuProfile,
                 nic: hardware.NicProfile) -> tuple[rank.OpSpec, int, list[rank.FlowSpec]]:
    """Pick chunk sizes by the closed-form model (DeepEP reports the best over a chunk sweep) and the
    recommended SM count.

    Returns:
        ``(spec with the tuned config, recommended num_sms, the op's flows)``; the flows do not depend on the
        config, so the DES reuses them.
    """
    assert spec.config is not None
    base = rank.normal_model(spec, traffic, gpu, nic)
    loads = rank.max_load_per_kind(base, spec.num_ranks)

    def time_of(cfg: Config) -> float:
        return rank.roofline_us(rank.normal_model(replace(spec, config=cfg), traffic, gpu, nic, base.flows), loads)

    def tune(cfg: Config) -> Config:
        nvl_choices = DISPATCH_NVL_CHUNKS if spec.op == "dispatch" else COMBINE_NVL_CHUNKS
        rdma_choices = RDMA_CHUNKS if spec.num_nodes > 1 else (cfg.num_max_rdma_chunked_send_tokens,)
        best, best_t = cfg, time_of(cfg)
        for sn in nvl_choices:
            for sr in rdma_choices:
                cand = _with_chunks(cfg, sn, sr)
                if cand is not None and (t := time_of(cand)) < best_t - 1e-9:
                    best, best_t = cand, t
        return best

    tuned = tune(spec.config)
    max_sms = min(gpu.num_device_sms, 64) // 2 * 2
    times = {}
    for sms in range(4, max_sms + 1, 2):
        cfg = _with_chunks(replace(tuned, num_sms=sms))
        if cfg is not None:
            times[sms] = time_of(cfg)
    best_t = min(times.values())
    recommended = min(s for s, t in times.items() if t <= best_t * SM_RECOMMEND_SLACK)
    return replace(spec, config=tuned), recommended, base.flows


# Traffic depends only on the workload fields, not on hardware or SMs: keep the last few (validation and
# calibration re-run the same workloads with different profiles). Traces are never cached.
_TRAFFIC_CACHE: dict[tuple, list[workload.SourceTraffic]] = {}
_TRAFFIC_CACHE_SIZE = 32


def _traffic(sc: Scenario, router: workload.Router, tokens: int, mask_ll: bool) -> list[workload.SourceTraffic]:
    key = (sc.routing, sc.experts, sc.num_redundant_experts, sc.topk, sc.nodes, sc.gpus_per_node, tokens, mask_ll,
           sc.seed)
    if sc.routing.startswith("trace:") or key not in _TRAFFIC_CACHE:
        traffic = workload.build_traffic(router, sc.num_ranks, sc.gpus_per_node, tokens, sc.num_redundant_experts,
                                         mask_ll=mask_ll)
        if sc.routing.startswith("trace:"):
            return traffic
        if len(_TRAFFIC_CACHE) >= _TRAFFIC_CACHE_SIZE:
            _TRAFFIC_CACHE.pop(next(iter(_TRAFFIC_CACHE)))
        _TRAFFIC_CACHE[key] = traffic
    return _TRAFFIC_CACHE[key]


def _ll_specs(sc: Scenario) -> tuple[int, list[workload.SourceTraffic], int, list[tuple[rank.OpSpec, str]]]:
    """LL workload of ``sc``: ``(tokens, traffic, physical experts, [(spec, dtype)] for dispatch and combine)``."""
    tokens = sc.low_latency_tokens
    # A fresh router, so that LL draws do not depend on whether normal mode ran first.
    traffic = _traffic(sc, _router(sc, sc.experts), tokens, mask_ll=sc.ll_mask)
    # Message bytes as DeepEP's LL test counts them: 16-byte header + payload (+ FP8 scales); BF16 combine.
    ll_msgs = {"dispatch": 16 + rank.token_bytes(sc.hidden, sc.dispatch_dtype), "combine": 2 * sc.hidden}
    specs = [(rank.OpSpec("low-latency", op, sc.hidden, sc.topk, ll_msgs[op], ll_msgs[op], sc.nodes,
                          sc.gpus_per_node, None, allow_nvlink=sc.ll_allow_nvlink),
              sc.dispatch_dtype if op == "dispatch" else "bf16") for op in ("dispatch", "combine")]
    return tokens, traffic, sc.experts + sc.num_redundant_experts, specs


def _run_deep_ep(sc: Scenario, gpu: hardware.GpuProfile, nic: hardware.NicProfile) -> Report:
    """``run`` for the ``deep_ep`` kernel family (``simulator.deep_ep_kernels``)."""
    prof = deep_ep_kernels.profile()
    num_ranks, per_node = sc.num_ranks, sc.gpus_per_node
    ops: list[OpRow] = []
    timing = ("normal-mode time is the wall time of a cached call (the bench's metric: launch included, no "
              "notify); " if sc.mode != "low-latency" else "")
    notes = [f"deep_ep kernels: {timing}parameters from simulator/data/calibration_deep_ep.json, the rest labelled "
             "assumed (python -m simulator.calibrate --show lists them)"]
    fused = deep_ep_fused.is_fused(rank.OpSpec("internode", "dispatch", sc.hidden, sc.topk, 0, 0, sc.nodes, per_node,
                                               None))
    if sc.mode in ("normal", "both") and sc.nodes > 1 and not fused and (per_node > 1 or sc.nodes > NUM_MAX_RING_RANKS):
        if per_node > 1:
            limit = (f"{sc.nodes} x {per_node} GPUs is beyond deep_ep's fused kernels (at most "
                     f"{NUM_MAX_FUSED_RANKS} ranks): the Buffer runs the composed path with a torch rail (NCCL over "
                     f"the rail subgroup; the node stage stays on the kernels)")
        else:
            limit = (f"deep_ep's one-GPU-per-node kernels serve at most {NUM_MAX_RING_RANKS} nodes: at {sc.nodes} "
                     f"nodes the Buffer runs its torch backend (NCCL point-to-point)")
        notes.append(f"{limit}; the normal rows model that torch part with assumed parameters (torch_call_us, "
                     f"torch_p2p_efficiency: simulator/deep_ep_torch.py)")
    if sc.mode in ("normal", "both") and not nic.shares_nvlink and fused:
        notes.append(f"{sc.nodes} x {per_node} GPUs: behind a NIC deep_ep's fused kernels make their rail hops "
                     f"NVSHMEM puts (staged records put as runs, a signal per published chunk); the normal rows "
                     f"model them with DeepEP's chunked puts over the NIC (--nic nvlink-p2p models the one-host "
                     f"case)")
    if nic.shares_nvlink and sc.nodes > 1:
        notes.append(f"nic {nic.name}: virtual-node test setup, {sc.nodes} nodes x {per_node} GPUs on one NVLink "
                     f"host; the scale-out puts share the GPUs' NVLink ports (counted under NVL_GB/s)")
    chunks: dict[str, int] = {}
    nvl_bytes = rdma_bytes = ll_bytes = 0
    rec_sms = rec_qps = None
    rec_time: dict[str, float] = {}
    if sc.mode in ("normal", "both"):
        traffic = _traffic(sc, _router(sc, sc.experts), sc.normal_tokens, mask_ll=False)
        recommended = []
        max_sms = min(gpu.num_device_sms, 64) // 2 * 2
        normal_ops = []
        for op, chunk in (("dispatch", prof.dispatch_chunk), ("combine", prof.combine_chunk)):
            dtype = sc.dispatch_dtype if op == "dispatch" else "bf16"
            payload = rank.token_bytes(sc.hidden, dtype)
            spec = rank.OpSpec("internode" if sc.nodes > 1 else "intranode", op, sc.hidden, sc.topk, payload,
                               payload, sc.nodes, per_node, None)
            res = deep_ep_kernels.simulate_normal(spec, traffic, gpu, nic, prof, sc.num_sms, chunk, dtype)
            normal_ops.append((spec, chunk, dtype, res.time_us))
            if not deep_ep_kernels.torch_served(spec):  # the torch backend alone takes no SM budget
                recommended.append(deep_ep_kernels.recommended_sms(spec, traffic, gpu, nic, prof, chunk, dtype,
                                                                   max_sms, SM_RECOMMEND_SLACK))
            chunks[f"{op}_chunk"] = chunk
            ops.append(OpRow.from_result(sc.nodes, num_ranks, "normal", op, dtype, sc.normal_tokens, res))
            try:  # our Buffer takes deep_ep.config's size hints, the max over the dispatch and combine configs
                table_config = get_dispatch_config if op == "dispatch" else get_combine_config
                cfg = table_config(_table_ranks(num_ranks), sc.num_sms)
                nvl_bytes = max(nvl_bytes, nvl_buffer_size_hint(cfg, sc.hidden * 2, num_ranks))
                rdma_bytes = max(rdma_bytes, rdma_buffer_size_hint(cfg, sc.hidden * 2, num_ranks))
            except ValueError as exc:
                notes.append(f"no DeepEP buffer size hint for EP{num_ranks}: {exc}")
        rec_sms = max(recommended, default=None)
        if rec_sms is not None:  # the predicted time at the recommended setting (the rows' own when it is num_sms)
            for spec, chunk, dtype, time_us in normal_ops:
                rec_time[spec.op] = time_us if rec_sms == sc.num_sms else deep_ep_kernels.simulate_normal(
                    spec, traffic, gpu, nic, prof, rec_sms, chunk, dtype).time_us
    if sc.mode in ("low-latency", "both"):
        tokens, traffic, num_physical, specs = _ll_specs(sc)
        for spec, dtype in specs:
            res = deep_ep_kernels.simulate_low_latency(spec, traffic, gpu, nic, prof, dtype)
            ops.append(OpRow.from_result(sc.nodes, num_ranks, "low-latency", spec.op, dtype, tokens, res))
        ll_bytes = layout.low_latency_rdma_size_hint(tokens, sc.hidden, num_ranks, num_physical)
        rec_qps = num_physical // num_ranks
    scale = ScaleRow(nodes=sc.nodes, ep_size=num_ranks, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes,
                     num_ll_rdma_bytes=ll_bytes, recommended_num_sms=rec_sms, chunks=chunks,
                     recommended_num_qps_per_rank=rec_qps, notes=tuple(notes), recommended_sms_time_us=rec_time)
    return Report(scenario=sc, ops=ops, scales=[scale])


def run(sc: Scenario) -> Report:
    """Simulate ``sc`` (each requested mode, dispatch then combine) and return the report."""
    gpu, nic = hardware.get_gpu(sc.gpu), hardware.get_nic(sc.nic)
    if sc.kernels == "deep_ep":
        return _run_deep_ep(sc, gpu, nic)
    num_ranks, per_node = sc.num_ranks, sc.gpus_per_node
    ops: list[OpRow] = []
    notes: list[str] = []
    hidden_bytes = sc.hidden * 2
    nvl_bytes = rdma_bytes = ll_bytes = 0
    rec_sms = rec_qps = None
    rec_time: dict[str, float] = {}
    chunks: dict[str, int] = {}
    router = _router(sc, sc.experts)

    if sc.mode in ("normal", "both"):
        if num_ranks > 8 and per_node != NUM_MAX_SCALEUP_RANKS:
            raise ValueError(f"normal internode mode needs gpus_per_node == 8 (DeepEP forwards over 8 NVLink "
                             f"peers), got {per_node}")
        table = _table_ranks(num_ranks)
        if table != num_ranks:
            notes.append(f"normal mode: EP{num_ranks} is outside DeepEP V1's tuned table / kernel limits "
                         f"({'/'.join(map(str, SUPPORTED_NORMAL_RANKS))}); simulated as a what-if with the "
                         f"EP{table} chunk config")
        traffic = _traffic(sc, router, sc.normal_tokens, mask_ll=False)
        recommended = []
        normal_ops = []
        for op, cfg in (("dispatch", get_dispatch_config(table, sc.num_sms)),
                        ("combine", get_combine_config(table, sc.num_sms))):
            dtype = sc.dispatch_dtype if op == "dispatch" else "bf16"
            payload = rank.token_bytes(sc.hidden, dtype)
            spec = rank.OpSpec("internode" if sc.nodes > 1 else "intranode", op, sc.hidden, sc.topk, payload,
                               payload, sc.nodes, per_node, cfg)
            spec, sms, flows = _best_normal(spec, traffic, gpu, nic)
            recommended.append(sms)
            res = rank.simulate_normal(spec, traffic, gpu, nic, flows)
            normal_ops.append((spec, flows, res.time_us))
            assert spec.config is not None
            chunks[f"{op}_nvl_chunk"] = spec.config.num_max_nvl_chunked_send_tokens
            if sc.nodes > 1:
                chunks[f"{op}_rdma_chunk"] = spec.config.num_max_rdma_chunked_send_tokens
            # DeepEP V1's kernels take DeepEP's formulas (deep_ep's scale-out hint also holds its fused kernels).
            nvl_bytes = max(nvl_bytes, nvl_buffer_size_hint(cfg, hidden_bytes, num_ranks))
            rdma_bytes = max(rdma_bytes, deepep_rdma_buffer_size_hint(cfg, hidden_bytes, num_ranks))
            ops.append(OpRow.from_result(sc.nodes, num_ranks, "normal", op, dtype, sc.normal_tokens, res,
                                         notify_us=gpu.notify_us))
        rec_sms = max(recommended)
        rec_qps = max(sc.num_sms // 2, 1) if sc.nodes > 1 else None
        for spec, flows, time_us in normal_ops:  # the tuned chunks at the recommended SM count, as chosen
            assert spec.config is not None
            cfg = _with_chunks(replace(spec.config, num_sms=rec_sms))
            if rec_sms == sc.num_sms:
                rec_time[spec.op] = time_us
            elif cfg is not None:
                rec_time[spec.op] = rank.simulate_normal(replace(spec, config=cfg), traffic, gpu, nic, flows).time_us

    if sc.mode in ("low-latency", "both"):
        tokens, traffic, num_physical, specs = _ll_specs(sc)
        for spec, dtype in specs:
            res = rank.simulate_low_latency(spec, traffic, gpu, nic, num_physical)
            ops.append(OpRow.from_result(sc.nodes, num_ranks, "low-latency", spec.op, dtype, tokens, res))
        ll_bytes = layout.low_latency_rdma_size_hint(tokens, sc.hidden, num_ranks, num_physical)
        rec_qps_ll = num_physical // num_ranks
        rec_qps = max(rec_qps or 0, rec_qps_ll)

    scale = ScaleRow(nodes=sc.nodes, ep_size=num_ranks, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes,
                     num_ll_rdma_bytes=ll_bytes, recommended_num_sms=rec_sms, chunks=chunks,
                     recommended_num_qps_per_rank=rec_qps, notes=tuple(notes), recommended_sms_time_us=rec_time)
    return Report(scenario=sc, ops=ops, scales=[scale])


def run_sweep(sc: Scenario, node_counts: list[int]) -> Report:
    """Run ``sc`` once per node count and merge the reports (rows in node order)."""
    if not node_counts:
        raise ValueError("sweep_nodes must list at least one node count")
    merged = Report(scenario=sc, ops=[], scales=[])
    for nodes in node_counts:
        part = run(replace(sc, nodes=nodes))
        merged.ops.extend(part.ops)
        merged.scales.extend(part.scales)
    return merged
