"""The non-dominated suffixes kept per ``(operator, P)`` (ELK §4.2, ``elk.suffix._keep``):
dominance within ``1e-12`` and the beam keeping the largest vectors, checked against a plain
pairwise reading on random vectors."""

from __future__ import annotations

import random

import pytest

from elk.model import Step
from elk.suffix import _keep, _State


def _state(k: int) -> _State:
    return _State(Step(0, 1, 0, -1, float(k), 0.0, 1.0, 1, False), (), (), None)


def _reference(vecs: list[tuple[float, ...]], beam: int | None) -> list[int]:
    """Which vectors one-at-a-time insertion keeps, by the definition: a vector enters unless
    a kept one is at least it less 1e-12 throughout; it drops those it so dominates."""
    kept: list[int] = []
    for k, vec in enumerate(vecs):
        if any(all(a >= b - 1e-12 for a, b in zip(vecs[j], vec)) for j in kept):
            continue
        kept = [j for j in kept if not all(a >= b - 1e-12 for a, b in zip(vec, vecs[j]))]
        kept.append(k)
        if beam is not None and len(kept) > beam:
            kept = sorted(kept, key=lambda j: vecs[j], reverse=True)[:beam]
    return kept


@pytest.mark.parametrize("seed", range(30))
def test_keep_matches_the_pairwise_definition(seed: int) -> None:
    rng = random.Random(seed)
    n, width = rng.randint(1, 12), rng.randint(1, 40)
    beam = rng.choice([None, 1, 2, 4])
    # few distinct values and near-ties within eps, so dominance and ties both occur
    base = [rng.choice([0.0, 1.0, 2.0]) for _ in range(width)]
    vecs = [tuple(b + rng.choice([-1.0, 0.0, 0.5e-12, 5e-12, 1.0]) for b in base) for _ in range(n)]
    states = [_state(k) for k in range(n)]
    kept: list = []
    for vec, st in zip(vecs, states):
        kept = _keep(kept, vec, st, beam)
    assert [states.index(e[-1]) for e in kept] == _reference(vecs, beam)


def test_a_vector_within_eps_is_dominated_and_a_larger_one_replaces() -> None:
    a, b, c = _state(0), _state(1), _state(2)
    kept = _keep([], (1.0, 2.0, 3.0), a, None)
    kept = _keep(kept, (1.0 + 1e-13, 2.0, 3.0), b, None)  # within eps: dominated
    assert [e[-1] for e in kept] == [a]
    kept = _keep(kept, (1.0, 2.0 + 1e-6, 3.0), c, None)  # strictly better: replaces a
    assert [e[-1] for e in kept] == [c]


@pytest.mark.parametrize("seed", range(20))
def test_anchored_vectors_keep_what_whole_vectors_keep(seed: int, monkeypatch) -> None:
    """Suffixes sharing an ancestor are compared without its preload starts
    (``elk.suffix._keyed``): the kept set and its order are those of the whole vectors."""
    import elk.suffix as sx
    from elk.model import Item, Policy

    monkeypatch.setattr(sx, "ANCHOR_DEPTH", 2)
    rng = random.Random(seed)
    items = [Item(f"op{k}", (), (), 1.0) for k in range(4)]
    pol = Policy(capacity=1.0)

    def grow(parent: _State | None, op: int, P: int) -> _State:
        tail = parent.spre if parent is not None else ()
        head = tuple(
            rng.choice([0.0, 1.0, 2.0]) for _ in range((parent.step.P if parent else 5) - P)
        )
        step = Step(op, P, 0, -1, rng.choice([0.0, 1.0]), 0.0, 1.0, 1, False)
        return _State(
            step, head + tail, ((7, rng.choice([1, 2]), rng.choice([0.0, 1.0]), 0, 0),), parent
        )

    root = grow(None, 3, 4)
    mids = [grow(root, 2, 3) for _ in range(3)]
    lows = [grow(m, 1, 2) for m in mids for _ in range(2)]
    sts = [grow(p, 0, 1) for p in lows for _ in range(2)]
    beam = rng.choice([None, 1, 2, 4])
    whole = lambda s: sx._vector(s, items, pol)  # noqa: E731
    kept_whole: list = []
    kept_keyed: list = []
    for st in sts:
        kept_whole = _keep(kept_whole, whole(st), st, beam)
        vec, key = sx._keyed(st, items, pol)
        kept_keyed = _keep(kept_keyed, vec, st, beam, key, whole)
    assert [e[-1] for e in kept_keyed] == [e[-1] for e in kept_whole]
    assert any(sx._keyed(st, items, pol)[1] is not None for st in sts)
