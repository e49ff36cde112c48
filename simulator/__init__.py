"""SimPy performance model of deep_ep's dispatch/combine and the ``python -m simulator`` capacity planner.

Imports the standard library, simpy, numpy, ``deep_ep.config`` and ``deep_ep.layout`` only (never torch).

    >>> from simulator import Scenario, run
    >>> print(run(Scenario(nodes=2)).to_text())
"""
from simulator.report import OpRow, Report, ScaleRow
from simulator.scenario import Scenario, run, run_sweep

__all__ = ["OpRow", "Report", "ScaleRow", "Scenario", "run", "run_sweep"]
