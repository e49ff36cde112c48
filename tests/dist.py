"""Multi-process harness: a pool of gloo (or NCCL, one GPU per rank) ranks that stays up across test cases.

A :class:`RankPool` starts ``world_size`` processes once (spawn context, gloo over a ``FileStore``) and runs many
cases on them: :meth:`RankPool.run` ships ``(module, function, case)`` to every rank, which calls
``function(ctx, case)`` and reports ``None`` (passed) or a failure message. Every rank regenerates all ranks' inputs
from the case's seed, so the case stays tiny. Waits are bounded: the driver waits at most ``case_timeout_s`` per
case and notices dead workers (exit code and last traceback); the workers run with a short ``DEEP_EP_TIMEOUT_S``,
so a broken collective raises instead of hanging. A pool that failed is restarted before the next case::

    @pytest.fixture(scope="module")
    def pools():
        with dist.PoolManager() as manager:
            yield manager

    def test_x(pools):
        pools.get(4, {"DEEP_EP_GPUS_PER_NODE": "2"}).check("test_mod", "worker_fn", case)
"""
from __future__ import annotations

import contextlib
import os
import queue
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.multiprocessing as mp

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
# Per-wait budget inside the workers: a broken collective fails within this many seconds.
WORKER_TIMEOUT_S = 30.0
# Driver-side budgets.
START_TIMEOUT_S = 180.0
CASE_TIMEOUT_S = 120.0


@dataclass
class WorkerContext:
    """What a worker function receives besides the case.

    Attributes:
        rank / world_size: this process's rank and the group size.
        group: the process group of all ranks (gloo, or NCCL in a pool built with ``backend="nccl"``).
        cache: a per-process dict that survives across cases (e.g. to reuse a Buffer).
    """

    rank: int
    world_size: int
    group: Any
    cache: dict = field(default_factory=dict)


def _worker_main(rank: int, world_size: int, store_path: str, env: dict, backend: str, tasks: Any,
                 results: Any) -> None:
    """Entry point of one rank: set up the ``backend`` group (NCCL: on ``cuda:rank``), then serve tasks until
    ``None`` arrives."""
    os.environ.update(env)
    os.environ.setdefault("DEEP_EP_TIMEOUT_S", str(WORKER_TIMEOUT_S))
    for path in (str(REPO_ROOT), str(TESTS_DIR)):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        import datetime
        import importlib

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        device = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = dict(device_id=torch.device("cuda", rank))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S * 2), **device)
        ctx = WorkerContext(rank, world_size, dist.group.WORLD)
        results.put((rank, "ready", None))
    except BaseException:  # report the setup failure to the driver instead of dying silently
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        serial, module_name, function_name, case = task
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            outcome = function(ctx, case)
            message = None if outcome in (None, "ok") else str(outcome)
        except BaseException:
            message = f"rank {rank} raised:\n{traceback.format_exc()}"
        results.put((rank, serial, message))
    # Leave at once: destroy_process_group() or the interpreter's teardown of gloo can block on peers that are
    # gone. Flush the result queue first so that nothing already reported is lost.
    results.close()
    results.join_thread()
    if os.environ.get("TEST_WORKER_NORMAL_EXIT") == "1":
        # compute-sanitizer writes a process's report from its exit handlers, which os._exit skips.
        return
    os._exit(0)


def round_trip_matches_reference(buf: Any, rank: int, world: int, num_experts: int, seed: int, num_tokens: int = 6,
                                 hidden: int = 128) -> Optional[str]:
    """Worker side: a correct dispatch + combine on ``buf`` (every rank calls it; inputs of all ranks drawn from
    ``seed``, top-2 routing), compared bit for bit with ``reference``. Returns a failure message or None."""
    import torch

    import reference
    from deep_ep.config import Topology
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randint(-8, 9, (num_tokens, hidden), generator=gen).to(torch.bfloat16) for _ in range(world)]
    idxs = [torch.rand(num_tokens, num_experts, generator=gen).argsort(1)[:, :2].contiguous() for _ in range(world)]
    topo = Topology(world, world)
    layout = buf.get_dispatch_layout(idxs[rank], num_experts)
    recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank], num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                               num_tokens_per_expert=layout[2])
    combined, _, _ = buf.combine(recv_x, handle)
    masks = [reference.get_dispatch_layout(i, num_experts, topo).is_token_in_rank for i in idxs]
    refs = reference.dispatch(xs, masks, topo)
    ref_c = reference.combine([r.recv_x for r in refs], [r.handle for r in refs], topo)
    if not torch.equal(recv_x, refs[rank].recv_x) or not torch.equal(combined, ref_c[rank].combined_x):
        return "a correct dispatch/combine gave results that differ from reference"
    return None

class WorkerFailure(AssertionError):
    """One or more ranks failed a case (or died); the message holds every rank's report."""


class RankPool:
    """``world_size`` worker processes sharing one process group.

    Args:
        world_size: number of ranks.
        env: environment variables set in every worker before anything is imported (e.g.
            ``DEEP_EP_GPUS_PER_NODE``).
        backend: ``"gloo"``, or ``"nccl"`` with rank ``r`` on GPU ``r``.
    """

    def __init__(self, world_size: int, env: Optional[dict] = None, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.env = dict(env or {})
        self.broken = False
        self._serial = 0
        context = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="deep_ep_pool_")
        store_path = os.path.join(self._tmp.name, "store")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._procs = [context.Process(target=_worker_main, daemon=True,
                                       args=(r, world_size, store_path, self.env, backend, self._tasks[r],
                                             self._results))
                       for r in range(world_size)]
        for proc in self._procs:
            proc.start()
        reports = self._collect("ready", START_TIMEOUT_S)
        errors = [msg for msg in reports.values() if msg is not None]
        if errors:
            self.close()
            raise WorkerFailure("worker setup failed:\n" + "\n".join(errors))

    def _collect(self, serial: Any, timeout_s: float) -> dict:
        """Wait (bounded) for every rank's report of ``serial``; dead workers and timeouts become failures."""
        reports: dict[int, Optional[str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(reports) < self.world_size:
            try:
                rank, got_serial, message = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in reports]
                if dead:
                    self.broken = True
                    for r in dead:
                        reports[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                    # The others may be blocked on the dead rank; give them a bounded chance to report.
                    deadline = min(deadline, time.monotonic() + WORKER_TIMEOUT_S + 10)
                if time.monotonic() > deadline:
                    self.broken = True
                    for r in range(self.world_size):
                        reports.setdefault(r, f"rank {r} did not report within {timeout_s:.0f} s")
                continue
            if got_serial == "error":
                self.broken = True
                reports[rank] = f"rank {rank} failed during setup:\n{message}"
            elif got_serial == serial:
                reports[rank] = message
        return reports

    def run(self, module: str, function: str, case: Any, timeout_s: float = CASE_TIMEOUT_S) -> dict:
        """Run ``module.function(ctx, case)`` on every rank; returns ``{rank: None or failure message}``."""
        if self.broken:
            raise WorkerFailure("this pool is broken by an earlier failure; use PoolManager.get for a fresh one")
        self._serial += 1
        for task_queue in self._tasks:
            task_queue.put((self._serial, module, function, case))
        reports = self._collect(self._serial, timeout_s)
        if any(m is not None for m in reports.values()):
            self.broken = True
        return reports

    def check(self, module: str, function: str, case: Any, timeout_s: float = CASE_TIMEOUT_S) -> None:
        """:meth:`run`, raising :class:`WorkerFailure` with ``case.describe()`` if any rank failed."""
        reports = self.run(module, function, case, timeout_s)
        failures = {r: m for r, m in reports.items() if m is not None}
        if failures:
            describe = case.describe() if hasattr(case, "describe") else repr(case)
            body = "\n".join(f"--- rank {r} ---\n{m}" for r, m in sorted(failures.items()))
            raise WorkerFailure(f"case {describe} failed on ranks {sorted(failures)}:\n{body}")

    def close(self) -> None:
        for task_queue, proc in zip(self._tasks, self._procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    task_queue.put(None)
        deadline = time.monotonic() + (60 if os.environ.get("TEST_WORKER_NORMAL_EXIT") == "1" else 10)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._tmp.cleanup()


class PoolManager:
    """One live :class:`RankPool` per (world size, environment); broken pools are replaced on demand."""

    def __init__(self) -> None:
        self._pools: dict[tuple, RankPool] = {}

    def get(self, world_size: int, env: Optional[dict] = None) -> RankPool:
        key = (world_size, tuple(sorted((env or {}).items())))
        pool = self._pools.get(key)
        if pool is not None and pool.broken:
            pool.close()
            pool = None
        if pool is None:
            pool = RankPool(world_size, env)
            self._pools[key] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "PoolManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
