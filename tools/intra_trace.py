"""Summarise the role trace of a debug build's intranode dispatch / combine kernels (DEEP_EP_DEBUG_BUILD=1).

Every CTA of every launch prints ``INTRATRACE <kernel> r<rank> s<call_seq> c<channel> g<entry ns>`` and, per role
(S copy / ring-sender warps, P the publisher warp, R receiver / reducer warps), nine numbers: warps, prologue end,
first item begun, last item done, first warp out, last warp out (ns from the CTA's entry, -1: none), wait sum over
the role's warps, longest wait (ns), items (csrc/kernels/intranode.cu, RoleTrace). This prints, per kernel:

* the launch span (earliest CTA entry to the last warp out, per rank and launch) and the CTAs' entry skew;
* per role, the median and the maximum over CTAs and launches of each section time (us from the CTA's entry), of
  the wait per warp, of the longest wait, of the waiting share (wait per warp / time from the prologue's end to the
  role's last warp out) and of the items;
* the critical path: which role's warps leave last, in every CTA and in each launch's last CTA, what that role
  waited on and for how long, and a hint of what that points to.

    python tools/intra_trace.py out/trace_intra.log [--kernel combine]
    python tools/intra_trace.py out/trace_intra/rank*.log
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ll_trace import matches  # noqa: E402  (tools/ is not a package)

ROLES = ("S", "P", "R")
FIELDS = ("warps", "prologue", "first", "last", "out_first", "out", "wait", "wait_max", "items")
_ROLE = r"(-?\d+(?: -?\d+){8})"
LINE = re.compile(r"INTRATRACE (\w+) r(\d+) s(-?\d+) c(\d+) g(\d+) S " + _ROLE + " P " + _ROLE + " R " + _ROLE)

# What each role's waits are, per kernel.
WAITS = {
    ("combine", "S"): "ring space (heads: the peer's reducers, published by the peer's publisher)",
    ("combine", "R"): "tails (rows from the peer's ring senders, published by the peer's publisher)",
    ("dispatch", "S"): "ring space (heads returned by the peer's receivers)",
    ("dispatch", "R"): "tails (rows from the peer's copy warps, published by the peer's publisher)",
}
IDLE = "idle polls: nothing new from the local copy / reducer warps to publish"


@dataclass
class Cta:
    kernel: str
    rank: int
    seq: int
    cta: int
    entry: int
    roles: dict  # role letter -> {field: int}

    def out(self) -> int:
        return max((r["out"] for r in self.roles.values() if r["warps"] > 0), default=-1)


def parse(log) -> list[Cta]:
    ctas = []
    for m in matches(log, LINE):
        roles = {}
        for i, role in enumerate(ROLES):
            values = [int(v) for v in m.group(6 + i).split()]
            roles[role] = dict(zip(FIELDS, values))
        ctas.append(Cta(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), roles))
    return ctas


def _us(ns: float) -> str:
    return f"{ns / 1e3:7.1f}"


def _med_max(values: list[float], fmt=_us) -> str:
    if not values:
        return f"{'-':>7} / {'-':>7}"
    return f"{fmt(statistics.median(values))} / {fmt(max(values))}"


def _waiting_share(role: dict) -> float | None:
    """Share of the role's time (prologue end to its last warp out) that an average warp spent waiting."""
    span = role["out"] - max(role["prologue"], 0)
    if role["warps"] <= 0 or role["out"] < 0 or span <= 0:
        return None
    return role["wait"] / role["warps"] / span


def _stamp(field: str):
    return lambda r: r[field] if r[field] >= 0 else None


def _share(s: float) -> str:
    return f"{100 * s:6.0f}%"


def _count(n: float) -> str:
    return f"{n:7.0f}"


# Rows of the per-role table: label, value of one CTA's role (None: not stamped), format.
TABLE = (
    ("prologue end", _stamp("prologue"), _us),
    ("first item", _stamp("first"), _us),
    ("last item", _stamp("last"), _us),
    ("first warp out", _stamp("out_first"), _us),
    ("last warp out", _stamp("out"), _us),
    ("wait / warp", lambda r: r["wait"] / r["warps"], _us),
    ("longest wait", lambda r: r["wait_max"], _us),
    ("waiting share", _waiting_share, _share),
    ("items", lambda r: r["items"], _count),
)


def _role_head(role: str, warps: float) -> str:
    return f"{role} ({warps:.0f} warp{'s' if warps != 1 else ''})".rjust(19)


def last_role(cta: Cta) -> str | None:
    live = [r for r in ROLES if cta.roles[r]["warps"] > 0 and cta.roles[r]["out"] >= 0]
    return max(live, key=lambda r: cta.roles[r]["out"]) if live else None


def _shares(counter: Counter) -> str:
    total = max(sum(counter.values()), 1)
    return " ".join(f"{r} {100 * counter[r] / total:.0f}%" for r in ROLES if counter[r])


def hint(kernel: str, role: str, share: float, sender_share: float | None) -> str:
    if role == "R":
        if share >= 0.5:
            if sender_share is not None and sender_share >= 0.3:
                return ("the receivers wait for rows while the senders wait for ring space: the ring round trip "
                        "(tail -> reduce -> head) limits, not a copy rate")
            return "the receivers mostly wait for rows: the senders (their copy rate or publication) limit"
        return "the receivers are mostly busy: their own copy / reduction rate limits"
    if role == "S":
        if share >= 0.5:
            return "the senders mostly wait for ring space: the peer's receivers / head returns limit"
        return "the senders are mostly busy: their copy rate limits"
    return "the publisher leaves last: its publications (fences, head / tail stores) trail the copy warps"


def summarise(ctas: list[Cta], out=print) -> None:
    by_kernel = defaultdict(list)
    for c in ctas:
        by_kernel[c.kernel].append(c)
    for kernel in sorted(by_kernel):
        rows = by_kernel[kernel]
        launches = defaultdict(list)
        for c in rows:
            launches[(c.rank, c.seq)].append(c)
        spans, skews, last_of_launch = [], [], []
        for group in launches.values():
            first_entry = min(c.entry for c in group)
            spans.append(max(c.entry + c.out() for c in group) - first_entry)
            skews.append(max(c.entry for c in group) - first_entry)
            last_of_launch.append(max(group, key=lambda c: c.entry + c.out()))
        ranks = sorted({c.rank for c in rows})
        out(f"INTRATRACE {kernel}: {len(launches)} launches, {len(rows)} CTAs (ranks {','.join(map(str, ranks))});"
            f" us, median / max over CTAs and launches")
        out(f"  launch span (first CTA in -> last warp out) {_med_max(spans)}   CTA entry skew {_med_max(skews)}")
        live = {role: [c.roles[role] for c in rows if c.roles[role]["warps"] > 0] for role in ROLES}
        live = {role: rs for role, rs in live.items() if rs}
        head = "".join(_role_head(role, statistics.median(r["warps"] for r in rs)) for role, rs in live.items())
        out(f"  {'':<15}{head}")
        for label, value, fmt in TABLE:
            cells = (_med_max([v for v in map(value, rs) if v is not None], fmt) for rs in live.values())
            out(f"  {label:<15}" + "".join(c.rjust(19) for c in cells))
        per_cta = Counter(last_role(c) for c in rows)
        per_launch = Counter(last_role(c) for c in last_of_launch)
        out(f"  critical path: last role out per CTA: {_shares(per_cta)}; in each launch's last CTA: "
            f"{_shares(per_launch)}")
        role = per_launch.most_common(1)[0][0] if per_launch else None
        if role is None:
            continue
        crit = [c.roles[role] for c in last_of_launch if last_role(c) == role]
        waits = [r["wait"] / r["warps"] for r in crit]
        shares = [s for s in (_waiting_share(r) for r in crit) if s is not None]
        share = statistics.median(shares) if shares else 0.0
        what = IDLE if role == "P" else WAITS.get((kernel, role), "its waits")
        out(f"  {role} leaves last (median out {_us(statistics.median(r['out'] for r in crit)).strip()} us); it "
            f"waited {_us(statistics.median(waits)).strip()} us per warp ({100 * share:.0f}% of its time)")
        out(f"    on {what}")
        sender = [s for s in (_waiting_share(c.roles["S"]) for c in last_of_launch) if s is not None]
        out(f"  hint: {hint(kernel, role, share, statistics.median(sender) if sender else None)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", nargs="+", help="the benchmark's log, or one file per rank (DEEP_EP_TRACE_DIR)")
    parser.add_argument("--kernel", choices=["dispatch", "combine"], help="only this kernel's lines")
    args = parser.parse_args(argv)
    ctas = [c for c in parse(args.log) if args.kernel is None or c.kernel == args.kernel]
    if not ctas:
        print(f"INTRATRACE: no trace lines in {' '.join(args.log)} (a release build prints none: "
              f"DEEP_EP_DEBUG_BUILD=1)")
        return 1
    summarise(ctas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
