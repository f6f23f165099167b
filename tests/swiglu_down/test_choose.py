"""Which design runs a P1 call (``moe_lib.swiglu_down.choose``), pinned by value, and what each design supports.

The chooser's table: (T, H, I, dtype, precision, device, aligned) -> the configured design, written out as
literals (never computed from the constants under test), covering each rule of ``choose.py``'s docstring and each
boundary at its value and one off: the few-token bands, the measured table's band edges on both paths, the generic
rule's form, splits and persistent programs on a Hopper GPU of another SM count, the faithful path's chained band
off Hopper, unaligned inputs and rows, fp32, the interpreter. Devices are built as values (no GPU needed). Then:
every choice is one its design says it can run, over a grid of shapes; each design's reasons by value; a ``config``
that cannot run a call is refused before any allocation.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.swiglu_down import runtime
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.designs import ChainedConfig, FewTokensConfig, LibraryGemmsConfig, TileConfig
from moe_lib.swiglu_down.designs.gluon import FORMS, GluonLaunches, grad_down_in_second_launch, with_second
from moe_lib.swiglu_down.runtime import Device

H200 = Device("cuda", 132, 232448, (9, 0), "H200-like")
H100_PCIE = Device("cuda", 114, 232448, (9, 0), "H100-PCIe-like: no measured table for its SM count")
A100 = Device("cuda", 108, 166912, (8, 0), "A100-like: a CUDA GPU that runs no Gluon kernel")
INTERPRETER = runtime.INTERPRETER_DEVICE
CPU = Device("cpu", 1, 0)  # CPU tensors without the interpreter
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

FEW = "few_tokens"  # the few-token design, whatever its tiles (tests/swiglu_down/test_few_tokens.py tests those)


def gluon(form: str, *, dwd_in_launch_2: bool = False, dx_splits: int = 1, persistent: int = 0) -> GluonLaunches:
    """The Gluon form named ``form`` (designs/gluon.py's FORMS) with dWd's tiles in launch 2 or not, dx split over
    ``dx_splits`` programs and ``persistent`` programs taking launch 2's weight-gradient tiles (0: one a tile)."""
    launches = grad_down_in_second_launch(FORMS[form]) if dwd_in_launch_2 else FORMS[form]
    return with_second(launches, grad_x_splits=dx_splits, weight_grad_programs=persistent)


# cuBLAS's design: the fast path with dA in fp32 and [Wg; Wu] stacked by a kernel (few tokens), in 16 bits and by two
# memcpys (many tokens), both on two streams; the faithful path's
LIBRARY_FEW = LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True)
LIBRARY_MANY = LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True, stack_by_memcpy=True)
LIBRARY_FAITHFUL = LibraryGemmsConfig(d_a_fp32=True)
# ... and below 2I tokens dx in two products instead of [Wg; Wu] stacked
LIBRARY_FEW_DX2 = dataclasses.replace(LIBRARY_FEW, dx_in_two=True)
LIBRARY_MANY_DX2 = dataclasses.replace(LIBRARY_MANY, dx_in_two=True)
# the chained launch: narrow dWd tiles; 128 x 256 ones with dx's tiles first; the same with dWd's tiles last
CHAINED_NARROW = ChainedConfig(
    TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)), warps=8, stages=3
)
CHAINED_WIDE_DX_FIRST = ChainedConfig(
    TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), grad_x_first=True),
    warps=8,
    stages=3,
)
CHAINED_WIDE_DWD_LAST = ChainedConfig(
    TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
    warps=8,
    stages=3,
    grad_down_last=True,
)
# the two Triton launches: the fast path's wide tiles; the faithful path's; fp32's; the interpreter's
TRITON_WIDE = TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4))
TRITON_FP32 = TileConfig((64, 64, 16, 1), (64, 64, 16, 1), (64, 64, 16, 1), (64, 64, 16, 1), (4, 4), (3, 3))
TRITON_FAITHFUL = TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3))
TRITON_INTERPRETER = TileConfig((16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 1), (1, 1), (1, 1), 2)

# (T, H, I, dtype, precision, device, aligned, expected)
TABLE = [
    # the interpreter: the portable design's tiny tiles, whatever the call
    (1, 2048, 768, BF16, "faithful", INTERPRETER, True, TRITON_INTERPRETER),
    (3000, 2048, 768, BF16, "fast", INTERPRETER, True, TRITON_INTERPRETER),
    (5, 40, 24, FP32, "faithful", INTERPRETER, False, TRITON_INTERPRETER),
    # the benchmark's shape on the H200, faithful path: few tokens to 64, then the measured table's bands
    (0, 2048, 768, BF16, "faithful", H200, True, FEW),
    (1, 2048, 768, BF16, "faithful", H200, True, FEW),
    (64, 2048, 768, BF16, "faithful", H200, True, FEW),
    (65, 2048, 768, BF16, "faithful", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (65, 2048, 768, FP16, "faithful", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (128, 2048, 768, BF16, "faithful", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (129, 2048, 768, BF16, "faithful", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=2, persistent=68)),
    (256, 2048, 768, BF16, "faithful", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=2, persistent=68)),
    (257, 2048, 768, BF16, "faithful", H200, True, gluon("tall", persistent=68)),
    (512, 2048, 768, BF16, "faithful", H200, True, gluon("tall", persistent=68)),
    (513, 2048, 768, BF16, "faithful", H200, True, gluon("tall_dx_first", dwd_in_launch_2=True)),
    (1099, 2048, 768, BF16, "faithful", H200, True, gluon("tall_dx_first", dwd_in_launch_2=True)),
    (1100, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first")),
    (1399, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first")),
    (1400, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first_tall")),
    (1499, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first_tall")),
    (1500, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first_tall", dwd_in_launch_2=True)),
    (2299, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da_first_tall", dwd_in_launch_2=True)),
    (2300, 2048, 768, BF16, "faithful", H200, True, gluon("wide")),
    (3299, 2048, 768, BF16, "faithful", H200, True, gluon("wide")),
    (3300, 2048, 768, BF16, "faithful", H200, True, gluon("wide_tall")),
    (3599, 2048, 768, BF16, "faithful", H200, True, gluon("wide_tall")),
    (3600, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (5199, 2048, 768, BF16, "faithful", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (5200, 2048, 768, BF16, "faithful", H200, True, gluon("wide")),
    (65536, 2048, 768, BF16, "faithful", H200, True, gluon("wide")),
    # ... the fast path: few tokens to 64, then its own table, with cuBLAS's GEMMs in two bands and from 4300
    (0, 2048, 768, BF16, "fast", H200, True, FEW),
    (64, 2048, 768, BF16, "fast", H200, True, FEW),
    (65, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=4, persistent=68)),
    (65, 2048, 768, FP16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=4, persistent=68)),
    (128, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=4, persistent=68)),
    (129, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=2, persistent=68)),
    (192, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, dx_splits=2, persistent=68)),
    (193, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, persistent=68)),
    (384, 2048, 768, BF16, "fast", H200, True, gluon("narrow", dwd_in_launch_2=True, persistent=68)),
    (385, 2048, 768, BF16, "fast", H200, True, gluon("tall", dwd_in_launch_2=True, persistent=68)),
    (512, 2048, 768, BF16, "fast", H200, True, gluon("tall", dwd_in_launch_2=True, persistent=68)),
    (513, 2048, 768, BF16, "fast", H200, True, gluon("tall_dx_first", dwd_in_launch_2=True)),
    (1099, 2048, 768, BF16, "fast", H200, True, gluon("tall_dx_first", dwd_in_launch_2=True)),
    (1100, 2048, 768, BF16, "fast", H200, True, gluon("wide_narrow_da", dwd_in_launch_2=True)),
    (1407, 2048, 768, BF16, "fast", H200, True, gluon("wide_narrow_da", dwd_in_launch_2=True)),
    (1408, 2048, 768, BF16, "fast", H200, True, gluon("wide_da_first_tall", dwd_in_launch_2=True)),
    (1499, 2048, 768, BF16, "fast", H200, True, gluon("wide_da_first_tall", dwd_in_launch_2=True)),
    (1500, 2048, 768, BF16, "fast", H200, True, gluon("wide", dwd_in_launch_2=True)),
    (2299, 2048, 768, BF16, "fast", H200, True, gluon("wide", dwd_in_launch_2=True)),
    (2300, 2048, 768, BF16, "fast", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (2599, 2048, 768, BF16, "fast", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (2600, 2048, 768, BF16, "fast", H200, True, gluon("wide")),
    (3299, 2048, 768, BF16, "fast", H200, True, gluon("wide")),
    (3300, 2048, 768, BF16, "fast", H200, True, LIBRARY_MANY),
    (3599, 2048, 768, BF16, "fast", H200, True, LIBRARY_MANY),
    (3600, 2048, 768, BF16, "fast", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (4299, 2048, 768, BF16, "fast", H200, True, gluon("wide_da256", dwd_in_launch_2=True)),
    (4300, 2048, 768, BF16, "fast", H200, True, LIBRARY_MANY),
    (65536, 2048, 768, BF16, "fast", H200, True, LIBRARY_MANY),
    # the benchmark's shape on 114 SMs (no measured table): the generic rule. Faithful path: narrow 64-row tiles
    # while T/64 · I/64 ≤ 57 (to 256 tokens), dx split in 4 or 2 while its tiles fill at most 57 SMs, the 68
    # persistent programs only beside dx's programs on 114 SMs; tall tiles while T/128 · I/128 < 57 (to 1152);
    # launch 2's 64-row tiles while T/128 · H/256 < 114 (to 1792); wide beyond
    (1, 2048, 768, BF16, "faithful", H100_PCIE, True, FEW),
    (64, 2048, 768, BF16, "faithful", H100_PCIE, True, FEW),
    (65, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("narrow", dx_splits=2, persistent=68)),
    (128, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("narrow", dx_splits=2, persistent=68)),
    (129, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("narrow", dx_splits=2)),  # 48 + 68 > 114
    (256, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("narrow", persistent=68)),  # 32 + 68 ≤ 114
    (257, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("tall", persistent=68)),
    (1152, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("tall")),
    (1153, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("wide_tall")),
    (1792, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("wide_tall")),
    (1793, 2048, 768, BF16, "faithful", H100_PCIE, True, gluon("wide")),
    # ... fast path: cuBLAS's GEMMs from 65 tokens, dA in 16 bits and the stacking by memcpy from 1024, dx in two
    # products below 2I = 1536
    (64, 2048, 768, BF16, "fast", H100_PCIE, True, FEW),
    (65, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_FEW_DX2),
    (1023, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_FEW_DX2),
    (1024, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_MANY_DX2),
    (1535, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_MANY_DX2),
    (1536, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_MANY),
    (65536, 2048, 768, BF16, "fast", H100_PCIE, True, LIBRARY_MANY),
    # another shape on the H200: the generic rule (narrow to 128 tokens, tall to 640, wide_tall to 1024)
    (65, 4096, 1536, BF16, "faithful", H200, True, gluon("narrow", dx_splits=2, persistent=68)),
    (65, 4096, 1536, FP16, "faithful", H200, True, gluon("narrow", dx_splits=2, persistent=68)),
    (128, 4096, 1536, BF16, "faithful", H200, True, gluon("narrow", dx_splits=2, persistent=68)),
    (129, 4096, 1536, BF16, "faithful", H200, True, gluon("tall", persistent=68)),
    (640, 4096, 1536, BF16, "faithful", H200, True, gluon("tall")),
    (641, 4096, 1536, BF16, "faithful", H200, True, gluon("wide_tall")),
    (1024, 4096, 1536, BF16, "faithful", H200, True, gluon("wide_tall")),
    (1025, 4096, 1536, BF16, "faithful", H200, True, gluon("wide")),
    (65, 4096, 1536, BF16, "fast", H200, True, LIBRARY_FEW_DX2),
    (3000, 4096, 1536, BF16, "fast", H200, True, LIBRARY_MANY_DX2),
    # no Gluon kernels (a GPU before Hopper, whose shared memory the few-token tiles are not sized for): the faithful
    # path's chained launch to 1249 (dx's tiles first from 512, dWd's last from 1153), the two launches beyond; the fast
    # path's cuBLAS
    (128, 2048, 768, BF16, "faithful", A100, True, CHAINED_NARROW),
    (129, 2048, 768, BF16, "faithful", A100, True, CHAINED_NARROW),
    (511, 2048, 768, BF16, "faithful", A100, True, CHAINED_NARROW),
    (512, 2048, 768, BF16, "faithful", A100, True, CHAINED_WIDE_DX_FIRST),
    (1152, 2048, 768, BF16, "faithful", A100, True, CHAINED_WIDE_DX_FIRST),
    (1153, 2048, 768, BF16, "faithful", A100, True, CHAINED_WIDE_DWD_LAST),
    (1249, 2048, 768, BF16, "faithful", A100, True, CHAINED_WIDE_DWD_LAST),
    (1250, 2048, 768, BF16, "faithful", A100, True, TRITON_FAITHFUL),
    (64, 2048, 768, BF16, "fast", A100, True, LIBRARY_FEW_DX2),
    (65, 2048, 768, BF16, "fast", A100, True, LIBRARY_FEW_DX2),
    # an operand off a 16-byte boundary on the H200: no TMA, so as without the Gluon kernels
    (64, 2048, 768, BF16, "faithful", H200, False, FEW),
    (65, 2048, 768, BF16, "faithful", H200, False, FEW),
    (128, 2048, 768, BF16, "faithful", H200, False, FEW),
    (129, 2048, 768, BF16, "faithful", H200, False, CHAINED_NARROW),
    (1249, 2048, 768, BF16, "faithful", H200, False, CHAINED_WIDE_DWD_LAST),
    (1250, 2048, 768, BF16, "faithful", H200, False, TRITON_FAITHFUL),
    (65, 2048, 768, BF16, "fast", H200, False, LIBRARY_FEW_DX2),
    (300, 2048, 768, BF16, "fast", H200, False, LIBRARY_FEW_DX2),
    # rows TMA cannot address (I = 300: 600 bytes): the faithful path's cuBLAS design from 129 tokens, on any GPU
    (1, 1000, 300, BF16, "faithful", H200, True, FEW),
    (128, 1000, 300, BF16, "faithful", H200, True, FEW),
    (129, 1000, 300, BF16, "faithful", H200, True, LIBRARY_FAITHFUL),
    (3000, 1000, 300, BF16, "faithful", H200, True, LIBRARY_FAITHFUL),
    (129, 1000, 300, BF16, "faithful", A100, True, LIBRARY_FAITHFUL),
    (64, 1000, 300, BF16, "fast", H200, True, FEW),
    (65, 1000, 300, BF16, "fast", H200, True, LIBRARY_FEW),  # I's rows of 600 bytes: no dx in two,
    (3000, 1000, 300, BF16, "fast", H200, True, LIBRARY_MANY),
    # fp32: exact fp32 products on the two Triton launches in tiles for 4-byte operands, both paths, any GPU
    (1, 2048, 768, FP32, "faithful", H200, True, TRITON_FP32),
    (257, 2048, 768, FP32, "fast", H200, True, TRITON_FP32),
    (65536, 1001, 300, FP32, "fast", H200, False, TRITON_FP32),
    (3000, 2048, 768, FP32, "faithful", A100, True, TRITON_FP32),
    # no tokens: the few-token design writes its zeros
    (0, 4096, 1536, BF16, "faithful", H200, True, FEW),
]
# a larger expert's few tokens on the H200: the few-token design while T·H·I ≤ 2^28, else the Gluon launches' narrow
# form on both paths where it applies, and where it does not (Mixtral's I), cuBLAS's design on the fast path
LARGE_EXPERTS = [
    (1, 4096, 1536, BF16, "faithful", H200, True, FEW),
    (1, 4096, 1536, BF16, "fast", H200, True, FEW),
    (64, 4096, 1024, BF16, "fast", H200, True, FEW),  # 2^28
    (64, 4096, 1032, BF16, "fast", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (64, 4096, 1032, BF16, "faithful", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (64, 4096, 1536, BF16, "faithful", H200, True, gluon("narrow", dx_splits=4, persistent=68)),
    (18, 7168, 2048, BF16, "fast", H200, True, FEW),  # 2.64e8
    (19, 7168, 2048, BF16, "fast", H200, True, gluon("narrow", dx_splits=2, persistent=68)),
    (1, 4096, 14336, BF16, "faithful", H200, True, FEW),
    (7, 4096, 14336, BF16, "fast", H200, True, LIBRARY_FEW_DX2),
]


def describe(design) -> str:
    """A design in a few words, for failure messages: its name, and a Gluon form's name, splits and programs."""
    if isinstance(design, GluonLaunches):
        for name, form in FORMS.items():
            first = dataclasses.replace(design.first, grad_down_tiles=True)
            second = dataclasses.replace(
                design.second,
                grad_down_tiles=False,
                grad_x_splits=1,
                weight_grad_programs=form.second.weight_grad_programs,
            )
            if (first, second) == (form.first, form.second):
                return (
                    f"gluon {name}, dWd in launch {2 if design.second.grad_down_tiles else 1}, dx in "
                    f"{design.second.grad_x_splits}, {design.second.weight_grad_programs} persistent programs"
                )
    return f"{design.name}: {design}"


@pytest.mark.parametrize("T, H, I, dtype, precision, device, aligned, expected", TABLE + LARGE_EXPERTS)
def test_choice_by_value(T, H, I, dtype, precision, device, aligned, expected):
    got = choose_design(T, H, I, dtype=dtype, precision=precision, device=device, aligned=aligned)
    if expected == FEW:
        assert isinstance(got, FewTokensConfig), describe(got)
    else:
        assert got == expected, f"{describe(got)}, expected {describe(expected)}"
    if isinstance(got, GluonLaunches):
        assert got.as_one_graph  # both launches submitted as one CUDA graph in eager calls


def test_table_covers_every_design_and_device():
    chosen = {FEW if expected == FEW else expected.name for *_, expected in TABLE}
    assert chosen == {"few_tokens", "gluon_launches", "library_gemms", "chained", "triton_launches"}
    assert {row[5] for row in TABLE} == {INTERPRETER, H200, H100_PCIE, A100}


# a grid of calls: H and I from 256 to 16384, multiples of 16 or not; T from none to 65536
SIZES = [256, 300, 1000, 1001, 2048, 2880, 7168, 16384]
TOKENS = [0, 1, 16, 17, 64, 65, 128, 129, 256, 1249, 1250, 4096, 65536]


def test_every_choice_is_one_its_design_can_run():
    """Pure host arithmetic: over the grid, with bf16, fp16 and fp32, both precisions, a Hopper device, one with
    another SM count, a CUDA GPU before Hopper, the interpreter, operands on 16-byte boundaries or not."""
    for H, I, T, dtype, precision, device, aligned in itertools.product(
        SIZES,
        SIZES,
        TOKENS,
        (BF16, FP16, FP32),
        ("faithful", "fast"),
        (H200, H100_PCIE, A100, INTERPRETER),
        (True, False),
    ):
        design = choose_design(T, H, I, dtype=dtype, precision=precision, device=device, aligned=aligned)
        reason = design.supports(T, H, I, dtype, device, aligned=aligned)
        assert reason is None, (T, H, I, dtype, precision, device, aligned, describe(design), reason)


# (design, (T, H, I, dtype, device, aligned), its reason or None)
REASONS = [
    (FORMS["wide"], (64, 2048, 768, BF16, H200, True), None),
    (FORMS["wide"], (64, 2048, 768, BF16, A100, True), "the Gluon kernels need a Hopper GPU (sm_90)"),
    (FORMS["wide"], (64, 2048, 768, BF16, INTERPRETER, True), "the Gluon kernels need a Hopper GPU (sm_90)"),
    (FORMS["wide"], (64, 2048, 768, FP32, H200, True), "the Gluon kernels take 16-bit operands, got torch.float32"),
    (
        FORMS["wide"],
        (64, 1000, 300, BF16, H200, True),
        "TMA needs rows of 16-byte multiples: H = 1000, I = 300 elements of 2 B",
    ),
    (FORMS["wide"], (64, 2048, 768, FP16, H200, False), "TMA needs every operand to start on a 16-byte boundary"),
    (FORMS["narrow"], (0, 2048, 768, BF16, H200, True), "a TMA descriptor needs at least one token row"),
    (LIBRARY_MANY, (64, 1000, 300, FP16, A100, False), None),
    (LIBRARY_MANY, (64, 2048, 768, FP32, H200, True), "its dSwiGLU pass takes 16-bit operands, got torch.float32"),
    (LIBRARY_FAITHFUL, (64, 2048, 768, BF16, INTERPRETER, True), "cuBLAS's GEMMs need a CUDA GPU"),
    (LIBRARY_FAITHFUL, (64, 2048, 768, BF16, CPU, True), "cuBLAS's GEMMs need a CUDA GPU"),
    (TRITON_WIDE, (64, 1001, 300, FP32, A100, False), None),
    (TRITON_WIDE, (64, 1001, 300, BF16, INTERPRETER, True), None),
    (
        TRITON_WIDE,
        (64, 2048, 768, torch.float64, H200, True),
        "dtype torch.float64 is not one of (torch.bfloat16, torch.float16, torch.float32)",
    ),
    (
        dataclasses.replace(TRITON_WIDE, grad_x=(128, 256, 64, 3)),
        (64, 2048, 768, BF16, H200, True),
        "grad_x: SPLIT must be a power of two, got 3",
    ),
    (TRITON_WIDE, (64, 2048, 768, BF16, CPU, True), "Triton kernels need a CUDA GPU or the interpreter"),
    (CHAINED_NARROW, (64, 1001, 300, BF16, A100, False), None),
    (
        ChainedConfig(dataclasses.replace(TRITON_WIDE, d_intermediate=(64, 128, 64, 0))),
        (1, 16, 16, BF16, A100, True),
        "d_intermediate: SPLIT must be a power of two, got 0",
    ),
    (CHAINED_NARROW, (64, 2048, 768, BF16, CPU, True), "Triton kernels need a CUDA GPU or the interpreter"),
    (
        FewTokensConfig(),
        (1, 2048, 768, FP32, H200, True),
        "the few-token tiles are sized for 16-bit operands, got torch.float32",
    ),
]


@pytest.mark.parametrize("design, call, reason", REASONS)
def test_supports_reasons_by_value(design, call, reason):
    *shape, aligned = call
    assert design.supports(*shape, aligned=aligned) == reason


needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreter_enabled(), reason="the refusals are those of the interpreter's device"
)


@needs_interpreter
@pytest.mark.parametrize(
    "config, dtype, reason",
    [
        (FORMS["wide"], BF16, r"the Gluon kernels need a Hopper GPU \(sm_90\)"),
        (LIBRARY_FEW, BF16, "cuBLAS's GEMMs need a CUDA GPU"),
        (
            dataclasses.replace(TRITON_FP32, grad_down=(64, 64, 16, 6)),
            FP32,
            "grad_down: SPLIT must be a power of two, got 6",
        ),
        (FewTokensConfig(), FP32, "the few-token tiles are sized for 16-bit operands, got torch.float32"),
    ],
)
def test_a_config_that_cannot_run_the_call_is_refused_before_any_work(config, dtype, reason, monkeypatch):
    """``config=`` overrides the chooser; one that cannot run the call raises a ValueError naming ``config``, the
    design and the reason, before anything is allocated."""
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    inputs = problems.make_inputs("swiglu_down_backward", 5, seed=0, dtype=dtype, hidden_size=32, intermediate_size=16)
    allocations = []
    real = runtime.allocate
    monkeypatch.setattr(runtime, "allocate", lambda *a, **k: allocations.append(a) or real(*a, **k))
    message = f"^config: the {config.name} design cannot run T = 5, H = 32, I = 16, {dtype}: {reason}$"
    with pytest.raises(ValueError, match=message):
        swiglu_down_backward_triton(*inputs.values(), config=config)
    assert allocations == []
