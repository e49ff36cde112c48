"""Calibration: re-derive the constants of ``simulator.hardware`` (DeepEP V1 family), or fit the ``deep_ep`` family
from our own benchmark JSON.

``python -m simulator.calibrate`` prints the fitted DeepEP V1 values (it does not edit files): each parameter of
:func:`steps` is solved until the signed error of its calibration row(s) is zero, in order, coupled groups twice;
every other row is a hold-out. :func:`leave_one_group_out` re-fits without each group of rows and predicts it.

``python -m simulator.calibrate --from-bench FILE.json [--hold-out 16,32] [--check OTHER.json] [--warps default|best]
[--fix NAME=VALUE] [--no-write]`` fits deep_ep's kernel parameters by least squares on the bench points (the given
SM counts held out), predicts the ``--check`` files' points (never fitted), prints measured vs predicted per point
and the MAPEs, and writes ``simulator/data/calibration_deep_ep.json`` (values, sources, command, every point). A
``benchmarks/bench_low_latency.py`` file fits the low-latency parameters; ``--hold-out`` then names token counts. A
``benchmarks/bench_internode.py --composed`` file fits the fused kernels' team rates (ranks on one GPU under MPS).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from simulator import hardware, validate

SM90 = ("h800", "h200", "h100", "b200")  # per-SM and per-message costs shared by the SM90 fits (B200: assumed)
RowKey = tuple[str, str]


def _rows(keys: tuple[RowKey, ...]) -> list[validate.Row]:
    by_key = {(r.set_name, r.label): r for r in validate.all_rows()}
    return [by_key[k] for k in keys]


def _mean_error(rows: list[validate.Row]) -> float:
    outcomes = validate.validate(rows)
    return sum(o.error for o in outcomes) / len(outcomes)


def _set_gpu(names: tuple[str, ...], **values: float) -> None:
    for name in names:
        hardware.GPUS[name] = replace(hardware.GPUS[name], **values)


def _set_nic(**values: float) -> None:
    hardware.NICS["cx7"] = replace(hardware.NICS["cx7"], **values)


def _set_wall(x: float) -> None:
    validate.WALL_OVERHEAD_US = x


def _solve(apply: Callable[[float], None], rows: list[validate.Row], lo: float, hi: float, steps: int = 12) -> float:
    """Find ``x`` in ``[lo, hi]`` with zero mean signed error of ``rows`` (monotone in ``x``): regula falsi with
    the Illinois step, ending at the bracket end when the root lies outside."""
    apply(lo)
    f_lo = _mean_error(rows)
    apply(hi)
    f_hi = _mean_error(rows)
    if (f_lo > 0) == (f_hi > 0):
        best = lo if abs(f_lo) < abs(f_hi) else hi
        apply(best)
        return best
    side = 0
    x = hi
    for _ in range(steps):
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        apply(x)
        f = _mean_error(rows)
        if abs(f) < 2e-4:
            break
        if (f > 0) == (f_lo > 0):
            lo, f_lo = x, f
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            hi, f_hi = x, f
            if side == 1:
                f_lo /= 2
            side = 1
    apply(x)
    return x


@dataclass(frozen=True)
class Step:
    """One calibrated parameter: how to set it, the rows that fit it (the first candidate whose rows are all
    available), its search interval, and its prior (the physical estimate kept when no candidate is available)."""

    name: str
    apply: Callable[[float], None]
    candidates: tuple[tuple[RowKey, ...], ...]
    lo: float
    hi: float
    prior: Callable[[], float]


def _const(x: float) -> Callable[[], float]:
    return lambda: x


def _sm_copy_steps() -> list[Step]:
    return [
        Step("SM90.ring_row_ns", lambda x: _set_gpu(SM90, ring_row_ns=x),
             ((("h200-sweep", "8 SMs fp8 dispatch"),), (("h200", "fp8 dispatch"),)), 20, 800,
             _const(200.0)),  # assumed: one dependent HBM load per row of a ring
        Step("SM90.sm_copy_gbps", lambda x: _set_gpu(SM90, sm_copy_gbps=x),
             ((("h200-sweep", "8 SMs bf16 dispatch"),), (("h200", "bf16 dispatch"),)), 15, 200,
             _const(46.0)),  # measured: one SM, 16-byte stores, 4 in flight (data/nvlink_sm_h200x2.json)
        Step("WALL_OVERHEAD_US", _set_wall, ((("h200-sweep", "16 SMs fp8 dispatch"),),), 0, 100,
             _const(20.0)),  # assumed: cached notify kernel + launch gap
    ]


def steps() -> list[Step]:
    """The calibration, in order (coupled groups repeated)."""
    ll = [
        Step("SM90.ll_launch_us", lambda x: _set_gpu(SM90, ll_launch_us=x), ((("h200", "LL dispatch"),),), 0, 60,
             _const(10.0)),  # assumed: cooperative launch + grid barrier + buffer clean-up
        Step("SM90.ll_nvl_signal_us", lambda x: _set_gpu(SM90, ll_nvl_signal_us=x),
             ((("ll-h800", "EP8 dispatch"),),), 0, 10, _const(2.0)),  # assumed: one NVLink flag round trip
        Step("SM90.ll_rdma_signal_us", lambda x: _set_gpu(SM90, ll_rdma_signal_us=x),
             ((("ll-h800", "EP16 dispatch"),), (("ll-rdma-h800", "EP8 dispatch"),)), 0, 40,
             _const(6.0)),  # assumed: two NIC latencies (put completion, count atomic)
        Step("SM90.ll_rdma_peer_us", lambda x: _set_gpu(SM90, ll_rdma_peer_us=x),
             ((("ll-rdma-h800", "EP256 dispatch"),), (("ll-h800", "EP64 dispatch"),)), 0, 0.5,
             _const(0.02)),  # assumed: one work request per peer
    ]
    return (_sm_copy_steps() * 2 + [
        Step("SM90.combine_tail_us", lambda x: _set_gpu(SM90, combine_tail_us=x),
             ((("h200", "bf16 combine"),), (("h200-sweep", "24 SMs bf16 combine"),)), 0, 150,
             _const(30.0)),  # assumed: last reductions + ring reset
        Step("H200.nvl_ring_efficiency", lambda x: _set_gpu(("h200", "h100", "b200"), nvl_ring_efficiency=x),
             ((("h200-sweep", "48 SMs bf16 dispatch"),),), 0.3, 1.0, _const(0.85)),  # assumed
        Step("H800.nvl_ring_efficiency", lambda x: _set_gpu(("h800",), nvl_ring_efficiency=x),
             ((("normal-h800", "EP8 dispatch"),),), 0.3, 1.0,
             lambda: hardware.GPUS["h200"].nvl_ring_efficiency),  # prior: the same ring protocol as H200
        Step("SM90.fwd_sm_gbps", lambda x: _set_gpu(SM90, fwd_sm_gbps=x), ((("normal-h800", "EP16 dispatch"),),),
             4, 40, _const(15.0)),  # assumed
        Step("CX7.normal_efficiency", lambda x: _set_nic(normal_efficiency=x),
             ((("normal-h800", "EP32 dispatch"),),), 0.4, 1.0, _const(0.9)),  # assumed
    ] + ll * 2)


def calibration_rows() -> dict[RowKey, str]:
    """Row -> the parameters it fits in the full calibration (every candidate's first choice)."""
    out: dict[RowKey, list[str]] = {}
    for step in steps():
        for key in step.candidates[0]:
            names = out.setdefault(key, [])
            if step.name not in names:
                names.append(step.name)
    return {k: ", ".join(v) for k, v in out.items()}


def calibrate(verbose: bool = True, exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    """Fit every calibrated constant in place (``hardware.GPUS``/``NICS``, ``validate.WALL_OVERHEAD_US``) without
    the rows of the groups in ``exclude`` (``validate.Row.group``): a parameter none of whose candidates is left
    keeps its prior."""
    groups = {(r.set_name, r.label): r.group for r in validate.all_rows()}
    fitted: dict[str, float] = {}
    for step in steps():
        usable = [c for c in step.candidates if not any(groups[k] in exclude for k in c)]
        if usable:
            value = _solve(step.apply, _rows(usable[0]), step.lo, step.hi)
        else:
            value = step.prior()
            step.apply(value)
        fitted[step.name] = value
        if verbose:
            print(f"{step.name:<32} {value:10.4f}  {'fit' if usable else 'prior'}", flush=True)
    return fitted


def leave_one_group_out(groups: list[str] | None = None) -> list[validate.GroupCheck]:
    """For each group of rows (``validate.Row.group``): re-run :func:`calibrate` without its rows, predict them,
    and restore the fitted constants. Parameters only that group fits fall back to their priors (listed)."""
    rows = validate.all_rows()
    names = groups if groups is not None else list(dict.fromkeys(r.group for r in rows))
    unknown = sorted(set(names) - {r.group for r in rows})
    if unknown:
        raise ValueError(f"groups must name row groups from {sorted({r.group for r in rows})}, got {unknown}")
    saved = (dict(hardware.GPUS), dict(hardware.NICS), validate.WALL_OVERHEAD_US)
    out = []
    try:
        for group in names:
            keys = {(r.set_name, r.label): r.group for r in rows}
            priors = tuple(st.name for st in steps()
                           if not any(all(keys[k] != group for k in c) for c in st.candidates))
            calibrate(verbose=False, exclude=frozenset({group}))
            outcomes = validate.validate([r for r in rows if r.group == group])
            out.append(validate.GroupCheck(group, outcomes, tuple(dict.fromkeys(priors))))
            hardware.GPUS.update(saved[0])
            hardware.NICS.update(saved[1])
            validate.WALL_OVERHEAD_US = saved[2]
    finally:
        hardware.GPUS.update(saved[0])
        hardware.NICS.update(saved[1])
        validate.WALL_OVERHEAD_US = saved[2]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import shlex
    import sys

    from simulator import bench_fit
    parser = argparse.ArgumentParser(prog="python -m simulator.calibrate",
                                     description="Re-fit the DeepEP V1 constants (no arguments), or fit the deep_ep "
                                                 "kernel family from a bench JSON (--from-bench).")
    parser.add_argument("--from-bench", metavar="FILE.json", default=None,
                        help="fit deep_ep's kernel parameters from this benchmark JSON")
    parser.add_argument("--hold-out", default=None, metavar="S1,S2",
                        help="SM counts (normal-mode benches; default 16,32) or tokens per rank (the low-latency "
                             "bench; default 2,4,16,32,128) kept out of the fit and reported as predictions")
    parser.add_argument("--check", action="append", default=[], metavar="FILE.json",
                        help="another bench JSON whose points are predicted with the fit, not fitted (repeatable), "
                             "e.g. a benchmarks/bench_internode.py run")
    parser.add_argument("--warps", choices=bench_fit.WARPS_CHOICES, default="default",
                        help="bench_intranode sweeps: time of Buffer's default copy-warp count (default) or of the "
                             "best one per point")
    parser.add_argument("--output", default=str(bench_fit.CALIBRATION_PATH),
                        help="calibration JSON to write (default simulator/data/calibration_deep_ep.json)")
    parser.add_argument("--no-write", action="store_true", help="print the fit only")
    parser.add_argument("--fix", action="append", default=[], metavar="NAME=VALUE",
                        help="pin a parameter instead of fitting it (repeatable), e.g. --fix sm_local_gbps=75")
    parser.add_argument("--show", action="store_true",
                        help="print the deep_ep profile in use (value and source per parameter) and exit")
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(raw_argv)
    if args.show:
        for name, value, source in bench_fit.dek.profile().describe():
            print(f"{name:<26} {value!s:>10}  {source}")
        return 0
    if args.from_bench is None:
        calibrate()
        print()
        print(validate.to_text(validate.validate(), leave_one_group_out()))
        return 0
    hold_out = None
    if args.hold_out is not None:
        try:
            hold_out = [int(x) for x in args.hold_out.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--hold-out must be a comma-separated list of integers, got {args.hold_out!r}")
    fixed = {}
    for item in args.fix:
        name, _, value = item.partition("=")
        try:
            fixed[name.strip()] = float(value)
        except ValueError:
            parser.error(f"--fix needs NAME=VALUE with a number, got {item!r}")
    try:
        run = bench_fit.read_bench(args.from_bench, args.warps)
        checks = [bench_fit.read_bench(path, args.warps) for path in args.check]
        result = bench_fit.fit(run, hold_out, fixed=fixed, check=checks)
    except ValueError as exc:
        parser.error(str(exc))
    print(bench_fit.to_text(result), end="")
    if not args.no_write:
        command = " ".join(["python -m simulator.calibrate", *(shlex.quote(a) for a in raw_argv)])
        bench_fit.write_calibration(result, args.output, command)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
