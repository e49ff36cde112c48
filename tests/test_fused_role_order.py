"""A token-level model of the fused internode kernels' rings and warp schedule (csrc/kernels/fused_internode.cu,
``make_roles``): where a CTA has more roles than its 32 warps, a warp serves several one after the other. With the
kernels' rule, every rank serving its shared roles in the same ascending order, every dispatch and combine must
complete for any routing at the smallest ring capacity; the model must find the deadlock of an order that differs
between roles or ranks, or it could not tell.

A ring holds ``capacity`` records; a role moves one record when its inputs are there and its output rings have room.
In dispatch a record counts as soon as it is written (its teams publish before any wait). The combine's leaders
publish the finished prefix every chunk, inside every wait and before the role returns; the combine model holds
records and consumed slots back until such a publication, and must find the deadlock of a rule without the
publications inside waits.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Callable, Optional

import pytest

from simulator.deep_ep_fused import role_warps

WARPS = 32
Order = Callable[[int, str], int]  # (rank, role kind) -> 1 ascending, -1 descending


def _ascending(rank: int, kind: str) -> int:
    return 1


def _lists(count: int, warps: int, direction: int) -> list[list[int]]:
    """Role instances per warp: one each up to ``warps`` (teams), else warp w serves w, w + warps, ..."""
    if count <= warps:
        return [[i] for i in range(count)]
    return [list(range(w, count, warps))[::direction] for w in range(warps)]


def _routing(num_nodes: int, per_node: int, tokens: int, seed: int) -> list[list[dict[int, set[int]]]]:
    """Per source rank and token: the local ranks of each node that need it."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_nodes * per_node):
        rows = []
        for _ in range(tokens):
            need = {n: {j for j in range(per_node) if rng.random() < 0.3} for n in range(num_nodes)}
            rows.append({n: js for n, js in need.items() if js})
        out.append(rows)
    return out


def _drain(warps: list[list], step: Callable[[int, str, int], Optional[bool]]) -> bool:
    """Run every warp's current role while any moves; ``step`` returns True (moved), False (waits) or None (done).
    True when every warp finished its roles."""
    while True:
        moved = False
        for warp in warps:
            rank, kind, roles = warp
            while roles:
                result = step(rank, kind, roles[0])
                if result is None:
                    roles.popleft()
                elif result:
                    moved = True
                else:
                    break
        if all(not roles for _, _, roles in warps):
            return True
        if not moved:
            return False


def fused_window(rail_capacity: int, node_capacity: int) -> int:
    """The kernels' window (csrc/kernels/fused_internode.cu ``fused_window``): tokens a sender team routes at once
    and records a forwarder team waits for at once."""
    return max(1, min(32, rail_capacity // 2, node_capacity))


def dispatch_completes(num_nodes: int, per_node: int, seed: int, capacity: int = 1, order: Order = _ascending,
                       send_window: Optional[int] = None, forward_window: Optional[int] = None,
                       tokens: int = 12) -> bool:
    """Senders (node n) -> rail ring at forwarder (n, l) -> forwarders (source node m) -> node ring at each receiver
    of the token's mask -> receivers (source rank s).

    Windows as the kernels' teams take them (default :func:`fused_window` of ``capacity``): a sender routes
    ``send_window`` tokens at once and writes their records only when the rail ring has room for all of them; a
    forwarder waits until the next ``forward_window`` records of the call (fewer at its end) are in its rail ring and
    every node ring has room for its share of them, then forwards them all."""
    window = fused_window(capacity, capacity)
    send_window, forward_window = send_window or window, forward_window or window
    num_ranks, routing = num_nodes * per_node, _routing(num_nodes, per_node, tokens, seed)
    to_route = {}  # (source node, destination node, local) -> per token left: its local mask there, or None
    to_forward = {}  # the same key -> records the forwarder has yet to take
    rail = {}  # the same key -> records in the rail ring (local masks)
    for s in range(num_ranks):
        m, local = divmod(s, per_node)
        for n in range(num_nodes):
            to_route[(m, n, local)] = deque(row.get(n) for row in routing[s])
            to_forward[(m, n, local)] = sum(1 for row in routing[s] if n in row)
            rail[(m, n, local)] = deque()
    node = {(r, s): 0 for r in range(num_ranks) for s in range(num_ranks)}
    to_receive = {(r, s): sum(1 for row in routing[s] if r // per_node in row and r % per_node in row[r // per_node])
                  for r in range(num_ranks) for s in range(num_ranks)}

    def step(rank: int, kind: str, i: int) -> Optional[bool]:
        m, local = divmod(rank, per_node)
        if kind == "send":
            key = (m, i, local)
            if not to_route[key]:
                return None
            records = [mask for mask in list(to_route[key])[:send_window] if mask is not None]
            if len(rail[key]) + len(records) > capacity:
                return False
            for _ in range(min(send_window, len(to_route[key]))):
                to_route[key].popleft()
            rail[key].extend(records)
            return True
        if kind == "forward":
            key, s = (i, m, local), i * per_node + local
            if to_forward[key] == 0:
                return None
            batch = min(forward_window, to_forward[key])
            if len(rail[key]) < batch:
                return False
            masks = [rail[key][k] for k in range(batch)]
            share = {j: sum(1 for mask in masks if j in mask) for j in range(per_node)}
            if any(node[(m * per_node + j, s)] + count > capacity for j, count in share.items()):
                return False
            for j, count in share.items():
                node[(m * per_node + j, s)] += count
            for _ in range(batch):
                rail[key].popleft()
            to_forward[key] -= batch
            return True
        if to_receive[(rank, i)] == 0:
            return None
        if node[(rank, i)] == 0:
            return False
        node[(rank, i)] -= 1
        to_receive[(rank, i)] -= 1
        return True

    warps = []
    role_warps = WARPS // 2 if 2 * num_nodes > WARPS else num_nodes
    for rank in range(num_ranks):
        for kind, count, num_warps in (("send", num_nodes, role_warps), ("forward", num_nodes, role_warps),
                                       ("receive", num_ranks, WARPS)):
            warps += [[rank, kind, deque(roles)] for roles in _lists(count, num_warps, order(rank, kind))]
    return _drain(warps, step)


def combine_completes(num_nodes: int, per_node: int, seed: int, capacity: int = 1, order: Order = _ascending,
                      chunk: int = 1, publish_in_waits: bool = True) -> bool:
    """Senders (source rank s) -> node ring at forwarder (my node, local of s) -> forwarders (owner's node: a token's
    rows of every local rank in its mask, in token order) -> rail ring at the owner -> owner (every node's partial of
    each of its tokens, in token order).

    Publication as the combine's leaders do it: a role's written records become visible, and the slots it consumed
    go back to their writers, only when it publishes: every ``chunk`` records, inside every wait when
    ``publish_in_waits``, and before the role returns (so the warp's next role starts with nothing held back)."""
    num_ranks, routing = num_nodes * per_node, _routing(num_nodes, per_node, 12, seed)
    to_send = {(r, s): deque(t for t, row in enumerate(routing[s])
                             if r // per_node in row and r % per_node in row[r // per_node])
               for r in range(num_ranks) for s in range(num_ranks)}
    to_forward = {(n, s): deque(t for t, row in enumerate(routing[s]) if n in row)
                  for n in range(num_nodes) for s in range(num_ranks)}
    to_own = {s: deque(range(len(routing[s]))) for s in range(num_ranks)}
    # Per ring: records the reader sees, records written but not yet published, free slots as the writer sees them,
    # and slots the reader consumed but has not returned. Node ring (r, s): sender r -> forwarder of s's local on
    # r's node; rail ring (n, s): forwarder on node n -> owner s.
    rings = {key: {"visible": deque(), "held": deque(), "free": capacity, "consumed": 0}
             for key in list(to_send) + [("rail",) + key for key in to_forward]}
    since = {}  # (rank, kind, role) -> records moved since its last publication

    def node_ring(r: int, s: int) -> dict:
        return rings[(r, s)]

    def rail_ring(n: int, s: int) -> dict:
        return rings[("rail", n, s)]

    def outputs_and_inputs(rank: int, kind: str, i: int) -> tuple[list[dict], list[dict]]:
        n, local = divmod(rank, per_node)
        if kind == "send":
            return [node_ring(rank, i)], []
        if kind == "forward":
            s = i * per_node + local
            return [rail_ring(n, s)], [node_ring(n * per_node + j, s) for j in range(per_node)]
        return [], [rail_ring(m, rank) for m in range(num_nodes)]

    def publish(rank: int, kind: str, i: int) -> bool:
        outputs, inputs = outputs_and_inputs(rank, kind, i)
        changed = any(ring["held"] for ring in outputs) or any(ring["consumed"] for ring in inputs)
        for ring in outputs:
            ring["visible"].extend(ring["held"])
            ring["held"].clear()
        for ring in inputs:
            ring["free"] += ring["consumed"]
            ring["consumed"] = 0
        since[(rank, kind, i)] = 0
        return changed

    def take(readable: list[dict], t: int, out: Optional[dict]) -> bool:
        if not all(ring["visible"] and ring["visible"][0] == t for ring in readable):
            return False
        if out is not None and out["free"] == 0:
            return False
        for ring in readable:
            ring["visible"].popleft()
            ring["consumed"] += 1
        if out is not None:
            out["free"] -= 1
            out["held"].append(t)
        return True

    def move(rank: int, kind: str, i: int) -> Optional[bool]:
        n, _ = divmod(rank, per_node)
        if kind == "send":
            queue = to_send[(rank, i)]
            if not queue:
                return None
            if not take([], queue[0], node_ring(rank, i)):
                return False
        elif kind == "forward":
            s = i * per_node + rank % per_node
            queue = to_forward[(n, s)]
            if not queue:
                return None
            readable = [node_ring(n * per_node + j, s) for j in routing[s][queue[0]][n]]
            if not take(readable, queue[0], rail_ring(n, s)):
                return False
        else:
            queue = to_own[rank]
            if not queue:
                return None
            if not take([rail_ring(m, rank) for m in routing[rank][queue[0]]], queue[0], None):
                return False
        queue.popleft()
        return True

    def step(rank: int, kind: str, i: int) -> Optional[bool]:
        result = move(rank, kind, i)
        if result is None:
            publish(rank, kind, i)
            return None
        if result:
            since[(rank, kind, i)] = since.get((rank, kind, i), 0) + 1
            if since[(rank, kind, i)] >= chunk:
                publish(rank, kind, i)
            return True
        return publish_in_waits and publish(rank, kind, i)

    warps = []
    # The forwarders share the warps the owner team leaves (the simulator's mirror of the kernels' split).
    forward_warps = role_warps("combine", num_nodes, num_ranks)["forward"][0]
    for rank in range(num_ranks):
        for kind, count, num_warps in (("send", num_ranks, WARPS), ("forward", num_nodes, forward_warps)):
            warps += [[rank, kind, deque(roles)] for roles in _lists(count, num_warps, order(rank, kind))]
        warps.append([rank, "own", deque([0])])
    return _drain(warps, step)


GROUPS = [(2, 2), (16, 2), (8, 4), (17, 2), (21, 3), (8, 8), (16, 4), (32, 2)]


@pytest.mark.parametrize(("num_nodes", "per_node"), GROUPS, ids=[f"{n}x{g}" for n, g in GROUPS])
def test_the_kernels_order_completes_every_call(num_nodes, per_node):
    for seed in range(3):
        assert dispatch_completes(num_nodes, per_node, seed), (num_nodes, per_node, seed)
        # Chunks longer than the ring: only the publications inside waits let the call finish.
        assert combine_completes(num_nodes, per_node, seed, chunk=3), (num_nodes, per_node, seed)
    assert combine_completes(num_nodes, per_node, 0, capacity=2, chunk=2), (num_nodes, per_node)


def test_an_order_that_differs_deadlocks():
    """The model's witness: senders ascending but forwarders descending (dispatch, 32 x 2), or combine senders in
    an order that depends on the rank's parity (8 x 8), stall some call."""
    def forwarders_descend(rank: int, kind: str) -> int:
        return -1 if kind == "forward" else 1

    def odd_ranks_descend(rank: int, kind: str) -> int:
        return -1 if rank % 2 else 1

    assert not all(dispatch_completes(32, 2, seed, order=forwarders_descend) for seed in range(3))
    assert not all(combine_completes(8, 8, seed, order=odd_ranks_descend, chunk=3) for seed in range(3))


@pytest.mark.parametrize("capacity", [2, 3, 4, 6, 10, 64])
def test_dispatch_windows_complete_at_every_ring_size(capacity):
    """The kernels' windows (at most half a rail ring and at most a node ring) never stall a dispatch, small rings
    included, for groups with one and several roles per warp; windows as large as the ring do, so the model can tell
    (a forwarder waits for a whole window that its sender can only finish after more credits)."""
    for num_nodes, per_node in ((2, 2), (4, 2), (2, 8), (17, 2)):
        for seed in range(3):
            assert dispatch_completes(num_nodes, per_node, seed, capacity, tokens=40), (num_nodes, per_node, seed)
    if 3 <= capacity <= 10:  # windows shorter than the 40 tokens of a call
        assert not all(dispatch_completes(2, 2, seed, capacity, send_window=capacity, forward_window=capacity,
                                          tokens=40) for seed in range(6))


@pytest.mark.parametrize(("num_nodes", "per_node"), [(2, 2), (32, 2)], ids=["2x2", "32x2"])
def test_holding_back_across_a_wait_deadlocks(num_nodes, per_node):
    """The combine's publication rule matters: leaders that publish only every chunk and when their role ends (not
    inside their waits) stall the call, with a warp per role (2 x 2) and with shared forwarder warps (32 x 2), even
    where a chunk fits into the ring."""
    assert combine_completes(num_nodes, per_node, 0, capacity=2, chunk=2)
    assert not combine_completes(num_nodes, per_node, 0, capacity=2, chunk=2, publish_in_waits=False)
