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
    # [E, K, N] needs K a multiple of 64, a pair along K each half
    assert all(shape.b_t or (shape.k // (2 if shape.pair else 1)) % 64 == 0 for shape in probe.SHAPES.values())
    pair = probe.SHAPES["mixtral_t4096_swiglu_agu"]
    assert (pair.form, pair.width, pair.outputs) == ("nt2", 14336, ("out", "gate_out", "up_out"))
    dswiglu = probe.SHAPES["p2_t8192_dswiglu"]
    assert (dswiglu.form, dswiglu.n, dswiglu.k, dswiglu.flop) == ("nn", 2048, 4096, 2 * 65536 * 2048 * 4096)
    assert probe.SHAPES["p2_t8192_dx_pair_f32"].variant == ("nn2", "none", ("out",), True)


def test_quack_columns_take_only_the_plain_products_and_compile_on_the_gpu(probe, capsys):
    plain = [name for name, shape in probe.SHAPES.items() if shape.epilogue == "none" and not shape.pair]
    fused = [name for name in probe.SHAPES if name not in plain]
    assert "p2_t8192_gate_up" in plain and "p2_t8192_dswiglu" in fused and "p2_t8192_dx_pair" in fused
    for name in fused:  # declined before QuACK is imported: no tensors needed
        assert probe.quack_call("quack_default", probe.SHAPES[name], None, None, None, None) is None, name
    assert probe.compile_all(list(probe.QUACK), plain) == []
    printed = capsys.readouterr().out
    assert all(name in printed for name in probe.QUACK)
    assert not set(probe.QUACK) & set(probe.CONFIGS)


def test_dswiglu_takes_a_fitted_config_where_it_does_not_fit(probe):
    from moe_lib.engine.grouped_gemm import output_buffers

    for name in probe.CONFIGS:
        config = probe.config_for(name, "dswiglu")
        assert output_buffers(config, "dswiglu", 3) >= 2, name
        threads = 128 if config.pingpong else 256
        assert config.block_m * config.block_n // threads <= 64, name  # accumulator values a thread
        assert probe.config_for(name, "swiglu") == probe.CONFIGS[name]
    assert probe.config_for("coop_m128n128k64_s5", "dswiglu") == probe.CONFIGS["coop_m128n128k64_s5"]


@pytest.mark.parametrize("name", ["p2_t8192_swiglu_agu", "p2_t8192_swiglu_gu", "p2_t8192_dswiglu", "p2_t8192_dx_pair"])
def test_every_shape_s_arguments_pass_the_checks(probe, name):
    """kernel_tensors builds what grouped_gemm takes (meta tensors: no memory), g and u halves of one tensor."""
    from moe_lib.engine.grouped_gemm import check_arguments

    shape = probe.SHAPES[name]
    config = probe.config_for("coop_m128n256k64_s3", shape.epilogue)
    a, b, tensors = probe.kernel_tensors(
        shape, config, lambda role, size, dtype: torch.empty(size, dtype=dtype, device="meta")
    )
    offsets = torch.empty(shape.experts + 1, dtype=torch.int32, device="meta")
    assert check_arguments(a, b, offsets, epilogue=shape.epilogue, config=config, **tensors) is shape.b_t
    assert set(shape.outputs) <= set(tensors)
    if "gate_out" in tensors or "dgate_out" in tensors:  # side by side in one tensor
        g, u = (
            (tensors["gate_out"], tensors["up_out"])
            if "gate_out" in tensors
            else (tensors["dgate_out"], tensors["dup_out"])
        )
        assert g.stride(0) == 2 * shape.width and u.storage_offset() == shape.width


@pytest.mark.parametrize("epilogue", ["swiglu", "dswiglu", "none"])
def test_reference_and_errors_agree_with_the_tl_kernel(probe, epilogue, seed):
    """The probe's fp32 reference (and its check, output by output) on a small shape of each new form, against
    the plain Triton kernel under the interpreter and the baseline's torch._grouped_mm (on the CPU here)."""
    from moe_lib.engine.grouped_tl import SMALL_TILES, grouped_gemm_tl

    if epilogue == "swiglu":
        shape = probe.Shape(50, 4, 2, 96, 64, True, "swiglu", "", True, probe.SWIGLU_OUTPUTS)
    elif epilogue == "dswiglu":
        shape = probe.Shape(50, 4, 2, 80, 64, False, "dswiglu", "", outputs=probe.DSWIGLU_OUTPUTS)
    else:
        shape = probe.Shape(50, 4, 2, 48, 128, False, "none", "", True, out_f32=True)
    generator = torch.Generator().manual_seed(seed)
    offsets, weights = probe.routed_offsets(shape, generator, "cpu")
    a, b, tensors = probe.kernel_tensors(shape, SMALL_TILES, probe.random_maker(shape, generator, "cpu", weights))
    expected = probe.reference(shape, a, b, offsets, tensors)
    grouped_gemm_tl(a, b, offsets, epilogue=epilogue, b_transposed=shape.b_t, config=SMALL_TILES, **tensors)
    baseline, _ = probe.baseline_call(shape, a, b, offsets, tensors)
    theirs = baseline()
    for name in shape.outputs:
        assert probe.output_error(name, tensors[name], expected[name]) < (1e-5 if shape.out_f32 else 4e-3), name
        assert probe.output_error(name, theirs[name], expected[name]) < probe.TOLERANCE, name
    tensors[shape.outputs[0]].fill_(float("nan"))
    assert probe.output_error(shape.outputs[0], tensors[shape.outputs[0]], expected[shape.outputs[0]]) == float("inf")


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
