"""Fluid (flow-level) bandwidth sharing for SimPy.

A *port* is one direction of one resource with a capacity in bytes/µs: a GPU's NVLink egress or ingress, a NIC's
egress or ingress, or the copy throughput of the SMs that play one kernel role on one GPU (the SM budget). A *flow*
moves ``size`` bytes of progress and loads each port it uses with a coefficient (port bytes per byte of progress):
one token row sent to three peers loads the sender's egress port with 1 and each peer's ingress port with 1/3 of
the flow. All stages of a chunk-pipelined path are loaded at once, because chunking keeps them all busy.

Rates are max-min fair (progressive filling): every unfrozen flow's rate rises together until some port saturates
or a flow reaches its own cap; flows through a saturated port freeze; repeat. Simulated time jumps from one flow
completion to the next, so a collective costs O(number of flows) events, not O(bytes).

Times are in µs and sizes in bytes, so a capacity of ``X`` GB/s is ``X * 1e3`` bytes/µs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import simpy

GBPS = 1e3  # bytes per µs in one GB/s


@dataclass
class Flow:
    """One fluid transfer. ``ports``/``coefs`` are parallel arrays; ``done`` fires when ``remaining`` hits 0."""

    name: str
    size: float
    ports: np.ndarray
    coefs: np.ndarray
    cap: float
    done: simpy.Event
    start: float
    remaining: float = 0.0
    rate: float = 0.0


class FluidNetwork:
    """Ports with capacities and max-min fair flows, driven by a SimPy environment.

    Args:
        env: the SimPy environment.
        capacities: ``[num_ports]`` capacities in bytes/µs.
        port_names: ``[num_ports]`` names for reports and error messages.
        batch_tolerance: flows whose completion falls within this fraction of their elapsed time of the next
            completion are completed together (fewer rate recomputations; error bounded by this fraction).
    """

    def __init__(self, env: simpy.Environment, capacities: list[float], port_names: list[str],
                 batch_tolerance: float = 2e-3) -> None:
        if len(capacities) != len(port_names):
            raise ValueError("capacities and port_names must have the same length")
        for name, cap in zip(port_names, capacities):
            if not cap > 0:
                raise ValueError(f"port {name} needs a positive capacity, got {cap}")
        self.env = env
        self.capacity = np.asarray(capacities, dtype=float)
        self.port_names = list(port_names)
        self.batch_tolerance = batch_tolerance
        self.flows: list[Flow] = []
        self.port_bytes = np.zeros(len(capacities))      # bytes carried so far, per port
        # Bytes carried at the solved rates, per port: never above capacity x time (the solver's invariant), unlike
        # port_bytes, which also counts the last bytes of flows that a batched completion finishes early.
        self.port_load = np.zeros(len(capacities))
        self.port_busy_until = np.zeros(len(capacities))  # last time a port carried traffic
        self._last = 0.0
        self._version = 0
        self._pending = False
        self.num_recomputes = 0

    # -- public API ------------------------------------------------------------------------------------------
    def transfer(self, name: str, size: float, ports: np.ndarray, coefs: np.ndarray,
                 cap: float = math.inf) -> simpy.Event:
        """Start a flow of ``size`` bytes that loads ``ports[i]`` with ``coefs[i]`` port-bytes per byte.

        Returns the event that fires (with the completion time) when the last byte has moved.
        """
        done = self.env.event()
        keep = np.asarray(coefs) > 0
        if size <= 0 or not keep.any():
            done.succeed(self.env.now)
            return done
        self._advance()
        self.flows.append(Flow(name, float(size), np.asarray(ports)[keep], np.asarray(coefs, dtype=float)[keep],
                               cap, done, self.env.now, float(size)))
        self._schedule_recompute()
        return done

    def check_idle(self) -> None:
        """Raise if flows are still active after ``env.run()`` returned (a stalled model, not a result)."""
        if self.flows:
            stuck = ", ".join(f"{f.name} ({f.remaining:.0f} of {f.size:.0f} B left)" for f in self.flows[:5])
            raise RuntimeError(f"fluid network did not drain at t={self.env.now:.3f} us: {stuck}")

    def utilization(self, elapsed_us: float) -> np.ndarray:
        """Average load of every port over ``elapsed_us`` (0..1): the bytes it carried at the solved rates, which
        never exceed its capacity, over capacity x ``elapsed_us``."""
        if elapsed_us <= 0:
            return np.zeros_like(self.capacity)
        return self.port_load / (self.capacity * elapsed_us)

    def busy_us(self) -> np.ndarray:
        """Time every port would need at full capacity for the bytes it carried (µs)."""
        return self.port_bytes / self.capacity

    # -- internals -------------------------------------------------------------------------------------------
    def _schedule_recompute(self) -> None:
        if not self._pending:
            self._pending = True
            ev = self.env.timeout(0)
            ev.callbacks.append(lambda _ev: self._recompute())

    def _advance(self) -> None:
        """Move every flow forward by its rate over the time since the last update."""
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self.flows:
            for f in self.flows:
                moved = min(f.rate * dt, f.remaining)
                f.remaining -= moved
                np.add.at(self.port_bytes, f.ports, f.coefs * moved)
                np.add.at(self.port_load, f.ports, f.coefs * moved)
                if moved > 0:
                    self.port_busy_until[f.ports] = now
        self._last = now

    def _recompute(self) -> None:
        self._pending = False
        self._advance()
        self._finish_done()
        self._solve()
        self._version += 1
        if not self.flows:
            return
        horizon = min((f.remaining / f.rate) if f.rate > 0 else math.inf for f in self.flows)
        if not math.isfinite(horizon):
            names = ", ".join(f.name for f in self.flows[:5])
            raise RuntimeError(f"fluid network stalled at t={self.env.now:.3f} us: flows [{names}] have zero rate")
        version = self._version
        ev = self.env.timeout(horizon)
        ev.callbacks.append(lambda _ev: self._recompute() if version == self._version else None)

    def _finish_done(self) -> None:
        now = self.env.now
        keep = []
        for f in self.flows:
            elapsed = max(now - f.start, 1e-9)
            eta = f.remaining / f.rate if f.rate > 0 else math.inf
            if f.remaining <= 1e-6 * f.size or eta <= self.batch_tolerance * elapsed:
                if f.remaining > 0:  # batched: the last bytes are carried by the flow's own estimated end
                    np.add.at(self.port_bytes, f.ports, f.coefs * f.remaining)
                    self.port_busy_until[f.ports] = np.maximum(self.port_busy_until[f.ports], now + eta)
                    f.remaining = 0.0
                f.done.succeed(now)
            else:
                keep.append(f)
        self.flows = keep

    def _solve(self) -> None:
        """Max-min fair rates by progressive filling over all active flows."""
        self.num_recomputes += 1
        flows = self.flows
        if not flows:
            return
        num_flows, num_ports = len(flows), len(self.capacity)
        lengths = np.fromiter((len(f.ports) for f in flows), dtype=np.int64, count=num_flows)
        flow_of = np.repeat(np.arange(num_flows), lengths)
        ports = np.concatenate([f.ports for f in flows])
        coefs = np.concatenate([f.coefs for f in flows])
        caps = np.fromiter((f.cap for f in flows), dtype=float, count=num_flows)
        rate = np.zeros(num_flows)
        frozen = np.zeros(num_flows, dtype=bool)
        level = 0.0
        for _ in range(num_flows + 1):
            active = ~frozen[flow_of]
            demand = np.bincount(ports[active], coefs[active], minlength=num_ports)
            used = np.bincount(ports[~active], coefs[~active] * rate[flow_of[~active]], minlength=num_ports)
            residual = self.capacity - used - level * demand
            with np.errstate(divide="ignore", invalid="ignore"):
                steps = np.where(demand > 0, residual / demand, np.inf)
            step = max(0.0, min(float(steps.min()), float((caps[~frozen] - level).min())))
            level += step
            rate[~frozen] = level
            saturated = (demand > 0) & (residual - step * demand <= 1e-9 * self.capacity)
            newly = np.zeros(num_flows, dtype=bool)
            hit = saturated[ports] & active
            newly[flow_of[hit]] = True
            newly |= (~frozen) & (caps <= level * (1 + 1e-12))
            if not newly.any():  # numerical safety: freeze the flows of the tightest port
                newly[flow_of[active & (ports == int(np.argmin(steps)))]] = True
            frozen |= newly
            if frozen.all():
                break
        for f, r in zip(flows, rate):
            f.rate = float(r)
