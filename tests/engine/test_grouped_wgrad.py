"""The grouped weight-gradient kernel (``moe_lib/engine/grouped_wgrad.py``, its plain Triton twin
``grouped_wgrad_tl.py``): the tile schedule pinned by value, the argument checks, the tl kernel under the interpreter
against float64 at ragged experts (with infinities in a neighbour's rows), and on a Hopper GPU (``gpu``) the Gluon
kernel against float64 and a torch.mm per expert, deterministic and captured in a CUDA graph. Its sm_90 build:
tests/engine/test_wgrad_probe_script.py."""

import pytest
import torch

from moe_lib.engine.gathered import Gathered
from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.engine.grouped_wgrad import (
    DEFAULT_CONFIG,
    FP32_CONFIG,
    check_arguments,
    default_config,
    grid,
    grouped_weight_grad,
    problem_tiles,
    schedule,
    shared_bytes,
    tile_place,
    total_tiles,
    visits,
)
from moe_lib.engine.grouped_wgrad_tl import grouped_weight_grad_tl

SMALL = GemmConfig(64, 64, 32, 2, "pingpong", group_m=2)  # 64 × 64 tiles, 32 rows a step, two row tiles a group
# 64 × 128 tiles: dWg [I, H] and dWd [H, I] have different tile counts (with square tiles a transpose has as many)
WIDE = GemmConfig(64, 128, 32, 2, "pingpong", group_m=2)


def offsets_of(counts, device="cpu"):
    """int32 [E + 1]: the exclusive prefix of the experts' row counts, then their total."""
    return torch.tensor(
        [0] + torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32, device=device
    )


def reference(a, b, offsets):
    """C [E, M, N] in float64, expert by expert: A[rows_e]ᵀ · B[rows_e]."""
    bounds = offsets.tolist()
    return torch.stack([a[s:e].double().t() @ b[s:e].double() for s, e in zip(bounds[:-1], bounds[1:], strict=True)])


def within_rounding(out, expected):
    """Each element within its output dtype's rounding of the float64 value (fp32 accumulation aside)."""
    if not torch.isfinite(out).all():
        return False
    relative = 2**-8 if out.dtype == torch.bfloat16 else 1e-6
    scale = expected.abs().max().clamp_min(1e-30)  # a missing or extra row's product is ~1e-2 of it at these sizes
    return bool(((out.double() - expected).abs() <= expected.abs() * relative + 1e-4 * scale).all())


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def operands(kind, rows, generator, inter=40, hidden=136, device="cpu"):
    """Fresh bf16 operands of ``kind``: "down" dWd = dyᵀ·aw ([H, I]); "gate_up" dWg = dgᵀ·x and dWu = duᵀ·x with dg
    and du column views of one [rows, 2I] tensor (row stride 2I); "three" both."""

    def randn(*size):
        return torch.randn(size, generator=generator, device=device).to(torch.bfloat16)

    pairs = []
    if kind in ("gate_up", "three"):
        dgdu, x = randn(rows, 2 * inter), randn(rows, hidden)
        pairs += [(dgdu[:, :inter], x), (dgdu[:, inter:], x)]
    if kind in ("down", "three"):
        pairs.append((randn(rows, hidden), randn(rows, inter)))
    return pairs


def poisoned(pairs, num_experts, dtype, device="cpu"):
    return [
        torch.full((num_experts, a.shape[1], b.shape[1]), float("nan"), dtype=dtype, device=device) for a, b in pairs
    ]


# --- the schedule -----------------------------------------------------------------------------------------------


def test_tile_place_and_schedule_pinned_on_two_products():
    """dW [130, 64] (three row tiles: a group of two, then one) and [64, 130] (three column tiles), two experts,
    four programs: expert-major, problem by problem inside an expert, the grouped order inside a problem."""
    shapes = [(130, 64), (64, 130)]
    assert problem_tiles(shapes, SMALL) == [3, 3] and total_tiles(2, shapes, SMALL) == 12
    expert0 = [(0, 0, 0, 0), (0, 0, 64, 0), (0, 0, 128, 0), (0, 1, 0, 0), (0, 1, 0, 64), (0, 1, 0, 128)]
    assert [tile_place(t, shapes, SMALL) for t in range(6)] == expert0
    assert [tile_place(t, shapes, SMALL) for t in range(6, 12)] == [(1,) + place[1:] for place in expert0]
    assert schedule(2, shapes, SMALL, 4) == [
        [(0, 0, 0, 0), (0, 1, 0, 64), (1, 0, 128, 0)],
        [(0, 0, 64, 0), (0, 1, 0, 128), (1, 1, 0, 0)],
        [(0, 0, 128, 0), (1, 0, 0, 0), (1, 1, 0, 64)],
        [(0, 1, 0, 0), (1, 0, 64, 0), (1, 1, 0, 128)],
    ]
    assert [visits(tiles) for tiles in schedule(2, shapes, SMALL, 4)] == [3, 3, 3, 3]
    assert [visits(tiles) for tiles in schedule(2, shapes, SMALL, 1)] == [4]  # one program: one run a product


def test_grouped_order_inside_a_product():
    """[200, 130]: four row tiles by three column tiles, two row tiles a group, column by column."""
    order = [tile_place(t, [(200, 130)], SMALL)[2:] for t in range(12)]
    assert order == [(0, 0), (64, 0), (0, 64), (64, 64), (0, 128), (64, 128),
                     (128, 0), (192, 0), (128, 64), (192, 64), (128, 128), (192, 128)]  # fmt: skip


@pytest.mark.parametrize("trial", range(10))
def test_schedule_covers_every_output_tile_once(trial):
    generator = torch.Generator().manual_seed(trial)
    E = int(torch.randint(1, 6, (1,), generator=generator))
    shapes = [tuple(int(v) for v in torch.randint(1, 300, (2,), generator=generator)) for _ in range(1 + trial % 3)]
    programs = int(torch.randint(1, 9, (1,), generator=generator))
    every = sorted(t for tiles in schedule(E, shapes, SMALL, programs) for t in tiles)
    expected = sorted(
        (e, p, m, n) for e in range(E) for p, (M, N) in enumerate(shapes) for m in range(0, M, 64)
        for n in range(0, N, 64)
    )  # fmt: skip
    assert every == expected


def test_grid_uses_the_experts_and_shapes_only():
    config = GemmConfig()  # 128 × 256 tiles
    p2 = [(2048, 4096), (2048, 4096), (4096, 2048)]
    assert problem_tiles(p2, config) == [256, 256, 256]
    assert grid(256, p2, config, 132) == 132
    assert grid(1, [(128, 256)], config, 132) == 1
    assert grid(0, p2, config, 132) == 1


def test_output_buffers_two_where_they_fit_beside_the_ring():
    from moe_lib.engine.grouped_wgrad import output_buffers

    assert output_buffers(GemmConfig(), torch.bfloat16) == 1  # 3 stages: 144 KB of ring
    assert output_buffers(GemmConfig(128, 256, 64, 2), torch.bfloat16) == 2  # 96 KB of ring + 2 × 64 KB
    assert output_buffers(GemmConfig(128, 256, 64, 2), torch.float32) == 1
    assert output_buffers(FP32_CONFIG, torch.float32) == 1
    assert output_buffers(GemmConfig(128, 128, 64, 5, "pingpong"), torch.bfloat16) == 1
    assert output_buffers(GemmConfig(128, 128, 64, 2, "pingpong"), torch.bfloat16) == 2
    for config in (GemmConfig(128, 256, 64, 2), GemmConfig(128, 128, 64, 2, "pingpong")):
        assert shared_bytes(config, torch.bfloat16, output_buffers(config, torch.bfloat16)) <= 232448


def test_default_config_is_the_fp32_tile_for_fp32_outputs():
    assert default_config(torch.float32) == FP32_CONFIG
    assert default_config(torch.bfloat16) == DEFAULT_CONFIG != FP32_CONFIG


def test_shared_memory_counts_the_output_dtype():
    assert shared_bytes(GemmConfig(), torch.bfloat16) == 3 * (128 + 256) * 64 * 2 + 128 * 256 * 2 + 512
    assert shared_bytes(GemmConfig(), torch.float32) > 232448  # an fp32 128 × 256 tile leaves no room for a ring
    assert shared_bytes(FP32_CONFIG, torch.float32) <= 232448


# --- the argument checks ----------------------------------------------------------------------------------------


def misaligned(rows, cols):
    """A contiguous bf16 [rows, cols] view starting 2 bytes past a 16-byte boundary."""
    return torch.empty(rows * cols + 8, dtype=torch.bfloat16)[1 : 1 + rows * cols].view(rows, cols)


I32 = torch.int32
A, B, OFFSETS = meta(64, 32), meta(64, 48), meta(5, dtype=I32)
CASES = [
    # (problems, offsets, keyword arguments, error type, message)
    (meta(64, 32), OFFSETS, {}, TypeError, "problems: expected a sequence of (A, B) pairs"),
    ([], OFFSETS, {}, ValueError, "problems: expected 1 to 3 (A, B) pairs, got 0"),
    ([(A, B)] * 4, OFFSETS, {}, ValueError, "problems: expected 1 to 3 (A, B) pairs, got 4"),
    ([(A,)], OFFSETS, {}, TypeError, "problems[0]: expected an (A, B) pair"),
    ([(A, B), ([[1.0]], B)], OFFSETS, {}, TypeError, "problems[1].a: expected a torch.Tensor"),
    ([(meta(64, 32, dtype=torch.float32), B)], OFFSETS, {}, TypeError, "problems[0].a: expected torch.bfloat16"),
    ([(A, B), (A, meta(64, 48, dtype=torch.float16))], OFFSETS, {}, TypeError, "problems[1].b: expected torch.bf"),
    ([(meta(64, 32, 1), B)], OFFSETS, {}, ValueError, "problems[0].a: expected a 2-D tensor"),
    ([(A, meta(63, 48))], OFFSETS, {}, ValueError, "problems[0].b: expected 64 rows"),
    ([(A, B), (meta(65, 32), B)], OFFSETS, {}, ValueError, "problems[1].a: expected 64 rows"),
    ([(meta(32, 64).t(), B)], OFFSETS, {}, ValueError, "problems[0].a: expected rows of contiguous elements"),
    ([(A, meta(64, 12))], OFFSETS, {}, ValueError, "problems[0].b: TMA needs a row stride of a multiple of 16"),
    ([(A, meta(64, 24)[:, :12])], OFFSETS, {}, ValueError, "problems[0].b: TMA needs the output's rows"),
    ([Gathered(meta(9, 48), meta(64, dtype=I32))], OFFSETS, {}, TypeError, "problems[0]: expected an (A, B) pair"),
    ([(A, Gathered(meta(9, 48), meta(64)))], OFFSETS, {}, TypeError, "problems[0].b.index: expected torch.int32"),
    ([(A, Gathered(meta(9, 48), meta(64, 1, dtype=I32)))], OFFSETS, {}, ValueError, "problems[0].b.index: expected a"),
    ([(A, Gathered(meta(9, 48, 1), meta(64, dtype=I32)))], OFFSETS, {}, ValueError, "problems[0].b.source: expected"),
    ([(A, Gathered(meta(9, 48), meta(63, dtype=I32)))], OFFSETS, {}, ValueError, "problems[0].b: expected 64 rows"),
    ([(A, Gathered(meta(9, 12), meta(64, dtype=I32)))], OFFSETS, {}, ValueError, "problems[0].b: TMA needs a row"),
    (
        [(A, Gathered(meta(9, 48), meta(64, dtype=I32))), (Gathered(meta(9, 32), meta(64, dtype=I32)), B)],
        OFFSETS,
        {},
        ValueError,
        "problems[1].a.index: the gathered operands of one launch share one index tensor",
    ),
    ([(A, B)], [0, 64], {}, TypeError, "offsets: expected a torch.Tensor"),
    ([(A, B)], meta(5, dtype=torch.int64), {}, TypeError, "offsets: expected torch.int32"),
    ([(A, B)], meta(0, dtype=I32), {}, ValueError, "offsets: expected a 1-D tensor of E + 1"),
    ([(A, B)], meta(5, 1, dtype=I32), {}, ValueError, "offsets: expected a 1-D tensor of E + 1"),
    ([(A, B)], meta(10, dtype=I32)[::2], {}, ValueError, "offsets: expected a contiguous tensor"),
    ([(A, B)], OFFSETS, dict(outs=meta(4, 32, 48)), TypeError, "outs: expected a sequence of 1 tensors"),
    ([(A, B)], OFFSETS, dict(outs=[meta(4, 32, 48)] * 2), ValueError, "outs: expected 1 tensors"),
    ([(A, B)], OFFSETS, dict(outs=[meta(4, 48, 32)]), ValueError, "outs[0]: expected shape (4, 32, 48)"),
    ([(A, B)], OFFSETS, dict(outs=[meta(4, 32, 48, dtype=torch.float16)]), TypeError, "outs[0]: expected one of"),
    (
        [(A, B), (A, B)],
        OFFSETS,
        dict(outs=[meta(4, 32, 48), meta(4, 32, 48, dtype=torch.float32)]),
        TypeError,
        "outs[1]: expected torch.bfloat16 like outs[0]",
    ),
    ([(A, B)], OFFSETS, dict(outs=[meta(4, 32, 96)[:, :, ::2]]), ValueError, "outs[0]: expected contiguous rows"),
    (
        [(A, B), (A, B)],
        OFFSETS,
        dict(outs=[meta(4, 32, 48), meta(4, 48, 32).transpose(1, 2)]),
        ValueError,
        "outs[1]: expected the layout of outs[0]",
    ),
    (
        [(A, B), (A, B)],
        OFFSETS,
        dict(outs=[(meta(4, 32, 16), meta(4, 32, 32)), meta(4, 32, 48)]),
        ValueError,
        "outs[0]: two column parts of one output are taken for a launch of one product only",
    ),
    ([(A, B)], OFFSETS, dict(outs=[(meta(4, 32, 48), meta(4, 32, 8))]), ValueError, "0 < N_left < N_p = 48"),
    ([(A, B)], OFFSETS, dict(outs=[(meta(4, 32, 16), meta(4, 32, 32))]), ValueError, "taken as transposed views"),
    ([(A, B)], OFFSETS, dict(outs=[(meta(4, 32, 16), meta(4, 32, 16))]), ValueError, "outs[0][1]: expected shape"),
    ([(A, B)], OFFSETS, dict(outs=[meta(4, 32, 52)[:, :, :48]]), ValueError, "outs[0]: expected contiguous rows"),
    ([(A, B)], OFFSETS, dict(outs=[[0.0]]), TypeError, "outs[0]: expected a torch.Tensor"),
    ([(A, B)], OFFSETS, dict(out_dtype=torch.float16), TypeError, "out_dtype: expected one of"),
    ([(A, B)], OFFSETS, dict(config=(128, 256, 64)), TypeError, "config: expected a GemmConfig"),
    ([(A, B)], OFFSETS, dict(out_dtype=torch.float32, config=GemmConfig()), ValueError, "config: 279040 bytes"),
    (
        [(torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 48, dtype=torch.bfloat16))],
        OFFSETS,
        {},
        ValueError,
        "problems[0].a: expected the device of offsets (meta)",
    ),
    (
        [(misaligned(64, 32), torch.empty(64, 48, dtype=torch.bfloat16))],
        torch.zeros(5, dtype=I32),
        {},
        ValueError,
        "problems[0].a: TMA needs the tensor to start on a 16-byte boundary",
    ),
    (
        [(torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 48, dtype=torch.bfloat16))],
        torch.zeros(5, dtype=I32),
        dict(outs=[misaligned(4 * 32, 48).view(4, 32, 48)]),
        ValueError,
        "outs[0]: TMA needs the tensor to start on a 16-byte boundary",
    ),
]


@pytest.mark.parametrize(("problems", "offsets", "kwargs", "error", "message"), CASES, ids=[c[-1] for c in CASES])
def test_arguments_are_checked_naming_the_argument(problems, offsets, kwargs, error, message):
    with pytest.raises(error) as raised:
        check_arguments(problems, offsets, **kwargs)
    assert message in str(raised.value)


def test_arguments_give_the_experts_shapes_and_output_dtype():
    dgdu = meta(64, 80)
    pairs = [(dgdu[:, :40], meta(64, 136)), (dgdu[:, 40:], meta(64, 136)), (meta(64, 136), meta(64, 40))]
    assert check_arguments(pairs, OFFSETS) == (4, [(40, 136), (40, 136), (136, 40)], torch.bfloat16)
    outs = [meta(4, 40, 136, dtype=torch.float32)]
    assert check_arguments(pairs[:1], OFFSETS, outs=outs, config=FP32_CONFIG) == (4, [(40, 136)], torch.float32)
    assert check_arguments([(A, B)], meta(1, dtype=I32)) == (0, [(32, 48)], torch.bfloat16)  # no experts


def test_gathered_operands_give_the_shapes_of_their_index():
    index = meta(64, dtype=I32)
    pairs = [(A, Gathered(meta(9, 48), index)), (Gathered(meta(9, 40), index), B)]
    assert check_arguments(pairs, OFFSETS) == (4, [(32, 48), (40, 48)], torch.bfloat16)


def test_grouped_weight_grad_refuses_cpu_tensors():
    a, b = torch.ones(64, 32, dtype=torch.bfloat16), torch.ones(64, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets: the Gluon weight-gradient kernel runs on a CUDA"):
        grouped_weight_grad([(a, b)], torch.zeros(5, dtype=torch.int32))


# --- the tl kernel under the interpreter --------------------------------------------------------------------------

RAGGED = {
    "empty_one_ragged": [0, 1, 70, 130, 0, 64],  # no rows, one row, not a step multiple, several steps and a bit
    "all_in_one": [0, 0, 197, 0],  # every row in one expert
    "single_rows": [1, 1, 1],
}


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["down", "gate_up", "three"])
@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
def test_tl_kernel_matches_float64_at_ragged_experts(counts, kind, out_dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    pairs = operands(kind, int(offsets[-1]), generator)
    outs = poisoned(pairs, len(counts), out_dtype)
    grouped_weight_grad_tl(pairs, offsets, outs=outs, config=WIDE, programs=3)
    for (a, b), out in zip(pairs, outs, strict=True):
        expected = reference(a, b, offsets)
        assert within_rounding(out, expected)
        for e, count in enumerate(counts):
            if count == 0:
                assert torch.equal(out[e], torch.zeros_like(out[e]))  # exact zeros, the poison gone


def test_tl_kernel_writes_column_slices_of_wider_outputs(seed):
    """Outputs that are column slices of wider tensors (the layer's weight gradients a slice of H at a time): each
    slice gets its product, rows strided by the wider tensor's width; the columns beside it are not touched."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([40, 0, 75, 1])
    pairs = operands("three", int(offsets[-1]), generator)
    wide = [torch.full((4, a.shape[1], b.shape[1] + 24), 7.0, dtype=torch.bfloat16) for a, b in pairs]
    outs = [w[:, :, 16 : 16 + b.shape[1]] for w, (_, b) in zip(wide, pairs, strict=True)]
    grouped_weight_grad_tl(pairs, offsets, outs=outs, config=WIDE, programs=3)
    for (a, b), out, w in zip(pairs, outs, wide, strict=True):
        assert within_rounding(out, reference(a, b, offsets))
        assert torch.all(w[:, :, :16] == 7.0) and torch.all(w[:, :, 16 + b.shape[1] :] == 7.0)


def test_tl_kernel_writes_transposed_views(seed):
    """Outputs given as transposed views (C_pᵀ laid out row by row: the layer's gate and up gradients with x as A)
    get their products, as contiguous outputs do."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([40, 0, 75, 1])
    pairs = operands("three", int(offsets[-1]), generator)
    outs = [torch.full((4, b.shape[1], a.shape[1]), float("nan"), dtype=torch.bfloat16).transpose(1, 2)
            for a, b in pairs]  # fmt: skip
    grouped_weight_grad_tl(pairs, offsets, outs=outs, config=WIDE, programs=3)
    for (a, b), out in zip(pairs, outs, strict=True):
        assert within_rounding(out, reference(a, b, offsets))


def test_tl_kernel_writes_one_product_into_two_column_parts(seed):
    """One product's output given as two column parts, transposed views ([left | right], the boundary inside a
    tile): each part gets its columns of the product."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([40, 0, 75, 1])
    ((a, b),) = operands("three", int(offsets[-1]), generator)[:1]
    left = 64  # WIDE's tiles are 128 columns: the boundary falls inside the first
    shapes = [(4, a.shape[1], left), (4, a.shape[1], b.shape[1] - left)]
    parts = tuple(torch.full((e, n, m), float("nan"), dtype=torch.bfloat16).transpose(1, 2) for e, m, n in shapes)
    grouped_weight_grad_tl([(a, b)], offsets, outs=[parts], config=WIDE, programs=3)
    expected = reference(a, b, offsets)
    assert within_rounding(parts[0], expected[:, :, :left]) and within_rounding(parts[1], expected[:, :, left:])


def test_tl_kernel_with_three_unlike_products(seed):
    """Three products of 2, 4 and 3 tiles an expert (64 × 128 tiles), two strided views: each tile finds its
    product and its place."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([40, 0, 75, 1])
    rows = int(offsets[-1])

    def randn(*size):
        return torch.randn(size, generator=generator).to(torch.bfloat16)

    wide = randn(rows, 200)
    pairs = [(randn(rows, 40), randn(rows, 136)), (wide[:, :72], randn(rows, 136)), (wide[:, 64:200], randn(rows, 48))]
    outs = poisoned(pairs, 4, torch.float32)
    grouped_weight_grad_tl(pairs, offsets, outs=outs, config=WIDE, programs=3)
    for (a, b), out in zip(pairs, outs, strict=True):
        assert within_rounding(out, reference(a, b, offsets))


def test_tl_kernel_keeps_a_neighbours_infinities_out(seed):
    """Infinities and NaN in the first row of expert 1 (read by expert 0's last, ragged step) and in rows past
    offsets[E] (read by the last expert's): every expert but 1 exact to float64's rounding."""
    generator = torch.Generator().manual_seed(seed)
    counts = [70, 5, 33, 0, 60]
    offsets = offsets_of(counts)
    rows = int(offsets[-1]) + 20  # 20 rows of no expert after the last
    pairs = operands("three", rows, generator)
    for a, b in pairs:
        for row in [70] + list(range(rows - 20, rows)):
            a[row, ::2], a[row, 1::2], b[row, ::3] = float("inf"), float("nan"), float("-inf")
    outs = poisoned(pairs, len(counts), torch.bfloat16)
    grouped_weight_grad_tl(pairs, offsets, outs=outs, config=WIDE, programs=2)
    for (a, b), out in zip(pairs, outs, strict=True):
        expected = reference(a, b, offsets)
        for e in (0, 2, 3, 4):
            assert within_rounding(out[e], expected[e]), e
        assert not torch.isfinite(out[1]).all()  # the expert's own infinities do reach its own gradient


@pytest.mark.parametrize("programs", [1, 2, 5, 64])
def test_tl_kernel_gives_the_same_bits_for_any_program_count(programs, seed):
    """Each tile computed by one program, whichever: the result does not depend on how the tiles are dealt."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of([3, 0, 150, 64, 1])
    pairs = operands("three", 218, generator)
    once = grouped_weight_grad_tl(pairs, offsets, config=SMALL, programs=1)
    again = grouped_weight_grad_tl(
        pairs, offsets, outs=poisoned(pairs, 5, torch.bfloat16), config=SMALL, programs=programs
    )
    assert all(torch.equal(x, y) for x, y in zip(once, again, strict=True))


def gathered_three(rows, tokens, generator, inter=40, hidden=136, device="cpu"):
    """MoE's three products with x and dy gathered from [tokens, H] sources by one index (tokens repeat, some never
    read), and the same products with the gathered rows written out."""

    def randn(*size):
        return torch.randn(size, generator=generator, device=device).to(torch.bfloat16)

    index = torch.randint(0, tokens, (rows,), generator=generator, device=device, dtype=torch.int32)
    x, dy = Gathered(randn(tokens, hidden), index), Gathered(randn(tokens, hidden), index)
    dgdu, aw = randn(rows, 2 * inter), randn(rows, inter)
    gathered = [(dgdu[:, :inter], x), (dgdu[:, inter:], x), (dy, aw)]
    written = [(a, b.materialise()) for a, b in gathered[:2]] + [(dy.materialise(), aw)]
    return gathered, written


@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
def test_tl_kernel_gathers_rows_through_the_index(counts, seed):
    """x and dy read through the index give the bits of the same rows written out, and float64's values."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_of(counts)
    gathered, written = gathered_three(int(offsets[-1]), 37, generator)
    poison = poisoned(written, len(counts), torch.bfloat16)
    outs = grouped_weight_grad_tl(gathered, offsets, outs=poison, config=WIDE, programs=3)
    expected = grouped_weight_grad_tl(written, offsets, config=WIDE, programs=3)
    for (a, b), out, same in zip(written, outs, expected, strict=True):
        assert torch.equal(out, same)
        assert within_rounding(out, reference(a, b, offsets))


def test_tl_kernel_without_rows_or_experts(seed):
    """No rows at all: every gradient exact zeros. No experts: [0, M_p, N_p] outputs, nothing launched."""
    generator = torch.Generator().manual_seed(seed)
    pairs = operands("three", 0, generator)
    outs = grouped_weight_grad_tl(pairs, offsets_of([0, 0, 0]), outs=poisoned(pairs, 3, torch.float32), config=SMALL)
    assert all(torch.equal(out, torch.zeros_like(out)) for out in outs)
    pairs = operands("gate_up", 10, generator)
    outs = grouped_weight_grad_tl(pairs, torch.zeros(1, dtype=torch.int32), config=SMALL)
    assert [tuple(out.shape) for out in outs] == [(0, 40, 136), (0, 40, 136)]


# --- on a Hopper GPU --------------------------------------------------------------------------------------------

CONFIGS = {
    "coop": GemmConfig(),
    "coop_128": GemmConfig(128, 128, 64, 5),
    "pingpong": GemmConfig(128, 128, 64, 5, "pingpong"),
    "coop_2_programs": GemmConfig(programs=2),  # many runs a program: both descriptor pairs reused many times
    "pingpong_3_programs": GemmConfig(128, 128, 64, 5, "pingpong", programs=3),
    # a two-step ring and two output buffers taken in turn (output_buffers); few programs: many tiles each
    "coop_s2_two_outputs": GemmConfig(128, 256, 64, 2),
    "coop_s2_two_outputs_3_programs": GemmConfig(128, 256, 64, 2, programs=3),
    "coop_256x128": GemmConfig(256, 128, 64, 3),  # 128 rows a consumer warpgroup
}
# row counts per expert: empty experts, single rows, ends inside a step, one expert holding everything, many experts
GPU_COUNTS = {
    "ragged": [0, 1, 200, 129, 0, 383, 64, 7],
    "all_in_one": [0, 0, 1000, 0],
    "many": [0, 3, 17, 130, 255, 256, 257, 1, 0, 90] * 6,
}


def per_expert_mm(a, b, offsets):
    """C [E, M, N] by one bf16 torch.mm per expert (zeros where an expert has no rows)."""
    bounds = offsets.tolist()
    out = torch.zeros((len(bounds) - 1, a.shape[1], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            out[e] = torch.mm(a[bounds[e] : bounds[e + 1]].t(), b[bounds[e] : bounds[e + 1]])
    return out


def relative_error(out, expected) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(GPU_COUNTS))
@pytest.mark.parametrize("kind", ["down", "gate_up", "three"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_weight_grad_matches_float64_and_torch_mm(name, kind, counts, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of(GPU_COUNTS[counts], device="cuda")
    # I 328 and H 520: partial tiles on every side; 128 × 256 tiles give dWg and dWd 9 and 10 tiles
    pairs = operands(kind, int(offsets[-1]), generator, inter=328, hidden=520, device="cuda")
    outs = poisoned(pairs, len(GPU_COUNTS[counts]), torch.bfloat16, device="cuda")
    grouped_weight_grad(pairs, offsets, outs=outs, config=CONFIGS[name])
    for (a, b), out in zip(pairs, outs, strict=True):
        expected = reference(a, b, offsets)
        error = relative_error(out, expected)
        assert error <= 4e-3, error  # the bf16 output's rounding
        assert within_rounding(out, expected)
        theirs = per_expert_mm(a, b, offsets)
        assert error <= 2 * relative_error(theirs, expected) + 1e-4
        assert ((out.float() - theirs.float()).abs() <= 2**-6 * expected.abs().float() + 1e-2).all()
    again = grouped_weight_grad(
        pairs,
        offsets,
        outs=poisoned(pairs, len(GPU_COUNTS[counts]), torch.bfloat16, device="cuda"),
        config=CONFIGS[name],
    )
    assert all(torch.equal(x, y) for x, y in zip(outs, again, strict=True))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("config", [FP32_CONFIG, GemmConfig(128, 128, 64, 5)], ids=["s4", "s5"])
def test_gpu_weight_grad_in_fp32(config, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of(GPU_COUNTS["ragged"], device="cuda")
    pairs = operands("three", int(offsets[-1]), generator, inter=328, hidden=264, device="cuda")
    outs = grouped_weight_grad(pairs, offsets, out_dtype=torch.float32, config=config)
    for (a, b), out in zip(pairs, outs, strict=True):
        assert out.dtype == torch.float32
        assert relative_error(out, reference(a, b, offsets)) <= 1e-4  # a bf16 rounding would be ~2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["coop", "pingpong"])
def test_gpu_weight_grad_keeps_a_neighbours_infinities_out(name, seed):
    """Infinities and NaN in the first row of expert 1 (read by expert 0's ragged last step) and in rows past
    offsets[E]: every other expert's gradient finite and right."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = [70, 5, 300, 0, 129]
    offsets = offsets_of(counts, device="cuda")
    rows = int(offsets[-1]) + 40
    pairs = operands("three", rows, generator, inter=328, hidden=264, device="cuda")
    for a, b in pairs:
        for row in [70] + list(range(rows - 40, rows)):
            a[row, ::2], a[row, 1::2], b[row, ::3] = float("inf"), float("nan"), float("-inf")
    outs = grouped_weight_grad(pairs, offsets, config=CONFIGS[name])
    for (a, b), out in zip(pairs, outs, strict=True):
        expected = reference(a, b, offsets)
        for e in (0, 2, 3, 4):
            assert within_rounding(out[e], expected[e]), e


@pytest.mark.gpu
def test_gpu_weight_grad_without_rows_gives_zeros(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    pairs = operands("three", 0, generator, device="cuda")
    outs = grouped_weight_grad(
        pairs, offsets_of([0, 0, 0], device="cuda"), outs=poisoned(pairs, 3, torch.bfloat16, device="cuda")
    )
    assert all(torch.equal(out, torch.zeros_like(out)) for out in outs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["coop", "pingpong"])
def test_gpu_weight_grad_replays_in_a_cuda_graph_with_new_offsets(name, seed):
    """Captured once, replayed after the offsets changed on the device: the tiles follow them (no host copy)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of([300, 0, 129, 600, 1], device="cuda")
    pairs = operands("three", 1030, generator, inter=256, hidden=512, device="cuda")
    outs = poisoned(pairs, 5, torch.bfloat16, device="cuda")
    grouped_weight_grad(pairs, offsets, outs=outs, config=CONFIGS[name])  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_weight_grad(pairs, offsets, outs=outs, config=CONFIGS[name])
    for counts in ([300, 0, 129, 600, 1], [0, 1030, 0, 0, 0], [206, 206, 206, 206, 206], [0, 0, 0, 0, 0]):
        offsets.copy_(offsets_of(counts, device="cuda"))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (a, b), out in zip(pairs, outs, strict=True):
            expected = reference(a, b, offsets)
            assert within_rounding(out, expected), counts


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["coop", "pingpong"])
def test_gpu_weight_grad_writes_column_slices_of_wider_outputs(name, seed):
    """Outputs that are column slices of wider tensors (TMA stores through their strides): the bits of contiguous
    outputs, and the columns beside each slice untouched."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = GPU_COUNTS["ragged"]
    offsets = offsets_of(counts, device="cuda")
    pairs = operands("three", int(offsets[-1]), generator, inter=328, hidden=520, device="cuda")
    wide = [torch.full((len(counts), a.shape[1], b.shape[1] + 64), 7.0, dtype=torch.bfloat16, device="cuda")
            for a, b in pairs]  # fmt: skip
    outs = [w[:, :, 32 : 32 + b.shape[1]] for w, (_, b) in zip(wide, pairs, strict=True)]
    grouped_weight_grad(pairs, offsets, outs=outs, config=CONFIGS[name])
    expected = grouped_weight_grad(pairs, offsets, config=CONFIGS[name])
    for (a, b), out, w, same in zip(pairs, outs, wide, expected, strict=True):
        assert torch.equal(out, same) and relative_error(out, reference(a, b, offsets)) < 1e-2
        assert torch.all(w[:, :, :32] == 7.0) and torch.all(w[:, :, 32 + b.shape[1] :] == 7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("products", ["two", "one_in_column_parts"])
@pytest.mark.parametrize("counts", ["ragged", "many"])
@pytest.mark.parametrize("name", ["coop", "pingpong", "coop_s2_two_outputs_3_programs"])
def test_gpu_weight_grad_writes_transposed_views_with_x_gathered_as_a(name, counts, products, seed):
    """The gate and up gradients with x gathered as their A operand (dWgᵀ = x_sᵀ·dg), written through the
    gradients' transposed views (each tile stored transposed): as two products, or as one against [dg | du] of N =
    2I whose output is the two views as column parts (I 320: the tile across I stored into both, the right part in
    64-row boxes from its row 0). The products with x as B within a few bf16 roundings (the transposed products'
    fp32 sums may round apart), float64's values, exact zeros for experts without rows, nothing left unwritten."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    counts = GPU_COUNTS[counts]
    offsets = offsets_of(counts, device="cuda")
    gathered, written = gathered_three(int(offsets[-1]), 301, generator, inter=320, hidden=520, device="cuda")
    as_b = grouped_weight_grad(gathered[:2], offsets, config=CONFIGS[name])
    gradients = [torch.full_like(out, float("nan")) for out in as_b]  # [E, I, H], written through [E, H, I] views
    views = [g.transpose(1, 2) for g in gradients]
    if products == "two":
        grouped_weight_grad([(x, dg) for dg, x in gathered[:2]], offsets, outs=views, config=CONFIGS[name])
    else:
        x, dgdu = gathered[0][1], gathered[0][0].as_strided((int(offsets[-1]), 640), (640, 1))  # [dg | du]
        grouped_weight_grad([(x, dgdu)], offsets, outs=[tuple(views)], config=CONFIGS[name])
    for (dg, x_s), out, same in zip(written[:2], gradients, as_b, strict=True):
        assert torch.isfinite(out).all() and relative_error(out, reference(dg, x_s, offsets)) < 1e-2
        assert relative_error(out, same.double()) < 1e-3
        for e, count in enumerate(counts):
            if count == 0:
                assert torch.equal(out[e], torch.zeros_like(out[e]))


@pytest.mark.gpu
@pytest.mark.parametrize("counts", ["ragged", "many"])
@pytest.mark.parametrize(
    "name", ["coop", "pingpong", "coop_2_programs", "coop_s2_two_outputs_3_programs", "coop_256x128"]
)
def test_gpu_weight_grad_gathers_rows_through_the_index(name, counts, seed):
    """x and dy gathered by cp.async in the loading partition: the bits of the same rows written out and read by
    TMA (the same products in the same order), float64's values, and exact zeros for experts without rows."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    offsets = offsets_of(GPU_COUNTS[counts], device="cuda")
    gathered, written = gathered_three(int(offsets[-1]), 301, generator, inter=328, hidden=520, device="cuda")
    poison = poisoned(written, len(GPU_COUNTS[counts]), torch.bfloat16, device="cuda")
    outs = grouped_weight_grad(gathered, offsets, outs=poison, config=CONFIGS[name])
    expected = grouped_weight_grad(written, offsets, config=CONFIGS[name])
    for (a, b), out, same in zip(written, outs, expected, strict=True):
        assert torch.equal(out, same)
        assert relative_error(out, reference(a, b, offsets)) < 1e-2
        for e, count in enumerate(GPU_COUNTS[counts]):
            if count == 0:
                assert torch.equal(out[e], torch.zeros_like(out[e]))
