"""tools/ll_trace.py on a synthetic log: the kernel's printf format (one LLTRACE line per launch, 17 numbers: latest
entry, then earliest / latest end per section, -1 when unused) parses, and the medians land on the named sections."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ll_trace", REPO / "tools" / "ll_trace.py")
ll_trace = importlib.util.module_from_spec(_spec)
sys.modules["ll_trace"] = ll_trace
_spec.loader.exec_module(ll_trace)


def _line(kernel: str, phases: int, rank: int, values: list) -> str:
    values = values + [-1] * (17 - len(values))
    return f"LLTRACE {kernel} p{phases} r{rank} n132 " + " ".join(str(v) for v in values) + "\n"


def test_kernel_printf_format_matches_the_tool():
    src = (REPO / "csrc" / "kernels" / "low_latency_nvshmem.cu").read_text()
    fmt = re.search(r'printf\("LLTRACE %s p%d r%d n%d ((?:%lld ?)+)', src.replace('"\n               "', ""))
    assert fmt is not None and len(fmt.group(1).split()) == 17


def test_medians_per_section(tmp_path: Path):
    log = tmp_path / "rank0.log"
    lines = ["T  disp us ...\n"]
    # Fused combine: spread 300 ns; row prefix 1.0-1.4 us; rows sent 16-26 us; arrival words seen, rows staged,
    # reduced (3 launches).
    for extra in (0, 1000, 2000):
        lines.append(_line("combine", 3, 0, [300, 1000, 1400, 16000, 26000 + extra, 1700, 28500 + extra,
                                             1800, 29000 + extra, 27700, 31000 + extra, 27800, 31100 + extra]))
        lines.append("noise between launches\n")
    log.write_text("".join(lines))
    out = ll_trace.summarise([str(log)])
    assert out[0].startswith("combine p3 (3 launches): CTA entries spread over 0.30 us")
    sections = {line.split("first CTA")[0].strip(): line for line in out[1:]}
    assert list(sections) == ["row prefix", "rows sent", "arrivals seen", "first rows arrived", "first token reduced",
                              "all reduced"]
    assert "last CTA   29.50 us" in sections["arrivals seen"]
    assert "last CTA   27.00 us" in sections["rows sent"]  # median of 26, 27, 28 us
    assert "first CTA    1.80 us" in sections["first rows arrived"]
