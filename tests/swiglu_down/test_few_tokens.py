"""P1's few-token design (``moe_lib/swiglu_down/designs/few_tokens.py``): one launch, weights streamed in chunks.

CPU: the kernels under the Triton interpreter (their two phases as two launches there) on small odd shapes, H and I
no multiple of 8, with tiles that cover several H-chunks and leave ragged edges, several tiles along each axis:
against the float64 reference, both precisions, both input distributions (``inputs.py``), every output and workspace
from NaN-filled memory, two calls bitwise equal (the arrival counters carry over from call to call). Tiles held
whole (one chunk) and streamed (several); phase-1 tiles straddling phase-2 I-blocks and the other way round, with
programs that hold a tile of one phase only; the one-token kernel on the CUDA cores likewise. ``supports``' reasons,
and ``for_shape`` over model shapes. The kernels ``for_shape`` picks at model shapes compiled for sm_90 (in a child
process without the interpreter): within the shared memory, no spill, at most 255 registers.
GPU (``gpu`` marker): model shapes and the benchmark's against float64 from poisoned memory; determinism; CUDA-graph
replay with new inputs; the trace; a cooperative launch beside another stream's kernel.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import compile_env
from conftest import rel_error

from moe_lib import problems
from moe_lib.bench.checks import compare_output
from moe_lib.bench.sm90 import SHARED_MEMORY_LIMIT
from moe_lib.dispatch import interpreter_enabled
from moe_lib.swiglu_down import runtime
from moe_lib.swiglu_down.backward import allocate_outputs, swiglu_down_backward_triton
from moe_lib.swiglu_down.designs import Inputs
from moe_lib.swiglu_down.designs.few_tokens import (
    DX_SUM_SLICES,
    ONE_BLOCK_PHASE2_TILE,
    TRACE_POINTS,
    TRACE_SLOTS,
    FewTokensConfig,
)
from moe_lib.swiglu_down.runtime import INTERPRETER_DEVICE, Device

from .helpers import ELEMENT_RULE, OUTPUTS, check_against_float64, float64_reference

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rows of 150 and 90 bytes (no multiple of 16); with 16-wide chunks and tiles of 40 or 48 of H: 2 tiles along H (40
# rows in chunks of 16, 16, 8, then 35 in 16, 16, 3), 3 or 6 along I (the last 13 or 5 wide)
H, I = 75, 45
H200 = Device("cuda", 132, SHARED_MEMORY_LIMIT, (9, 0), "H200")
# (H, I) of real models' experts and a few extremes (SMs: 132): the benchmark's, Llama-like, DeepSeek-V3, Mixtral,
# gpt-oss, Qwen-MoE-like, DeepSeek-V2-Lite-like, odd rows
MODEL_SHAPES = [
    (2048, 768),
    (4096, 1536),
    (7168, 2048),
    (4096, 14336),
    (2880, 2880),
    (2048, 1024),
    (2048, 1408),
    (1000, 300),
]
EXTREME_SHAPES = [(256, 256), (16384, 16384), (16384, 256), (256, 16384), (4000, 13000), (16383, 1000), (3001, 301)]
COMPILE_TOKENS = [1, 7, 64, 128]


def run(inputs: dict, config, precision: str):
    return swiglu_down_backward_triton(*inputs.values(), config=config, precision=precision)


def small_inputs(
    T: int, seed: int, distribution: str | None = None, hidden_size: int = H, intermediate_size: int = I
) -> dict:
    return problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        distribution=distribution,
    )


def tiles(block_t: int = 16, **fields) -> FewTokensConfig:
    """Interpreter-sized tiles (16 wide: one warp, the smallest dot); ``fields`` replace the defaults."""
    base = dict(
        block_t=block_t, block_h1=16, block_i1=16, block_i2=16, block_h2=16, weights_ahead="after_phase1", warps=1
    )
    return FewTokensConfig(**(base | fields))


# name -> tiles at H, I = 75, 45 (the tile counts (N_H1, N_I1, N_I2, N_H2) and H-chunks per tile in the comment)
TILINGS = {
    # held whole: 32 × 32 tiles, 3 × 2 each phase
    "whole": tiles(block_h1=32, block_i1=32, block_i2=32, block_h2=32),
    # streamed: 2 × 3 phase-1 tiles of 40 rows in 3 chunks, 3 × 2 phase-2 tiles of 48 columns in 3 chunks
    "streamed": tiles(span_h1=40, span_h2=48),
    # streamed, 16-wide phase-1 I-blocks two to a 32-wide phase-2 I-block (2 × 3 and 2 × 2 tiles)
    "streamed straddled": tiles(span_h1=40, block_i2=32, span_h2=48),
    # streamed, 32-wide phase-1 I-blocks on two 16-wide phase-2 I-blocks each (2 × 2 and 3 × 2 tiles)
    "streamed straddling": tiles(span_h1=40, block_i1=32, span_h2=48),
    # phase 1 streamed (1 × 3 tiles of 75 rows in 5 chunks), phase 2 held whole in spans shorter than their blocks
    # (3 × 3 tiles of 28 columns in 32-wide blocks: a block's masked columns belong to the next tile)
    "streamed and spans": tiles(span_h1=80, block_h2=32, span_h2=28),
    # with every option the GPU's default takes: Wg, Wu ahead (one chunk only), the launch count late, phase 2 staged
    # before the wait (one chunk only), the saved tiles after phase 1, dx's sum by rows over 2 programs, dWd late
    "streamed, GPU options": tiles(
        block_t=32,
        span_h1=40,
        block_i2=16,
        span_h2=48,
        weights_ahead="registers",
        count_late=True,
        stage_before_wait=True,
        saved_late=True,
        dx_sum_slices=2,
        grad_down_late=True,
        chunk_stages=1,
    ),
    "whole, GPU options": tiles(
        block_t=32,
        block_h1=32,
        block_i1=16,
        block_i2=16,
        block_h2=32,
        weights_ahead="registers",
        count_late=True,
        stage_before_wait=True,
        saved_late=True,
        dx_sum_slices=2,
        grad_down_late=True,
    ),
    # dx's sum by rows over 4 programs (of 3 phase-2 I-blocks... at most the I-blocks: 2 with 32-wide ones)
    "sliced sum 2": tiles(span_h1=40, block_i2=32, span_h2=48, dx_sum_slices=2),
    # the identity moves asked for (the interpreter keeps the selects)
    "moves": tiles(
        block_h1=32,
        block_i1=32,
        block_i2=32,
        block_h2=32,
        weights_ahead="registers",
        count_late=True,
        stage_before_wait=True,
        once_by_move=True,
    ),
}


def check_small(got, again, want, precision: str) -> list[float]:
    """The CPU rules: the outputs' dtype and shapes, two calls bitwise equal, relative error ≤ 2e-2 and, on the
    faithful path, the benchmark's element rule. Returns the relative errors."""
    errors = []
    for name, g, a, w in zip(OUTPUTS, got, again, want, strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape, name
        assert torch.equal(g, a), f"{name}: two calls differ"
        error = rel_error(g, w)
        assert error <= 2e-2, f"{name}: {error:.3g}"
        if precision == "faithful":
            result = compare_output(g, w, ELEMENT_RULE)
            assert result["pass_fraction"] >= ELEMENT_RULE["required_fraction"], f"{name}: {result}"
        errors.append(error)
    return errors


@needs_triton
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_streamed_tiles_match_float64_reference(T, distribution, seed, poisoned):
    """Tiles of 3 H-chunks in both phases (the last chunk of each tile ragged), 16-token blocks: faithful twice
    (bitwise equal), fast twice; at the harness's scale the faithful path at least as close as the fast one."""
    config = TILINGS["streamed"]
    assert config.chunks == (3, 3) and config.tiles(H, I) == (2, 3, 3, 2)
    inputs = small_inputs(T, seed, distribution)
    want = float64_reference(inputs)
    errors = {}
    for precision in ("faithful", "fast"):
        got, again = run(inputs, config, precision), run(inputs, config, precision)
        errors[precision] = check_small(got, again, want, precision)
    if distribution == "harness":
        for name, faithful, fast in zip(OUTPUTS, errors["faithful"], errors["fast"], strict=True):
            assert faithful <= fast + 1e-7, name


@needs_triton
@pytest.mark.parametrize(
    "T, tiling",
    [
        (2, "whole"),
        (16, "whole"),
        (5, "streamed straddled"),
        (3, "streamed straddling"),
        (11, "streamed and spans"),
        (17, "streamed, GPU options"),
        (32, "streamed, GPU options"),
        (9, "whole, GPU options"),
        (13, "sliced sum 2"),
        (3, "moves"),
    ],
)
def test_other_tilings(T, tiling, seed, poisoned):
    """Tiles held whole, streamed ones whose phases' I-blocks do not line up (programs with a tile of one phase
    only), spans shorter than the blocks, the options the GPU takes, the sliced dx sum: both paths, harness
    inputs."""
    config = TILINGS[tiling]
    assert T <= config.block_t and (tiling.startswith("whole") or tiling == "moves" or max(config.chunks) > 1)
    inputs = small_inputs(T, seed, "harness")
    want = float64_reference(inputs)
    for precision in ("faithful", "fast"):
        check_small(run(inputs, config, precision), run(inputs, config, precision), want, precision)


# one token on the CUDA cores: name -> tiles (the I spans shorter than their blocks straddle the other phase's)
ONE_TOKEN_TILINGS = {
    "whole": dataclasses.replace(TILINGS["whole"], cuda_cores=True),
    "streamed": dataclasses.replace(TILINGS["streamed"], cuda_cores=True),
    "streamed, I spans": FewTokensConfig(
        block_h1=16,
        span_h1=40,
        block_i1=32,
        span_i1=24,
        block_i2=32,
        span_i2=20,
        block_h2=16,
        span_h2=48,
        warps=1,
        cuda_cores=True,
    ),
    "streamed, dWd late": FewTokensConfig(
        block_h1=16,
        span_h1=80,
        block_i1=16,
        block_i2=32,
        block_h2=32,
        span_h2=28,
        warps=1,
        cuda_cores=True,
        grad_down_late=True,
    ),
}


@needs_triton
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("tiling", list(ONE_TOKEN_TILINGS))
def test_one_token_on_cuda_cores_matches_float64_reference(tiling, distribution, seed, poisoned):
    """Every product on the CUDA cores in fp32: both paths the same bits, twice, within the faithful path's rules at
    either scale, and as close to float64 as the tensor-core form's faithful path on the same tiles (both leave
    little more than the outputs' rounding)."""
    inputs = small_inputs(1, seed, distribution)
    want = float64_reference(inputs)
    config = ONE_TOKEN_TILINGS[tiling]
    faithful, again = run(inputs, config, "faithful"), run(inputs, config, "faithful")
    errors = check_small(faithful, again, want, "faithful")
    for name, a, b in zip(OUTPUTS, faithful, run(inputs, config, "fast"), strict=True):
        assert torch.equal(a, b), f"{name}: the paths differ"
    tensor_cores = (
        TILINGS["streamed"] if config.span_i1 or config.span_i2 else dataclasses.replace(config, cuda_cores=False)
    )
    for name, g, w, error in zip(OUTPUTS, run(inputs, tensor_cores, "faithful"), want, errors, strict=True):
        assert error <= rel_error(g, w) + 2e-4, f"{name}: {error:.3g} against the tensor cores' {rel_error(g, w):.3g}"


@needs_triton
@pytest.mark.parametrize("cuda_cores", [False, True])
def test_sums_of_many_partials(cuda_cores, seed, poisoned):
    """More partials than a sum unrolls at once (16): dA from 19 phase-1 H-tiles (4 rows each), dx from 18 phase-2
    I-blocks (16 of I's 275 columns each), summed 16 at a time and then the rest, in order."""
    config = tiles(block_h1=16, span_h1=4, block_i1=64, block_i2=16, block_h2=64, cuda_cores=cuda_cores)
    assert config.tiles(H, 275) == (19, 5, 18, 2)
    T = 1 if cuda_cores else 3
    inputs = small_inputs(T, seed, "harness", intermediate_size=275)
    check_small(*(run(inputs, config, "faithful") for _ in range(2)), float64_reference(inputs), "faithful")


@needs_triton
@pytest.mark.parametrize("tiling", ["whole", "streamed"])
@pytest.mark.parametrize("cuda_cores", [False, True])
def test_no_tokens(tiling, cuda_cores, seed, poisoned):
    config = dataclasses.replace(TILINGS[tiling], cuda_cores=cuda_cores)
    grad_x, *weight_grads = run(small_inputs(0, seed), config, "faithful")
    assert grad_x.shape == (0, H)
    for grad in weight_grads:
        assert grad.isfinite().all() and torch.count_nonzero(grad) == 0


# ---------------------------------------------------------------------------------------------
# what it supports


@pytest.mark.parametrize(
    "fields, call, reason",
    [
        ({}, dict(dtype=torch.float32), "the few-token tiles are sized for 16-bit operands, got torch.float32"),
        ({}, dict(T=17), "every token goes in one token block: 17 tokens against block_t 16"),
        (dict(cuda_cores=True), dict(T=2), "cuda_cores takes one token, got 2"),
        (dict(block_t=256), dict(T=1), "block_t must be between 1 and 128 (one token block), got 256"),
        (
            dict(block_t=128),
            dict(T=100),
            "its [tokens, I-block] tiles of 128 × 128 would exceed 8192 elements, which the registers hold",
        ),
        (
            dict(block_h1=512),
            {},
            "a phase-1 chunk of 32768 weight elements exceeds 16384: more would not fit the 232448 "
            "bytes of shared memory at 128 tokens",
        ),
        (dict(block_i2=96), {}, "block_i2 must be a power of two, got 96"),
        (
            dict(weights_ahead="soon"),
            {},
            "weights_ahead must be one of ['after_phase1', 'prefetch', 'registers'], got 'soon'",
        ),
        (
            dict(span_i1=20),
            {},
            "span_i1, span_i2 need cuda_cores (the tensor-core form takes whole I-blocks), got 20, 0",
        ),
        (
            dict(span_i2=200, cuda_cores=True),
            {},
            "span_i2 must be between 1 and its block (128), or 0 for the block; got 200",
        ),
        (dict(span_h2=-1), {}, "span_h1, span_h2 must be ≥ 0 (0: one block), got 0, -1"),
        (
            dict(dx_sum_slices=3),
            {},
            "dx_sum_slices must be a power of two between 1 and block_t (16) and the phase-2 I-blocks (6), got 3",
        ),
        (
            dict(dx_sum_slices=32),
            {},
            "dx_sum_slices must be a power of two between 1 and block_t (16) and the phase-2 I-blocks (6), got 32",
        ),
        (dict(chunk_stages=0), {}, "chunk_stages must be ≥ 1, got 0"),
        (
            {},
            dict(H=4096, I=14336),
            "its waits need every program resident: 3584 programs for H 4096, I 14336 against 132 SMs",
        ),
        (
            {},
            dict(device=Device("cuda", 132, 101376, (8, 9))),
            "its chunks are sized for 232448 bytes of shared memory per program (sm_90), the device has 101376",
        ),
        ({}, dict(device=Device("cpu", 1 << 30, 0)), "Triton kernels need a CUDA GPU or the interpreter"),
    ],
)
def test_supports_names_what_it_cannot_do(fields, call, reason):
    call = dict(dict(T=8, H=2048, I=768, dtype=torch.bfloat16, device=H200), **call)
    config = FewTokensConfig(**fields)
    assert config.supports(call["T"], call["H"], call["I"], call["dtype"], call["device"]) == reason


def test_supports_rows_of_any_alignment_and_the_interpreter():
    for T, (hidden, inter) in ((1, (1000, 300)), (64, (1000, 300)), (16, (75, 45)), (128, (2048, 768))):
        config = FewTokensConfig.for_shape(T, hidden, inter, 132)
        assert config.supports(T, hidden, inter, torch.bfloat16, H200, aligned=False) is None
        assert config.supports(T, hidden, inter, torch.float16, INTERPRETER_DEVICE) is None
    # the registers' limit on rows of H loaded element by element is the GPU's: the interpreter runs any T to 128
    config = FewTokensConfig.for_shape(32, 75, 45, 132)
    assert config.supports(32, 75, 45, torch.bfloat16, H200).startswith("rows of H (75) not a multiple of 8")
    assert config.supports(32, 75, 45, torch.bfloat16, INTERPRETER_DEVICE) is None


@needs_triton
def test_run_refuses_what_it_does_not_support(seed):
    inputs = small_inputs(2, seed)
    out = allocate_outputs(inputs["x"], I)
    with pytest.raises(ValueError, match=r"^config: cuda_cores takes one token, got 2$"):
        FewTokensConfig(cuda_cores=True).run(Inputs(*inputs.values()), with_lo=True, out=out)
    with pytest.raises(ValueError, match=r"^trace: expected an int64 tensor"):
        trace = torch.zeros((1, TRACE_SLOTS), dtype=torch.int64, device=DEVICE)
        TILINGS["whole"].run(Inputs(*inputs.values()), with_lo=True, out=out, trace=trace)


# ---------------------------------------------------------------------------------------------
# the tiles for a shape


@pytest.mark.parametrize("T", [1, 2, 3, 16, 17, 32, 33, 64, 65, 100, 128])
def test_for_shape_keeps_the_benchmark_tiles(T):
    """At H 2048, I 768 on 132 SMs: the measured tiles, one chunk per tile (96 programs)."""
    if T == 1:
        want = FewTokensConfig(cuda_cores=True, cooperative=True)
    else:
        block_i2, block_h2 = ONE_BLOCK_PHASE2_TILE
        want = FewTokensConfig(
            block_t=max(16, 1 << (T - 1).bit_length()),
            block_i2=block_i2,
            block_h2=block_h2,
            count_late=True,
            stage_before_wait=True,
            once_by_move=True,
            cooperative=True,
            saved_late=True,
            dx_sum_slices=DX_SUM_SLICES,
        )
    config = FewTokensConfig.for_shape(T, 2048, 768, 132)
    assert config == want and config.chunks == (1, 1) and config.grid_size(2048, 768) == 96


@pytest.mark.parametrize("shape", MODEL_SHAPES + EXTREME_SHAPES)
@pytest.mark.parametrize("T", COMPILE_TOKENS)
def test_for_shape_fits_the_sms_or_says_why_not(shape, T):
    """Every tiling from (T, H, I, SMs): the grid within the SMs, every token in one block, chunks of at most 32 KB
    streamed where a tile spans more H than one chunk; where the I-blocks a program may hold at T do not fit the SMs
    (more than 132 × 64 columns of I at 128 tokens), or rows of H not 16 bytes apart at more than 16 tokens,
    ``supports`` says so."""
    hidden, inter = shape
    config = FewTokensConfig.for_shape(T, hidden, inter, 132)
    reason = config.supports(T, hidden, inter, torch.bfloat16, H200)
    if T > 16 and hidden % 8:
        assert reason.startswith(f"rows of H ({hidden}) not a multiple of 8 elements are loaded element by element")
        return
    if T == 128 and inter > 132 * 64:
        assert reason.startswith("its waits need every program resident")
        return
    assert reason is None
    assert config.grid_size(hidden, inter) <= 132 and T <= config.block_t <= max(16, 2 * T)
    assert config.block_h1 * config.block_i1 <= 16384 and config.block_i2 * config.block_h2 <= 16384
    n_h1, n_i1, n_i2, n_h2 = config.tiles(hidden, inter)
    assert n_i1 <= 132 and n_i2 <= 132
    for span, block, chunks in zip(config.spans, (config.block_h1, config.block_h2), config.chunks, strict=True):
        assert chunks == -(-span // block) and (chunks == 1 or span % 64 == 0)


def test_for_shape_streams_where_one_chunk_per_tile_would_not_fit():
    """H 7168, I 2048: 4 × 32 tiles of 1792 rows each phase, in 7 chunks of 256 (32 KB of Wd, of Wg, of Wu) to 16
    tokens, 14 of 128 at 32 and 64 tokens, 28 of 64 at 128 (the accumulators' registers)."""
    for T, chunk in ((7, 256), (16, 256), (32, 128), (64, 128), (128, 64)):
        config = FewTokensConfig.for_shape(T, 7168, 2048, 132)
        assert config.spans == (1792, 1792) and config.tiles(7168, 2048) == (4, 32, 32, 4)
        assert (config.block_h1, config.block_h2) == (chunk, chunk) and config.chunks == (1792 // chunk,) * 2
    mixtral = FewTokensConfig.for_shape(7, 4096, 14336, 132)  # 224 I-blocks of 64: 112 of 128, with 128-row chunks
    assert (mixtral.block_i1, mixtral.block_h1, mixtral.block_i2, mixtral.block_h2) == (128, 128, 128, 128)
    assert mixtral.tiles(4096, 14336) == (1, 112, 112, 1) and mixtral.chunks == (32, 32)
    # one token on the CUDA cores where rows of H are 16 bytes apart, else the tensor cores' form
    assert FewTokensConfig.for_shape(1, 1000, 300, 132).cuda_cores
    assert not FewTokensConfig.for_shape(1, 16383, 1000, 132).cuda_cores


@pytest.mark.parametrize(
    "T, H, I, slices",
    [
        (64, 1000, 300, 4),
        (65, 1000, 300, 1),
        (100, 1000, 300, 1),
        (128, 1000, 300, 1),
        (100, 1000, 768, 1),
        (100, 1008, 300, 4),
        (100, 2048, 768, 8),
        (65, 992, 768, 8),
        (128, 2880, 2880, 8),
    ],
)
def test_for_shape_sums_dx_whole_at_128_token_blocks_when_h_is_not_a_multiple_of_16(T, H, I, slices):
    """The 128-token form with dx's sum sliced read shared memory misaligned on the H200 at H 1000 (65-127 tokens;
    notes/p1/races.md); one slice there, the sliced sum everywhere else."""
    assert FewTokensConfig.for_shape(T, H, I, 132).dx_sum_slices == slices


# ---------------------------------------------------------------------------------------------
# compiled for sm_90 (a child process without the interpreter: scripts/p1/p1_few_tokens_check.py --compile-only)


def compiled_rows(shapes, tokens, tmp_path) -> list[dict]:
    env = compile_env(ROOT)
    path = tmp_path / "rows.json"
    command = [
        sys.executable,
        "scripts/p1/p1_few_tokens_check.py",
        "--compile-only",
        "--json",
        str(path),
        "--shapes",
        ",".join(f"{h}x{i}" for h, i in shapes),
        "--tokens",
        ",".join(map(str, tokens)),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(path.read_text())


def assert_fits_sm90(rows: list[dict]) -> None:
    """Each kernel within the shared memory, at most 255 registers, and no stack (a spill), except the tiles held
    whole at 128 tokens: the benchmark's measured tiles, compiled as before, which spill 96-160 bytes
    (notes/p1/design-27.md)."""
    assert rows
    for row in rows:
        label = f"{row['H']}x{row['I']} T={row['T']} {row['precision']}"
        if "refused" in row:
            assert (row["T"] == 128 and row["refused"].startswith("its waits need")) or (
                row["T"] > 16 and row["refused"].startswith("rows of H")
            ), label
            continue
        assert "error" not in row, f"{label}: {row.get('error')}"
        assert row["shared"] <= SHARED_MEMORY_LIMIT and row["registers"] <= 255, f"{label}: {row}"
        whole_at_128 = row["T"] == 128 and row["chunks"] == [1, 1]
        assert row["stack"] == 0 or (whole_at_128 and row["stack"] <= 160), f"{label}: {row}"


def test_compiled_for_sm90_within_its_resources(tmp_path):
    """A representative few: streamed tiles at 7 and 64 tokens, of 64- and of Mixtral's widened 128-wide I-blocks."""
    assert_fits_sm90(compiled_rows([(4096, 1536), (4096, 14336)], [7, 64], tmp_path))


@pytest.mark.slow
def test_compiled_for_sm90_within_its_resources_at_every_model_shape(tmp_path, request):
    """Every model shape and extreme at 1, 7, 64, 128 tokens: about 100 kernels, minutes of CPU, so it runs only
    where asked for (``pytest -m slow``)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full sm_90 compile grid runs with -m slow")
    assert_fits_sm90(compiled_rows(MODEL_SHAPES + EXTREME_SHAPES, COMPILE_TOKENS, tmp_path))


# ---------------------------------------------------------------------------------------------
# GPU


def gpu_inputs(T: int, seed: int, shape=(2048, 768), distribution: str | None = "harness") -> dict:
    return problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device="cuda",
        distribution=distribution,
        hidden_size=shape[0],
        intermediate_size=shape[1],
    )


def gpu_config(T: int, shape=(2048, 768)) -> FewTokensConfig:
    config = FewTokensConfig.for_shape(T, *shape, torch.cuda.get_device_properties(0).multi_processor_count)
    reason = config.supports(T, *shape, torch.bfloat16, runtime.device_of(torch.empty(0, device="cuda")))
    if reason is not None:
        pytest.skip(reason)
    return config


def checked_from_poison(T: int, config, precision: str, seed: int, shape=(2048, 768), distribution="harness"):
    """(inputs, outputs) of ``config``, run from poisoned memory and checked against float64 (GPU)."""
    from moe_lib.bench.timing import poison_allocator

    inputs = gpu_inputs(T, seed, shape, distribution)
    poison_allocator("cuda", 512 * 2**20)
    got = run(inputs, config, precision)
    check_against_float64(inputs, got, precision)
    return inputs, got


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_model_shapes_against_float64(shape, T, precision, seed):
    """The tiles for each model shape (streamed where a tile spans several chunks) within the path's rules from
    poisoned memory, and twice the same bits."""
    config = gpu_config(T, shape)
    inputs, got = checked_from_poison(T, config, precision, seed, shape)
    for name, a, b in zip(OUTPUTS, got, run(inputs, config, precision), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 65, 100, 128])
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_benchmark_shape_against_float64(T, distribution, precision, seed):
    checked_from_poison(T, gpu_config(T), precision, seed, distribution=distribution)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16, 64])
@pytest.mark.parametrize("shape", [(2048, 768), (4096, 1536)])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_grad_down_late_against_float64(T, shape, precision, seed):
    config = dataclasses.replace(gpu_config(T, shape), grad_down_late=True)
    inputs, got = checked_from_poison(T, config, precision, seed, shape)
    for name, a, b in zip(OUTPUTS, got, run(inputs, config, precision), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_spans_fill_the_sms(T, precision, seed):
    """132 programs with H in spans shorter than the blocks. The interpreter runs the programs in order, so a
    block's masked rows written over the next tile's would be overwritten again there: only the GPU, where
    the tiles race, shows such a store."""
    config = FewTokensConfig(
        block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94, cuda_cores=T == 1
    )
    if config.grid_size(2048, 768) > torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("fewer SMs than the 132 programs")
    inputs, got = checked_from_poison(T, config, precision, seed)
    for name, a, b in zip(OUTPUTS, got, run(inputs, config, precision), strict=True):
        assert torch.equal(a, b), name


def assert_replayed_as_eager(T: int, config, precision: str, seed: int, shape=(2048, 768)):
    """``config`` captured in a CUDA graph, its inputs then overwritten with new ones and the graph replayed three
    times (the counters move on with every replay): the outputs of an eager call on the new inputs, bitwise (GPU)."""
    from moe_lib.bench.timing import capture

    static = gpu_inputs(T, seed, shape)
    graph, outputs = capture(lambda: run(static, config, precision))
    fresh = gpu_inputs(T, seed + 1, shape)
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for name, g, e in zip(OUTPUTS, outputs, run(fresh, config, precision), strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T, shape", [(1, (2048, 768)), (4, (2048, 768)), (16, (2048, 768)), (1, (7168, 2048)), (16, (7168, 2048))]
)
def test_gpu_cuda_graph_replay_with_new_inputs(T, shape, seed):
    assert_replayed_as_eager(T, gpu_config(T, shape), "faithful", seed, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("T, shape", [(1, (2048, 768)), (16, (2048, 768)), (16, (4096, 1536))])
def test_gpu_trace_stamps_in_order_and_changes_nothing(T, shape, seed):
    """Traced, the launch gives the same outputs bitwise, and every program stamps every point, in order."""
    inputs = gpu_inputs(T, seed, shape)
    config = gpu_config(T, shape)
    plain = run(inputs, config, "faithful")
    trace = torch.zeros((config.grid_size(*shape), TRACE_SLOTS), dtype=torch.int64, device="cuda")
    out = allocate_outputs(inputs["x"], shape[1])
    config.run(Inputs(*inputs.values()), with_lo=True, out=out, trace=trace)
    for name, a, b in zip(OUTPUTS, plain, out, strict=True):
        assert torch.equal(a, b), name
    times = trace[:, : len(TRACE_POINTS)].cpu()
    assert (times > 0).all() and (times.diff(dim=1) >= 0).all()
    assert (trace[:, -1] < torch.cuda.get_device_properties(0).multi_processor_count).all()  # an SM's number


CONCURRENT_SCRIPT = """
import sys
import torch
from moe_lib import problems
from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
from moe_lib.swiglu_down.designs.few_tokens import FewTokensConfig

num_tokens, hidden, inter = (int(arg) for arg in sys.argv[1:4])
config = FewTokensConfig.for_shape(num_tokens, hidden, inter, torch.cuda.get_device_properties(0).multi_processor_count)
inputs = problems.make_inputs("swiglu_down_backward", num_tokens, seed=0, device="cuda", distribution="harness",
                              hidden_size=hidden, intermediate_size=inter)
want = swiglu_down_backward_triton(*inputs.values(), config=config)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
busy, other = torch.cuda.Stream(), torch.cuda.Stream()
for _ in range(20):  # the launch beside a matmul that holds SMs on another stream
    with torch.cuda.stream(busy):
        a @ a
    with torch.cuda.stream(other):
        got = swiglu_down_backward_triton(*inputs.values(), config=config)
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "differs beside another stream's kernel"
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("T, shape", [(8, (2048, 768)), (1, (2048, 768)), (8, (7168, 2048))])
def test_gpu_cooperative_launch_beside_another_stream(T, shape):
    """The waits between programs need every program resident: with another stream's kernel holding SMs, the
    cooperative launch still completes (in a child process, so that a hang fails the test)."""
    done = subprocess.run(
        [sys.executable, "-c", CONCURRENT_SCRIPT, str(T), *map(str, shape)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
