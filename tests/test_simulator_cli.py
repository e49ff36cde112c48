"""Tests of the ``python -m simulator`` command line as a planner uses it: the kernel family it plans for, the
comparison of two families, one-line errors for every misuse, the low-latency token limit, a fluid batch within
port capacity, the plot, ``--help``, the recommended settings with their time and the golden outputs. The CLI runs
in-process (``main``). Regenerate the golden files after an intended model change with:
    python -m simulator --preset v3-ep64 > tests/golden/v3-ep64.txt
    python -m simulator --preset h200-ep2 > tests/golden/h200-ep2.txt
    python -m simulator --preset v3-ep64 --compare deepep > tests/golden/v3-ep64-compare.txt
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import simpy

from simulator import Scenario, run, scenario
from simulator.__main__ import PRESET_HELP, main, plan_parser
from simulator.links import FluidNetwork

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
ERROR_PREFIX = "python -m simulator"


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``python -m simulator ARGS``, run in this process."""
    try:
        rc = main(list(args))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------------------------------------------
# The kernel family and the comparison
# ---------------------------------------------------------------------------------------------------------------

def test_default_plans_for_deep_ep_and_names_it(capsys):
    rc, out, _ = _cli(capsys, "--mode", "low-latency")
    assert rc == 0
    assert out.splitlines()[0].startswith("deep_ep simulator, kernels deep_ep (this library's kernels): H800")
    rc, out, _ = _cli(capsys, "--mode", "low-latency", "--json")
    data = json.loads(out)
    assert data["kernels"] == "deep_ep" and data["scenario"]["kernels"] == "deep_ep"
    assert data["kernels_description"] == "this library's kernels"
    rc, out, _ = _cli(capsys, "--mode", "low-latency", "--kernels", "deepep")
    assert "kernels deepep (DeepEP V1's kernels)" in out.splitlines()[0]
    # A preset does not choose the family: it stays the default, or what --kernels says.
    rc, out, _ = _cli(capsys, "--preset", "decode-ep32", "--json")
    assert json.loads(out)["kernels"] == "deep_ep"


def test_compare_text_and_json(capsys):
    args = ("--tokens", "512", "--ll-tokens", "64")
    rc, out, _ = _cli(capsys, *args, "--compare", "deepep", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["kernels"] == "deep_ep" and data["compare"] == "deepep"
    ours = run(Scenario(tokens=512, ll_tokens=64, kernels="deep_ep"))
    theirs = run(Scenario(tokens=512, ll_tokens=64, kernels="deepep"))
    assert [(r["mode"], r["op"]) for r in data["comparison"]] == [(r.mode, r.op) for r in ours.ops]
    for row, a, b in zip(data["comparison"], ours.ops, theirs.ops):
        assert row["time_us"] == {"deep_ep": round(a.time_us, 2), "deepep": round(b.time_us, 2)}
        assert row["ratio"] == pytest.approx(a.time_us / b.time_us, abs=1e-3)
    assert data["reports"]["deepep"]["kernels"] == "deepep"
    rc, text, _ = _cli(capsys, *args, "--compare")  # without a name: the other family
    assert "kernels deep_ep (this library's kernels) vs deepep (DeepEP V1's kernels)" in text.splitlines()[0]
    assert "ratio = deep_ep time / deepep time" in text
    for a, b in zip(ours.ops, theirs.ops):
        assert re.search(rf"{a.mode}\s+{a.op}\s.*\s{a.time_us:.1f}\s+{b.time_us:.1f}\s+{a.time_us / b.time_us:.2f}",
                         text)
    rc, text, _ = _cli(capsys, *args, "--kernels", "deepep", "--compare")
    assert "kernels deepep (DeepEP V1's kernels) vs deep_ep" in text.splitlines()[0]


@pytest.mark.parametrize("golden, args", [("v3-ep64", ()), ("h200-ep2", ()),
                                           ("v3-ep64-compare", ("--compare", "deepep"))])
def test_golden_output(capsys, golden, args):
    rc, out, _ = _cli(capsys, "--preset", golden.removesuffix("-compare"), *args)
    assert rc == 0 and out == (GOLDEN / f"{golden}.txt").read_text()


def test_make_run_shows_the_comparison_for_8_nodes():
    makefile = (ROOT / "Makefile").read_text()
    sim_args = re.search(r"^SIM_ARGS\s*\?=\s*(.*)$", makefile, re.M).group(1).split()
    assert sim_args[:2] == ["--nodes", "8"] and "--compare" in sim_args
    run_target = makefile[makefile.index("\nrun:"):]
    assert "-m simulator $(SIM_ARGS)" in run_target.split("\n\n")[0]


# ---------------------------------------------------------------------------------------------------------------
# Misuse: one line on stderr, exit status 2, no usage block, no traceback
# ---------------------------------------------------------------------------------------------------------------

MISUSES = [
    (["--plot", "{tmp}/missing/plan.png", "--sweep-nodes", "1,2"], "does not exist"),
    (["--plot", "{tmp}/plan.xyz", "--sweep-nodes", "1,2"], "the extension picks the format"),
    (["--plot", "{tmp}/plan.png"], "needs --sweep-nodes with two counts"),
    (["--plot", "{tmp}/plan.png", "--sweep-nodes", "2"], "needs --sweep-nodes with two counts"),
    (["--plot", "{tmp}/plan.png", "--sweep-nodes", "1,2", "--compare"], "--plot draws one kernel family"),
    (["--nodes", "2", "--sweep-nodes", "1,2"], "--nodes and --sweep-nodes: give one"),
    (["--sweep-nodes", "1,1"], "lists a node count twice"),
    (["--mode", "normal", "--ll-tokens", "64"], "--mode is normal"),
    (["--mode", "low-latency", "--tokens", "64", "--ll-tokens", "64"], "give one"),
    (["--mode", "low-latency", "--num-sms", "20"], "--mode is low-latency"),
    (["--mode", "low-latency", "--tokens", "4096"], "--tokens must be <= 1024 in low-latency mode"),
    (["--ll-tokens", "2000"], "--ll-tokens must be in [1, 1024]"),
    (["--hidden", "256"], "--hidden must be in [1024, 16384] in low-latency mode"),
    (["--compare", "cuda"], "--compare must name a kernel family"),
    (["--compare", "deep_ep"], "another kernel family than --kernels"),
    (["--nic", "nvlink-p2p", "--nodes", "2", "--compare"], "--compare deepep: nic nvlink-p2p"),
    (["--routing", "trace:{tmp}/bad.json"], "not valid JSON"),
    (["--nodes", "0"], "--nodes must be in [1, 1024]"),
    (["--num-sms", "7"], "--num-sms must be even"),
    (["--experts", "100", "--redundant-experts", "0"], "must be divisible by the EP size"),
    (["--routing", "zipf:x"], "zipf:A needs a number"),
    (["--routing", "trace:{tmp}/missing.json"], "cannot read file"),
    (["--sweep-nodes", "1,a"], "comma-separated list"),
    (["--tokens", "x"], "invalid int value"),
    (["--kernels", "cuda"], "invalid choice"),
    (["--bogus"], "unrecognized arguments"),
    (["validate", "--set", "nope"], "--set must name sets"),
    (["predict", "--calibration", "{tmp}/missing.json"], "--calibration must be an existing file"),
]


@pytest.mark.parametrize(("args", "message"), MISUSES, ids=[" ".join(a) for a, _ in MISUSES])
def test_misuse_is_one_line(capsys, tmp_path, args, message):
    (tmp_path / "bad.json").write_text("{not json")
    rc, out, err = _cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(ERROR_PREFIX), err
    assert message in err and "usage:" not in err and "Traceback" not in err
    assert not (tmp_path / "plan.png").exists()


# ---------------------------------------------------------------------------------------------------------------
# Low-latency tokens, utilisation
# ---------------------------------------------------------------------------------------------------------------

def test_low_latency_limits_match_the_library():
    from deep_ep import validate as v
    assert (scenario.LL_MAX_TOKENS, scenario.LL_MIN_HIDDEN, scenario.LL_MAX_HIDDEN) == (
        v.LL_MAX_TOKENS, v.LL_MIN_HIDDEN, v.LL_MAX_HIDDEN)


def test_tokens_do_not_leak_into_low_latency_past_its_limit(capsys):
    assert Scenario(tokens=4096).low_latency_tokens == scenario.LL_MAX_TOKENS
    assert Scenario(tokens=256).low_latency_tokens == 256
    assert Scenario(tokens=4096, ll_tokens=64).low_latency_tokens == 64
    rc, out, _ = _cli(capsys, "--tokens", "4096", "--json")
    data = json.loads(out)
    result = data["results"][0]
    assert result["normal"]["dispatch"]["tokens_per_rank"] == 4096
    assert result["low-latency"]["dispatch"]["tokens_per_rank"] == scenario.LL_MAX_TOKENS
    assert any("low-latency rows use 1024 tokens per rank" in n for n in data["notes"])


def test_fluid_batched_completion_keeps_utilization_within_capacity():
    env = simpy.Environment()
    net = FluidNetwork(env, [100.0], ["port"])
    ports, coefs = np.array([0]), np.array([1.0])
    ends = []

    def flow(size):
        ends.append((yield net.transfer(f"f{size}", size, ports, coefs)))
    env.process(flow(1000.0))
    env.process(flow(1001.0))  # ends within the batch tolerance of the first: both complete together
    env.run()
    assert net.port_bytes[0] == pytest.approx(2001.0)
    assert max(ends) < 2001.0 / 100.0  # the batch finished it early ...
    assert net.utilization(max(ends))[0] <= 1.0 + 1e-12  # ... and the port still never ran above capacity


# ---------------------------------------------------------------------------------------------------------------
# Plot, help, recommendations
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, head", [("plan.svg", b"<?xml"), ("plan.png", b"\x89PNG\r\n\x1a\n")])
def test_plot_says_what_it_wrote_and_puts_one_unit_per_axis(capsys, tmp_path, name, head):
    path = tmp_path / name
    rc, out, err = _cli(capsys, "--sweep-nodes", "1,2", "--tokens", "256", "--plot", str(path))
    assert rc == 0 and path.read_bytes().lstrip().startswith(head)  # the extension picks the format
    assert err.startswith(f"wrote {path}: ") and "nodes 1,2" in err
    assert "    1    8 normal" in out and "    2   16 normal" in out  # the sweep's table: one row per scale
    report = scenario.run_sweep(Scenario(tokens=256, kernels="deep_ep"), [1, 2])
    assert [s.nodes for s in report.scales] == [1, 2]
    fig = report.figure()
    axes = fig.get_axes()
    assert len(axes) == 4  # one row per mode: time, bandwidth
    for ax in axes:
        assert len(re.findall(r"\(([^)]*)\)", ax.get_ylabel())) == 1, ax.get_ylabel()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
        assert len({line.get_label() for line in ax.get_lines()}) == len(ax.get_lines()) == 2


def test_help_describes_every_flag_subcommand_and_preset(capsys):
    parser = plan_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
    rc, out, _ = _cli(capsys, "--help")
    assert rc == 0
    for name in ("validate", "predict"):
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), name
    assert set(PRESET_HELP) == set(scenario.PRESETS)
    for name, text in PRESET_HELP.items():
        assert f"{name}  " in out and text in out.replace("\n", " ")


def test_recommended_settings_come_with_their_time(capsys):
    rc, out, _ = _cli(capsys, "--gpus-per-node", "2", "--gpu", "h200", "--routing", "uniform", "--json")
    result = json.loads(out)["results"][0]
    rec = result["recommended_num_sms"]
    at_rec = run(Scenario(gpus_per_node=2, gpu="h200", routing="uniform", mode="normal", num_sms=rec,
                          kernels="deep_ep"))
    assert result["recommended_num_sms_time_us"] == {r.op: round(r.time_us, 2) for r in at_rec.ops}
    rc, text, _ = _cli(capsys, "--gpus-per-node", "2", "--gpu", "h200", "--routing", "uniform")
    times = "/".join(f"{r.time_us:.1f}" for r in at_rec.ops).replace("/", ", ")
    assert f"recommended: num_sms {rec} -> normal dispatch/combine {times} us" in text
    ll = [result["low-latency"][op]["time_us"] for op in ("dispatch", "combine")]
    assert (f"recommended: num_qps_per_rank {result['recommended_num_qps_per_rank']} -> low-latency "
            f"dispatch/combine {ll[0]:.1f}, {ll[1]:.1f} us") in text
    # DeepEP V1's family too (its tuned chunks at the recommended SM count): from 4 SMs, more SMs are faster.
    report = run(Scenario(nodes=2, tokens=512, kernels="deepep", mode="normal", num_sms=4))
    scale = report.scales[0]
    assert scale.recommended_num_sms > 4 and set(scale.recommended_sms_time_us) == {"dispatch", "combine"}
    for r in report.ops:
        assert scale.recommended_sms_time_us[r.op] < r.time_us
