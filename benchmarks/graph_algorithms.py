"""Hand-written graph searches against the libraries that could replace them (wall time).

    python benchmarks/graph_algorithms.py

(i)  the wait-for cycle search that picks the FIFOs to deepen
     (:func:`torch2step.spatial.fifos.blocked_channels`) against networkx: ``simple_cycles`` and
     ``strongly_connected_components`` (in a wait-for graph every blocked core waits on at most
     one other, so its cycles are its non-trivial SCCs), on random wait-for graphs of 16 to
     4096 cores;
(ii) the placement's chain-following topological order
     (:func:`torch2step.spatial.placement._chain_order`) against the same rule driven by
     ``graphlib.TopologicalSorter`` (``get_ready`` / ``done``), on random acyclic unit graphs.
     ``graphlib`` cannot replace it outright: unit graphs can be cyclic (a Streamify runs on its
     Bufferize's unit) and ``graphlib`` refuses cycles; networkx's
     ``lexicographical_topological_sort`` takes a static key, while the rule's key depends on
     the units already placed.

Both results are checked equal to the hand-written ones (``tests/spatial/test_graph_oracles.py``).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import networkx as nx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "spatial"))

from test_graph_oracles import _fake_sim, _graphlib_chain_order, _scc_oracle  # noqa: E402

from torch2step.spatial.fifos import blocked_channels  # noqa: E402
from torch2step.spatial.placement import _chain_order  # noqa: E402


def _simple_cycles(nxt: dict[int, tuple]) -> set[str]:
    g = nx.DiGraph()
    g.add_edges_from((k, c) for k, (c, _) in nxt.items() if c is not None and c in nxt)
    return {nxt[k][1] for cyc in nx.simple_cycles(g) for k in cyc if nxt[k][1] is not None}


def _ms(fn, args: list) -> float:
    t = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - t) / len(args) * 1e3


def main() -> None:
    rng = random.Random(0)
    print("wait-for cycle search (ms per search):  cores  hand  nx.simple_cycles  nx.SCC")
    for n in (16, 256, 4096):
        cases = [_fake_sim(rng, n) for _ in range(20)]
        for sim, nxt in cases:
            assert blocked_channels(sim) == _scc_oracle(nxt) == _simple_cycles(nxt)
        hand = _ms(blocked_channels, [s for s, _ in cases])
        simple = _ms(_simple_cycles, [x for _, x in cases])
        scc = _ms(_scc_oracle, [x for _, x in cases])
        print(f"{n:>44}  {hand:6.3f}  {simple:8.3f}  {scc:8.3f}")
    print("chain-following order (ms per order):   units  hand  graphlib")
    for n in (64, 512, 2048):
        preds = []
        for _ in range(5):
            preds.append([frozenset(rng.sample(range(k), min(k, 2))) for k in range(n)])
        sts = [SimpleNamespace(units=[()] * n, preds=p) for p in preds]
        for st in sts:
            assert _chain_order(st) == _graphlib_chain_order(st.preds)
        hand = _ms(_chain_order, sts)
        gl = _ms(_graphlib_chain_order, preds)
        print(f"{n:>44}  {hand:7.2f}  {gl:7.2f}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help prints the purpose
    main()
