"""The documentation's hand-written STeP example runs and equals numpy."""

from __future__ import annotations

import numpy as np
import sympy as sp

from torch2step.examples.tiled_matmul import main, tiled_matmul
from torch2step.step import dyn, metrics, run


def test_tiled_matmul_equals_numpy_and_its_metrics() -> None:
    prog = tiled_matmul()
    rng = np.random.default_rng(1)
    a = rng.standard_normal((48, 64), dtype=np.float32)
    b = rng.standard_normal((64, 32), dtype=np.float32)
    c = np.asarray(run(prog, {"a": a, "b": b}).tensors["c"])
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-4)
    m = metrics(prog)
    at = {dyn("M"): 3}
    # a read once, b's two [32, 32] tiles read once per row block, c written once
    assert int(sp.sympify(m.offchip_read_bytes).subs(at)) == (48 * 64 + 3 * 64 * 32) * 4
    assert int(sp.sympify(m.offchip_write_bytes).subs(at)) == 48 * 32 * 4


def test_main_prints_the_program(capsys) -> None:  # type: ignore[no-untyped-def]
    main(row_blocks=2)
    out = capsys.readouterr().out
    assert "step.graph tiled_matmul" in out and "max |c - a @ b|" in out
