"""Summarise the section trace of a debug build's low-latency kernels (DEEP_EP_DEBUG_BUILD=1).

Each launch prints one line from its last CTA to finish (csrc/kernels/low_latency_nvshmem.cu, SectionTrace):
``LLTRACE <kernel> p<phases> r<rank> n<CTAs> <latest entry> <earliest end> <latest end> ...`` (one pair per section,
-1 when unused), in ns from the launch's earliest CTA entry. This prints, per (kernel, phases), the median over
launches and ranks of each number, in microseconds, with the sections' names.

    python tools/ll_trace.py out/trace_ll/rank*.log
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

LINE = re.compile(r"LLTRACE (\w+) p(\d) r(\d+) n(\d+) ((?:-?\d+ ?){17})")
SECTIONS = {
    ("dispatch", 1): ["counted", "count words", "planned", "messages", "signalled"],
    ("dispatch", 2): ["counts received", "data arrived", "expanded"],
    ("dispatch", 3): ["counted", "count words", "planned", "messages", "signalled", "counts received",
                      "data arrived", "expanded"],
    ("combine", 1): ["row prefix", "rows sent"],
    ("combine", 2): ["arrivals seen", "first rows arrived", "first token reduced", "all reduced"],
    ("combine", 3): ["row prefix", "rows sent", "arrivals seen", "first rows arrived", "first token reduced",
                     "all reduced"],
    ("combine_partials", 3): ["routing published", "partials sent", "all reduced"],
}


def matches(logs, pattern: re.Pattern):
    """The matches of ``pattern`` in the lines of ``logs`` (one path or several), in order; other lines skipped."""
    for log in [logs] if isinstance(logs, str) else logs:
        with open(log, errors="replace") as f:
            for line in f:
                m = pattern.search(line)
                if m:
                    yield m


def summarise(logs) -> list[str]:
    rows = defaultdict(list)
    for m in matches(logs, LINE):
        rows[(m.group(1), int(m.group(2)))].append([int(v) for v in m.group(5).split()])
    out = []
    for key in sorted(rows):
        med = [statistics.median(col) for col in zip(*rows[key])]
        names = SECTIONS.get(key, [])
        out.append(f"{key[0]} p{key[1]} ({len(rows[key])} launches): CTA entries spread over {med[0] / 1e3:.2f} us")
        for i in range((len(med) - 1) // 2):
            first, last = med[1 + 2 * i], med[2 + 2 * i]
            if last < 0:
                continue
            name = names[i] if i < len(names) else f"section {i}"
            out.append(f"  {name:<20} first CTA {first / 1e3:7.2f} us   last CTA {last / 1e3:7.2f} us")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", nargs="+", help="the benchmark's log, or one file per rank (DEEP_EP_TRACE_DIR)")
    args = parser.parse_args()
    print("\n".join(summarise(args.log)))


if __name__ == "__main__":
    main()
