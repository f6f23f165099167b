"""What the benchmark's element rule asks of P1's dGate and dUp (moe_lib/lab/derivations.py, notebook 01)."""

import pytest
import torch

from moe_lib.lab import derivations

OUTPUTS = ("dx", "dWg", "dWu")


@pytest.fixture(scope="module")
def rows():
    table = derivations.representation_pass_fractions(256, scales=(1.0, 4.0), seed=3)
    return {(row["scale"], row["representation"]): row for row in table}


def test_one_row_per_scale_and_representation(rows):
    assert set(rows) == {(s, r) for s in (1.0, 4.0) for r in derivations.REPRESENTATIONS}
    for row in rows.values():
        assert row["tokens"] == 256 and row["tensor work"] == derivations.REPRESENTATIONS[row["representation"]]
        assert all(0.0 <= row[f"{o} pass"] <= 1.0 and row[f"{o} rel err"] >= 0.0 for o in OUTPUTS), row
        if row["representation"] != "fp16":  # fp16 overflows at the larger scale (its error is then inf)
            assert all(row[f"{o} rel err"] < 1e-2 for o in OUTPUTS), row


def test_bf16_fails_the_weight_gradients_and_hi_lo_passes_everything(rows):
    for scale in (1.0, 4.0):
        assert rows[scale, "bf16"]["dWg pass"] < 0.99 and rows[scale, "bf16"]["dWu pass"] < 0.99
        for representation in ("bf16 hi/lo", "hi + fp8 lo"):
            assert min(rows[scale, representation][f"{o} pass"] for o in OUTPUTS) >= 0.99, (scale, representation)
    # dx passes in plain bf16 only where the rule's absolute term still covers its errors
    assert rows[1.0, "bf16"]["dx pass"] >= 0.99 > rows[4.0, "bf16"]["dx pass"]
    # the second half lands closer to the exact products than bf16 alone
    for scale in (1.0, 4.0):
        for output in OUTPUTS:
            for representation in ("bf16 hi/lo", "hi + fp8 lo"):
                assert rows[scale, representation][f"{output} rel err"] < rows[scale, "bf16"][f"{output} rel err"]


def test_fp8_blocks_keep_three_mantissa_bits_under_their_scale():
    v = torch.randn(200, 96, dtype=torch.float64) * torch.logspace(-6, 2, 96, dtype=torch.float64)
    for block in ((1, 32), (64, 1), (64, 32), (256, 128)):
        got = derivations._fp8(v, block)
        assert got.shape == v.shape
        # each tile's largest element sets its scale (to between 224 and 448): e4m3's normal numbers, from 2⁻⁶,
        # then reach down to 2⁻¹³·⁸ of that largest and keep 2⁻⁴ of themselves
        bm, bn = block
        tile_max = torch.zeros_like(v)
        for i in range(0, v.shape[0], bm):
            for j in range(0, v.shape[1], bn):
                tile_max[i : i + bm, j : j + bn] = v[i : i + bm, j : j + bn].abs().max()
        normal = v.abs() >= tile_max * 2.0**-13
        assert ((got - v).abs() <= 2.0**-4 * v.abs())[normal].all(), block
        # below that, fp8's subnormal steps: at most half of 2⁻⁹ of the scale, ≤ 2⁻¹⁷ of the tile's largest
        assert ((got - v).abs() <= 2.0**-17 * tile_max)[~normal].all(), block
