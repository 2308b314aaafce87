"""The usage example in the package docstring runs as written."""

from __future__ import annotations

import textwrap

import torch2step.step as step


def _example_code() -> str:
    doc = step.__doc__ or ""
    block = doc.split("Example:", 1)[1].split("::\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def test_docstring_example_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    scope: dict = {}
    exec(compile(_example_code(), "<torch2step.step docstring>", "exec"), scope)
    assert "step.graph tiny_matmul {" in capsys.readouterr().out
    res, m = scope["res"], scope["m"]
    assert m.evaluate(res.bindings)["offchip_bytes"] == res.offchip_bytes == 14336 * 3
    assert m.evaluate(res.bindings)["onchip_bytes"] == res.onchip_total
