"""The grouped GEMM (``moe_lib/engine/grouped_gemm.py``, its plain Triton twin ``grouped_tl.py``): the tile schedule
pinned by value, the argument checks, the tl kernel under the interpreter against float64 at ragged expert sizes,
the Gluon kernel's sm_90 build on the CPU, and on a Hopper GPU (``gpu``) the Gluon kernel against float64 and
torch._grouped_mm, deterministic and captured in a CUDA graph."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.engine.grouped_gemm import check_arguments, expert_tiles, grid, grouped_gemm, schedule, tile_bound
from moe_lib.engine.grouped_tl import SMALL_TILES, grouped_gemm_tl

ROOT = Path(__file__).resolve().parents[2]
SMALL = GemmConfig(64, 64, 32, 2, "pingpong", group_m=2)  # 64 × 64 tiles, two row tiles a group


def offsets_of(counts, device="cpu"):
    """int32 [E + 1]: the exclusive prefix of the experts' row counts, then M_total."""
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)


def reference(a, b, offsets, b_transposed, scale=None, swiglu=False):
    """C in float64, expert by expert (with swiglu: silu of the first half of the columns times the second)."""
    bounds = offsets.tolist()
    out = torch.zeros((a.shape[0], b.shape[1] if b_transposed else b.shape[2]), dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):
        w = b[e].double()
        out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]].double() @ (w.t() if b_transposed else w)
    if swiglu:
        half = out.shape[1] // 2
        return torch.nn.functional.silu(out[:, :half]) * out[:, half:]
    return out if scale is None else out * scale.double()[:, None]


def relative_error(out, expected) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


# --- the schedule -----------------------------------------------------------------------------------------------


def test_schedule_pinned_on_a_ragged_example():
    """Experts of 0, 1, 129, 0 and 70 rows, N = 100 (two column tiles of 64), five programs: an expert without rows
    has no tiles, each expert's row tiles start at its first row, two row tiles a group column by column."""
    offsets = [0, 0, 1, 130, 130, 200]
    assert expert_tiles(offsets, 100, SMALL) == [0, 2, 6, 0, 4]
    assert schedule(offsets, 100, SMALL, 5) == [
        [(1, 0, 0), (2, 65, 64), (4, 130, 64)],
        [(1, 0, 64), (2, 129, 0), (4, 194, 64)],
        [(2, 1, 0), (2, 129, 64)],
        [(2, 65, 0), (4, 130, 0)],
        [(2, 1, 64), (4, 194, 0)],
    ]


def test_schedule_with_swiglu_takes_half_the_output_columns_a_tile():
    """With swiglu a 64-column product tile is 32 output columns (its gate and up halves): N = 40 takes two."""
    assert schedule([0, 70], 40, SMALL, 2, "swiglu") == [[(0, 0, 0), (0, 0, 32)], [(0, 64, 0), (0, 64, 32)]]
    assert expert_tiles([0, 70], 40, SMALL, "swiglu") == [4] and expert_tiles([0, 70], 40, SMALL) == [2]


def test_schedule_of_one_busy_expert_and_of_no_rows():
    offsets = [0, 0, 150, 150]  # all rows in expert 1: three row tiles, group_m 2 then a group of one
    assert schedule(offsets, 64, SMALL, 2) == [[(1, 0, 0), (1, 128, 0)], [(1, 64, 0)]]
    assert schedule([0, 0, 0], 64, SMALL, 3) == [[], [], []]


@pytest.mark.parametrize("trial", range(20))
def test_tile_bound_covers_any_offsets_and_the_grid_never_exceeds_it(trial):
    generator = torch.Generator().manual_seed(trial)
    E = int(torch.randint(1, 40, (1,), generator=generator))
    counts = torch.randint(0, 200, (E,), generator=generator) * torch.randint(0, 2, (E,), generator=generator)
    offsets = offsets_of(counts.tolist()).tolist()
    M, N = offsets[-1], 1 + int(torch.randint(0, 300, (1,), generator=generator))
    tiles = sum(expert_tiles(offsets, N, SMALL))
    assert tiles <= tile_bound(M, E, N, SMALL)
    assert grid(M, E, N, SMALL, 132) <= max(1, tile_bound(M, E, N, SMALL))
    every = sorted(t for program in schedule(offsets, N, SMALL, 7) for t in program)
    assert len(every) == len(set(every)) == tiles  # each tile once


def test_grid_uses_m_total_and_experts_only():
    config = GemmConfig()  # 128 × 256 tiles
    assert tile_bound(65536, 256, 4096, config) == (512 + 256) * 16
    assert grid(65536, 256, 4096, config, 132) == 132
    assert grid(100, 256, 256, config, 132) == 101  # ≤ one row tile + one a row, one column tile
    assert grid(0, 8, 256, config, 132) == 1


# --- the argument checks ----------------------------------------------------------------------------------------


def misaligned(rows, cols):
    """A contiguous bf16 [rows, cols] view starting 2 bytes past a 16-byte boundary."""
    return torch.empty(rows * cols + 8, dtype=torch.bfloat16)[1 : 1 + rows * cols].view(rows, cols)


I32 = torch.int32
CASES = [
    # (a, b, offsets, keyword arguments, error type, message)
    (meta(64, 32, dtype=torch.float32), meta(4, 48, 32), meta(5, dtype=I32), {}, TypeError, "a: expected torch.bf"),
    (meta(64, 32), meta(4, 48, 32, dtype=torch.float16), meta(5, dtype=I32), {}, TypeError, "b: expected torch.bf"),
    (meta(64, 32), meta(4, 48, 32), meta(5, dtype=torch.int64), {}, TypeError, "offsets: expected torch.int32"),
    (meta(64, 32), meta(4, 48, 32), meta(4, dtype=I32), {}, ValueError, "offsets: expected shape (5,)"),
    (meta(64, 32, 1), meta(4, 48, 32), meta(5, dtype=I32), {}, ValueError, "a: expected a 2-D tensor"),
    (meta(64, 32), meta(48, 32), meta(5, dtype=I32), {}, ValueError, "b: expected a 3-D tensor"),
    (meta(64, 32), meta(4, 48, 40), meta(5, dtype=I32), {}, ValueError, "b: expected [E, N, K] or [E, K, N] with K"),
    (meta(64, 32), meta(4, 32, 32), meta(5, dtype=I32), {}, ValueError, "b: shape (4, 32, 32) is [E, N, K] and"),
    (meta(64, 32), meta(4, 48, 32), meta(5, dtype=I32), dict(out=meta(64, 40)), ValueError, "out: expected shape"),
    (
        meta(64, 32),
        meta(4, 48, 32),
        meta(5, dtype=I32),
        dict(out=meta(64, 48, dtype=torch.float16)),
        TypeError,
        "out: expected torch.bfloat16 or torch.float32",
    ),
    (meta(64, 32), meta(4, 48, 32), meta(5, dtype=I32), dict(epilogue="gelu"), ValueError, "epilogue: expected"),
    (
        meta(64, 64),
        meta(4, 64, 96),
        meta(5, dtype=I32),
        dict(epilogue="swiglu", b_transposed=False),
        ValueError,
        "b: the swiglu epilogue takes B held transposed",
    ),
    (meta(64, 32), meta(4, 49, 32), meta(5, dtype=I32), dict(epilogue="swiglu"), ValueError, "an odd 49 rows"),
    (
        meta(64, 32),
        meta(4, 48, 32),
        meta(5, dtype=I32),
        dict(epilogue="swiglu", out=meta(64, 48)),
        ValueError,
        "out: expected shape (64, 24)",
    ),
    (meta(64, 32), meta(4, 48, 32), meta(5, dtype=I32), dict(epilogue="row_scale"), ValueError, "scale: the row_"),
    (meta(64, 32), meta(4, 48, 32), meta(5, dtype=I32), dict(scale=meta(64)), ValueError, "scale: given, but"),
    (
        meta(64, 32),
        meta(4, 48, 32),
        meta(5, dtype=I32),
        dict(scale=meta(63, dtype=torch.float32), epilogue="row_scale"),
        ValueError,
        "scale: expected shape (64,)",
    ),
    (
        meta(64, 32),
        meta(4, 48, 32),
        meta(5, dtype=I32),
        dict(scale=meta(64, dtype=torch.int32), epilogue="row_scale"),
        TypeError,
        "scale: expected one of",
    ),
    (meta(32, 64).t(), meta(4, 48, 32), meta(5, dtype=I32), {}, ValueError, "a: expected a contiguous tensor"),
    (meta(64, 12), meta(4, 48, 12), meta(5, dtype=I32), {}, ValueError, "a: TMA needs rows of a multiple of 16"),
    (meta(64, 64), meta(4, 64, 60), meta(5, dtype=I32), {}, ValueError, "b: TMA needs rows of a multiple of 16"),
    (meta(64, 48), meta(4, 48, 64), meta(5, dtype=I32), {}, ValueError, "b: the [E, K, N] form needs K (48)"),
    (meta(64, 32), [[1.0]], meta(5, dtype=I32), {}, TypeError, "b: expected a torch.Tensor"),
    (
        torch.empty(64, 32, dtype=torch.bfloat16),
        torch.empty(4, 48, 32, dtype=torch.bfloat16),
        meta(5, dtype=I32),
        {},
        ValueError,
        "offsets: expected the device of a (cpu)",
    ),
    (
        misaligned(64, 32),
        torch.empty(4, 48, 32, dtype=torch.bfloat16),
        torch.zeros(5, dtype=I32),
        {},
        ValueError,
        "a: TMA needs the tensor to start on a 16-byte boundary",
    ),
]


@pytest.mark.parametrize(("a", "b", "offsets", "kwargs", "error", "message"), CASES, ids=[c[-1] for c in CASES])
def test_arguments_are_checked_naming_the_argument(a, b, offsets, kwargs, error, message):
    with pytest.raises(error) as raised:
        check_arguments(a, b, offsets, **kwargs)
    assert message in str(raised.value)


def test_forms_are_read_off_the_shapes():
    offsets = meta(5, dtype=I32)
    assert check_arguments(meta(64, 64), meta(4, 48, 64), offsets) is True  # [E, N, K]
    assert check_arguments(meta(64, 64), meta(4, 64, 48), offsets) is False  # [E, K, N]
    assert check_arguments(meta(64, 64), meta(4, 64, 64), offsets, b_transposed=False) is False
    assert check_arguments(meta(64, 64), meta(4, 64, 64), offsets, out=meta(64, 64), b_transposed=True) is True


def test_grouped_gemm_refuses_cpu_tensors():
    a, b = torch.ones(64, 32, dtype=torch.bfloat16), torch.ones(4, 48, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a: the Gluon grouped GEMM runs on a CUDA"):
        grouped_gemm(a, b, torch.zeros(5, dtype=torch.int32))


# --- the tl kernel under the interpreter --------------------------------------------------------------------------

RAGGED = {
    "empty_one_ragged": [0, 1, 70, 130, 0, 64],  # no rows, one row, not a tile multiple, two tiles and a bit
    "all_in_one": [0, 0, 197, 0],  # every row in one expert
    "single_rows": [1, 1, 1, 1, 1],
    "tile_multiples": [64, 128, 0, 64],  # no ragged end: every tile goes out whole
}


@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
@pytest.mark.parametrize(
    ("b_transposed", "epilogue"),
    [(True, "none"), (False, "none"), (True, "row_scale"), (False, "row_scale"), (True, "swiglu")],
    ids=["b_enk", "b_ekn", "b_enk_row_scale", "b_ekn_row_scale", "b_enk_swiglu"],  # swiglu takes [E, 2N, K] only
)
def test_tl_kernel_matches_float64_at_ragged_experts(counts, b_transposed, epilogue, seed):
    generator = torch.Generator().manual_seed(seed)
    E, N = len(counts), 80
    K = 88 if b_transposed else 96  # past a multiple of 32 where B is held transposed ([E, K, N] needs K % 32 == 0)
    offsets = offsets_of(counts)
    M = int(offsets[-1])
    a = torch.randn(M, K, generator=generator).to(torch.bfloat16)
    b_size = (E, N, K) if b_transposed else (E, K, N)
    b = torch.randn(b_size, generator=generator).to(torch.bfloat16)
    scale = torch.rand(M, generator=generator) + 0.5 if epilogue == "row_scale" else None
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    if epilogue == "swiglu":
        out = out[:, : N // 2].contiguous()  # 40 columns: a 64-column tile is 32 gate and 32 up columns, two tiles
    grouped_gemm_tl(a, b, offsets, out=out, scale=scale, epilogue=epilogue, config=SMALL, programs=3)
    expected = reference(a, b, offsets, b_transposed, scale, swiglu=epilogue == "swiglu")
    assert relative_error(out, expected) < 4e-3
    # each element within bf16's rounding of the float64 value (fp32 accumulation of at most 96 products aside)
    assert ((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-3 * expected.abs().max()).all()


@pytest.mark.parametrize("programs", [1, 2, 5, 64])
def test_tl_kernel_gives_the_same_bits_for_any_program_count(programs, seed):
    """Each tile computed by one program, whichever: the result does not depend on how the tiles are dealt."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([3, 0, 150, 64, 1])
    a = torch.randn(218, 64, generator=generator).to(torch.bfloat16)
    b = torch.randn(5, 136, 64, generator=generator).to(torch.bfloat16)
    once = grouped_gemm_tl(a, b, offsets, config=SMALL, programs=1)
    again = grouped_gemm_tl(a, b, offsets, out=torch.full_like(once, float("nan")), config=SMALL, programs=programs)
    assert torch.equal(once, again)


def test_tl_kernel_leaves_rows_past_the_last_expert_alone(seed):
    """Rows ≥ offsets[E] belong to no expert: not written (the poison stays), and no tile's store reaches them."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([5, 60])
    a = torch.randn(100, 32, generator=generator).to(torch.bfloat16)
    b = torch.randn(2, 32, 64, generator=generator).to(torch.bfloat16)  # [E, K, N]
    out = torch.full((100, 64), float("nan"), dtype=torch.bfloat16)
    grouped_gemm_tl(a, b, offsets, out=out, b_transposed=False, config=SMALL_TILES)
    assert out[65:].isnan().all() and not out[:65].isnan().any()
    assert relative_error(out[:65], reference(a[:65], b, offsets, False)) < 4e-3


# --- the Gluon kernel compiled for sm_90 on the CPU ------------------------------------------------------------


@pytest.mark.slow
def test_probe_configs_compile_for_sm90_unserialised_within_the_limits(tmp_path):
    """Every config the grouped probe times, in each B form and epilogue, compiled for sm_90 by the probe itself
    (``--compile-only``): no stack, within 227 KB, wgmma not serialised by ptxas, ≤ 256 registers a partition."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "scripts/p2/grouped_probe.py", "--compile-only", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "grouped_probe_compile.json").read_text())["compile"]
    forms = {(row["form"], row["epilogue"]) for row in rows}
    assert forms == {("nt", "none"), ("nn", "none"), ("nt", "row_scale"), ("nt", "swiglu")}
    for row in rows:
        assert row["error"] is None and row["problems"] == [], row
        assert row["stack"] == 0 and row["shared"] <= 232448 and row["serialized"] == "no", row
        assert max(row["partition_registers"]) <= 256 and row["wgmma"] > 0, row


# --- on a Hopper GPU --------------------------------------------------------------------------------------------

CONFIGS = {
    "coop": GemmConfig(),
    "coop_2_programs": GemmConfig(programs=2),  # many tiles a program: the walk crosses many experts
    "coop_128": GemmConfig(128, 128, 64, 5),
    "pingpong": GemmConfig(128, 128, 64, 5, "pingpong"),
    "pingpong_3_programs": GemmConfig(64, 256, 64, 4, "pingpong", programs=3),
}
# row counts per expert: empty experts, single rows, ends inside a tile, one expert holding everything, many experts
GPU_COUNTS = {
    "ragged": [0, 1, 200, 129, 0, 383, 64, 7],
    "all_in_one": [0, 0, 1000, 0],
    "many": [0, 3, 17, 130, 255, 256, 257, 1, 0, 90] * 6,
}


def gpu_case(counts, N, K, b_transposed, scaled, generator):
    offsets = offsets_of(counts, device="cuda")
    M, E = int(sum(counts)), len(counts)

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    a = randn(M, K)
    b = randn(*((E, N, K) if b_transposed else (E, K, N)), scale=K**-0.5)
    scale = torch.rand(M, generator=generator, device="cuda") + 0.5 if scaled else None
    return a, b, offsets, scale


def torch_grouped(a, b, offsets, b_transposed, scale, swiglu=False):
    """torch._grouped_mm's bf16 result (its offs: each group's end row), then the epilogue in fp32; None where it
    refuses the operands."""
    try:
        out = torch._grouped_mm(a, b.transpose(1, 2) if b_transposed else b, offs=offsets[1:])
    except (RuntimeError, AttributeError):
        return None
    if swiglu:
        half = out.shape[1] // 2
        return (torch.nn.functional.silu(out[:, :half].float()) * out[:, half:].float()).to(torch.bfloat16)
    return out if scale is None else (out.float() * scale[:, None]).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("form", ["b_enk", "b_ekn", "b_enk_scaled", "b_enk_swiglu"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_grouped_gemm_matches_float64_and_grouped_mm(name, form, counts, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    b_transposed, scaled, swiglu = form != "b_ekn", form.endswith("scaled"), form.endswith("swiglu")
    epilogue = "row_scale" if scaled else "swiglu" if swiglu else "none"
    N, K = (328, 264) if b_transposed else (328, 256)  # partial tiles on every side; [E, K, N] needs K % 64 == 0
    N = 336 if swiglu else N  # 168 output columns: TMA's rows a multiple of 16 bytes
    a, b, offsets, scale = gpu_case(GPU_COUNTS[counts], N, K, b_transposed, scaled, generator)
    expected = reference(a, b, offsets, b_transposed, scale, swiglu)
    out = torch.full((a.shape[0], N // 2 if swiglu else N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm(
        a,
        b,
        offsets,
        out=out,
        scale=scale,
        epilogue=epilogue,
        b_transposed=b_transposed,
        config=CONFIGS[name],
    )
    error = relative_error(out, expected)
    # bf16 rounding of the output bounds the error; torch's own grouped product is held to the same bound
    assert error <= 4e-3, error
    theirs = torch_grouped(a, b, offsets, b_transposed, scale, swiglu)
    if theirs is not None:
        assert error <= 2 * relative_error(theirs, expected) + 1e-4
        assert ((out.float() - theirs.float()).abs() <= 2**-6 * expected.abs().float() + 1e-2).all()
    again = torch.full_like(out, float("nan"))
    grouped_gemm(
        a,
        b,
        offsets,
        out=again,
        scale=scale,
        epilogue=epilogue,
        b_transposed=b_transposed,
        config=CONFIGS[name],
    )
    assert torch.equal(out, again)  # deterministic


@pytest.mark.gpu
def test_gpu_grouped_gemm_leaves_rows_past_the_last_expert_alone(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a, b, offsets, _ = gpu_case([100, 77], 256, 128, True, False, generator)
    a = torch.cat([a, a[:50]])  # 50 rows past offsets[E]
    out = torch.full((a.shape[0], 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm(a, b, offsets, out=out)
    assert out[177:].isnan().all() and not out[:177].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["coop", "pingpong"])
def test_gpu_grouped_gemm_replays_in_a_cuda_graph_with_new_offsets(name, seed):
    """Captured once, replayed after the offsets changed on the device: the schedule follows them (no host copy)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    a, b, offsets, scale = gpu_case([300, 0, 129, 600, 1], 512, 256, True, True, generator)
    out = torch.empty((a.shape[0], 512), dtype=torch.bfloat16, device="cuda")
    run = dict(out=out, scale=scale, epilogue="row_scale", config=CONFIGS[name])
    grouped_gemm(a, b, offsets, **run)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm(a, b, offsets, **run)
    for counts in ([300, 0, 129, 600, 1], [0, 1030, 0, 0, 0], [206, 206, 206, 206, 206]):
        offsets.copy_(offsets_of(counts, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, reference(a, b, offsets, True, scale)) <= 4e-3, counts
