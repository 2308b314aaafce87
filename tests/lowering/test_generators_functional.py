"""Acceptance: Cannon, SUMMA and weight-stationary programs on a 4x4 mesh, run by the simulator
in functional mode, compute the same product as numpy."""

from __future__ import annotations

import numpy as np
import pytest

import hwmodel
import lowering as L
import runtime

CHIP = hwmodel.with_mesh_shape(hwmodel.load_chip("mesh"), 4, 4)
GENERATORS = {
    "cannon": L.cannon_matmul,
    "summa": L.summa_matmul,
    "weight_stationary": L.weight_stationary_matmul,
}


def _tensors(result) -> dict[str, np.ndarray]:
    out = getattr(result, "outputs", None)
    return out if out is not None else result.tensors


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_matmul_on_4x4_mesh_equals_numpy(name: str) -> None:
    rng = np.random.default_rng(2024)
    a = rng.standard_normal((32, 16)).astype(np.float32)
    b = rng.standard_normal((16, 24)).astype(np.float32)
    ps = GENERATORS[name](CHIP, 32, 16, 24)
    L.validate_programs(ps, CHIP)
    result = runtime.simulate(ps, CHIP, mode="functional", inputs={"A": a, "B": b})
    np.testing.assert_allclose(_tensors(result)["C"], a @ b, rtol=1e-5, atol=1e-5)
    assert result.cycles > 0
