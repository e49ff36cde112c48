"""Summarise the section trace of a debug build's low-latency kernels (DEEP_EP_DEBUG_BUILD=1).

Each launch prints, for thread 0 of its first and last CTA, ``LLTRACE <kernel> p<phases> r<rank> b<cta> g<entry ns>
<cycles from entry to each section end>`` (csrc/kernels/low_latency_nvshmem.cu, SectionTrace). This prints, per
(kernel, phases, CTA), the median cycles to each section end and the same in microseconds at ``--ghz``, and the median
entry skew between the first and the last CTA of a launch.

    python tools/ll_trace.py out/bench_ll.log [--ghz 1.98]
    python tools/ll_trace.py out/trace_ll/rank*.log
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

LINE = re.compile(r"LLTRACE (\w+) p(\d) r(\d+) b(\d+) g(\d+) ((?:-?\d+ ?){8})")


def matches(logs, pattern: re.Pattern):
    """The matches of ``pattern`` in the lines of ``logs`` (a path, or several: one per rank when the benchmark ran
    with DEEP_EP_TRACE_DIR), in order; lines that do not match are skipped (the kernels' printf lines are mixed with
    the benchmark's output and, in one shared log, with other ranks' lines)."""
    for log in [logs] if isinstance(logs, str) else logs:
        with open(log, errors="replace") as f:
            for line in f:
                m = pattern.search(line)
                if m:
                    yield m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", nargs="+", help="the benchmark's log, or one file per rank (DEEP_EP_TRACE_DIR)")
    parser.add_argument("--ghz", type=float, default=1.98, help="SM clock for cycles -> us (H200 boost: 1.98)")
    args = parser.parse_args()
    stamps = defaultdict(list)
    entries = defaultdict(list)  # (kernel, phases, rank) -> [(cta, entry ns)] in order of appearance
    for m in matches(args.log, LINE):
        kernel, (phases, rank, cta, entry) = m.group(1), (int(m.group(i)) for i in range(2, 6))
        values = [int(v) for v in m.group(6).split()]
        stamps[(kernel, phases, "first" if cta == 0 else "last")].append(values)
        entries[(kernel, phases, rank)].append((cta, entry))
    for key in sorted(stamps):
        rows = stamps[key]
        med = [statistics.median(col) for col in zip(*rows)]
        used = [v for v in med if v > 0]
        print(f"{key[0]:<9} p{key[1]} {key[2]:<5} n={len(rows):<4} cycles " + " ".join(f"{v:8.0f}" for v in used)
              + "   us " + " ".join(f"{v / args.ghz / 1e3:6.2f}" for v in used))
    for key in sorted(entries):
        seq, skews = entries[key], []
        for (c0, g0), (c1, g1) in zip(seq, seq[1:]):
            if c0 == 0 and c1 != 0:
                skews.append(abs(g1 - g0))
        if skews:
            print(f"{key[0]:<9} p{key[1]} r{key[2]} entry skew first->last CTA: median "
                  f"{statistics.median(skews) / 1e3:.2f} us, max {max(skews) / 1e3:.2f} us")


if __name__ == "__main__":
    main()
