"""Routing workloads (which experts each token picks) and the traffic they induce.

Pure Python, seeded with ``random.Random(seed)``; no torch, no numpy. Routing kinds (``Workload.routing``):

* ``uniform``: top-k of i.i.d. scores over all experts (DeepEP's intranode and low-latency tests): a uniformly
  random k-subset.
* ``group-limited``: DeepEP's internode test / DeepSeek-V3 node-limited routing: a token keeps the ``min(nodes, 4)``
  nodes with the largest maximum score and takes its top-k inside them, sampled exactly from a uniformly random
  permutation of the experts (the first distinct groups met are the best ones).
* ``zipf:A``: expert popularity ``p_e ∝ 1 / rank^A`` (ranks randomly permuted); top-k sampled without replacement.
* ``trace:FILE``: replay of saved ``topk_idx``; see :func:`load_trace` for the format.

``redundant_experts > 0`` adds EPLB-style replicas of the hottest logical experts (longest-processing-time placement
onto the least loaded rank) and splits each replicated expert's tokens evenly between its copies.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

# Tokens are drawn for at most this many distinct source ranks; the others reuse them (ranks are exchangeable
# under synthetic routing). A trace supplies its own ranks and is reused cyclically if it has fewer.
MAX_SAMPLED_SOURCES = 8
# DeepEP's low-latency test masks this many random (token, k) entries to -1.
LL_NUM_MASKED = 10
# Node limit of group-limited routing (DeepSeek-V3: each token reaches at most 4 nodes).
MAX_ROUTED_NODES = 4


@dataclass(frozen=True)
class SourceTraffic:
    """What one source rank sends, aggregated over its tokens.

    Attributes:
        num_tokens: tokens on this rank.
        num_selections: valid (token, expert) selections (``topk_idx >= 0``), the LL message count.
        rows_to_rank: ``[num_ranks]`` tokens with at least one selected expert on each rank (normal-mode rows).
        msgs_to_rank: ``[num_ranks]`` selections whose expert lives on each rank (LL messages).
        records_to_node: ``[num_nodes]`` tokens with at least one selected expert on each node (RDMA records).
    """

    num_tokens: int
    num_selections: int
    rows_to_rank: tuple[int, ...]
    msgs_to_rank: tuple[int, ...]
    records_to_node: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return sum(self.rows_to_rank)

    @property
    def num_records(self) -> int:
        return sum(self.records_to_node)


def parse_routing(text: str) -> tuple[str, float | str | None]:
    """``'uniform'`` / ``'group-limited'`` / ``'zipf:A'`` / ``'trace:FILE'`` -> ``(kind, argument)``."""
    if not isinstance(text, str):
        raise TypeError(f"routing must be a str, got {type(text).__name__}")
    if text in ("uniform", "group-limited"):
        return text, None
    if text.startswith("zipf:"):
        try:
            alpha = float(text[5:])
        except ValueError:
            raise ValueError(f"routing zipf:A needs a number A >= 0, got {text!r}") from None
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"routing zipf:A needs a finite A >= 0, got {text!r}")
        return "zipf", alpha
    if text.startswith("trace:") and len(text) > 6:
        return "trace", text[6:]
    raise ValueError(f"routing must be uniform, group-limited, zipf:A or trace:FILE, got {text!r}")


def read_json(path: str, label: str) -> object:
    """The JSON content of ``path``; ``ValueError`` starting with ``label`` when unreadable or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{label}: cannot read file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{label}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def load_trace(path: str) -> tuple[int | None, list[list[list[int]]]]:
    """Read a ``topk_idx`` trace.

    Format: a JSON object ``{"num_experts": E, "topk_idx": [rank][token][k]}`` (ints, ``-1`` = no selection), or a
    bare JSON list ``[rank][token][k]``. From torch: ``json.dump({"num_experts": E, "topk_idx": [t.tolist() for t in
    per_rank_topk_idx]}, f)``. ``num_experts`` is optional (then the CLI's ``--experts`` applies).

    Returns:
        ``(num_experts or None, topk_idx per rank)``.

    Raises:
        ValueError naming the file and the rule when the content is malformed.
    """
    data = read_json(path, f"routing trace:{path}")
    num_experts = None
    if isinstance(data, dict):
        num_experts = data.get("num_experts")
        data = data.get("topk_idx")
    if not isinstance(data, list) or not data:
        raise ValueError(f"routing trace:{path}: topk_idx must be a non-empty list [rank][token][k]")
    width = None
    for r, rank_rows in enumerate(data):
        if not isinstance(rank_rows, list):
            raise ValueError(f"routing trace:{path}: topk_idx[{r}] must be a list of tokens")
        for t, row in enumerate(rank_rows):
            if not isinstance(row, list) or not all(isinstance(e, int) and e >= -1 for e in row):
                raise ValueError(f"routing trace:{path}: topk_idx[{r}][{t}] must be a list of ints >= -1, got {row!r}")
            width = len(row) if width is None else width
            if len(row) != width:
                raise ValueError(f"routing trace:{path}: every token needs the same top-k ({width}), "
                                 f"topk_idx[{r}][{t}] has {len(row)}")
    if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                    or num_experts < 1):
        raise ValueError(f"routing trace:{path}: num_experts must be a positive int, got {num_experts!r}")
    return num_experts, data


def trace_max_expert(topk_idx: list[list[list[int]]]) -> int:
    return max((e for rank_rows in topk_idx for row in rank_rows for e in row), default=-1)


class Router:
    """Draws ``topk_idx`` rows for one workload, deterministically from ``seed``.

    Args:
        kind, arg: from :func:`parse_routing`.
        num_experts: logical experts ``E``.
        topk: experts per token ``K``.
        num_nodes: scale-out domains (group-limited routing groups experts by node).
        seed: RNG seed.
        trace: per-rank ``topk_idx`` when ``kind == 'trace'``.
    """

    def __init__(self, kind: str, arg: float | str | None, num_experts: int, topk: int, num_nodes: int, seed: int,
                 trace: list[list[list[int]]] | None = None) -> None:
        self.kind, self.num_experts, self.topk, self.num_nodes = kind, num_experts, topk, num_nodes
        self.rng = random.Random(seed)
        self.trace = trace
        self.popularity = [1.0 / num_experts] * num_experts
        if kind == "zipf":
            order = list(range(num_experts))
            self.rng.shuffle(order)
            weights = [0.0] * num_experts
            for rank, e in enumerate(order):
                weights[e] = 1.0 / (rank + 1) ** float(arg)  # type: ignore[arg-type]
            total = sum(weights)
            self.popularity = [w / total for w in weights]
            self._cum = []
            acc = 0.0
            for w in self.popularity:
                acc += w
                self._cum.append(acc)
        elif kind == "trace" and trace is not None:
            counts = [0] * num_experts
            for rank_rows in trace:
                for row in rank_rows:
                    for e in row:
                        if e >= 0:
                            counts[e] += 1
            total = sum(counts) or 1
            self.popularity = [c / total for c in counts]

    def _uniform(self) -> list[int]:
        return self.rng.sample(range(self.num_experts), self.topk)

    def _group_limited(self) -> list[int]:
        """Exact draw without drawing every score. Walk experts in decreasing score order (a uniformly random
        permutation): until ``keep`` groups are known every expert met is in a chosen group (or opens one), so it
        is picked; after that the remaining picks are a uniform sample of the unmet experts of the chosen groups.
        Group of expert ``e`` = ``e * groups // E`` (contiguous blocks, one per node)."""
        groups, num_experts = self.num_nodes, self.num_experts
        keep = min(groups, MAX_ROUTED_NODES)
        if keep == groups:  # every group may be chosen: no limit, plain top-k
            return self._uniform()
        rand = self.rng.random
        picked: list[int] = []
        chosen: set[int] = set()
        while len(picked) < self.topk and len(chosen) < keep:
            e = int(rand() * num_experts)
            if e in picked:
                continue
            picked.append(e)
            chosen.add(e * groups // num_experts)
        if len(picked) < self.topk:
            # Uniform draws over the chosen groups' experts, rejecting repeats (= sampling without replacement).
            ranges = [(-(-g * num_experts // groups), -(-(g + 1) * num_experts // groups)) for g in sorted(chosen)]
            total = sum(hi - lo for lo, hi in ranges)
            while len(picked) < self.topk:
                i = int(rand() * total)
                for lo, hi in ranges:
                    if i < hi - lo:
                        e = lo + i
                        break
                    i -= hi - lo
                if e not in picked:
                    picked.append(e)
        return picked

    def _zipf(self) -> list[int]:
        picked: list[int] = []
        seen: set[int] = set()
        cum, choices = self._cum, self.rng.choices
        population = range(self.num_experts)
        while len(picked) < self.topk:
            for e in choices(population, cum_weights=cum, k=self.topk):
                if e not in seen:
                    seen.add(e)
                    picked.append(e)
                    if len(picked) == self.topk:
                        break
        return picked

    def rank_rows(self, rank: int, num_tokens: int, mask_ll: bool = False) -> list[list[int]]:
        """``topk_idx`` of one source rank: ``[num_tokens][topk]`` ints, ``-1`` for masked entries."""
        if self.kind == "trace":
            assert self.trace is not None
            rows = self.trace[rank % len(self.trace)]
            return [list(rows[t % len(rows)]) for t in range(num_tokens)] if rows else []
        draw = {"uniform": self._uniform, "group-limited": self._group_limited, "zipf": self._zipf}[self.kind]
        rows = [draw() for _ in range(num_tokens)]
        if mask_ll and num_tokens > 0:
            for _ in range(LL_NUM_MASKED):
                rows[self.rng.randrange(num_tokens)][self.rng.randrange(self.topk)] = -1
        return rows


def replica_placement(popularity: list[float], num_redundant: int, num_ranks: int) -> list[list[int]]:
    """Physical copies of each logical expert: ``copies[e]`` lists the physical expert slots of ``e``.

    The ``num_redundant`` most popular logical experts get one extra copy each. Copies are placed
    longest-processing-time first onto the least loaded rank with a free slot; each rank has
    ``(E + num_redundant) / num_ranks`` slots.
    """
    num_logical = len(popularity)
    num_physical = num_logical + num_redundant
    slots_per_rank = num_physical // num_ranks
    hot = sorted(range(num_logical), key=lambda e: (-popularity[e], e))[:num_redundant]
    num_copies = [1] * num_logical
    for e in hot:
        num_copies[e] += 1
    items = sorted(((popularity[e] / num_copies[e], e) for e in range(num_logical) for _ in range(num_copies[e])),
                   key=lambda x: (-x[0], x[1]))
    load = [0.0] * num_ranks
    used = [0] * num_ranks
    copies: list[list[int]] = [[] for _ in range(num_logical)]
    for weight, e in items:
        rank = min((r for r in range(num_ranks) if used[r] < slots_per_rank), key=lambda r: (load[r], r))
        copies[e].append(rank * slots_per_rank + used[rank])
        used[rank] += 1
        load[rank] += weight
    return copies


def summarize(rows: list[list[int]], num_ranks: int, experts_per_rank: int, ranks_per_node: int) -> SourceTraffic:
    """Aggregate one source rank's ``topk_idx`` (physical expert ids) into per-rank / per-node counts."""
    num_nodes = num_ranks // ranks_per_node
    rows_to_rank = [0] * num_ranks
    msgs_to_rank = [0] * num_ranks
    records_to_node = [0] * num_nodes
    num_selections = 0
    for row in rows:
        ranks = [e // experts_per_rank for e in row if e >= 0]
        num_selections += len(ranks)
        for r in ranks:
            msgs_to_rank[r] += 1
        distinct = set(ranks)
        for r in distinct:
            rows_to_rank[r] += 1
        for n in {r // ranks_per_node for r in distinct}:
            records_to_node[n] += 1
    return SourceTraffic(len(rows), num_selections, tuple(rows_to_rank), tuple(msgs_to_rank), tuple(records_to_node))


def build_traffic(router: Router, num_ranks: int, ranks_per_node: int, num_tokens: int, num_redundant: int,
                  mask_ll: bool, max_sources: int = MAX_SAMPLED_SOURCES) -> list[SourceTraffic]:
    """Per-source-rank traffic for all ``num_ranks`` ranks (``[num_ranks]``).

    Synthetic routing draws ``min(num_ranks, max_sources)`` distinct source ranks and reuses them cyclically
    (source ranks are exchangeable: scores do not depend on the source). A trace uses its own ranks.
    """
    num_physical = router.num_experts + num_redundant
    if num_physical % num_ranks != 0:
        raise ValueError(f"experts + redundant experts ({num_physical}) must be divisible by the EP size "
                         f"({num_ranks})")
    experts_per_rank = num_physical // num_ranks
    copies = (replica_placement(router.popularity, num_redundant, num_ranks) if num_redundant
              else None)
    num_distinct = num_ranks if router.kind == "trace" else min(num_ranks, max_sources)
    distinct = []
    for r in range(num_distinct):
        rows = router.rank_rows(r, num_tokens, mask_ll)
        if copies is not None:
            pick = router.rng.randrange
            rows = [[(copies[e][pick(len(copies[e]))] if e >= 0 else -1) for e in row] for row in rows]
        distinct.append(summarize(rows, num_ranks, experts_per_rank, ranks_per_node))
    if router.kind in ("trace", "zipf") or num_distinct == num_ranks:
        return [distinct[r % num_distinct] for r in range(num_ranks)]
    # Exchangeable routing: rank r reuses sample r % S with its destinations rotated by whole nodes, so that
    # the sampling noise of different destinations stays independent (a rotation by nodes is another valid draw;
    # with uniform popularity the replica placement is balanced, so this holds approximately with replicas too).
    num_nodes = num_ranks // ranks_per_node
    out = []
    for r in range(num_ranks):
        base = distinct[r % num_distinct]
        shift_nodes = (r // num_distinct) % num_nodes
        out.append(rotate(base, shift_nodes, ranks_per_node))
    return out


def rotate(t: SourceTraffic, shift_nodes: int, ranks_per_node: int) -> SourceTraffic:
    """The same traffic with every destination moved ``shift_nodes`` nodes up (cyclically)."""
    if shift_nodes == 0:
        return t
    k = shift_nodes * ranks_per_node

    def roll(v: tuple[int, ...], by: int) -> tuple[int, ...]:
        return v[-by:] + v[:-by] if by % len(v) else v
    return SourceTraffic(t.num_tokens, t.num_selections, roll(t.rows_to_rank, k), roll(t.msgs_to_rank, k),
                         roll(t.records_to_node, shift_nodes))


def expected_ranks_per_token(num_experts: int, topk: int, num_ranks: int) -> float:
    """Closed form for uniform routing: ``R * (1 - C(E - E/R, k) / C(E, k))``."""
    per_rank = num_experts // num_ranks
    return num_ranks * (1 - math.comb(num_experts - per_rank, topk) / math.comb(num_experts, topk))
