"""The runnable examples of the README: the CPU demo finishes and reports that every rank's check passed (also with
0 tokens per rank); started wrongly, the examples say what is wrong and how to launch them, without a traceback."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tokens", [32, 0])
@pytest.mark.parametrize("extra", [[], ["--gpus-per-node", "1"]], ids=["intranode", "internode-2x1"])
def test_cpu_demo_two_ranks(extra: list[str], tokens: int) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "cpu_demo.py"), "--num-processes", "2",
           "--num-experts", "8", "--num-tokens", str(tokens), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: 2 of 2 ranks passed (OK)" in proc.stdout, proc.stdout
    if tokens == 0:
        assert "rank 0: 0 tokens" in proc.stdout, proc.stdout


def test_cpu_demo_refuses_negative_tokens() -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "cpu_demo.py"), "--num-tokens", "-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--num-tokens must be >= 0, got -1" in proc.stderr and "Traceback" not in proc.stderr


def test_train_tiny_moe_without_torchrun_says_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_tiny_moe.py"), "--steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "torchrun --nproc-per-node 2 examples/train_tiny_moe.py --steps 3" in proc.stderr, proc.stderr
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in proc.stderr, proc.stderr
