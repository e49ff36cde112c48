"""Calibration: re-derive the constants of ``simulator.hardware`` (DeepEP V1 family), or fit the ``deep_ep`` family
from our own benchmark JSON.

``python -m simulator.calibrate`` prints the fitted DeepEP V1 values (it does not edit files): each parameter is
bisected until the signed error of its calibration row(s) (``calib`` in ``simulator.validate.CALIBRATION``) is zero,
in the order below, with two passes over the coupled low-latency parameters; every other row is a hold-out.

``python -m simulator.calibrate --from-bench FILE.json [--hold-out 16,32] [--check OTHER.json] [--warps default|best]
[--fix NAME=VALUE] [--no-write]`` fits deep_ep's kernel parameters by least squares on the bench points (the given
SM counts held out), predicts the ``--check`` files' points (never fitted), prints measured vs predicted per point
and the MAPEs, and writes ``simulator/data/calibration_deep_ep.json`` (values, sources, command, every point). A
``benchmarks/bench_low_latency.py`` file fits the low-latency parameters; ``--hold-out`` then names token counts.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from simulator import hardware, validate


def _rows(*keys: tuple[str, str]) -> list[validate.Row]:
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


def _bisect(apply: Callable[[float], None], rows: list[validate.Row], lo: float, hi: float,
            steps: int = 14) -> float:
    """Find ``x`` in ``[lo, hi]`` with zero mean signed error (the error must be monotone in ``x``)."""
    apply(lo)
    err_lo = _mean_error(rows)
    for _ in range(steps):
        mid = (lo + hi) / 2
        apply(mid)
        err = _mean_error(rows)
        if (err > 0) == (err_lo > 0):
            lo, err_lo = mid, err
        else:
            hi = mid
    best = (lo + hi) / 2
    apply(best)
    return best


def calibrate(verbose: bool = True) -> dict[str, float]:
    """Fit every calibrated constant in place (``hardware.GPUS``/``NICS``, ``validate.WALL_OVERHEAD_US``)."""
    sm90 = ("h800", "h200", "h100")
    fitted: dict[str, float] = {}

    def note(name: str, value: float) -> None:
        fitted[name] = value
        if verbose:
            print(f"{name:<32} {value:10.4f}", flush=True)

    def set_wall(x: float) -> None:
        validate.WALL_OVERHEAD_US = x

    for _ in range(2):  # SM90 copy cost per row and per byte, and the wall-time overhead (coupled)
        note("SM90.sm_token_ns", _bisect(lambda x: _set_gpu(sm90, sm_token_ns=x),
                                         _rows(("h200-sweep", "8 SMs fp8 dispatch")), 20, 400))
        note("SM90.sm_copy_gbps", _bisect(lambda x: _set_gpu(sm90, sm_copy_gbps=x),
                                          _rows(("h200-sweep", "8 SMs bf16 dispatch")), 15, 200))
        note("WALL_OVERHEAD_US", _bisect(set_wall, _rows(("h200-sweep", "16 SMs fp8 dispatch")), 0, 100))
    note("SM90.combine_tail_us", _bisect(lambda x: _set_gpu(sm90, combine_tail_us=x),
                                         _rows(("h200", "bf16 combine")), 0.0, 150.0))
    note("H200.nvl_ring_efficiency", _bisect(lambda x: _set_gpu(("h200",), nvl_ring_efficiency=x),
                                             _rows(("h200-sweep", "48 SMs bf16 dispatch")), 0.3, 1.0))
    note("H800.nvl_ring_efficiency", _bisect(lambda x: _set_gpu(("h800",), nvl_ring_efficiency=x),
                                             _rows(("normal-h800", "EP8 dispatch")), 0.3, 1.0))
    note("SM90.fwd_sm_gbps", _bisect(lambda x: _set_gpu(sm90, fwd_sm_gbps=x),
                                     _rows(("normal-h800", "EP16 dispatch")), 4, 40))
    note("CX7.normal_efficiency", _bisect(lambda x: _set_nic(normal_efficiency=x),
                                          _rows(("normal-h800", "EP32 dispatch")), 0.4, 1.0))
    for _ in range(2):
        note("H800.ll_fixed_us", _bisect(lambda x: _set_gpu(("h800",), ll_fixed_us=x),
                                         _rows(("ll-h800", "EP8 dispatch")), 0, 80))
        for _ in range(2):
            note("SM90.ll_rdma_extra_us", _bisect(lambda x: _set_gpu(sm90, ll_rdma_extra_us=x),
                                                  _rows(("ll-h800", "EP16 dispatch")), 0, 60))
            note("CX7.ll_dispatch_efficiency", _bisect(lambda x: _set_nic(ll_dispatch_efficiency=x),
                                                       _rows(("ll-h800", "EP32 dispatch")), 0.5, 1.2))
        note("CX7.ll_combine_efficiency", _bisect(lambda x: _set_nic(ll_combine_efficiency=x),
                                                  _rows(("ll-h800", "EP16 combine"), ("ll-h800", "EP32 combine")),
                                                  0.5, 1.2))
        note("CX7.qp_derate_per_doubling", _bisect(lambda x: _set_nic(qp_derate_per_doubling=x),
                                                   _rows(("ll-rdma-h800", "EP256 dispatch")), 0.0, 0.1))
    note("H200.ll_fixed_us", _bisect(lambda x: _set_gpu(("h200",), ll_fixed_us=x), _rows(("h200", "LL dispatch")),
                                     0, 60))
    return fitted


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
        print(validate.to_text(validate.validate()))
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
