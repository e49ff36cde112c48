"""Shared pytest setup: ``sys.path``, hypothesis profiles and the GPU markers.

``tests/`` has no ``__init__.py``; this file puts ``tests/`` and the repository root at the front of ``sys.path``,
so test files import helpers by bare name (``import dist``, ``import strategies``).

Hypothesis profile by ``HYPOTHESIS_PROFILE`` (default ``dev``): ``dev`` few examples for local runs; ``ci`` more,
``derandomize=True``, no deadline; ``gpu`` very few, no deadline. A test whose examples are expensive caps itself
with ``@settings(max_examples=...)``; the whole CI run stays under ~15 minutes on 2 cores.

Markers: ``@pytest.mark.gpu`` needs CUDA; ``@pytest.mark.multi_gpu`` / ``multi_gpu(n)`` needs 2 (or n) CUDA
devices, else the test is skipped with the reason. ``TEST_RANKS_PER_GPU=n`` counts each device n times, so tests
whose ranks share devices (rank % devices; NVSHMEM runs several processes per GPU time-sliced) run on fewer GPUs:
a check of correctness only, never of timing.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for _path in (str(REPO_ROOT), str(TESTS_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# Test-only: the interpreter that multiprocessing's spawn starts for the pools' workers. tests/gpu/sanitize.sh points
# it at a wrapper that runs each worker under its own compute-sanitizer instance.
if os.environ.get("TEST_WORKER_EXECUTABLE"):
    import multiprocessing

    multiprocessing.set_executable(os.environ["TEST_WORKER_EXECUTABLE"])

settings.register_profile(
    "dev", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", max_examples=50, derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "gpu", max_examples=5, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
if PROFILE not in ("dev", "ci", "gpu"):
    raise ValueError(f"HYPOTHESIS_PROFILE must be one of dev, ci, gpu; got {PROFILE!r}")
settings.load_profile(PROFILE)


def _cuda_device_count() -> tuple[int, str]:
    """(number of usable CUDA devices, why zero). Imports torch only when a GPU-marked test was collected."""
    try:
        import torch
    except ImportError as exc:
        return 0, f"torch is not importable ({exc})"
    if torch.version.cuda is None:
        return 0, f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return 0, "torch.cuda.is_available() is False (no CUDA device or driver)"
    return torch.cuda.device_count() * int(os.environ.get("TEST_RANKS_PER_GPU", "1")), ""


def _required_gpus(item: pytest.Item) -> int:
    """0 for CPU tests, 1 for ``gpu``, n (default 2) for ``multi_gpu(n)``."""
    needed = 0
    if item.get_closest_marker("gpu") is not None:
        needed = 1
    marker = item.get_closest_marker("multi_gpu")
    if marker is not None:
        count = marker.args[0] if marker.args else marker.kwargs.get("n", 2)
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise pytest.UsageError(f"{item.nodeid}: multi_gpu(n) needs an int n >= 2, got {count!r}")
        needed = max(needed, count)
    return needed


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {item: _required_gpus(item) for item in items}
    if not any(needs.values()):
        return
    available, why = _cuda_device_count()
    for item, needed in needs.items():
        if needed == 0 or available >= needed:
            continue
        if available == 0:
            reason = f"needs CUDA: {why}"
        else:
            reason = f"needs >= {needed} CUDA devices, found {available}"
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {PROFILE} (set HYPOTHESIS_PROFILE=dev|ci|gpu)"


@pytest.fixture(scope="module")
def pools():
    """The rank pools of one test module (``dist.PoolManager``): processes started once per (world size,
    environment) and shared by the module's multi-process tests; a module may define its own ``pools``."""
    import dist

    with dist.PoolManager() as manager:
        yield manager
