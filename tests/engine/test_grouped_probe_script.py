"""scripts/p2/grouped_probe.py on the CPU: its routing, its shapes and its table (its children run on a GPU; its
--compile-only run is tests/engine/test_grouped_gemm.py's)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(ROOT / "scripts" / "p2"))
    spec = importlib.util.spec_from_file_location("grouped_probe", ROOT / "scripts" / "p2" / "grouped_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["grouped_probe"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_routing_gives_every_token_k_distinct_experts_in_sorted_offsets(probe, seed):
    shape = probe.SHAPES["qwen3_t8192_gate_up"]
    generator = torch.Generator().manual_seed(seed)
    offsets, weights = probe.routed_offsets(shape, generator, "cpu")
    counts = offsets.diff()
    assert offsets.dtype == torch.int32 and offsets[0] == 0 and offsets[-1] == shape.rows == 8192 * 8
    assert (counts >= 0).all() and weights.shape == (shape.rows,)
    # uniform: 512 rows an expert on average, binomial spread (σ ≈ 22): none below 350 or above 700
    assert counts.min() > 350 and counts.max() < 700, counts


def test_shapes_name_the_products_and_their_forms(probe):
    p2 = probe.SHAPES["p2_t8192_gate_up"]
    assert (p2.rows, p2.n, p2.k, p2.form, p2.flop) == (65536, 4096, 4096, "nt", 2 * 65536 * 4096 * 4096)
    assert probe.SHAPES["mixtral_t4096_dap"].form == "nn" and probe.SHAPES["mixtral_t4096_dap"].n == 14336
    assert probe.SHAPES["p2_t8192_down_scaled"].epilogue == "row_scale"
    assert all(shape.form == "nt" or shape.k % 64 == 0 for shape in probe.SHAPES.values())  # [E, K, N] needs it


def test_table_gives_tflops_fractions_and_the_geomean(probe):
    def ok(tflops):
        return dict(check="ok", tflops=tflops)

    runs = {
        "grouped_mm": dict(results={"p2_t8192_gate_up": ok(600.0), "p2_t8192_dap": ok(500.0)}),
        "coop_m128n256k64_s3": dict(
            results={"p2_t8192_gate_up": ok(540.0), "p2_t8192_dap": dict(check="WRONG: relative error 0.5")}
        ),
        "pp_m128n128k64_s5": dict(results={"p2_t8192_gate_up": ok(600.0), "p2_t8192_dap": ok(550.0)}),
    }
    text = probe.table(runs, ["p2_t8192_gate_up", "p2_t8192_dap"])
    lines = text.splitlines()
    assert lines[0] == "c1 = coop_m128n256k64_s3" and lines[1] == "c2 = pp_m128n128k64_s5"
    assert "540 0.90" in text and "WRONG" in text and "550 1.10" in text
    assert lines[-1].split()[-3:] == ["1.000", "0.900", f"{(1.0 * 1.1) ** 0.5:.3f}"]
