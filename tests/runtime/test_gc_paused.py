"""runtime.gc_paused: the collector is off inside, back on after the outermost block, and
what the block allocated goes to the oldest generation without being walked on the way."""

from __future__ import annotations

import gc
import weakref

from runtime import gc_paused


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _in_generation(obj: object, gen: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=gen))


def test_pause_nests_and_restores_the_collector() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves the outer one's pause alone
    assert gc.isenabled()


def test_survivors_move_to_the_oldest_generation_and_cycles_are_still_collected() -> None:
    gc.unfreeze()  # (nothing an earlier test froze stays frozen)
    with gc_paused():
        kept = _Node()
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a reference cycle, garbage once the names go
        gone = weakref.ref(a)
        assert _in_generation(kept, 0)
    assert _in_generation(kept, 2) and not _in_generation(kept, 0)
    assert gc.get_freeze_count() == 0  # nothing stays frozen
    del a, b
    assert gone() is not None  # a cycle: reference counting cannot free it
    gc.collect()
    assert gone() is None


def test_objects_a_caller_froze_stay_frozen() -> None:
    mine = _Node()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            young = _Node()
        # not unfrozen by the pause (gc.unfreeze would empty the permanent generation); the
        # count itself may fall a little: another thread of the test process (pytest-xdist's
        # channel) frees objects that were alive when they were frozen
        assert gc.get_freeze_count() > frozen // 2
        assert not any(o is mine for o in gc.get_objects())  # still in the frozen generation
        assert not _in_generation(young, 2)  # and this block's objects take the usual way
        assert not _in_generation(mine, 2)
    finally:
        gc.unfreeze()
