"""Loop folding of unit programs: exact (unfolding gives the steps back) and nested."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lowering.isa import Instr, Loop, Set
from torch2step.spatial.compress import compress


def _step(name: str) -> tuple[Instr, ...]:
    return (Set(name, 0),)


def _unfold(body: tuple[Instr, ...]) -> list[Instr]:
    out: list[Instr] = []
    for ins in body:
        if isinstance(ins, Loop):
            assert isinstance(ins.count, int) and ins.count >= 2
            out.extend(_unfold(ins.body) * ins.count)
        else:
            out.append(ins)
    return out


def _flat(steps: list[tuple[Instr, ...]]) -> list[Instr]:
    return [x for s in steps for x in s]


def test_a_run_becomes_one_loop() -> None:
    assert compress([_step("a")] * 5) == (Loop(5, (Set("a", 0),)),)


def test_sixteen_rotating_buffers_fold() -> None:
    steps = [_step(f"b{k % 16}") for k in range(16 * 6)]
    (loop,) = compress(steps)
    assert isinstance(loop, Loop) and loop.count == 6 and len(loop.body) == 16


def test_reductions_become_nested_loops() -> None:
    """12 reductions of 8 elements, accumulators alternating between two buffers: the middle
    elements fold first, then the pairs of reductions."""
    steps = []
    for r in range(12):
        acc = f"acc{r % 2}"
        steps += [_step(f"first.{acc}")] + [_step(f"mid.{acc}")] * 6 + [_step(f"last.{acc}")]
    out = compress(steps)
    assert _unfold(out) == _flat(steps)
    (outer,) = out
    assert isinstance(outer, Loop) and outer.count == 6
    inner = [i for i in outer.body if isinstance(i, Loop)]
    assert [i.count for i in inner] == [6, 6] and len(outer.body) == 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abc"), max_size=60), st.integers(1, 8))
def test_folding_is_exact(names: list[str], period: int) -> None:
    steps = [_step(n) for n in names]
    out = compress(steps, max_period=period)
    assert _unfold(out) == _flat(steps)
    assert len(_unfold(out)) >= len(out)


def _by_value(steps: list[tuple[Instr, ...]], max_period: int = 64) -> tuple[Instr, ...]:
    """The folding with blocks compared by value (hashing every block on every pass): what
    :func:`compress` must give, with its ids found once per instruction object."""
    from torch2step.spatial import compress as c

    items = [s for s in steps if s]
    while True:
        table: dict[tuple[Instr, ...], int] = {}
        ids = [table.setdefault(b, len(table)) for b in items]
        n = len(ids)
        nxt, last = [n] * n, {}
        for j in range(n - 1, -1, -1):
            nxt[j] = last.get(ids[j], n)
            last[ids[j]] = j
        periods = [c._shortest_period(ids, nxt, i, max_period) for i in range(n)]
        found = [p for p in periods if p]
        if not found:
            return tuple(x for b in items for x in b)
        want, out, i = min(found), [], 0
        while i < n:
            if periods[i] == want:
                k = c._repeats(ids, i, want, n)
                out.append((Loop(k, tuple(x for b in items[i : i + want] for x in b)),))
                i += k * want
            else:
                out.append(items[i])
                i += 1
        items = out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from("abc"), min_size=1, max_size=6),
    st.integers(1, 5),
    st.integers(1, 4),
    st.booleans(),
)
def test_interned_ids_fold_as_values_do(
    names: list[str], inner: int, outer: int, given_loop: bool
) -> None:
    # equal instructions as distinct objects and as one shared object, and a Loop already in
    # the steps equal to one the folding makes: ids by object must agree with ids by value
    shared = {n: Set(n, 0) for n in names}
    steps: list[tuple[Instr, ...]] = []
    for _ in range(outer):
        for k, n in enumerate(names):
            steps += [(shared[n],) if k % 2 else (Set(n, 0),)] * inner
        if given_loop:
            steps.append((Loop(2, (Set("a", 0),)),))
            steps += [(Set("a", 0),)] * 2
    assert compress(steps) == _by_value(steps)
    assert _unfold(compress(steps)) == _unfold(_by_value(steps))
