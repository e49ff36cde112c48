"""A token-level model of the fused internode kernels' rings and warp schedule (csrc/kernels/fused_internode.cu,
``make_roles``): where a CTA has more roles than its 32 warps, a warp serves several one after the other. With the
kernels' rule, every rank serving its shared roles in the same ascending order, every dispatch and combine must
complete for any routing at the smallest ring capacity; the model must find the deadlock of an order that differs
between roles or ranks, or it could not tell.

A ring holds ``capacity`` records; a role moves one record when its inputs are there and its output rings have room
(the kernels publish what they hold back before any wait, so a record counts as soon as it is written).
"""
from __future__ import annotations

import random
from collections import deque
from typing import Callable, Optional

import pytest

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


def dispatch_completes(num_nodes: int, per_node: int, seed: int, capacity: int = 1, order: Order = _ascending) -> bool:
    """Senders (node n) -> rail ring at forwarder (n, l) -> forwarders (source node m) -> node ring at each receiver
    of the token's mask -> receivers (source rank s)."""
    num_ranks, routing = num_nodes * per_node, _routing(num_nodes, per_node, 12, seed)
    to_send = {}  # (source node, destination node, local) -> records left to write
    rail = {}  # the same key -> records in the rail ring (local masks)
    for s in range(num_ranks):
        m, local = divmod(s, per_node)
        for n in range(num_nodes):
            to_send[(m, n, local)] = deque(row[n] for row in routing[s] if n in row)
            rail[(m, n, local)] = deque()
    node = {(r, s): 0 for r in range(num_ranks) for s in range(num_ranks)}
    to_receive = {(r, s): sum(1 for row in routing[s] if r // per_node in row and r % per_node in row[r // per_node])
                  for r in range(num_ranks) for s in range(num_ranks)}

    def step(rank: int, kind: str, i: int) -> Optional[bool]:
        m, local = divmod(rank, per_node)
        if kind == "send":
            key = (m, i, local)
            if not to_send[key]:
                return None
            if len(rail[key]) >= capacity:
                return False
            rail[key].append(to_send[key].popleft())
            return True
        if kind == "forward":
            key, s = (i, m, local), i * per_node + local
            if not rail[key]:
                return None if not to_send[key] else False
            mask = rail[key][0]
            if any(node[(m * per_node + j, s)] >= capacity for j in mask):
                return False
            for j in mask:
                node[(m * per_node + j, s)] += 1
            rail[key].popleft()
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


def combine_completes(num_nodes: int, per_node: int, seed: int, capacity: int = 1, order: Order = _ascending) -> bool:
    """Senders (source rank s) -> node ring at forwarder (my node, local of s) -> forwarders (owner's node: a token's
    rows of every local rank in its mask, in token order) -> rail ring at the owner -> owner (every node's partial of
    each of its tokens, in token order)."""
    num_ranks, routing = num_nodes * per_node, _routing(num_nodes, per_node, 12, seed)
    to_send = {(r, s): deque(t for t, row in enumerate(routing[s])
                             if r // per_node in row and r % per_node in row[r // per_node])
               for r in range(num_ranks) for s in range(num_ranks)}
    node = {key: deque() for key in to_send}
    to_forward = {(n, s): deque(t for t, row in enumerate(routing[s]) if n in row)
                  for n in range(num_nodes) for s in range(num_ranks)}
    rail = {key: deque() for key in to_forward}
    to_own = {s: deque(range(len(routing[s]))) for s in range(num_ranks)}

    def step(rank: int, kind: str, i: int) -> Optional[bool]:
        n, local = divmod(rank, per_node)
        if kind == "send":
            key = (rank, i)
            if not to_send[key]:
                return None
            if len(node[key]) >= capacity:
                return False
            node[key].append(to_send[key].popleft())
            return True
        if kind == "forward":
            s = i * per_node + local
            queue = to_forward[(n, s)]
            if not queue:
                return None
            t, rings = queue[0], [node[(n * per_node + j, s)] for j in routing[s][queue[0]][n]]
            if not all(ring and ring[0] == t for ring in rings) or len(rail[(n, s)]) >= capacity:
                return False
            for ring in rings:
                ring.popleft()
            rail[(n, s)].append(queue.popleft())
            return True
        queue = to_own[rank]
        if not queue:
            return None
        t, rings = queue[0], [rail[(m, rank)] for m in routing[rank][queue[0]]]
        if not all(ring and ring[0] == t for ring in rings):
            return False
        for ring in rings:
            ring.popleft()
        queue.popleft()
        return True

    warps = []
    forward_warps = WARPS - 1 if num_nodes + 1 > WARPS else num_nodes
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
        assert combine_completes(num_nodes, per_node, seed), (num_nodes, per_node, seed)


def test_an_order_that_differs_deadlocks():
    """The model's witness: senders ascending but forwarders descending (dispatch, 32 x 2), or combine senders in
    an order that depends on the rank's parity (8 x 8), stall some call."""
    def forwarders_descend(rank: int, kind: str) -> int:
        return -1 if kind == "forward" else 1

    def odd_ranks_descend(rank: int, kind: str) -> int:
        return -1 if rank % 2 else 1

    assert not all(dispatch_completes(32, 2, seed, order=forwarders_descend) for seed in range(3))
    assert not all(combine_completes(8, 8, seed, order=odd_ranks_descend) for seed in range(3))
