"""A hand-written STeP program for the documentation: ``c = a @ b`` tiled, with the weight
tiles re-read per row block (STeP (arXiv 2511.07776) §3, Fig. 2's building blocks).

``a: [16*M, 64]`` streams in ``[16, 32]`` tiles (``M`` row blocks, 2 column blocks);
Bufferize holds a row block on chip, LinearOffChipLoad reads the matching ``[32, 32]`` tiles
of ``b`` once per row block, Map(matmul) multiplies, Accum(add) reduces over the 2 column
blocks, and LinearOffChipStore writes the ``[16, 32]`` results.  ``M`` is a dynamic size,
learnt from the data at run time.

Run it::

    python -m torch2step.examples.tiled_matmul

The production building blocks (SwiGLU Mixture-of-Experts with dynamic tiling, GQA decode and
prefill attention) are in :mod:`torch2step.lower.blocks`.
"""

from __future__ import annotations

import numpy as np

from torch2step.step import Graph, Program, dyn, metrics, run, zeros

__all__ = ["tiled_matmul", "main"]


def tiled_matmul() -> Program:
    """The program ``c = a @ b`` with ``a: [16*M, 64]``, ``b: [64, 32]``, ``c: [16*M, 32]``."""
    M = dyn("M")
    g = Graph("tiled_matmul")
    a = g.tensor("a", (16 * M, 64))
    b = g.tensor("b", (64, 32))
    c = g.tensor("c", (16 * M, 32))
    a_rows = g.bufferize(g.linear_load(a, (16, 32)), 1)  # one row block of a on chip
    b_t = g.linear_load(b, (32, 32), ref=a_rows, out_shape=(2,), stride=(1,))
    prod = g.map("matmul", g.streamify(a_rows, a_rows), b_t)
    g.linear_store(g.accum(prod, "add", zeros(16, 32), 1), c)
    return g.build()


def main(row_blocks: int = 3) -> None:
    """Print the program, run it on random data, check it against numpy, print its metrics."""
    prog = tiled_matmul()
    print(prog)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16 * row_blocks, 64), dtype=np.float32)
    b = rng.standard_normal((64, 32), dtype=np.float32)
    res = run(prog, {"a": a, "b": b})
    err = float(np.abs(np.asarray(res.tensors["c"]) - a @ b).max())
    print(f"\nmax |c - a @ b| = {err:.2e}")
    m = metrics(prog)
    at = {dyn("M"): row_blocks}
    print("STeP §4.1 metrics at M =", row_blocks)
    for key in ("offchip_read_bytes", "offchip_write_bytes", "onchip_bytes", "flops"):
        expr = getattr(m, key)
        print(f"  {key:20s} {expr}  = {int(expr.subs(at))}")


if __name__ == "__main__":
    main()
