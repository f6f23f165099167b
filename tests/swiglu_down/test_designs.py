"""P1's designs one by one, driven by the registry (``moe_lib.swiglu_down.designs.DESIGNS``).

CPU: every design that runs under the Triton interpreter (its ``supports`` says so) on small odd shapes (H and I no
multiples of 16, several tiles and splits along every axis, no tokens) in both precisions and three dtypes, from
NaN-filled allocations, against the float64 reference; the chained launch bit for bit against the two launches of
the same tiles, and its ticket counters across shapes; the cuBLAS design's host code on the CPU (torch.mm in
cuBLAS's place).
GPU (``gpu`` marker): every named configured design of ``moe_lib.bench.tuning.P1_CANDIDATES`` from poisoned
memory at both input scales within its precision's rule of float64, deterministic and replayed from a CUDA graph;
the Gluon launches' compiled-kernel and graph caches; the chained launch beside a busy stream.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rel_error

from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.swiglu_down.designs import DESIGNS, ChainedConfig, LibraryGemmsConfig, TileConfig
from moe_lib.swiglu_down.designs.triton_launches import INTERPRETER_TILES
from moe_lib.swiglu_down.runtime import INTERPRETER_DEVICE, device_of

from .helpers import DEVICE, OUTPUTS, check_against_float64, check_small, float64_reference, run_design

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
REPO_ROOT = Path(__file__).resolve().parents[2]

# tiles with every reduction split, each kind its own shape (the interpreter's default tiles split only some)
SPLIT_TILES = TileConfig((16, 16, 16, 4), (16, 32, 16, 2), (16, 16, 32, 8), (32, 16, 16, 4), (1, 1), (1, 1), 2)

# the configured designs run under the interpreter, by registry name
INTERPRETER_CONFIGS = {
    "triton_launches": {
        "interpreter tiles": INTERPRETER_TILES,
        "split": SPLIT_TILES,
        "split, dx first": dataclasses.replace(SPLIT_TILES, grad_x_first=True),
    },
    "chained": {
        "interpreter tiles": ChainedConfig(INTERPRETER_TILES, warps=1, stages=1),
        "split": ChainedConfig(SPLIT_TILES, warps=1, stages=1),
        "split, dWd first": ChainedConfig(SPLIT_TILES, warps=1, stages=1, grad_down_first=True),
        "split, dx first, dWd last": ChainedConfig(
            dataclasses.replace(SPLIT_TILES, grad_x_first=True), warps=1, stages=1, grad_down_last=True
        ),
    },
}
# the designs tested elsewhere, and where
ELSEWHERE = {
    "few_tokens": "tests/swiglu_down/test_few_tokens.py (its own interpreter tests, through the registry too)",
    "library_gemms": "cuBLAS needs a CUDA GPU: its host code on the CPU below, the design on the GPU",
    "gluon_launches": "a Hopper GPU only: the test_gpu_* tests",
    "engine": "tests/swiglu_down/test_engine_design.py (the fast path only; the engine's Triton twins on the CPU)",
}
# (T, H, I, dtype): no tokens, one token, odd sizes (no multiples of 16: ragged edges on every side)
SMALL_SHAPES = [
    (0, 16, 8, torch.bfloat16),
    (1, 40, 24, torch.bfloat16),
    (37, 33, 19, torch.bfloat16),
    (21, 48, 40, torch.float16),
    (13, 40, 24, torch.float32),
]
ODD = (21, 33, 19, torch.bfloat16)


def small_cases():
    """(design, config, T, H, I, dtype, precision): each design's first config at every shape in both precisions
    (one for fp32: both are exact fp32 there), the other configs of the two launches at one odd shape on the faithful
    path (the other chained configs give their two launches' bits: test_chained_launch_equals_the_two_launches_...)."""
    for design, configs in INTERPRETER_CONFIGS.items():
        for index, label in enumerate(configs):
            if index and design == "chained":
                continue
            for T, H, I, dtype in SMALL_SHAPES if index == 0 else [ODD]:
                both = dtype != torch.float32 and index == 0
                for precision in ("faithful", "fast") if both else ("faithful",):
                    yield pytest.param(
                        design,
                        label,
                        T,
                        H,
                        I,
                        dtype,
                        precision,
                        id=f"{design}-{label}-T{T}-H{H}-I{I}-{str(dtype)[6:]}-{precision}",
                    )


def test_every_design_of_the_registry_is_tested():
    assert set(DESIGNS) == set(INTERPRETER_CONFIGS) | set(ELSEWHERE)
    assert not set(INTERPRETER_CONFIGS) & set(ELSEWHERE)
    for design, configs in INTERPRETER_CONFIGS.items():
        assert all(type(config) is DESIGNS[design] for config in configs.values()), design


def test_designs_tested_elsewhere_say_why_they_do_not_run_here():
    """The cuBLAS and Gluon designs refuse the interpreter (were that to change, they belong in INTERPRETER_CONFIGS);
    the few-token design runs there, in its own tests."""
    from moe_lib.swiglu_down.designs.gluon import FORMS

    call = (5, 40, 24, torch.bfloat16, INTERPRETER_DEVICE)
    assert LibraryGemmsConfig().supports(*call) == "cuBLAS's GEMMs need a CUDA GPU"
    assert FORMS["wide"].supports(*call) == "the Gluon kernels need a Hopper GPU (sm_90)"


@needs_triton
@pytest.mark.parametrize("design, label, T, H, I, dtype, precision", list(small_cases()))
def test_small_shapes_match_float64(design, label, T, H, I, dtype, precision, seed, poisoned):
    """Through the call (choose -> allocate -> run), with the design given as ``config``."""
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    config = INTERPRETER_CONFIGS[design][label]
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        dtype=dtype,
        hidden_size=H,
        intermediate_size=I,
        distribution="harness",
    )
    assert config.supports(T, H, I, dtype, device_of(inputs["x"])) is None
    got = swiglu_down_backward_triton(*inputs.values(), config=config, precision=precision)
    check_small(got, float64_reference(inputs), dtype, precision)


@needs_triton
def test_chained_launch_equals_the_two_launches_bitwise(seed, poisoned):
    """The chained launch runs the two launches' tiles in their arithmetic order: from NaN-filled memory, the same
    bits as the two launches with the same tiles (checked against float64 in test_small_shapes_match_float64), in
    every order of its tickets, and twice in a row the same (its ticket counters carry over from call to call). On
    the faithful path, whose launch-2 branch carries the lo halves; the fast path's against float64 there."""
    precision = "faithful"
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    T, H, I, dtype = ODD
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        dtype=dtype,
        hidden_size=H,
        intermediate_size=I,
        distribution="harness",
    )
    two_launches = {}
    for index, chained in enumerate(INTERPRETER_CONFIGS["chained"].values()):
        if chained.tiles not in two_launches:
            two_launches[chained.tiles] = swiglu_down_backward_triton(
                *inputs.values(), config=chained.tiles, precision=precision
            )
        for _ in range(2 if index == 0 else 1):
            one = swiglu_down_backward_triton(*inputs.values(), config=chained, precision=precision)
            for name, a, b in zip(OUTPUTS, one, two_launches[chained.tiles], strict=True):
                assert torch.isfinite(a).all() and torch.equal(a, b), (chained, name)


CHAINED_SHAPES_OF_ONE_GRID = """
import torch
from moe_lib import problems
from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
from moe_lib.swiglu_down.designs import ChainedConfig
from moe_lib.swiglu_down.designs.triton_launches import INTERPRETER_TILES

device = "cuda" if torch.cuda.is_available() else "cpu"
config = ChainedConfig(INTERPRETER_TILES, warps=1, stages=1)
# 14 programs each: 2 dA programs at H = 32, I = 16, then 4 at H = 16, I = 32, then 2 again
for H, I in ((32, 16), (16, 32), (32, 16)):
    inputs = problems.make_inputs("swiglu_down_backward", 1, seed=H, device=device, hidden_size=H,
                                  intermediate_size=I)
    got = swiglu_down_backward_triton(*inputs.values(), config=config)
    want = swiglu_down_backward_triton(*inputs.values(), config=config.tiles)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), (H, I)
print("ok")
"""


@needs_triton
def test_chained_launches_of_one_grid_size_and_other_shapes_do_not_hang():
    """Two shapes whose chained launches have the same grid but different dA program counts, one after the other:
    each waits for its own dA count (a counter shared by grid size alone made the second wait forever). In a child
    process with a time limit, so that a hang fails the test."""
    result = subprocess.run(
        [sys.executable, "-c", CHAINED_SHAPES_OF_ONE_GRID],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_chained_launch_refuses_dwd_first_and_last_at_once():
    with pytest.raises(ValueError, match="^config: grad_down_first and grad_down_last exclude each other"):
        ChainedConfig(SPLIT_TILES, grad_down_first=True, grad_down_last=True)


# the cuBLAS design's forms: as the chooser takes it on the fast path, few and many tokens (dA in fp32 or 16 bits,
# [Wg; Wu] stacked by a kernel or two memcpys, on a second stream), as it takes it on the faithful path, dx in two
LIBRARY_CONFIGS = {
    "fast": LibraryGemmsConfig.for_shape(1, 768),
    "fast, many tokens": LibraryGemmsConfig.for_shape(8192, 768),
    "faithful": LibraryGemmsConfig(d_a_fp32=True),
    "dx in two": LibraryGemmsConfig(dx_in_two=True),
}


@needs_triton
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("label", list(LIBRARY_CONFIGS))
def test_library_gemms_run_on_the_cpu(label, T, precision, seed, poisoned):
    """The cuBLAS design's host code with torch.mm in cuBLAS's place and its dSwiGLU pass under the interpreter (its
    ``supports`` refuses the interpreter: the call would not take it here), from NaN-filled memory at the harness's
    scale: the faithful path passes the element rule (its hi/lo rows through one product each); the two weight
    gradients come back as the row halves of one allocation."""
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        hidden_size=64,
        intermediate_size=48,
        distribution="harness",
    )
    got = run_design(LIBRARY_CONFIGS[label], inputs, precision)
    check_small(got, float64_reference(inputs), torch.bfloat16, precision)
    assert got[2].data_ptr() == got[1].data_ptr() + got[1].numel() * got[1].element_size()


@needs_triton
def test_library_gemms_takes_adjacent_gate_up_weights_without_a_copy(seed):
    """Wg and Wu as the two row halves of one buffer (a fused gate-up weight): [Wg; Wu] is a view of it, and the
    gradients are those of the same weights held apart."""
    from moe_lib.swiglu_down.designs.library_gemms import gate_up_view

    inputs = problems.make_inputs(
        "swiglu_down_backward", 21, seed=seed, device=DEVICE, hidden_size=40, intermediate_size=24
    )
    fused = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
    view = gate_up_view(fused[:24], fused[24:])
    assert view.data_ptr() == fused.data_ptr() and torch.equal(view, fused)
    assert gate_up_view(inputs["gate_weight"], inputs["up_weight"]) is None
    assert gate_up_view(fused[24:], fused[:24]) is None  # halves in the wrong order
    together = inputs | dict(gate_weight=fused[:24], up_weight=fused[24:])
    for config in (*LIBRARY_CONFIGS.values(), LibraryGemmsConfig(stack_aside=True, streams=True)):
        apart = run_design(config, inputs, "fast")
        for name, a, b in zip(OUTPUTS, apart, run_design(config, together, "fast"), strict=True):
            assert rel_error(a, b) <= 1e-2, (config, name)  # dx in two GEMMs only where it would need the copy


# ---------------------------------------------------------------------------------------------
# GPU: every named configured design (moe_lib.bench.tuning.P1_CANDIDATES)


def candidates(prefix: str) -> list[str]:
    from moe_lib.bench.tuning import P1_CANDIDATES

    return [name for name in P1_CANDIDATES if name.startswith(prefix)]


def check_candidate_at_both_scales(name: str, T: int, precision: str, seed: int, H: int = 2048, I: int = 768) -> None:
    """A candidate from poisoned memory, at our generator's scale and at the harness's, against float64 under its
    precision's rule."""
    from moe_lib.bench.timing import poison_allocator
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    for distribution in ("forward", "harness"):
        inputs = problems.make_inputs(
            "swiglu_down_backward",
            T,
            seed=seed,
            device="cuda",
            distribution=distribution,
            hidden_size=H,
            intermediate_size=I,
        )
        poison_allocator("cuda", 256 * 2**20)
        got = swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[name], precision=precision)
        torch.cuda.synchronize()
        check_against_float64(inputs, got, precision)


def check_deterministic_and_replayed(name: str, precision: str, seed: int, T: int = 1087) -> None:
    """Two calls of a candidate bitwise equal; captured in a CUDA graph and replayed on new inputs, the same
    outputs as an eager call."""
    from moe_lib.bench.timing import capture
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    def run(inputs):
        return swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[name], precision=precision)

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    for output, a, b in zip(OUTPUTS, run(inputs), run(inputs), strict=True):
        assert torch.equal(a, b), output
    static = {k: v.clone() for k, v in inputs.items()}
    graph, outputs = capture(lambda: run(static))
    fresh = problems.make_inputs("swiglu_down_backward", T, seed=seed + 1, device="cuda")
    for key, tensor in fresh.items():
        static[key].copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    for output, g, e in zip(OUTPUTS, outputs, run(fresh), strict=True):
        assert torch.equal(g, e), output


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 128, 1087, 2447, 8192, 12288])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("name", candidates("gluon_"))
def test_gpu_gluon_forms_at_both_input_scales(name, T, precision, seed):
    """Every Gluon form (with dWd's tiles in launch 2, with dx split) from poisoned memory: partial tiles along T
    and I, the ring's last K steps and the saved tiles' rows beyond T filled with zeros by TMA."""
    check_candidate_at_both_scales(name, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    ["gluon_narrow", "gluon_tall_dx2", "gluon_wide_da256", "gluon_wide_narrow_da_dwd2", "gluon_wide_da_first_dx4"],
)
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_gluon_forms_with_partial_tiles_along_i_and_h(name, precision, seed):
    """A shape off the benchmark's (I = 384: the 256-wide dA tiles' right halves wholly beyond I; H = 320: a partial
    dWd row block and a partial K step of dA)."""
    check_candidate_at_both_scales(name, 300, precision, seed, H=320, I=384)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 1087])
@pytest.mark.parametrize(
    "name", ["gluon_narrow", "gluon_tall_dx4", "gluon_wide", "gluon_wide_da256_dwd2", "gluon_wide_da_first_tall_dx2"]
)
def test_gpu_gluon_forms_deterministic_and_replayed_from_a_graph(name, T, seed):
    """dx's tiles split over programs (the last to arrive sums the partials in split order), weight-gradient tiles
    taken in turn by persistent programs: bitwise the same call after call, and from a replayed CUDA graph on new
    inputs (the descriptors are built per call and passed by value; the arrival counters carry over)."""
    check_deterministic_and_replayed(name, "faithful", seed, T)


@pytest.mark.gpu
def test_gpu_gluon_second_launch_reuses_one_compiled_kernel_across_token_counts(seed):
    """After the first call launch 2 goes straight to the launcher of the kernel compiled then: one kernel per
    device, dtype, precision and config serves token counts with and without 16 | T."""
    from moe_lib.swiglu_down import gluon_launch2

    gluon_launch2.ENCODED_LAUNCHES.clear()
    for T in (128, 1087, 3, 2448):
        check_candidate_at_both_scales("gluon_wide", T, "faithful", seed + T)
    assert len(gluon_launch2.ENCODED_LAUNCHES) == 1


@pytest.mark.gpu
def test_gpu_gluon_launches_as_one_graph_in_eager_calls(seed):
    """An eager call whose kernels are compiled submits both launches as one CUDA graph, one kept executable per
    token count, brought up to each call's inputs: within the rule of float64 on fresh inputs every call."""
    from moe_lib import encoded_launch

    encoded_launch.GRAPH_EXECS.clear()
    for T in (200, 200, 1087):  # each check calls twice: compiled by the first call at the latest
        check_candidate_at_both_scales("gluon_tall", T, "faithful", seed + T)
    assert len(encoded_launch.GRAPH_EXECS) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 128, 1087, 5000, 12288])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("name", candidates("library_gemms"))
def test_gpu_library_gemms_at_both_input_scales(name, T, precision, seed):
    check_candidate_at_both_scales(name, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", candidates("library_gemms"))
def test_gpu_library_gemms_deterministic_and_replayed_from_a_graph(name, seed):
    """With ``streams`` the capture forks to a second stream and joins it again (with ``stack_aside`` the caller's
    stream also waits for the copy made there, with ``stack_by_memcpy`` two memcpy nodes)."""
    check_deterministic_and_replayed(name, "fast", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 100, 999, 5000])
@pytest.mark.parametrize("name", candidates("chained"))
def test_gpu_chained_launch_beside_a_busy_stream(name, T, seed):
    """The chained launch over one to many waves of programs, while a matmul on another stream holds SMs: within
    the element rule at the harness's scale, and the same bits as the two launches with the same tiles, warps
    and stages."""
    from moe_lib.bench.timing import poison_allocator
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    config = P1_CANDIDATES[name]
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    poison_allocator("cuda", 256 * 2**20)
    with torch.cuda.stream(side):
        busy = big @ big
    got = swiglu_down_backward_triton(*inputs.values(), config=config)
    torch.cuda.synchronize()
    assert torch.isfinite(busy).all()
    check_against_float64(inputs, got, "faithful")
    tiles = dataclasses.replace(config.tiles, warps=(config.warps,) * 2, stages=(config.stages,) * 2)
    two = swiglu_down_backward_triton(*inputs.values(), config=tiles)
    for output, a, b in zip(OUTPUTS, got, two, strict=True):
        assert torch.equal(a, b), output


@pytest.mark.gpu
@pytest.mark.parametrize("name", candidates("chained"))
def test_gpu_chained_launch_deterministic_and_replayed_from_a_graph(name, seed):
    check_deterministic_and_replayed(name, "faithful", seed, T=700)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 100, 999, 5000])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("name", candidates("triton_"))
def test_gpu_triton_launches_at_both_input_scales(name, T, precision, seed):
    check_candidate_at_both_scales(name, T, precision, seed)
