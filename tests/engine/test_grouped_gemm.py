"""The grouped GEMM (``moe_lib/engine/grouped_gemm.py``, its plain Triton twin ``grouped_tl.py``): the tile schedule
pinned by value, the shared-memory plan, the argument checks, the tl kernel under the interpreter against float64 at
ragged expert sizes in every form (one B or a pair, each epilogue, strided outputs), the Gluon kernel's sm_90 build
on the CPU, and on a Hopper GPU (``gpu``) the Gluon kernel against float64 and torch._grouped_mm, deterministic and
captured in a CUDA graph."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import compile_env

from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.engine.grouped_gemm import (
    DSWIGLU_CONFIG,
    DSWIGLU_SAVED_CONFIG,
    RING_DSWIGLU_CONFIG,
    check_arguments,
    default_config,
    expert_tiles,
    grid,
    grouped_gemm,
    launch_arguments,
    output_buffers,
    partial_rows,
    schedule,
    shared_bytes,
    tile_bound,
)
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


# --- the epilogues' and pairs' plan and checks ------------------------------------------------------------------


def test_dswiglu_tiles_are_full_width_and_topk_partial_has_a_row_per_column_tile():
    assert schedule([0, 70], 100, SMALL, 2, "dswiglu") == schedule([0, 70], 100, SMALL, 2)
    assert expert_tiles([0, 70], 100, SMALL, "dswiglu") == [4]  # two row tiles, two column tiles of 64
    assert partial_rows(100, SMALL) == 2 and partial_rows(2048, DSWIGLU_CONFIG) == 16


def test_output_buffers_are_those_that_fit_beside_the_ring(monkeypatch):
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", False)  # whole saved tiles in output buffers
    coop = GemmConfig()  # 3 stages of (128 + 256) × 64 bf16: 144 KB of ring
    assert shared_bytes(coop, "swiglu", 2) == 3 * 49152 + 2 * 128 * 128 * 2 + 1024
    assert output_buffers(coop, "swiglu", 3) == 2 and output_buffers(coop, "swiglu", 1) == 1  # a third: 241 KB
    assert output_buffers(coop, "dswiglu", 3) == 1  # 128 × 256 tiles of 64 KB: dswiglu needs two
    assert output_buffers(GemmConfig(128, 128, 64, 5), "dswiglu", 3) == 2  # aw then waits for dg's store
    assert output_buffers(DSWIGLU_CONFIG, "dswiglu", 3) == 3 and output_buffers(DSWIGLU_CONFIG, "dswiglu", 2) == 2
    assert output_buffers(GemmConfig(128, 128, 64, 5, "pingpong"), "dswiglu", 3) == 1  # two consumers' tiles each
    assert output_buffers(coop, "none", 0) == 0  # an fp32 C leaves from registers
    assert default_config("dswiglu") == DSWIGLU_CONFIG and default_config("swiglu") == GemmConfig()


def test_the_saved_sigmoid_and_silu_take_four_output_buffers_and_a_shorter_ring():
    # g, u, σ and silu: four 32 KB tiles beside a 3-stage ring of 32 KB steps (4 stages: 261 KB)
    assert DSWIGLU_SAVED_CONFIG == GemmConfig(128, 128, 64, 3)
    assert default_config("dswiglu", saved=True) == DSWIGLU_SAVED_CONFIG
    assert shared_bytes(DSWIGLU_SAVED_CONFIG, "dswiglu", 4) == 3 * 32768 + 4 * 32768 + 1024 <= 232448
    assert output_buffers(DSWIGLU_SAVED_CONFIG, "dswiglu", 2, saved=True) == 4
    assert output_buffers(DSWIGLU_SAVED_CONFIG, "dswiglu", 3, saved=True) == 4  # w·a through σ's buffer
    assert output_buffers(DSWIGLU_CONFIG, "dswiglu", 3, saved=True) == 3  # too few: refused (FORM_CASES)
    assert output_buffers(GemmConfig(64, 128, 64, 4, "pingpong"), "dswiglu", 3, saved=True) == 4
    assert output_buffers(GemmConfig(64, 128, 64, 5, "pingpong"), "dswiglu", 3, saved=True) == 3


def pair_of(*shape, second=None):
    return (meta(*shape), second if second is not None else meta(*shape))


F32 = torch.float32
SAVED = dict(gate=meta(64, 48), up=meta(64, 48), scale=meta(64, dtype=F32))  # dswiglu's inputs at N = 48
FORM_CASES = [
    # (a, b, keyword arguments, error type, message); offsets meta(5) (E = 4)
    (meta(64, 32), (meta(4, 48, 32),) * 3, dict(epilogue="swiglu"), ValueError, "b: a pair of weights is two"),
    (meta(64, 32), pair_of(4, 48, 32, second=meta(4, 40, 32)), dict(epilogue="swiglu"), ValueError, "b[1]: expected "),
    (
        meta(64, 32),
        pair_of(4, 48, 32, second=meta(4, 48, 32, dtype=torch.float16)),
        dict(epilogue="swiglu"),
        TypeError,
        "b[1]: expected torch.bfloat16",
    ),
    (meta(64, 32), pair_of(4, 48, 40), dict(epilogue="swiglu"), ValueError, "b[0]: expected [E, N, K] with K = 32"),
    (
        meta(64, 64),
        pair_of(4, 48, 64),
        dict(epilogue="swiglu", b_transposed=False),
        ValueError,
        "b: the swiglu epilogue takes B held transposed",
    ),
    (
        meta(64, 32),
        pair_of(4, 48, 32),
        dict(epilogue="swiglu", gate_out=meta(64, 40)),
        ValueError,
        "gate_out: expected shape (64, 48)",
    ),
    (
        meta(64, 32),
        pair_of(4, 48, 32),
        dict(epilogue="swiglu", up_out=meta(64, 48, dtype=F32)),
        TypeError,
        "up_out: expected torch.bfloat16, got torch.float32",
    ),
    (
        meta(64, 32),
        meta(4, 96, 32),
        dict(epilogue="swiglu", out=meta(64, 48, dtype=F32)),
        TypeError,
        "out: expected torch.bfloat16, got torch.float32",
    ),
    (
        meta(64, 32),
        pair_of(4, 48, 32),
        dict(epilogue="swiglu", gate_out=meta(64, 100)[:, :48]),
        ValueError,
        "gate_out: TMA needs rows a multiple of 16 bytes apart; its rows are 100 elements apart",
    ),
    (
        meta(64, 32),
        pair_of(4, 48, 32),
        dict(epilogue="swiglu", out=meta(48, 64).t()),
        ValueError,
        "out: expected rows of adjacent elements",
    ),
    (
        meta(64, 32),
        pair_of(4, 44, 32),
        dict(epilogue="swiglu", up_out=meta(64, 48)[:, :44]),
        ValueError,
        "up_out: its rows hold 44 elements, not a multiple of 16 bytes",
    ),
    (
        meta(64, 32),
        pair_of(4, 48, 32),
        dict(epilogue="swiglu", dgate_out=meta(64, 48)),
        ValueError,
        "dgate_out: given, but the 'swiglu' epilogue takes none",
    ),
    (meta(64, 32), meta(4, 48, 32), dict(gate_out=meta(64, 48)), ValueError, "gate_out: given, but the 'none'"),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", up=meta(64, 48), scale=meta(64, dtype=F32)),
        ValueError,
        "gate: the dswiglu epilogue needs the saved gate",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate=meta(64, 48), up=meta(64, 48)),
        ValueError,
        "scale: the dswiglu epilogue needs a [M_total] tensor",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", out=meta(64, 48), **SAVED),
        ValueError,
        "out: given, but the 'dswiglu' epilogue takes none",
    ),
    (
        meta(64, 64),
        pair_of(4, 64, 48),
        dict(epilogue="dswiglu", **SAVED),
        ValueError,
        "b: the dswiglu epilogue takes one weight",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", **dict(SAVED, gate=meta(64, 40))),
        ValueError,
        "gate: expected shape (64, 48)",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", **dict(SAVED, up=meta(64, 100)[:, :48])),
        ValueError,
        "up: TMA needs rows a multiple of 16 bytes apart",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", topk_partial=meta(2, 64, dtype=F32), **SAVED),
        ValueError,
        "topk_partial: expected shape (1, 64)",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", topk_partial=meta(1, 64), **SAVED),
        TypeError,
        "topk_partial: expected torch.float32",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", topk_partial=meta(64, 2, dtype=F32).t()[:1], **SAVED),
        ValueError,
        "topk_partial: expected a contiguous tensor",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", config=GemmConfig(128, 256, 64, 2, "pingpong"), **SAVED),
        ValueError,
        "config: the dswiglu epilogue needs 2 output tile(s) of 128×256",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", config=GemmConfig(128, 256, 32, 9), scaled_act_out=meta(64, 48), **SAVED),
        ValueError,
        "config: dswiglu through the ring needs 238592 bytes",
    ),
    (meta(64, 0), meta(4, 0, 48), dict(epilogue="dswiglu", **SAVED), ValueError, "a: the dswiglu epilogue needs K ≥ 1"),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_sigmoid=meta(64, 48), **SAVED),
        ValueError,
        "gate_silu: the dswiglu epilogue takes the saved σ and silu both or neither; gate_sigmoid was given alone",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_silu=meta(64, 48), **SAVED),
        ValueError,
        "gate_sigmoid: the dswiglu epilogue takes the saved σ and silu both or neither; gate_silu was given alone",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_sigmoid=meta(64, 40), gate_silu=meta(64, 48), **SAVED),
        ValueError,
        "gate_sigmoid: expected shape (64, 48)",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_sigmoid=meta(64, 48), gate_silu=meta(64, 48, dtype=F32), **SAVED),
        TypeError,
        "gate_silu: expected torch.bfloat16",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_sigmoid=meta(64, 100)[:, :48], gate_silu=meta(64, 48), **SAVED),
        ValueError,
        "gate_sigmoid: TMA needs rows a multiple of 16 bytes apart",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate_sigmoid=meta(64, 48), gate_silu=meta(48, 64).t(), **SAVED),
        ValueError,
        "gate_silu: expected rows of adjacent elements",
    ),
    (
        meta(64, 64),
        meta(4, 48, 64),
        dict(epilogue="row_scale", scale=meta(64, dtype=F32), gate_sigmoid=meta(64, 48), gate_silu=meta(64, 48)),
        ValueError,
        "gate_sigmoid: given, but the 'row_scale' epilogue takes none",
    ),
    (
        meta(64, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", config=DSWIGLU_CONFIG, gate_sigmoid=meta(64, 48), gate_silu=meta(64, 48), **SAVED),
        ValueError,
        "config: the dswiglu epilogue with the saved σ and silu needs 4 output tile(s) of 128×128",
    ),
    (meta(64, 128), pair_of(4, 48, 48), {}, ValueError, "b: a pair along K takes [E, K/2, N] each with K = 128"),
    (meta(64, 96), pair_of(4, 48, 48), {}, ValueError, "b: a pair along K needs K/2 (48) a multiple of block_k (64)"),
    (
        meta(64, 128),
        pair_of(4, 64, 48),
        dict(b_transposed=True),
        ValueError,
        "b: a pair along K takes its weights as they lie",
    ),
    (
        meta(64, 128),
        pair_of(4, 64, 48),
        dict(epilogue="row_scale", scale=meta(64, dtype=F32), out=meta(64, 44, dtype=F32)),
        ValueError,
        "out: expected shape (64, 48)",
    ),
    (
        torch.empty(64, 32, dtype=torch.bfloat16),
        tuple(torch.empty(4, 48, 32, dtype=torch.bfloat16) for _ in range(2)),
        dict(epilogue="swiglu", gate_out=misaligned(64, 48)),
        ValueError,
        "gate_out: TMA needs the tensor to start on a 16-byte boundary",
    ),
]


@pytest.mark.parametrize(("a", "b", "kwargs", "error", "message"), FORM_CASES, ids=[c[-1] for c in FORM_CASES])
def test_new_forms_arguments_are_checked_naming_the_argument(a, b, kwargs, error, message):
    offsets = meta(5, dtype=I32) if a.device.type == "meta" else torch.zeros(5, dtype=I32)
    with pytest.raises(error) as raised:
        check_arguments(a, b, offsets, **kwargs)
    assert message in str(raised.value)


def test_new_forms_are_taken_with_strided_outputs():
    offsets = meta(5, dtype=I32)
    halves = meta(64, 96)  # g and u (or dg and du) side by side, each a strided view
    assert (
        check_arguments(
            meta(64, 32), pair_of(4, 48, 32), offsets, epilogue="swiglu", gate_out=halves[:, :48], up_out=halves[:, 48:]
        )
        is True
    )
    assert (
        check_arguments(
            meta(64, 64),
            meta(4, 64, 48),
            offsets,
            epilogue="dswiglu",
            gate=halves[:, :48],
            up=halves[:, 48:],
            scale=meta(64, dtype=F32),
            dgate_out=halves[:, :48],
            dup_out=halves[:, 48:],
            scaled_act_out=meta(64, 56)[:, :48],
            topk_partial=meta(1, 64, dtype=F32),
        )
        is False
    )
    assert check_arguments(meta(64, 128), pair_of(4, 64, 48), offsets, out=meta(64, 48, dtype=F32)) is False
    assert check_arguments(meta(64, 64), meta(4, 48, 64), offsets, out=meta(64, 48, dtype=F32)) is True


# --- the new forms in the tl kernel under the interpreter ---------------------------------------------------------

NEW_RAGGED = {"empty_one_ragged": [0, 1, 70, 130], "all_in_one": [0, 0, 197, 0]}


def per_expert(a, w, offsets, transposed):
    """A[r] · B_e in float64 for each expert's rows (zeros for rows past offsets[E])."""
    bounds = offsets.tolist()
    out = torch.zeros((a.shape[0], w.shape[1] if transposed else w.shape[2]), dtype=torch.float64)
    for e in range(w.shape[0]):
        m = w[e].double()
        out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]].double() @ (m.t() if transposed else m)
    return out


def within_bf16(out, expected) -> bool:
    """Each element within bf16's rounding of the float64 value (fp32 accumulation aside); a NaN fails."""
    return bool(((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-3 * expected.abs().max()).all())


def dswiglu_reference(dap, gate, up, w, gate_sigmoid=None, gate_silu=None):
    """dswiglu's outputs in float64 from dAp (float64), the saved bf16 g, u and the row weights; with the saved σ and
    silu, those in place of σ(g) and silu(g) (P1's definition)."""
    g, u, w = gate.double(), up.double(), w.double()[:, None]
    sigmoid = torch.sigmoid(g) if gate_sigmoid is None else gate_sigmoid.double()
    silu = g * sigmoid if gate_silu is None else gate_silu.double()
    dA = dap * w
    a = silu * u
    return dict(dg=dA * u * sigmoid * (1 + g * (1 - sigmoid)), du=dA * silu, aw=a * w, a=a)


def bf16_randn(*size, generator, scale=1.0):
    return (torch.randn(size, generator=generator) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("counts", list(NEW_RAGGED.values()), ids=list(NEW_RAGGED))
@pytest.mark.parametrize("outputs", [("out", "gate_out", "up_out"), ("gate_out", "up_out"), ("out",), ("up_out",)])
@pytest.mark.parametrize("stacked", [False, True], ids=["pair", "stacked"])
def test_tl_swiglu_writes_the_outputs_asked_for(counts, outputs, stacked, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    E, M, N, K = len(counts), int(offsets[-1]), 40, 88  # 32 output columns a tile: two, the second ragged
    a = bf16_randn(M, K, generator=generator)
    gate, up = bf16_randn(E, N, K, generator=generator), bf16_randn(E, N, K, generator=generator)
    b = torch.cat([gate, up], 1) if stacked else (gate, up)
    wide = torch.full((M, 3 * N + 8), float("nan"), dtype=torch.bfloat16)  # the outputs: strided views of it
    views = {"out": wide[:, :N], "gate_out": wide[:, N + 8 : 2 * N + 8], "up_out": wide[:, 2 * N + 8 :]}
    result = grouped_gemm_tl(
        a, b, offsets, epilogue="swiglu", config=SMALL, programs=3, **{name: views[name] for name in outputs}
    )
    g, u = per_expert(a, gate, offsets, True), per_expert(a, up, offsets, True)
    expected = {"out": torch.nn.functional.silu(g) * u, "gate_out": g, "up_out": u}
    for name in outputs:
        assert within_bf16(views[name], expected[name]), name
    for name in set(views) - set(outputs):
        assert views[name].isnan().all(), name  # not asked for: not written
    assert wide[:, N : N + 8].isnan().all()  # between the views: not written
    assert result is (views["out"] if "out" in outputs else None)


@pytest.mark.parametrize("counts", list(NEW_RAGGED.values()), ids=list(NEW_RAGGED))
@pytest.mark.parametrize("extras", [True, False], ids=["aw_and_partial", "dg_du_only"])
def test_tl_dswiglu_matches_float64(counts, extras, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    E, M, H, I = len(counts), int(offsets[-1]), 64, 80  # N = I: two column tiles of 64, the second ragged
    dy = bf16_randn(M, H, generator=generator)
    wd = bf16_randn(E, H, I, generator=generator, scale=H**-0.5)  # Wd [E, H, I] as it lies
    saved = bf16_randn(M, 2 * I, generator=generator, scale=2.0)  # g and u side by side, as the forward keeps them
    gate, up = saved[:, :I], saved[:, I:]
    w = torch.rand(M, generator=generator) + 0.5
    dh = torch.full((M, 2 * I), float("nan"), dtype=torch.bfloat16)  # dg and du side by side: dx's A
    aw = torch.full((M, I + 8), float("nan"), dtype=torch.bfloat16)[:, :I]
    partial = torch.full((partial_rows(I, SMALL), M), float("nan"))
    more = dict(scaled_act_out=aw, topk_partial=partial) if extras else {}
    result = grouped_gemm_tl(
        dy,
        wd,
        offsets,
        epilogue="dswiglu",
        gate=gate,
        up=up,
        scale=w,
        dgate_out=dh[:, :I],
        dup_out=dh[:, I:],
        config=SMALL,
        programs=3,
        **more,
    )
    assert result[0].data_ptr() == dh.data_ptr() and (result[2] is aw) == extras
    dap = per_expert(dy, wd, offsets, False)
    expected = dswiglu_reference(dap, gate, up, w)
    assert within_bf16(dh[:, :I], expected["dg"]) and within_bf16(dh[:, I:], expected["du"])
    if not extras:
        assert aw.isnan().all() and partial.isnan().all()
        return
    assert within_bf16(aw, expected["aw"])
    product = dap * expected["a"]
    for j in range(partial.shape[0]):  # each row of topk_partial: its column tile's share
        tile = product[:, 64 * j : 64 * (j + 1)]
        assert ((partial[j].double() - tile.sum(1)).abs() <= 1e-5 * tile.abs().sum(1) + 1e-12).all(), j
    total = partial.double().sum(0)  # the caller's sum over the tiles: ⟨dAp, a⟩ a row
    assert ((total - product.sum(1)).abs() <= 1e-5 * product.abs().sum(1) + 1e-12).all()


def dswiglu_saved_case(counts, generator, saved="harness"):
    """dy, Wd, offsets and dswiglu's keyword tensors (outputs NaN; g, u, σ, silu column quarters of one tensor) at
    N = I = 80 (two column tiles of 64, the second ragged): the saved σ and silu drawn apart from g, std 1
    (``"harness"``, as NVIDIA's harness draws them) or the forward's, bf16(σ(g)) and bf16(g · that) (``"forward"``)."""
    offsets = offsets_of(counts)
    E, M, H, I = len(counts), int(offsets[-1]), 64, 80
    dy = bf16_randn(M, H, generator=generator)
    wd = bf16_randn(E, H, I, generator=generator, scale=H**-0.5)
    kept = torch.cat(
        [bf16_randn(M, 2 * I, generator=generator, scale=2.0), bf16_randn(M, 2 * I, generator=generator)], 1
    )
    gate, up = kept[:, :I], kept[:, I : 2 * I]
    if saved == "forward":
        kept[:, 2 * I : 3 * I] = torch.sigmoid(gate.float()).to(torch.bfloat16)
        kept[:, 3 * I :] = (gate.float() * kept[:, 2 * I : 3 * I].float()).to(torch.bfloat16)
    dh = torch.full((M, 2 * I), float("nan"), dtype=torch.bfloat16)
    tensors = dict(
        gate=gate,
        up=up,
        gate_sigmoid=kept[:, 2 * I : 3 * I],
        gate_silu=kept[:, 3 * I :],
        scale=torch.rand(M, generator=generator) + 0.5,
        dgate_out=dh[:, :I],
        dup_out=dh[:, I:],
        scaled_act_out=torch.full((M, I + 8), float("nan"), dtype=torch.bfloat16)[:, :I],
        topk_partial=torch.full((partial_rows(I, SMALL), M), float("nan")),
    )
    return dy, wd, offsets, tensors


@pytest.mark.parametrize("counts", list(NEW_RAGGED.values()), ids=list(NEW_RAGGED))
@pytest.mark.parametrize("programs", [1, 3])
def test_tl_dswiglu_reads_the_saved_sigmoid_and_silu_drawn_apart_from_g(counts, programs, seed):
    """P1's definition on the harness's inputs: σ and silu independent std-1 draws, not σ(g), silu(g)."""
    generator = torch.Generator().manual_seed(seed)
    dy, wd, offsets, tensors = dswiglu_saved_case(counts, generator)
    dg, du, aw, partial = grouped_gemm_tl(
        dy, wd, offsets, epilogue="dswiglu", config=SMALL, programs=programs, **tensors
    )
    dap = per_expert(dy, wd, offsets, False)
    saved = {name: tensors[name] for name in ("gate_sigmoid", "gate_silu")}
    expected = dswiglu_reference(dap, tensors["gate"], tensors["up"], tensors["scale"], **saved)
    assert within_bf16(dg, expected["dg"]) and within_bf16(du, expected["du"]) and within_bf16(aw, expected["aw"])
    product = dap * expected["a"]
    for j in range(partial.shape[0]):  # each row of topk_partial: its column tile's share of ⟨dAp, silu·u⟩
        tile = product[:, 64 * j : 64 * (j + 1)]
        assert ((partial[j].double() - tile.sum(1)).abs() <= 1e-5 * tile.abs().sum(1) + 1e-12).all(), j
    recomputed = dswiglu_reference(dap, tensors["gate"], tensors["up"], tensors["scale"])
    for key, out in (("dg", dg), ("du", du), ("aw", aw)):  # the recomputing form is far off: the test can tell
        assert relative_error(out, recomputed[key]) > 0.5, key


@pytest.mark.parametrize("counts", list(NEW_RAGGED.values()), ids=list(NEW_RAGGED))
def test_tl_dswiglu_with_the_forwards_sigmoid_and_silu_is_the_recomputing_form_within_bf16(counts, seed):
    """σ = bf16(σ(g)), silu = bf16(g · σ): the outputs differ from those computing σ(g), silu(g) in fp32 by the two
    inputs' roundings (2⁻⁹ relative each) and the outputs' own."""
    generator = torch.Generator().manual_seed(seed)
    dy, wd, offsets, tensors = dswiglu_saved_case(counts, generator, saved="forward")
    saved = grouped_gemm_tl(dy, wd, offsets, epilogue="dswiglu", config=SMALL, programs=3, **tensors)
    recomputing = {
        key: torch.full_like(value, float("nan")) if key.endswith(("_out", "partial")) else value
        for key, value in tensors.items()
        if key not in ("gate_sigmoid", "gate_silu")
    }
    recomputed = grouped_gemm_tl(dy, wd, offsets, epilogue="dswiglu", config=SMALL, programs=3, **recomputing)
    g, s = tensors["gate"].double(), torch.sigmoid(tensors["gate"].double())
    dap = per_expert(dy, wd, offsets, False)
    dA = dap * tensors["scale"].double()[:, None]
    # silu'(g) = s(1 + g(1 − s)) moves by at most (1 + 2|g|)·|Δs| for a change Δs of s: the bound of dg's change
    dg_bound = (dA * tensors["up"].double()).abs() * (1 + 2 * g.abs()) * s * 2**-8
    size = {key: value.double().abs() for key, value in zip(("dg", "du", "aw"), recomputed[:3], strict=False)}
    assert ((saved[0].double() - recomputed[0].double()).abs() <= dg_bound + size["dg"] * 2**-7 + 1e-6).all()
    for index, key in ((1, "du"), (2, "aw")):  # silu: one rounding of the input, one of each output
        assert ((saved[index].double() - recomputed[index].double()).abs() <= size[key] * 2**-6 + 1e-6).all(), key
    difference = (saved[3].double() - recomputed[3].double()).abs()
    assert (difference <= (dap * g * s * tensors["up"].double()).abs().sum(1) * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("counts", list(NEW_RAGGED.values()), ids=list(NEW_RAGGED))
@pytest.mark.parametrize(
    ("epilogue", "dtype"),
    [("none", torch.bfloat16), ("none", torch.float32), ("row_scale", torch.bfloat16), ("row_scale", torch.float32)],
    ids=["bf16", "fp32", "row_scale_bf16", "row_scale_fp32"],
)
@pytest.mark.parametrize("pair", [True, False], ids=["pair", "stacked"])
def test_tl_pair_along_k_matches_float64_and_the_stacked_weights(counts, epilogue, dtype, pair, seed):
    """[dg|du] · (Wg, Wu) as a pair along K, or as the stacked [Wg; Wu] (one B [E, K, N]): the same product."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    E, M, K_half, N = len(counts), int(offsets[-1]), 64, 72
    a = bf16_randn(M, 2 * K_half, generator=generator)
    wg, wu = bf16_randn(E, K_half, N, generator=generator), bf16_randn(E, K_half, N, generator=generator)
    scale = torch.rand(M, generator=generator) + 0.5 if epilogue == "row_scale" else None
    wide = torch.full((M, N + 8), float("nan"), dtype=dtype)
    out = wide[:, :N]  # a strided view
    b = (wg, wu) if pair else torch.cat([wg, wu], 1)
    assert grouped_gemm_tl(a, b, offsets, out=out, scale=scale, epilogue=epilogue, config=SMALL, programs=3) is out
    expected = per_expert(a[:, :K_half], wg, offsets, False) + per_expert(a[:, K_half:], wu, offsets, False)
    size = per_expert(a[:, :K_half].abs(), wg.abs(), offsets, False) + per_expert(
        a[:, K_half:].abs(), wu.abs(), offsets, False
    )  # Σ |a·b|: what fp32 accumulation errs by a fraction of
    if scale is not None:
        expected, size = expected * scale.double()[:, None], size * scale.double()[:, None]
    if dtype == torch.float32:  # no rounding: fp32 accumulation's error alone
        assert ((out.double() - expected).abs() <= 1e-5 * size).all()
    else:
        assert within_bf16(out, expected)
    assert wide[:, N:].isnan().all()


@pytest.mark.parametrize("programs", [1, 5])
def test_tl_dswiglu_gives_the_same_bits_for_any_program_count_and_leaves_later_rows(programs, seed):
    """Each tile by one program, whichever: the same bits; rows past offsets[E] keep their poison."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([3, 0, 150, 64, 1])
    M, H, I = 250, 64, 72  # 32 rows past offsets[E] = 218
    dy, wd = bf16_randn(M, H, generator=generator), bf16_randn(5, H, I, generator=generator, scale=H**-0.5)
    saved = bf16_randn(M, 2 * I, generator=generator, scale=2.0)
    w = torch.rand(M, generator=generator) + 0.5

    def run(count):
        outputs = [torch.full((M, I), float("nan"), dtype=torch.bfloat16) for _ in range(3)]
        partial = torch.full((partial_rows(I, SMALL), M), float("nan"))
        grouped_gemm_tl(
            dy,
            wd,
            offsets,
            epilogue="dswiglu",
            gate=saved[:, :I],
            up=saved[:, I:],
            scale=w,
            dgate_out=outputs[0],
            dup_out=outputs[1],
            scaled_act_out=outputs[2],
            topk_partial=partial,
            config=SMALL,
            programs=count,
        )
        return outputs + [partial.t()]

    once, again = run(1), run(programs)
    for first, second in zip(once, again, strict=True):
        assert torch.equal(first[:218], second[:218]) and not first[:218].isnan().any()
        assert second[218:].isnan().all()


# --- the Gluon kernel compiled for sm_90 on the CPU ------------------------------------------------------------


@pytest.mark.slow
def test_probe_configs_compile_for_sm90_unserialised_within_the_limits(tmp_path):
    """Every config the grouped probe times, in each B form, epilogue and set of outputs, compiled for sm_90 by the
    probe itself (``--compile-only``): no stack, within 227 KB, wgmma not serialised by ptxas, ≤ 256 registers a
    partition."""
    env = compile_env(ROOT)
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
    forms = {(row["form"], row["epilogue"], row["outputs"]) for row in rows}
    assert forms == {
        ("nt", "none", "out"),
        ("nn", "none", "out"),
        ("nt", "row_scale", "out"),
        ("nt", "swiglu", "out"),
        ("nt2", "swiglu", "out,g,u"),  # the pair (gate, up), the forward keeping g and u
        ("nt2", "swiglu", "g,u"),  # the backward recomputing them
        ("nn", "dswiglu", "dg,du,aw,part"),
        ("nn", "dswiglu", "dg,du,aw,part ←σ,silu"),  # reading the saved σ and silu (P1's definition)
        ("nn2", "none", "out"),  # the pair (Wg, Wu) along K
        ("nn2", "none", "out fp32"),
    }
    # dswiglu in another config where it does not fit: 128 × 128 tiles with a third output buffer, 64-row ping-pong;
    # reading the saved σ and silu too, as many stages as fit beside the four saved tiles
    substituted = {(row["config"], row["runs"]) for row in rows if row["runs"] != row["config"]}
    assert substituted == {
        ("coop_m128n256k64_s3", "coop_m128n128k64_s4"),
        ("pp_m128n128k64_s5", "pp_m64n128k64_s6"),
        ("coop_m128n256k64_s3", "coop_m128n128k64_s3"),
        ("coop_m128n128k64_s5", "coop_m128n128k64_s3"),
        ("pp_m128n128k64_s5", "pp_m64n128k64_s4"),
    }
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


# --- the new forms on a Hopper GPU ------------------------------------------------------------------------------

# dswiglu's configs: its epilogue needs two output tiles a consumer and at most a 128 × 128 accumulator a warpgroup
DSWIGLU_CONFIGS = {
    "coop_128_s4": DSWIGLU_CONFIG,  # three output tiles: w·a has its own
    "coop_128_s5": GemmConfig(128, 128, 64, 5),  # two: w·a waits for dg's store
    "coop_128_2_programs": GemmConfig(128, 128, 64, 4, programs=2),
    "pingpong_64": GemmConfig(64, 128, 64, 6, "pingpong"),
    "pingpong_64_3_programs": GemmConfig(64, 128, 64, 5, "pingpong", programs=3),
}


def gpu_randn(*size, generator, scale=1.0):
    return (torch.randn(size, generator=generator, device="cuda") * scale).to(torch.bfloat16)


def nan_like(rows, cols, dtype=torch.bfloat16):
    return torch.full((rows, cols), float("nan"), dtype=dtype, device="cuda")


def gpu_per_expert(a, w, offsets, transposed):
    """A[r] · B_e in float64 on the GPU, expert by expert."""
    bounds = offsets.tolist()
    out = torch.zeros((a.shape[0], w.shape[1] if transposed else w.shape[2]), dtype=torch.float64, device=a.device)
    for e in range(w.shape[0]):
        m = w[e].double()
        out[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]].double() @ (m.t() if transposed else m)
    return out


def swiglu_pair_case(counts, outputs, generator):
    """x, (gate, up), offsets, the outputs asked for (g and u column halves of one tensor) and their float64
    values."""
    N, K = 168, 264  # partial tiles on every side
    offsets = offsets_of(counts, device="cuda")
    M, E = int(sum(counts)), len(counts)
    x = gpu_randn(M, K, generator=generator)
    gate, up = (gpu_randn(E, N, K, generator=generator, scale=K**-0.5) for _ in range(2))
    halves = nan_like(M, 2 * N)
    views = {"out": nan_like(M, N), "gate_out": halves[:, :N], "up_out": halves[:, N:]}
    g, u = gpu_per_expert(x, gate, offsets, True), gpu_per_expert(x, up, offsets, True)
    expected = {"out": torch.nn.functional.silu(g) * u, "gate_out": g, "up_out": u}
    return x, (gate, up), offsets, {name: views[name] for name in outputs}, expected


def dswiglu_case(counts, config, generator):
    """dy, Wd, offsets, dswiglu's keyword tensors (g, u and dg, du column halves of one tensor each) and the float64
    values of its outputs (topk_partial's: ⟨dAp, a⟩ a row)."""
    H, I = 256, 328  # K = H a multiple of 64 ([E, K, N] as it lies), N = I ragged in the last column tile
    offsets = offsets_of(counts, device="cuda")
    M, E = int(sum(counts)), len(counts)
    dy = gpu_randn(M, H, generator=generator)
    wd = gpu_randn(E, H, I, generator=generator, scale=H**-0.5)
    saved = gpu_randn(M, 2 * I, generator=generator, scale=2.0)
    w = torch.rand(M, generator=generator, device="cuda") + 0.5
    dh = nan_like(M, 2 * I)
    tensors = dict(
        gate=saved[:, :I],
        up=saved[:, I:],
        scale=w,
        dgate_out=dh[:, :I],
        dup_out=dh[:, I:],
        scaled_act_out=nan_like(M, I),
        topk_partial=torch.full((partial_rows(I, config), M), float("nan"), device="cuda"),
    )
    dap = gpu_per_expert(dy, wd, offsets, False)
    expected = dswiglu_reference(dap, tensors["gate"], tensors["up"], w)
    expected["partial"] = (dap * expected["a"]).sum(1)
    return dy, wd, offsets, tensors, expected


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("outputs", [("out", "gate_out", "up_out"), ("gate_out", "up_out")], ids=["a_g_u", "g_u"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_swiglu_pair_matches_float64(name, outputs, counts, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x, b, offsets, tensors, expected = swiglu_pair_case(GPU_COUNTS[counts], outputs, generator)
    grouped_gemm(x, b, offsets, epilogue="swiglu", config=CONFIGS[name], **tensors)
    for key, out in tensors.items():
        assert relative_error(out, expected[key]) <= 4e-3, key
    again = {key: torch.full_like(out, float("nan")) for key, out in tensors.items()}
    grouped_gemm(x, b, offsets, epilogue="swiglu", config=CONFIGS[name], **again)
    assert all(torch.equal(tensors[key], again[key]) for key in tensors)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("name", list(DSWIGLU_CONFIGS))
@pytest.mark.parametrize("ring", [False, True], ids=["whole_saved_tiles", "saved_through_the_ring"])
def test_gpu_dswiglu_matches_float64(name, ring, counts, seed, monkeypatch):
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", ring)  # ping-pong tiles: whole either way
    check_dswiglu_against_float64(DSWIGLU_CONFIGS[name], counts, seed)


def check_dswiglu_against_float64(config, counts, seed):
    """dswiglu's four outputs (from NaN-filled memory) against float64, then again bit for bit."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, wd, offsets, tensors, expected = dswiglu_case(GPU_COUNTS[counts], config, generator)
    dg, du, aw, partial = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", config=config, **tensors)
    assert relative_error(dg, expected["dg"]) <= 4e-3 and relative_error(du, expected["du"]) <= 4e-3
    assert relative_error(aw, expected["aw"]) <= 4e-3
    product = expected["partial"]
    assert not partial.isnan().any()
    assert ((partial.double().sum(0) - product).abs() <= 1e-4 * (product.abs() + 1)).all()
    again = {
        key: torch.full_like(value, float("nan")) if key.endswith(("_out", "partial")) else value
        for key, value in tensors.items()
    }
    grouped_gemm(dy, wd, offsets, epilogue="dswiglu", config=config, **again)
    for key in ("dgate_out", "dup_out", "scaled_act_out", "topk_partial"):
        assert torch.equal(tensors[key], again[key]), key  # deterministic


# dswiglu with the saved σ and silu: four saved tiles a consumer (a 3-stage ring at 128 × 128, 4 at 64 × 128)
SAVED_CONFIGS = {
    "coop_128_s3": DSWIGLU_SAVED_CONFIG,
    "coop_128_2_programs": GemmConfig(128, 128, 64, 3, programs=2),
    "pingpong_64_s4": GemmConfig(64, 128, 64, 4, "pingpong"),
    "pingpong_64_3_programs": GemmConfig(64, 128, 64, 3, "pingpong", programs=3),
}
SAVED_COUNTS = {**GPU_COUNTS, "one_expert": [1000]}  # and E = 1, as P1's engine design runs it


def gpu_dswiglu_saved_case(counts, config, generator, saved):
    """:func:`dswiglu_case` with the saved σ and silu too (g, u, σ, silu column quarters of one tensor): drawn apart
    from g, std 1 (``"harness"``, as NVIDIA's harness draws them), or the forward's, bf16(σ(g)) and bf16(g · that)
    (``"forward"``); the float64 values of the outputs from them."""
    H, I = 256, 328
    offsets = offsets_of(counts, device="cuda")
    M, E = int(sum(counts)), len(counts)
    dy = gpu_randn(M, H, generator=generator)
    wd = gpu_randn(E, H, I, generator=generator, scale=H**-0.5)
    kept = torch.cat([gpu_randn(M, 2 * I, generator=generator, scale=2.0), gpu_randn(M, 2 * I, generator=generator)], 1)
    if saved == "forward":
        kept[:, 2 * I : 3 * I] = torch.sigmoid(kept[:, :I].float()).to(torch.bfloat16)
        kept[:, 3 * I :] = (kept[:, :I].float() * kept[:, 2 * I : 3 * I].float()).to(torch.bfloat16)
    dh = nan_like(M, 2 * I)
    tensors = dict(
        gate=kept[:, :I],
        up=kept[:, I : 2 * I],
        gate_sigmoid=kept[:, 2 * I : 3 * I],
        gate_silu=kept[:, 3 * I :],
        scale=torch.rand(M, generator=generator, device="cuda") + 0.5,
        dgate_out=dh[:, :I],
        dup_out=dh[:, I:],
        scaled_act_out=nan_like(M, I),
        topk_partial=torch.full((partial_rows(I, config), M), float("nan"), device="cuda"),
    )
    dap = gpu_per_expert(dy, wd, offsets, False)
    expected = dswiglu_reference(
        dap, tensors["gate"], tensors["up"], tensors["scale"], tensors["gate_sigmoid"], tensors["gate_silu"]
    )
    expected["partial"] = (dap * expected["a"]).sum(1)
    return dy, wd, offsets, tensors, expected


@pytest.mark.gpu
@pytest.mark.parametrize("saved", ["harness", "forward"])
@pytest.mark.parametrize("counts", list(SAVED_COUNTS))
@pytest.mark.parametrize("name", list(SAVED_CONFIGS))
def test_gpu_dswiglu_with_the_saved_sigmoid_and_silu_matches_float64_and_its_formula(name, counts, saved, seed):
    """Against float64 of P1's definition; du and w·a bit for bit, dg within a bf16 step, of the formula in fp32 from
    the kernel's own dAp (the none epilogue's fp32 C, the same tiles and K loop); deterministic."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    config = SAVED_CONFIGS[name]
    dy, wd, offsets, tensors, expected = gpu_dswiglu_saved_case(SAVED_COUNTS[counts], config, generator, saved)
    dg, du, aw, partial = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", config=config, **tensors)
    for key, out in (("dg", dg), ("du", du), ("aw", aw)):
        assert relative_error(out, expected[key]) <= 4e-3, key
    assert not partial.isnan().any()
    product = expected["partial"]
    assert ((partial.double().sum(0) - product).abs() <= 1e-4 * (product.abs() + 1)).all()
    dap = grouped_gemm(dy, wd, offsets, out=nan_like(*dg.shape, torch.float32), b_transposed=False, config=config)
    g, u, s, silu = (tensors[key].float() for key in ("gate", "up", "gate_sigmoid", "gate_silu"))
    w = tensors["scale"][:, None]
    dA = dap * w
    assert torch.equal(du, (dA * silu).to(torch.bfloat16))
    assert torch.equal(aw, (silu * u * w).to(torch.bfloat16))
    formula = dA * u * s * (1.0 + g * (1.0 - s))  # the compiler may fuse 1 + g·(1 − s): an fp32 rounding apart
    assert ((dg.float() - formula).abs() <= formula.abs() * 2**-7 + (dA * u * s).abs() * 2**-20).all()
    again = {
        key: torch.full_like(value, float("nan")) if key.endswith(("_out", "partial")) else value
        for key, value in tensors.items()
    }
    grouped_gemm(dy, wd, offsets, epilogue="dswiglu", config=config, **again)
    for key in ("dgate_out", "dup_out", "scaled_act_out", "topk_partial"):
        assert torch.equal(tensors[key], again[key]), key  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(SAVED_COUNTS))
def test_gpu_dswiglu_with_the_forwards_sigmoid_and_silu_agrees_with_the_recomputing_kernel_and_the_twin(counts, seed):
    """Given the forward's σ and silu (each config the default for its variant): within bf16 of the kernel computing
    σ(g) and silu(g), and of the plain-Triton twin on the GPU given the same."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, wd, offsets, tensors, expected = gpu_dswiglu_saved_case(
        SAVED_COUNTS[counts], DSWIGLU_SAVED_CONFIG, generator, "forward"
    )
    gluon = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", **tensors)
    recomputing = {  # no topk_partial: the recomputing default's tiles are wider
        key: torch.full_like(value, float("nan")) if key.endswith("_out") else value
        for key, value in tensors.items()
        if key not in ("gate_sigmoid", "gate_silu", "topk_partial")
    }
    default = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", **recomputing)
    for key, one, other in zip(("dg", "du", "aw"), gluon[:3], default[:3], strict=True):
        assert relative_error(one, other.double()) <= 8e-3, key
    twin_outputs = {  # no topk_partial: the twin's tiles are narrower
        key: torch.full_like(value, float("nan")) if key.endswith("_out") else value
        for key, value in tensors.items()
        if key != "topk_partial"
    }
    twin = grouped_gemm_tl(dy, wd, offsets, epilogue="dswiglu", **twin_outputs)
    for key, one, other in zip(("dg", "du", "aw"), gluon[:3], twin[:3], strict=True):
        assert relative_error(one, other.double()) <= 8e-3, key
        assert relative_error(other, expected[key]) <= 4e-3, key


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_pair_along_k_matches_float64(name, dtype, counts, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = GPU_COUNTS[counts]
    K_half, N = 192, 328
    offsets = offsets_of(counts, device="cuda")
    M, E = int(sum(counts)), len(counts)
    dh = gpu_randn(M, 2 * K_half, generator=generator)
    wg, wu = (gpu_randn(E, K_half, N, generator=generator, scale=(2 * K_half) ** -0.5) for _ in range(2))
    out = nan_like(M, N, dtype)
    grouped_gemm(dh, (wg, wu), offsets, out=out, config=CONFIGS[name])
    expected = gpu_per_expert(dh[:, :K_half], wg, offsets, False) + gpu_per_expert(dh[:, K_half:], wu, offsets, False)
    assert relative_error(out, expected) <= (4e-3 if dtype == torch.bfloat16 else 1e-5)
    again = torch.full_like(out, float("nan"))
    grouped_gemm(dh, (wg, wu), offsets, out=again, config=CONFIGS[name])
    assert torch.equal(out, again)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["swiglu_pair", "dswiglu", "dswiglu_saved", "pair_along_k_fp32"])
def test_gpu_new_forms_replay_in_a_cuda_graph_with_new_offsets(form, seed):
    """Captured once, replayed after the offsets changed on the device: each form's outputs follow them."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = [300, 0, 129, 600, 1]
    if form == "swiglu_pair":
        a, b, offsets, tensors, _ = swiglu_pair_case(counts, ("out", "gate_out", "up_out"), generator)
        run = dict(epilogue="swiglu", **tensors)
    elif form == "dswiglu":
        a, b, offsets, tensors, _ = dswiglu_case(counts, default_config("dswiglu"), generator)  # the call's tiles
        run = dict(epilogue="dswiglu", **tensors)
    elif form == "dswiglu_saved":  # the harness's saved σ and silu, drawn apart from g
        a, b, offsets, tensors, _ = gpu_dswiglu_saved_case(counts, DSWIGLU_SAVED_CONFIG, generator, "harness")
        run = dict(epilogue="dswiglu", **tensors)
    else:
        offsets = offsets_of(counts, device="cuda")
        a = gpu_randn(1030, 256, generator=generator)
        b = tuple(gpu_randn(5, 128, 264, generator=generator, scale=256**-0.5) for _ in range(2))
        run = dict(out=nan_like(1030, 264, torch.float32))
    grouped_gemm(a, b, offsets, **run)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_gemm(a, b, offsets, **run)
    for new in ([300, 0, 129, 600, 1], [0, 1030, 0, 0, 0], [206, 206, 206, 206, 206]):
        offsets.copy_(offsets_of(new, device="cuda"))
        for key, value in run.items():
            if key.endswith(("out", "partial")):
                value.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if form == "swiglu_pair":
            g = gpu_per_expert(a, b[0], offsets, True)
            assert relative_error(run["gate_out"], g) <= 4e-3, new
            u = gpu_per_expert(a, b[1], offsets, True)
            assert relative_error(run["out"], torch.nn.functional.silu(g) * u) <= 4e-3, new
        elif form.startswith("dswiglu"):
            dap = gpu_per_expert(a, b, offsets, False)
            saved = (run.get("gate_sigmoid"), run.get("gate_silu"))
            expected = dswiglu_reference(dap, run["gate"], run["up"], run["scale"], *saved)
            assert relative_error(run["dgate_out"], expected["dg"]) <= 4e-3, new
            assert relative_error(run["scaled_act_out"], expected["aw"]) <= 4e-3, new
        else:
            expected = gpu_per_expert(a[:, :128], b[0], offsets, False) + gpu_per_expert(
                a[:, 128:], b[1], offsets, False
            )
            assert relative_error(run["out"], expected) <= 1e-5, new


def dswiglu_off_and_on(switch, config, counts, saved, seed, monkeypatch):
    """dswiglu's outputs (dg, du, aw, partial, each poisoned with NaN first) on one drawn case, with grouped_gemm's
    ``switch`` off, then on; the saved σ and silu given where ``saved``."""
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, wd, offsets, tensors, _ = gpu_dswiglu_saved_case(SAVED_COUNTS[counts], config, generator, "harness")
    if not saved:
        tensors = {key: value for key, value in tensors.items() if key not in ("gate_sigmoid", "gate_silu")}
    results = []
    for on in (False, True):
        monkeypatch.setattr(grouped_gemm_module, switch, on)
        fresh = {
            key: torch.full_like(value, float("nan")) if key.endswith(("_out", "partial")) else value
            for key, value in tensors.items()
        }
        results.append(grouped_gemm(dy, wd, offsets, epilogue="dswiglu", config=config, **fresh))
    return results


# --- dswiglu's saved g and u through the ring (SAVED_THROUGH_RING) ----------------------------------------------


def test_saved_tiles_through_the_ring_take_no_output_tile_and_move_in_chunks(monkeypatch):
    """SAVED_THROUGH_RING (on by default): dswiglu's launch takes its saved and output tiles BLOCK_K columns a step
    (RING_CHUNKS of them a tile), no output tile in shared memory, its default config 128 × 256 with a 4-stage ring;
    not with the saved σ and silu, nor for ping-pong consumers; a ring too deep for w·a's staging is refused before
    any work. Off, whole tiles as before."""
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    M, H, I, E = 256, 128, 96, 4

    def launch(config=None, **extra):
        tensors = dict(gate=meta(M, I), up=meta(M, I), scale=meta(M, dtype=F32), dgate_out=meta(M, I),
                       dup_out=meta(M, I), scaled_act_out=meta(M, I), **extra)  # fmt: skip
        config = config or default_config("dswiglu", "gate_sigmoid" in extra)
        arguments, fixed = launch_arguments(config, meta(M, H), meta(E, H, I), meta(E + 1, dtype=torch.int32),
                                            "dswiglu", False, **tensors)  # fmt: skip
        return config, fixed["RING_CHUNKS"], fixed["OUT_BUFS"], arguments["gin_desc"].block_shape

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", False)
    assert launch() == (DSWIGLU_CONFIG, 0, 3, [128, 128])
    before = grouped_gemm_module.switches()
    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", True)
    assert grouped_gemm_module.switches() != before  # a launch made with it off never serves it on
    assert launch() == (RING_DSWIGLU_CONFIG, 4, 0, [128, 64]) and RING_DSWIGLU_CONFIG == GemmConfig(128, 256, 64, 4)
    assert launch(GemmConfig(128, 128, 32, 8))[1:] == (4, 0, [128, 32])
    assert launch(GemmConfig(128, 128, 64, 5, "pingpong"))[1] == 0  # ping-pong: whole tiles, as before
    saved = launch(gate_sigmoid=meta(M, I), gate_silu=meta(M, I))
    assert saved[:2] == (DSWIGLU_SAVED_CONFIG, 0)
    deep = GemmConfig(128, 256, 32, 9)  # 9 × 24 KB of ring and two 8 KB staging chunks: 1 KB over
    tensors = dict(gate=meta(M, I), up=meta(M, I), scale=meta(M, dtype=F32))
    with pytest.raises(ValueError, match="config: dswiglu through the ring needs 238592 bytes"):
        check_arguments(meta(M, H), meta(E, H, I), meta(E + 1, dtype=torch.int32), epilogue="dswiglu", config=deep,
                        scaled_act_out=meta(M, I), **tensors)  # fmt: skip
    check_arguments(
        meta(M, H), meta(E, H, I), meta(E + 1, dtype=torch.int32), epilogue="dswiglu", config=deep, **tensors
    )  # without w·a it fits


# dswiglu through the ring: 256 columns in 4 or 8 chunks, 128 in 2 or 4; several programs crossing experts
RING_CONFIGS = {
    "coop_256_k64_s4": RING_DSWIGLU_CONFIG,
    "coop_256_k32_s8": GemmConfig(128, 256, 32, 8),
    "coop_128_k32_s8": GemmConfig(128, 128, 32, 8),
    "coop_256_k64_s2_2_programs": GemmConfig(128, 256, 64, 2, programs=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("name", list(RING_CONFIGS))
def test_gpu_dswiglu_through_the_ring_matches_float64(name, counts, seed, monkeypatch):
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", True)
    check_dswiglu_against_float64(RING_CONFIGS[name], counts, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(SAVED_COUNTS))
@pytest.mark.parametrize(
    "config", [DSWIGLU_CONFIG, GemmConfig(128, 128, 64, 4, programs=2)], ids=["coop_128_s4", "coop_128_2_programs"]
)
def test_gpu_dswiglu_through_the_ring_changes_no_bit_of_its_outputs(config, counts, seed, monkeypatch):
    """SAVED_THROUGH_RING at 128 × 128 × 64 (two chunks a tile) against whole saved tiles: dg, du and w·a bit for
    bit (the same fp32 operations an element), topk_partial within fp32's rounding (its sums grouped by chunk), no
    NaN left."""
    results = dswiglu_off_and_on("SAVED_THROUGH_RING", config, counts, False, seed, monkeypatch)
    for key, whole, chunked in zip(("dg", "du", "aw", "partial"), *results, strict=True):
        assert not chunked.isnan().any(), key
        if key == "partial":
            assert torch.allclose(whole, chunked, rtol=1e-5, atol=1e-5), key
        else:
            assert torch.equal(whole, chunked), key


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
def test_gpu_dswiglu_through_the_ring_without_w_a_or_partials_matches_float64(counts, seed, monkeypatch):
    """Through the ring with dg and du alone (no w·a staging chunks, no topk_partial)."""
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", True)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, wd, offsets, tensors, expected = dswiglu_case(GPU_COUNTS[counts], RING_DSWIGLU_CONFIG, generator)
    del tensors["scaled_act_out"], tensors["topk_partial"]
    dg, du, aw, partial = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", **tensors)
    assert aw is None and partial is None
    assert relative_error(dg, expected["dg"]) <= 4e-3 and relative_error(du, expected["du"]) <= 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("ring", [False, True], ids=["whole_saved_tiles", "saved_through_the_ring"])
def test_gpu_dswiglu_writes_dg_and_du_over_g_and_u_as_it_would_apart(ring, counts, seed, monkeypatch):
    """dgate_out and dup_out the saved g and u themselves (the layer's GRADS_OVER_SAVED): each tile (or chunk) of g
    and u is read before dg and du are written there, and no tile writes past its expert's rows, so the outputs are
    the bits of separate ones."""
    from moe_lib.engine import grouped_gemm as grouped_gemm_module

    monkeypatch.setattr(grouped_gemm_module, "SAVED_THROUGH_RING", ring)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, wd, offsets, tensors, _ = dswiglu_case(GPU_COUNTS[counts], default_config("dswiglu"), generator)
    apart = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", **tensors)
    over = dict(
        tensors,
        dgate_out=tensors["gate"],
        dup_out=tensors["up"],
        scaled_act_out=torch.full_like(tensors["scaled_act_out"], float("nan")),
        topk_partial=torch.full_like(tensors["topk_partial"], float("nan")),
    )
    written = grouped_gemm(dy, wd, offsets, epilogue="dswiglu", **over)
    for name, got, want in zip(("dg", "du", "aw", "partial"), written, apart, strict=True):
        assert torch.equal(got, want), name
