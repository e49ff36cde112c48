"""SimPy performance model of deep_ep's dispatch/combine and the ``python -m simulator`` capacity planner.

Imports the standard library, simpy, numpy, ``deep_ep.config`` and ``deep_ep.layout`` only (never torch).
A :class:`Scenario` names its kernel family (``kernels``: ``deep_ep``, this library's, which the command line
plans for by default, or ``deepep``, DeepEP V1's); :class:`Comparison` puts two families' reports side by side.

    >>> from simulator import Comparison, Scenario, run
    >>> ours = run(Scenario(nodes=2, kernels="deep_ep"))
    >>> print(Comparison(ours, run(Scenario(nodes=2, kernels="deepep"))).to_text())
"""
from simulator.report import Comparison, OpRow, Report, ScaleRow
from simulator.scenario import Scenario, run, run_sweep

__all__ = ["Comparison", "OpRow", "Report", "ScaleRow", "Scenario", "run", "run_sweep"]
