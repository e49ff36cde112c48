"""tools/intra_trace.py on synthetic logs: parsing (the kernel's printf format and the tool's pattern agree), the
per-role table, the launch span and the critical path."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("intra_trace", REPO / "tools" / "intra_trace.py")
intra_trace = importlib.util.module_from_spec(_spec)
sys.modules["intra_trace"] = intra_trace
_spec.loader.exec_module(intra_trace)


def _role(warps, prologue, first, last, out_first, out, wait, wait_max, items):
    return f"{warps} {prologue} {first} {last} {out_first} {out} {wait} {wait_max} {items}"


def _line(kernel, rank, seq, cta, entry, s, p, r):
    return f"INTRATRACE {kernel} r{rank} s{seq} c{cta} g{entry} S {s} P {p} R {r}\n"


def _combine_log(path: Path) -> None:
    """2 ranks x 3 launches x 4 CTAs of a combine whose reducers leave last, waiting 60 % of their time; CTA 3
    enters 2 us late and leaves last. Noise lines in between, as in a benchmark's output."""
    lines = ["# bench output\n", "combine_bf16   16   16 ...\n"]
    for rank in (0, 1):
        for seq in (10, 11, 12):
            for cta in range(4):
                entry = 1_000_000 * seq + (2_000 if cta == 3 else 0)
                s = _role(8, 1_000, 1_100, 150_000, 140_000, 150_500, 8 * 20_000, 5_000, 32)
                p = _role(1, 1_000, 3_000, 199_000, 199_500, 199_500, 100_000, 30_000, 20)
                r = _role(23, 500, 600, 200_000, 190_000, 200_000 + 1_000 * cta, 23 * 120_000, 9_000, 256)
                lines.append(_line("combine", rank, seq, cta, entry, s, p, r))
            lines.append("UserWarning: something\n")
    path.write_text("".join(lines))


def test_kernel_format_matches_pattern(tmp_path):
    """Fill the printf format of csrc/kernels/intranode.cu with numbers: the tool's pattern must read it back."""
    src = (REPO / "csrc" / "kernels" / "intranode.cu").read_text()
    fmt = re.search(r'printf\("(INTRATRACE[^;]*?)\\n",', src, re.S).group(1)
    fmt = re.sub(r'"\s*"', "", fmt)  # adjacent string literals
    values = iter(range(100, 200))
    line = re.sub(r"%(?:s|d|lld|llu)", lambda m: "combine" if m.group() == "%s" else str(next(values)), fmt)
    m = intra_trace.LINE.search(line)
    assert m is not None, line
    log = tmp_path / "one.log"
    log.write_text(line + "\n")
    (cta,) = intra_trace.parse(str(log))
    assert (cta.kernel, cta.rank, cta.seq, cta.cta, cta.entry) == ("combine", 100, 101, 102, 103)
    assert cta.roles["S"]["warps"] == 104 and cta.roles["R"]["items"] == 130


def test_summary_of_combine(tmp_path):
    log = tmp_path / "trace.log"
    _combine_log(log)
    ctas = intra_trace.parse(str(log))
    assert len(ctas) == 24
    out: list[str] = []
    intra_trace.summarise(ctas, out=out.append)
    text = "\n".join(out)
    assert "INTRATRACE combine: 6 launches, 24 CTAs (ranks 0,1)" in text
    # Span: CTA 3 enters 2 us late and its reducers leave at 203 us -> 205 us; entry skew 2 us.
    assert re.search(r"launch span .*\s205\.0 /\s+205\.0\s+CTA entry skew\s+2\.0 /\s+2\.0", text), text
    assert "S (8 warps)" in out[2] and "P (1 warp)" in out[2] and "R (23 warps)" in out[2]
    # Wait per warp: S 20 us, P 100 us, R 120 us; R's waiting share 120 / (203 - 0.5) at the maximum.
    assert re.search(r"wait / warp\s+20\.0 /\s+20\.0\s+100\.0 /\s+100\.0\s+120\.0 /\s+120\.0", text), text
    assert re.search(r"last warp out\s+150\.5 /\s+150\.5\s+199\.5 /\s+199\.5\s+201\.5 /\s+203\.0", text), text
    assert re.search(r"items\s+32 /\s+32\s+20 /\s+20\s+256 /\s+256", text), text
    assert "critical path: last role out per CTA: R 100%; in each launch's last CTA: R 100%" in text
    assert "R leaves last (median out 203.0 us)" in text
    assert "tails (rows from the peer's ring senders" in text
    assert "hint: the receivers mostly wait for rows" in text


def test_publisher_last_and_kernel_filter(tmp_path):
    log = tmp_path / "trace.log"
    s = _role(12, 2_000, 2_100, 90_000, 80_000, 90_000, 0, 0, 16)
    p = _role(1, 2_000, 5_000, 100_000, 100_000, 100_000, 50_000, 10_000, 30)
    r = _role(19, 300, 400, 95_000, 94_000, 95_000, 19 * 10_000, 2_000, 100)
    log.write_text(_line("dispatch", 0, 1, 0, 5_000, s, p, r) + _line("dispatch", 0, 1, 1, 5_100, s, p, r)
                   + _line("combine", 0, 2, 0, 9_000, s, p, r))
    out: list[str] = []
    intra_trace.summarise([c for c in intra_trace.parse(str(log)) if c.kernel == "dispatch"], out=out.append)
    text = "\n".join(out)
    assert "INTRATRACE dispatch: 1 launches, 2 CTAs" in text and "combine" not in text
    assert "in each launch's last CTA: P 100%" in text
    assert "hint: the publisher leaves last" in text


def test_main_without_trace_lines(tmp_path, capsys):
    log = tmp_path / "empty.log"
    log.write_text("nothing here\n")
    assert intra_trace.main([str(log)]) == 1
    assert "no trace lines" in capsys.readouterr().out


def test_per_rank_files(tmp_path):
    """A log per rank (benchmarks with DEEP_EP_TRACE_DIR): parse and main read every file, in order."""
    whole = tmp_path / "trace.log"
    _combine_log(whole)
    lines = whole.read_text().splitlines(keepends=True)
    paths = []
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.log"
        path.write_text("".join(line for line in lines if f" r{rank} " in line))
        paths.append(str(path))
    ctas = intra_trace.parse(paths)
    assert len(ctas) == 24 and [c.rank for c in ctas] == [0] * 12 + [1] * 12
    assert intra_trace.main(paths + ["--kernel", "combine"]) == 0


def test_trace_to_rank_file(tmp_path):
    """bench_intranode.trace_to_rank_file sends fd 1 (where device printf lands) to <dir>/rank<r>.log."""
    import subprocess
    code = ("import os, sys; sys.path.insert(0, 'benchmarks'); from bench_intranode import trace_to_rank_file; "
            "trace_to_rank_file(3); os.write(1, b'INTRATRACE line\\n')")
    env = dict(os.environ, DEEP_EP_TRACE_DIR=str(tmp_path / "t"))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and (tmp_path / "t" / "rank3.log").read_text() == "INTRATRACE line\n"
