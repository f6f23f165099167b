"""moe_lib.lab.sonicmoe: our layer beside SonicMoE's, and our backward's kernels read from the committed ncu report."""

import pytest

from moe_lib.lab import sonicmoe

TKHI = 32768 * 8 * 4096 * 2048


@pytest.fixture(scope="module")
def kernels():
    return sonicmoe.ncu_kernels()


def test_the_ncu_report_is_read_kernel_by_kernel(kernels):
    assert len(kernels) == len(sonicmoe.NCU_CASES) * len(sonicmoe.KERNELS)
    case = kernels.xs(("bfloat16", 32768), level=("dtype", "tokens"))
    assert case.loc["A: g, u, Wdᵀdy, the dSwiGLU and dw", "time (ms)"] == pytest.approx(28.30)  # as the file has it
    assert case.loc["A: g, u, Wdᵀdy, the dSwiGLU and dw", "tensor pipe busy (%)"] == pytest.approx(52.94)
    assert case.loc["W: dWg, dWu", "top stalls"].startswith("barrier 43%")
    assert (kernels["time (ms)"] > 0).all()


def test_kernel_rates_by_hand(kernels):
    peak = 800e12
    rates = sonicmoe.kernel_rates(kernels, "bfloat16", 32768, peak, busy=0.5)
    a = "A: g, u, Wdᵀdy, the dSwiGLU and dw"
    assert rates.loc[a, "TFLOP"] == pytest.approx(6 * TKHI / 1e12)  # three products of 2·T·K·H·I
    assert rates.loc[a, "TFLOP/s"] == pytest.approx(6 * TKHI / (28.30e-3) / 1e12)
    assert rates.loc[a, "at 50% busy (ms)"] == pytest.approx(6 * TKHI / (0.5 * peak) * 1e3)
    fp32 = sonicmoe.kernel_rates(kernels, "float32", 8192, peak)
    assert fp32.loc[a, "TFLOP"] == pytest.approx(3 * 6 * 8192 * 8 * 4096 * 2048 / 1e12)  # bf16×3: three each


def test_a_report_with_other_kernels_names_its_file(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(sonicmoe.NCU_FILE.read_text().split("  token_sum_kernel")[0])
    with pytest.raises(ValueError, match="short.txt"):
        sonicmoe.ncu_kernels(short)


def test_the_layer_beside_sonicmoe():
    table = sonicmoe.layer_comparison()
    assert list(table.index) == [2048, 8192, 32768]
    for tokens, row in table.iterrows():
        assert row["triton_saved / sonicmoe"] == pytest.approx(row["triton_saved (ms)"] / row["sonicmoe (ms)"])
        rate = 18 * tokens * 8 * 4096 * 2048 / (row["sonicmoe (ms)"] * 1e-3) / 1e12
        assert row["sonicmoe (TFLOP/s)"] == pytest.approx(rate)
    assert "sonicmoe" in sonicmoe.styled_layer_comparison(table).to_html()
    assert sonicmoe.layer_comparison(peer="nobody").empty
