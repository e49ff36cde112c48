"""Re-derive the fitted constants of ``simulator.hardware`` from the calibration rows of ``simulator.validate``.

``python -m simulator.calibrate`` prints the fitted values (it does not edit files). Each parameter is fitted by
bisection so that the signed error of its calibration row(s) is zero, in the order below, with two passes over
the coupled low-latency parameters. The rows are those marked ``calib`` in ``simulator.validate.CALIBRATION``;
every other row is a hold-out prediction.
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


if __name__ == "__main__":
    calibrate()
    print()
    print(validate.to_text(validate.validate()))
