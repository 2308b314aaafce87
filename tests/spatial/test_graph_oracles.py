"""The hand-written graph searches checked against library oracles: the wait-for cycle search
(deepening FIFOs) against networkx's strongly connected components, and the placement's
chain-following topological order against the same rule driven by ``graphlib``."""

from __future__ import annotations

import graphlib
import random
from types import SimpleNamespace

import networkx as nx
import pytest

from runtime.report import wait_for
from torch2step.spatial.fifos import blocked_channels
from torch2step.spatial.placement import _chain_order


def _fake_sim(rng: random.Random, n: int) -> tuple[SimpleNamespace, dict[int, tuple]]:
    """A deadlocked simulation's cores: each waits for FIFO space (a channel), for a message
    from another core, or on HBM / nothing; some targets have finished."""
    cores, nxt = [], {}
    for k in range(n):
        r = rng.random()
        target = rng.randrange(n + 3)  # n, n+1, n+2: finished cores, not in the graph
        chan = SimpleNamespace(name=f"c{k}", src=target)
        if r < 0.4:
            why, edge = ("credit", SimpleNamespace(dst=target, chan=chan)), (target, f"c{k}")
        elif r < 0.8:
            post = SimpleNamespace(end=SimpleNamespace(chan=chan))
            why, edge = ("buf", None, post), (target, None)
        else:
            why, edge = ("barrier", None), (None, None)
        cores.append(SimpleNamespace(id=k, done=False, blocked=why))
        nxt[k] = edge
    sim = SimpleNamespace(comp=SimpleNamespace(active=cores))
    sim.waits = lambda: wait_for(sim)
    return sim, nxt


def _scc_oracle(nxt: dict[int, tuple]) -> set[str]:
    g = nx.DiGraph()
    g.add_nodes_from(nxt)
    g.add_edges_from((k, c) for k, (c, _) in nxt.items() if c is not None and c in nxt)
    out: set[str] = set()
    for comp in nx.strongly_connected_components(g):
        k0 = next(iter(comp))
        if len(comp) > 1 or g.has_edge(k0, k0):
            out.update(nxt[k][1] for k in comp if nxt[k][1] is not None)
    return out


@pytest.mark.parametrize("n", [1, 3, 17, 200])
def test_wait_for_cycle_search_matches_networkx(n: int) -> None:
    rng = random.Random(n)
    for _ in range(40):
        sim, nxt = _fake_sim(rng, n)
        assert blocked_channels(sim) == _scc_oracle(nxt)


def _graphlib_chain_order(preds: list[frozenset[int]]) -> list[int]:
    ts = graphlib.TopologicalSorter({k: set(p) for k, p in enumerate(preds)})
    ts.prepare()
    pos: dict[int, int] = {}
    ready: set[int] = set()
    order: list[int] = []
    while ts.is_active():
        ready.update(ts.get_ready())
        k = min(ready, key=lambda u: (-max((pos.get(p, -1) for p in preds[u]), default=-1), u))
        ready.remove(k)
        pos[k] = len(order)
        order.append(k)
        ts.done(k)
    return order


@pytest.mark.parametrize("n", [1, 5, 40, 150])
def test_chain_order_matches_graphlib_on_acyclic_units(n: int) -> None:
    rng = random.Random(n)
    for _ in range(20):
        preds = [frozenset(rng.sample(range(k), min(k, rng.randrange(3)))) for k in range(n)]
        perm = list(range(n))
        rng.shuffle(perm)  # unit indices need not follow the dependencies
        inv = {old: new for new, old in enumerate(perm)}
        shuffled = [frozenset()] * n
        for old, ps in enumerate(preds):
            shuffled[inv[old]] = frozenset(inv[p] for p in ps)
        st = SimpleNamespace(units=[()] * n, preds=shuffled)
        assert _chain_order(st) == _graphlib_chain_order(shuffled)


def test_chain_order_places_every_unit_of_a_cyclic_unit_graph() -> None:
    preds = [frozenset({2}), frozenset({0}), frozenset({1}), frozenset({0})]
    with pytest.raises(graphlib.CycleError):  # graphlib cannot order it; the placement must
        graphlib.TopologicalSorter({k: set(p) for k, p in enumerate(preds)}).prepare()
    order = _chain_order(SimpleNamespace(units=[()] * 4, preds=preds))
    assert sorted(order) == [0, 1, 2, 3] and order.index(0) < order.index(3)
