"""The Triton path of P1: ``swiglu_down_backward(..., impl="triton")`` and the ``swiglu_expert`` layer.

CPU: the kernels run under the Triton interpreter (tests/conftest.py switches it on where there is
no GPU) on small odd shapes: the two launches with the interpreter's default tiles, with every tile
kind split (the split-K path), and the one-launch path (phases as two launches there).
GPU (``gpu`` marker): every benchmark case plus odd token counts in bf16 against the float64
reference, each output's error at most 2× that of the careful PyTorch bf16 formulation + 1e-4;
outputs poisoned before the call; determinism; CUDA-graph capture and replay with new inputs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from conftest import rel_error
from oracles import swiglu_expert_grads

import moe_lib
from moe_lib import problems, reference
from moe_lib.bench.checks import compare_output
from moe_lib.bench.peers.swiglu_down import swiglu_down_backward_eager
from moe_lib.bench.timing import poison_allocator
from moe_lib.dispatch import interpreter_enabled

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
OUTPUTS = ("grad_x", "grad_gate_weight", "grad_up_weight", "grad_down_weight")
REPO_ROOT = Path(__file__).resolve().parents[1]


def float64_reference(inputs: dict):
    return reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])


def careful_pytorch_errors(inputs: dict, want) -> list[float]:
    """Relative error of the careful bf16 PyTorch formulation (the yardstick of the accuracy rule)."""
    w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
    got = swiglu_down_backward_eager(
        inputs["grad_output"], inputs["x"], w_gate_up, inputs["down_weight"], inputs["gate"],
        inputs["gate_sigmoid"], inputs["gate_silu"], inputs["up"], inputs["intermediate"],
    )  # fmt: skip
    return [rel_error(g, w) for g, w in zip(got, want, strict=True)]


def split_everything_config():
    """Small tiles with every reduction split (the interpreter's default splits only some)."""
    from moe_lib.swiglu_down.launch import TileConfig

    return TileConfig((16, 16, 16, 4), (16, 32, 16, 2), (16, 16, 32, 8), (32, 16, 16, 4), (1, 1), (1, 1), 2)


CPU_CASES = [
    pytest.param(0, 16, 8, torch.bfloat16, id="T0"),
    pytest.param(1, 40, 24, torch.bfloat16, id="T1"),
    pytest.param(13, 40, 24, torch.float32, id="odd-fp32"),
    pytest.param(37, 33, 19, torch.bfloat16, id="odd-bf16"),
]


def one_launch_odd_blocks_config():
    """The one-launch path with blocks that leave ragged edges on every side of the small shapes."""
    from moe_lib.swiglu_down.one_launch import OneLaunchConfig

    return OneLaunchConfig(block_t=16, block_i=16, block_h_down=16, block_h=32, block_k=16, block_n=16,
                           warps=1, stages=1)  # fmt: skip


def library_gemms_config():
    """The design on cuBLAS GEMMs (torch.mm on the CPU) with the dSwiGLU pass under the interpreter."""
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    return LibraryGemmsConfig(d_a_fp32=False)


def library_gemms_flat_pass_config():
    """The dSwiGLU pass by runs of 64 consecutive elements: several programs and a ragged last run on tiny shapes."""
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    return LibraryGemmsConfig(d_a_fp32=False, grads_flat_block=64)


def library_gemms_dx_in_two_config():
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    return LibraryGemmsConfig(dx_in_two=True)


def library_gemms_d_a_tile_config():
    """dA and the dSwiGLU pass as one Triton launch (split-K tiles), the rest on cuBLAS (torch.mm on the CPU)."""
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    return LibraryGemmsConfig(d_a_tile=(16, 16, 16, 2))


def library_gemms_d_a_and_grad_down_tiles_config():
    """dA, the dSwiGLU pass and dWd as one Triton launch (split-K tiles of both), dx and [dWg; dWu] on cuBLAS."""
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    return LibraryGemmsConfig(d_a_tile=(16, 16, 16, 2), grad_down_tile=(16, 32, 16, 2))


def chained_config():
    """The two launches' interpreter tiles chained into one launch by tickets."""
    from moe_lib.swiglu_down.chained import ChainedConfig
    from moe_lib.swiglu_down.launch import choose_config

    return ChainedConfig(choose_config(1, 1, 1, interpreter=True), warps=1, stages=1)


def chained_split_config():
    from moe_lib.swiglu_down.chained import ChainedConfig

    return ChainedConfig(split_everything_config(), warps=1, stages=1)


def chained_grad_down_first_config():
    from moe_lib.swiglu_down.chained import ChainedConfig

    return ChainedConfig(split_everything_config(), warps=1, stages=1, grad_down_first=True)


def chained_grad_down_last_config():
    """The dWd tiles' tickets after launch 2's, with launch 2's dx tiles first."""
    import dataclasses

    from moe_lib.swiglu_down.chained import ChainedConfig

    return ChainedConfig(dataclasses.replace(split_everything_config(), grad_x_first=True), warps=1, stages=1,
                         grad_down_last=True)  # fmt: skip


def chained_grad_x_first_config():
    """Launch 2's dx tiles before its dWg, dWu tiles, chained."""
    import dataclasses

    from moe_lib.swiglu_down.chained import ChainedConfig

    return ChainedConfig(dataclasses.replace(split_everything_config(), grad_x_first=True), warps=1, stages=1)


CONFIGS = {"default": lambda: None, "split": split_everything_config, "one-launch": one_launch_odd_blocks_config,
           "library": library_gemms_config, "library-flat-pass": library_gemms_flat_pass_config,
           "library-dx-in-two": library_gemms_dx_in_two_config,
           "chained": chained_config, "chained-split": chained_split_config,
           "chained-dwd-first": chained_grad_down_first_config,
           "library-d-a-tile": library_gemms_d_a_tile_config,
           "library-d-a-dwd-tiles": library_gemms_d_a_and_grad_down_tiles_config}  # fmt: skip


@needs_triton
@pytest.mark.parametrize("T, H, I, dtype", CPU_CASES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_small_shapes_match_float64_reference(T, H, I, dtype, config_name, seed):
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=device, dtype=dtype,
                                  hidden_size=H, intermediate_size=I)  # fmt: skip
    config = CONFIGS[config_name]()
    got = swiglu_down_backward_triton(*inputs.values(), config=config)
    again = swiglu_down_backward_triton(*inputs.values(), config=config)
    want = float64_reference(inputs)
    # fp32: exact products; bf16: the rounding of dGate/dUp and of the outputs (≈ 3e-3 each)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, a, w in zip(OUTPUTS, got, again, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert torch.equal(g, a), f"{name}: two runs differ"
        if T == 0 and name == "grad_x":
            continue
        if T == 0:
            assert torch.count_nonzero(g) == 0, name
        else:
            assert rel_error(g, w) <= tolerance, name


@needs_triton
@pytest.mark.parametrize("T", [1, 37])
def test_faithful_path_passes_the_element_rule_at_the_harness_scale(T, seed):
    """Std-1 inputs (what the benchmark's harness draws): dGate and dUp rounded to bf16 fail the element
    rule on elements near zero; carried as hi/lo pairs they pass it, and the default is that path."""
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=device, hidden_size=64,
                                  intermediate_size=48, distribution="harness")  # fmt: skip
    want = float64_reference(inputs)
    faithful = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    fast = swiglu_down_backward_triton(*inputs.values(), precision="fast")
    rule = problems.load("swiglu_down_backward").element_rule
    for name, f, q, w in zip(OUTPUTS, faithful, fast, want, strict=True):
        exact = compare_output(f, w, rule)
        assert exact["finite"] and exact["pass_fraction"] >= rule["required_fraction"], (name, exact)
        assert exact["rel_error"] <= compare_output(q, w, rule)["rel_error"] + 1e-7, name


@needs_triton
@pytest.mark.parametrize("T", [5, 37])
def test_public_entry_point_uses_triton(T, seed, monkeypatch):
    """impl="triton" runs the Triton launcher (a spy counts it; the reference would raise), whose outputs
    and workspaces come from NaN-filled memory: what comes back was written by the kernels."""
    from moe_lib.swiglu_down import api, launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=device, hidden_size=32,
                                  intermediate_size=16)  # fmt: skip
    calls, run_triton = [], launch.swiglu_down_backward_triton

    def spy(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return run_triton(*args, **kwargs)

    def no_reference(*args):
        raise AssertionError("impl='triton' ran the reference")

    monkeypatch.setattr(launch, "swiglu_down_backward_triton", spy)
    monkeypatch.setattr(api, "swiglu_down_backward_reference", no_reference)
    monkeypatch.setattr(launch, "allocate", lambda size, *, dtype, device: torch.full(size, float("nan"), dtype=dtype,
                                                                                      device=device))  # fmt: skip
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    assert calls == ["faithful"]
    for g, w in zip(got, float64_reference(inputs), strict=True):
        assert torch.isfinite(g).all() and rel_error(g, w) <= 2e-2


@needs_triton
def test_layer_gradients_match_autograd(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", 11, seed=seed, device=device, dtype=torch.float32,
                                  hidden_size=40, intermediate_size=24)  # fmt: skip
    leaves = [inputs[k].clone().requires_grad_() for k in ("x", "gate_weight", "up_weight", "down_weight")]
    y = moe_lib.swiglu_expert(*leaves, impl="triton")
    y.backward(inputs["grad_output"])
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(("x", "gate_weight", "up_weight", "down_weight"), leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 1e-5, name


@needs_triton
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("tiles", [{}, dict(grads_flat_block=64, stack_by_memcpy=True),
                                   dict(grad_x_tile=(16, 16, 16, 4)), dict(d_a_tile=(16, 16, 16, 4)),
                                   dict(d_a_tile=(16, 16, 16, 4), grad_down_tile=(16, 16, 16, 2))],
                         ids=["cublas-d-a", "cublas-d-a-flat-pass-memcpy", "triton-dx", "triton-d-a",
                              "triton-d-a-dwd"])  # fmt: skip
def test_library_gemms_design_poisoned_and_at_the_harness_scale(T, precision, tiles, seed, monkeypatch):
    """The design on cuBLAS GEMMs from NaN-filled memory, at the harness's std-1 scale: the faithful path
    passes the element rule (its hi/lo rows through one GEMM each), the fast path stays within 2e-2; the
    two weight gradients come back as [I, H] halves of one allocation."""
    from moe_lib.swiglu_down import launch
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=device, hidden_size=64,
                                  intermediate_size=48, distribution="harness")  # fmt: skip
    monkeypatch.setattr(launch, "allocate", lambda size, *, dtype, device: torch.full(size, float("nan"), dtype=dtype,
                                                                                      device=device))  # fmt: skip
    got = launch.swiglu_down_backward_triton(*inputs.values(), config=LibraryGemmsConfig(**tiles),
                                             precision=precision)  # fmt: skip
    rule = problems.load("swiglu_down_backward").element_rule
    for name, g, w in zip(OUTPUTS, got, float64_reference(inputs), strict=True):
        assert g.shape == w.shape and g.is_contiguous(), name
        result = compare_output(g, w, rule)
        assert result["finite"], name
        if precision == "faithful":
            assert result["pass_fraction"] >= rule["required_fraction"], (name, result)
        assert result["rel_error"] <= 2e-2, name


@needs_triton
def test_library_gemms_design_takes_adjacent_gate_up_weights_without_a_copy(seed):
    """Wg and Wu as the two row halves of one buffer (a fused gate-up weight): [Wg; Wu] is a view of it, and
    the gradients are those of the same weights held apart."""
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig, gate_up_view

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", 21, seed=seed, device=device, hidden_size=40,
                                  intermediate_size=24)  # fmt: skip
    fused = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
    view = gate_up_view(fused[:24], fused[24:])
    assert view.data_ptr() == fused.data_ptr() and torch.equal(view, fused)
    assert gate_up_view(inputs["gate_weight"], inputs["up_weight"]) is None
    assert gate_up_view(fused[24:], fused[:24]) is None  # halves in the wrong order
    for config in (LibraryGemmsConfig(), LibraryGemmsConfig(dx_in_two=True), LibraryGemmsConfig(stack_aside=True),
                   LibraryGemmsConfig(streams=True, stack_aside=True, stack_by_memcpy=True),
                   LibraryGemmsConfig(grad_x_tile=(16, 16, 16, 2))):
        apart = swiglu_down_backward_triton(*inputs.values(), config=config, precision="fast")
        together = swiglu_down_backward_triton(*(inputs | dict(gate_weight=fused[:24], up_weight=fused[24:])).values(),
                                               config=config, precision="fast")  # fmt: skip
        for name, a, b in zip(OUTPUTS, apart, together, strict=True):
            assert rel_error(a, b) <= 1e-2, name


@needs_triton
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_chained_launch_equals_the_two_launches_bitwise(precision, seed, monkeypatch):
    """The chained launch runs the two launches' tiles in their arithmetic order: from NaN-filled memory, the
    same bits as the two launches with the same tiles, and twice in a row the same (its ticket counters carry
    over from call to call); so do both with launch 2's dx tiles first, and the chained launch with its tickets in
    the other orders (dWd first, dWd last). The two launches' tiles match float64 in test_small_shapes_...[split]."""
    from moe_lib.swiglu_down import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", 37, seed=seed, device=device, hidden_size=33,
                                  intermediate_size=19, distribution="harness")  # fmt: skip
    monkeypatch.setattr(launch, "allocate", lambda size, *, dtype, device: torch.full(size, float("nan"), dtype=dtype,
                                                                                      device=device))  # fmt: skip
    chained = chained_split_config()
    two = launch.swiglu_down_backward_triton(*inputs.values(), config=chained.tiles, precision=precision)
    dx_first = chained_grad_x_first_config()
    for config in (chained, chained, chained_grad_down_first_config(), dx_first, dx_first.tiles,
                   chained_grad_down_last_config()):
        one = launch.swiglu_down_backward_triton(*inputs.values(), config=config, precision=precision)
        for name, a, b in zip(OUTPUTS, one, two, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b), name


CHAINED_SHAPES_OF_ONE_GRID = """
import torch
from moe_lib import problems
from moe_lib.swiglu_down.chained import ChainedConfig
from moe_lib.swiglu_down.launch import choose_config, swiglu_down_backward_triton

device = "cuda" if torch.cuda.is_available() else "cpu"
config = ChainedConfig(choose_config(1, 1, 1, interpreter=True), warps=1, stages=1)
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
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", CHAINED_SHAPES_OF_ONE_GRID], capture_output=True, text=True,
                            timeout=300, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_capture_takes_counters_an_eager_call_made_ready(monkeypatch):
    """A CUDA graph's capture cannot zero memory outside the graph: it takes the zeroed spare counters the last eager
    call of the slot made ready, and keeps them (no later call shares them); with none ready, zeros of its own. The
    eager calls keep their own counters, whatever the captures took."""
    from moe_lib.swiglu_down import launch
    from moe_lib.swiglu_down.launch import SplitWorkspace

    monkeypatch.setattr(SplitWorkspace, "_counters", {})
    monkeypatch.setattr(SplitWorkspace, "_spares", {})
    monkeypatch.setattr(SplitWorkspace, "_graph_owned", [])
    device = torch.device("cpu")
    capturing = [False]
    monkeypatch.setattr(launch, "capturing", lambda _: capturing[0])

    def counters(size=10):
        return SplitWorkspace.counters("slot", 2, size, device)

    eager = counters()
    eager.add_(2)  # a call's arrivals
    assert counters().data_ptr() == eager.data_ptr()
    capturing[0] = True
    first_graph = counters()
    assert first_graph.data_ptr() != eager.data_ptr() and not first_graph.any()
    second_graph = counters()  # no eager call since: zeros of its own
    assert second_graph.data_ptr() not in (eager.data_ptr(), first_graph.data_ptr()) and not second_graph.any()
    assert SplitWorkspace._graph_owned == [first_graph]
    capturing[0] = False
    assert counters().data_ptr() == eager.data_ptr() and eager[0] == 2  # the eager counts untouched
    capturing[0] = True
    third_graph = counters()
    assert third_graph.data_ptr() not in (eager.data_ptr(), first_graph.data_ptr()) and not third_graph.any()
    assert counters(size=4096).numel() >= 4096  # a spare too small is not taken


@pytest.mark.parametrize("launch", ["tma", "gluon1", "gluon2"])
def test_chained_launch_refuses_tma_and_gluon_tiles(launch):
    from moe_lib.swiglu_down.chained import ChainedConfig
    from moe_lib.swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
    from moe_lib.swiglu_down.gluon_launch2 import GluonSecondLaunchConfig
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton
    from moe_lib.swiglu_down.tma_launches import TmaSecondLaunchConfig

    inputs = problems.make_inputs("swiglu_down_backward", 3, seed=0, hidden_size=32, intermediate_size=16)
    tiles = split_everything_config()
    fields = {"tma": dict(tma_second_launch=TmaSecondLaunchConfig()),
              "gluon1": dict(gluon_first_launch=GluonFirstLaunchConfig()),
              "gluon2": dict(gluon_second_launch=GluonSecondLaunchConfig())}[launch]  # fmt: skip
    config = ChainedConfig(dataclasses.replace(tiles, **fields))
    with pytest.raises(ValueError, match="config: a chained launch .* no TMA or Gluon launch"):
        swiglu_down_backward_triton(*inputs.values(), config=config)


@needs_triton
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gluon_launches_step_aside_where_they_cannot_run(precision, seed):
    """Off a Hopper GPU (here: the interpreter) a TileConfig naming launches in Gluon runs the Triton launches: the
    same bits as the same tiles without them."""
    from moe_lib.swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
    from moe_lib.swiglu_down.gluon_launch2 import GluonSecondLaunchConfig
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    if torch.cuda.is_available() and not interpreter_enabled():
        pytest.skip("on a GPU the Gluon launches run (test_gpu_gluon_*)")
    inputs = problems.make_inputs("swiglu_down_backward", 21, seed=seed, hidden_size=40, intermediate_size=24)
    tiles = split_everything_config()
    with_gluon = dataclasses.replace(tiles, gluon_first_launch=GluonFirstLaunchConfig(),
                                     gluon_second_launch=GluonSecondLaunchConfig())  # fmt: skip
    got = swiglu_down_backward_triton(*inputs.values(), config=with_gluon, precision=precision)
    want = swiglu_down_backward_triton(*inputs.values(), config=tiles, precision=precision)
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        assert torch.equal(g, w), name


def test_faithful_path_chains_its_launches_in_its_band():
    """Where the Gluon launches cannot run, the faithful path: one launch up to ONE_LAUNCH_MAX_TOKENS (the few-token
    design at the benchmark's shape, to 128 tokens), the chained launch in CHAINED_LAUNCH_TOKENS beyond that, the two
    launches above; the fast path never chains (its own designs there)."""
    from moe_lib.swiglu_down.chained import ChainedConfig
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig
    from moe_lib.swiglu_down.launch import (
        CHAINED_LAUNCH_TOKENS,
        ONE_LAUNCH_MAX_TOKENS,
        TileConfig,
        choose_config,
    )

    def config(T, **kwargs):
        args = dict(interpreter=False, with_lo=True, max_programs=132, gluon=False)
        return choose_config(T, 2048, 768, **(args | kwargs))

    band = CHAINED_LAUNCH_TOKENS
    assert band.start == ONE_LAUNCH_MAX_TOKENS + 1
    assert isinstance(config(band.start), FewTokensConfig) and isinstance(config(128), FewTokensConfig)
    assert isinstance(config(band.start, max_programs=11), ChainedConfig)  # where the few-token grid does not fit
    assert isinstance(config(128, max_programs=11), ChainedConfig)
    for T in (129, 512, 1087, band.stop - 1):
        assert isinstance(config(T), ChainedConfig), T
        assert not isinstance(config(T, with_lo=False), ChainedConfig), T
        assert isinstance(config(T, interpreter=True), TileConfig), T
    assert config(129).tiles.grad_down == (64, 128, 64, 1) and config(1087).tiles.grad_down == (128, 256, 64, 1)
    # the order of the tickets: launch 2's dx tiles first at 512-1152 tokens, the dWd tiles last from 1153
    last = band.stop - 1
    orders = {T: (config(T).tiles.grad_x_first, config(T).grad_down_last) for T in (129, 511, 512, 1152, 1153, last)}
    assert orders == {129: (False, False), 511: (False, False), 512: (True, False), 1152: (True, False),
                      1153: (False, True), last: (False, True)}
    assert not any(config(T).grad_down_first for T in (129, 512, 1153))
    assert isinstance(config(ONE_LAUNCH_MAX_TOKENS), FewTokensConfig)
    for T in (band.stop, 8192):  # beyond the band the Triton launches
        assert isinstance(config(T), TileConfig) and config(T).gluon_first_launch is None, T


def test_faithful_path_takes_the_gluon_forms_where_they_run():
    """Where the Gluon launches run (a Hopper GPU, 16-bit operands TMA can address: ``gluon``), the faithful path
    takes them from the end of the one-launch designs on, in the forms of GLUON_FORMS (64-row tiles in both launches
    to 1099 tokens, then in launch 2 alone in three bands), launch 2 always by programmatic dependent launch; the
    chained launch not at all."""
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig
    from moe_lib.swiglu_down.launch import (
        CHAINED_LAUNCH_TOKENS,
        GLUON_FAST_FORMS,
        GLUON_FORMS,
        TileConfig,
        choose_config,
        fast_path_on_gluon,
    )

    def config(T, **kwargs):
        return choose_config(T, 2048, 768, **(dict(interpreter=False, with_lo=True, max_programs=132) | kwargs))

    assert isinstance(config(64), FewTokensConfig)  # the few-token design first where its grid fits, to 64 tokens
    assert isinstance(config(128, gluon=False), FewTokensConfig)  # to 128 where the Gluon launches cannot run
    for T in (65, 128, 8192):  # both launches submitted as one CUDA graph in eager calls
        assert config(T).gluon_as_one_graph and not getattr(config(T, gluon=False), "gluon_as_one_graph", False), T
    rows = {}
    for T in (CHAINED_LAUNCH_TOKENS.start, 129, 512, 1099, 1100, 1399, 1400, 2299, 2300, 3300, 4093, 4600, 8192,
              12288):  # fmt: skip
        for max_programs in (132, 11):
            tiles = config(T, max_programs=max_programs)
            assert isinstance(tiles, TileConfig), T
            assert None not in (tiles.gluon_first_launch, tiles.gluon_second_launch), T
            rows[T] = (tiles.gluon_first_launch.block_m, tiles.gluon_second_launch.block_m)
            assert tiles.gluon_first_launch.early_dependents and tiles.gluon_second_launch.programmatic, T
            # the saved tiles asked for early wherever a dA tile is one accumulator wide
            assert tiles.gluon_first_launch.stores_in_flight, T
            assert tiles.gluon_first_launch.saved_tiles_early or tiles.gluon_first_launch.d_a_halves == 2, T
            # dWd's tiles in one of the two launches
            assert tiles.gluon_first_launch.grad_down_tiles != tiles.gluon_second_launch.grad_down_tiles, T
            launch1, launch2 = GLUON_FORMS[max(first for first in GLUON_FORMS if first <= T)]
            assert tiles.gluon_first_launch == launch1, T
            # the persistent weight-gradient programs only where all of them fit beside dx's on the SMs
            dx_programs = launch2.grad_x_tiles(T, 2048) * launch2.grad_x_splits
            fits = dx_programs + launch2.weight_grad_programs <= max_programs
            assert tiles.gluon_second_launch == dataclasses.replace(
                launch2, weight_grad_programs=launch2.weight_grad_programs if fits else 0), T
        # the fast path: in its bands the same forms without the lo halves (dx's tiles unsplit), or its own
        # (GLUON_FAST_FORMS), its own design elsewhere
        assert (config(T, with_lo=False).gluon_first_launch is None) == (not fast_path_on_gluon(T)), T
        assert getattr(config(T, with_lo=False, element_bytes=4), "gluon_first_launch", None) is None, T  # 16-bit
        if fast_path_on_gluon(T) and not any(T in band for band in GLUON_FAST_FORMS):
            assert config(T, with_lo=False).gluon_first_launch == config(T).gluon_first_launch, T
            assert config(T, with_lo=False).gluon_second_launch == dataclasses.replace(
                config(T).gluon_second_launch, grad_x_splits=1,
                weight_grad_programs=config(T, with_lo=False).gluon_second_launch.weight_grad_programs), T
        assert config(T, interpreter=True).gluon_first_launch is None, T
    splits = {T: config(T).gluon_second_launch.grad_x_splits for T in (65, 128, 129, 256, 257, 8192)}
    assert splits == {65: 4, 128: 4, 129: 2, 256: 2, 257: 1, 8192: 1}  # dx's K split where its tiles are few
    # dWg's and dWu's 192 tiles taken in turn by 68 programs beside dx's to 512 tokens (the 132 SMs full with dx's 64
    # programs), one a tile where not all 68 fit beside dx's (here on 100 SMs) and from 513
    weight_programs = {T: (config(T).gluon_second_launch.weight_grad_programs,
                           config(T, with_lo=False).gluon_second_launch.weight_grad_programs,
                           config(T, max_programs=100).gluon_second_launch.weight_grad_programs)
                       for T in (65, 128, 256, 384, 512, 513, 959)}  # fmt: skip
    assert weight_programs == {65: (68, 68, 0), 128: (68, 68, 0), 256: (68, 68, 0), 384: (68, 68, 0),
                               512: (68, 68, 0), 513: (0, 0, 0), 959: (0, 0, 0)}  # fmt: skip
    assert rows == {65: (64, 64), 129: (64, 64), 512: (64, 64), 1099: (64, 64), 1100: (128, 64), 1399: (128, 64),
                    1400: (128, 64), 2299: (128, 64), 2300: (128, 128), 3300: (128, 64), 4093: (128, 128),
                    4600: (128, 128), 8192: (128, 128), 12288: (128, 128)}
    # launch 1's dA tiles 64 wide to 256 tokens, 256 wide at 3600-5199; dWd's tiles in launch 2 at 129-256, 513-1099,
    # 1500-2299 and 3600-5199
    shapes = {T: (config(T).gluon_first_launch.d_a_block_n, config(T).gluon_second_launch.grad_down_tiles)
              for T in (65, 128, 129, 256, 257, 512, 513, 1099, 1100, 1499, 1500, 2299, 2300, 3599, 3600, 5199,
                        5200)}  # fmt: skip
    assert shapes == {65: (64, False), 128: (64, False), 129: (64, True), 256: (64, True), 257: (128, False),
                      512: (128, False), 513: (128, True),
                      1099: (128, True), 1100: (128, False), 1499: (128, False), 1500: (128, True),
                      2299: (128, True), 2300: (128, False), 3599: (128, False), 3600: (256, True),
                      5199: (256, True), 5200: (128, False)}  # fmt: skip
    assert config(1087).gluon_first_launch.buffers == 8 and config(8192).gluon_first_launch.buffers == 6
    # the long tiles first: both launches' to 1399 tokens, launch 1's to 2299, neither beyond
    first = {T: (config(T).gluon_first_launch.d_a_first, config(T).gluon_second_launch.grad_x_first)
             for T in (129, 1099, 1100, 1399, 1400, 2299, 2300, 3300, 8192)}  # fmt: skip
    assert first == {129: (True, True), 1099: (True, True), 1100: (True, True), 1399: (True, True),
                     1400: (True, False), 2299: (True, False), 2300: (False, False), 3300: (False, False),
                     8192: (False, False)}


def test_fast_path_takes_forms_of_its_own_at_65_to_512_and_1100_to_2599_tokens():
    """GLUON_FAST_FORMS: at 65-512 tokens the faithful path's forms to 512 tokens with dWd's tiles in launch 2 (dx in 4
    to 128 tokens, in 2 to 192, unsplit beyond; launch 1's dA tiles 64 wide to 384); at 1100-2299 tokens forms with
    dWd's tiles in launch 2 (at 1100-1407 the 2300 band's tiles with launch 1's dA tiles 64 wide, at 1408-1499 the
    1400 band's, at 1500-2299 the 2300 band's), at 2300-2599 the 3600 form (launch 1's dA tiles 256 wide, dWd's tiles
    in launch 2); without the lo halves; the faithful path keeps GLUON_FORMS there. Elsewhere the fast path takes the
    faithful path's form with dx unsplit."""
    from moe_lib.swiglu_down.launch import GLUON_FAST_FORMS, GLUON_FORMS, choose_config, fast_path_on_gluon, gluon_form

    def config(T, with_lo):
        return choose_config(T, 2048, 768, interpreter=False, with_lo=with_lo, max_programs=132)

    for T, faithful_band in ((65, 0), (128, 0), (129, 129), (256, 129), (257, 257), (384, 257), (512, 257),
                             (1100, 1100), (1200, 1100), (1250, 1100), (1321, 1100),
                             (1407, 1400), (1408, 1400), (1499, 1400), (1500, 1500), (1571, 1500), (2299, 1500),
                             (2300, 2300), (2447, 2300), (2599, 2300)):  # fmt: skip
        assert fast_path_on_gluon(T), T
        fast, faithful = config(T, with_lo=False), config(T, with_lo=True)
        assert (faithful.gluon_first_launch, faithful.gluon_second_launch) == GLUON_FORMS[faithful_band], T
        assert not fast.gluon_first_launch.grad_down_tiles and fast.gluon_second_launch.grad_down_tiles, T
        assert fast.gluon_second_launch.grad_x_splits == (4 if T <= 128 else 2 if T <= 192 else 1), T
        assert fast.gluon_as_one_graph, T
        assert (fast.gluon_first_launch, fast.gluon_second_launch) == gluon_form(T, with_lo=False), T
    for T in (65, 128, 129, 192, 193, 384, 385, 512):  # the forms to 512 tokens, dWd's tiles moved
        launch1, launch2 = gluon_form(T, with_lo=False)
        assert launch1.d_a_block_n == (64 if T <= 384 else 128), T
        faithful1, faithful2 = GLUON_FORMS[0 if T <= 128 else 129 if T <= 256 else 257]
        assert launch1 == dataclasses.replace(faithful1, grad_down_tiles=False, d_a_block_n=launch1.d_a_block_n,
                                              block_n=launch1.block_n), T  # fmt: skip
        assert launch2 == dataclasses.replace(faithful2, grad_x_splits=launch2.grad_x_splits, grad_down_tiles=True), T
    assert gluon_form(513, with_lo=False) == (GLUON_FORMS[513][0],
                                              dataclasses.replace(GLUON_FORMS[513][1], grad_x_splits=1))
    assert gluon_form(1100, with_lo=False) == gluon_form(1321, with_lo=False)
    launch1, launch2 = gluon_form(1321, with_lo=False)  # dA's 11 x 12 tiles of 128 x 64: one wave on 132 SMs
    assert (launch1.block_m, launch1.d_a_block_n, launch2.block_m) == (128, 64, 128)
    assert launch2 == dataclasses.replace(GLUON_FORMS[2300][1], grad_down_tiles=True)
    launch1, launch2 = gluon_form(1450, with_lo=False)  # the 1400 band's tiles, dWd moved
    assert launch1 == dataclasses.replace(GLUON_FORMS[1400][0], grad_down_tiles=False)
    assert launch2 == dataclasses.replace(GLUON_FORMS[1400][1], grad_down_tiles=True)
    assert gluon_form(1571, with_lo=False)[1] == dataclasses.replace(GLUON_FORMS[2300][1], grad_down_tiles=True)
    assert gluon_form(2447, with_lo=False) == GLUON_FORMS[3600]
    assert gluon_form(2600, with_lo=False) == GLUON_FORMS[2300]  # the faithful path's form again from 2600
    assert fast_path_on_gluon(1099) and fast_path_on_gluon(1100) and not fast_path_on_gluon(3300)
    bands = sorted(GLUON_FAST_FORMS, key=lambda band: band.start)
    gaps = [(a.stop, b.start) for a, b in zip(bands, bands[1:], strict=False) if a.stop != b.start]
    assert gaps == [(513, 1100)] and all(a.stop <= b.start for a, b in zip(bands, bands[1:], strict=False))


def test_design_by_token_count():
    """The fast path on cuBLAS GEMMs from LIBRARY_GEMMS_MIN_TOKENS on, with 16-bit inputs on a GPU only, but in
    GLUON_FAST_TOKENS on the Gluon launches where they run; the Triton designs below, with fp32 inputs, under the
    interpreter and on the faithful path."""
    from moe_lib.swiglu_down.launch import (
        GLUON_FAST_TOKENS,
        LIBRARY_GEMMS_16BIT_DA_MIN_TOKENS,
        LIBRARY_GEMMS_MEMCPY_STACK_MIN_TOKENS,
        LIBRARY_GEMMS_MIN_TOKENS,
        choose_config,
        choose_design,
    )
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    first = LIBRARY_GEMMS_MIN_TOKENS["fast"]
    memcpy = LIBRARY_GEMMS_MEMCPY_STACK_MIN_TOKENS
    assert first == GLUON_FAST_TOKENS[0].start  # where the Gluon launches run, the fast path takes them first
    for T in [T for band in GLUON_FAST_TOKENS for T in (band.start, band.start + 1, band.stop - 1)]:
        design = choose_design(T, 2048, 768, interpreter=False, max_programs=132)
        assert design == choose_config(T, 2048, 768, interpreter=False, max_programs=132), T
        assert design.gluon_first_launch is not None and design.gluon_second_launch is not None, T
    for T, gluon in ((first, False), (first + 1, False), (1023, False), (1024, False), (memcpy - 1, False),
                     (memcpy, False), (1200, False), (1249, False), (2300, False), (GLUON_FAST_TOKENS[0].stop, True),
                     (GLUON_FAST_TOKENS[1].stop, True), (8192, True)):  # fmt: skip
        design = choose_design(T, 2048, 768, interpreter=False, max_programs=132, gluon=gluon)
        assert isinstance(design, LibraryGemmsConfig) and design.streams and design.stack_aside, T
        assert design.d_a_fp32 == (T < LIBRARY_GEMMS_16BIT_DA_MIN_TOKENS), T
        assert design.stack_by_memcpy == (T >= memcpy), T
    assert "faithful" not in LIBRARY_GEMMS_MIN_TOKENS  # its host work would show in NVIDIA's method
    for T, kwargs in ((first - 1, {}), (8192, dict(element_bytes=4)), (8192, dict(interpreter=True)),
                      (1, dict(with_lo=True)), (1087, dict(with_lo=True)), (8192, dict(with_lo=True))):  # fmt: skip
        args = dict(interpreter=False, max_programs=132) | kwargs
        assert choose_design(T, 2048, 768, **args) == choose_config(T, 2048, 768, **args), (T, kwargs)


# ---------------------------------------------------------------------------------------------
# GPU


def odd_token_counts():
    return [3, 100, 999, 5000, 12288]


ELEMENT_RULE = problems.load("swiglu_down_backward").element_rule


def check_against_float64(inputs: dict, got, precision: str) -> None:
    """Every output finite and within its rule of the float64 reference: "faithful" the benchmark's
    element rule and at most the careful PyTorch bf16 error; "fast" at most 2× that error + 1e-4."""
    want = float64_reference(inputs)
    yardstick = careful_pytorch_errors(inputs, want)
    for name, g, w, y in zip(OUTPUTS, got, want, yardstick, strict=True):
        result = compare_output(g, w, ELEMENT_RULE)
        assert result["finite"], f"{name}: NaN/Inf (an unwritten element?)"
        error = result["rel_error"]
        if precision == "faithful":
            assert result["pass_fraction"] >= ELEMENT_RULE["required_fraction"], f"{name}: {result}"
            assert error <= y + 1e-4, f"{name}: {error:.3g} vs careful PyTorch {y:.3g}"
        else:
            assert error <= 2 * y + 1e-4, f"{name}: {error:.3g} vs careful PyTorch {y:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", problems.load("swiglu_down_backward").suite + odd_token_counts())
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_accuracy_at_both_input_scales(T, distribution, precision, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    poison_allocator("cuda", 256 * 2**20)
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", validate=False, precision=precision)
    check_against_float64(inputs, got, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 200, 1000])
def test_gpu_one_launch_path(T, seed):
    """The one-launch path (its grid barrier runs only on a GPU); at 200 and 1000 tokens every phase loops
    over several token blocks."""
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton
    from moe_lib.swiglu_down.one_launch import OneLaunchConfig

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    poison_allocator("cuda", 256 * 2**20)
    got = swiglu_down_backward_triton(*inputs.values(), config=OneLaunchConfig(block_t=64))
    check_against_float64(inputs, got, "faithful")


@pytest.mark.gpu
def test_gpu_one_launch_grid_larger_than_the_sms_is_refused(seed):
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton
    from moe_lib.swiglu_down.one_launch import OneLaunchConfig

    inputs = problems.make_inputs("swiglu_down_backward", 4, seed=seed, device="cuda")
    too_many = OneLaunchConfig(block_i=16, block_h_down=8, block_h=16)  # 48 + 256 programs in phase 1
    with pytest.raises(ValueError, match="config: the one-launch grid"):
        swiglu_down_backward_triton(*inputs.values(), config=too_many)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 128, 1087, 8192])
def test_gpu_deterministic(T, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    first = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    second = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    for name, a, b in zip(OUTPUTS, first, second, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 512, 3089])
def test_gpu_cuda_graph_replay_with_new_inputs(T, seed):
    from moe_lib.bench.timing import capture

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    static = {k: v.clone() for k, v in inputs.items()}
    graph, outputs = capture(lambda: moe_lib.swiglu_down_backward(*static.values(), impl="triton", validate=False))
    fresh = problems.make_inputs("swiglu_down_backward", T, seed=seed + 1, device="cuda")
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    eager = moe_lib.swiglu_down_backward(*fresh.values(), impl="triton")
    for name, g, e in zip(OUTPUTS, outputs, eager, strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 128, 300])  # the few-token launches, the Gluon launches' split counters
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_captured_graph_zeroes_no_counters(T, precision, seed, tmp_path):
    """Captured after an eager call on another stream (as :func:`moe_lib.bench.timing.capture` does), the graph holds
    the call's kernels and no memset (its counters are the ones that call zeroed), and its replays give the eager
    call's bits."""
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # (its nodes kept for debug_dump)
    graph.enable_debug_mode()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outputs = moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    graph.debug_dump(str(tmp_path / "graph.dot"))
    nodes = (tmp_path / "graph.dot").read_text().upper()
    assert "KERNEL" in nodes and "MEMSET" not in nodes, nodes[:2000]
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    eager = moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    for name, g, e in zip(OUTPUTS, outputs, eager, strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [40, 300, 2447])  # the fast path's few-token launch, Gluon launches, cuBLAS design
def test_gpu_layer_bf16_against_autograd(T, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    leaves = [inputs[k].clone().requires_grad_() for k in ("x", "gate_weight", "up_weight", "down_weight")]
    y = moe_lib.swiglu_expert(*leaves)
    y.backward(inputs["grad_output"])
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(("x", "gate_weight", "up_weight", "down_weight"), leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 3e-2, name


# ---------------------------------------------------------------------------------------------
# the layer's elementwise step (kernels.swiglu_activation_kernel)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _activation_inputs(shape, dtype, seed, device):
    generator = torch.Generator(device=device).manual_seed(seed)
    gate = 4 * torch.randn(shape, generator=generator, device=device)
    edges = torch.tensor([-200.0, 200.0, 0.0, -0.0], device=device)  # exp(−gate) overflows; σ = 0, 1, ½
    gate.view(-1)[: min(4, gate.numel())] = edges[: gate.numel()]
    up = torch.randn(shape, generator=generator, device=device)
    return gate.to(dtype), up.to(dtype)


def check_activation(got, gate, up, *, exact: bool):
    """σ, silu and the intermediate against the layer's PyTorch ops (api._swiglu_saved): 16-bit inputs
    bitwise under the interpreter and within one unit in the last place on ≤ 0.1% of the elements on the
    GPU (CUDA's exp beside PyTorch's); fp32 within 1e-6 relative."""
    from moe_lib.swiglu_down.api import _swiglu_saved

    for name, g, w in zip(("gate_sigmoid", "gate_silu", "intermediate"), got, _swiglu_saved(gate, up), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"{name}: NaN/Inf (an unwritten element?)"
        if g.dtype == torch.float32:
            assert rel_error(g, w) <= 1e-6, name
        elif exact:
            assert torch.equal(g, w), name
        else:
            ulp = torch.finfo(g.dtype).eps * w.float().abs().clamp_min(torch.finfo(g.dtype).tiny)
            differ = g != w
            assert differ.float().mean() <= 1e-3, name
            assert ((g.float() - w.float()).abs() <= ulp)[differ].all(), name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (37, 53), (3, 1024), (5, 700)])
def test_activation_rounds_as_the_layers_forward(dtype, shape, seed, monkeypatch):
    from moe_lib.swiglu_down import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(launch, "allocate", _poisoned)
    gate, up = _activation_inputs(shape, dtype, seed, device)
    saved = launch.swiglu_activation(gate, up, with_saved=True)
    check_activation(saved, gate, up, exact=not torch.cuda.is_available())
    intermediate = launch.swiglu_activation(gate, up, with_saved=False)
    assert torch.equal(intermediate, saved[2])


@needs_triton
def test_activation_of_no_elements():
    from moe_lib.swiglu_down.launch import swiglu_activation

    device = "cuda" if torch.cuda.is_available() else "cpu"
    empty = torch.empty((0, 16), dtype=torch.bfloat16, device=device)
    assert [t.shape for t in swiglu_activation(empty, empty, with_saved=True)] == [(0, 16)] * 3


@needs_triton
def test_layer_runs_the_elementwise_step_in_one_launch_each_way(seed, monkeypatch):
    """The Triton layer's forward and backward each take σ, silu and the intermediate from the one launch,
    never from PyTorch's eager ops."""
    from moe_lib.swiglu_down import api, launch

    calls = []
    real = launch.swiglu_activation
    monkeypatch.setattr(launch, "swiglu_activation", lambda *a, **k: calls.append(k["with_saved"]) or real(*a, **k))

    def no_eager(*args):
        raise AssertionError("the Triton layer ran the eager elementwise ops")

    monkeypatch.setattr(api, "_swiglu_saved", no_eager)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs("swiglu_down_backward", 7, seed=seed, device=device, dtype=torch.float32,
                                  hidden_size=40, intermediate_size=24)  # fmt: skip
    leaves = [inputs[k].clone().requires_grad_() for k in ("x", "gate_weight", "up_weight", "down_weight")]
    y = moe_lib.swiglu_expert(*leaves, impl="triton")
    y.backward(inputs["grad_output"])
    assert calls == [False, True]
    monkeypatch.undo()
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(("x", "gate_weight", "up_weight", "down_weight"), leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_activation_at_the_layers_sizes(dtype, seed):
    from moe_lib.swiglu_down import launch

    poison_allocator("cuda", 256 * 2**20)
    gate, up = _activation_inputs((8192, 768), dtype, seed, "cuda")
    check_activation(launch.swiglu_activation(gate, up, with_saved=True), gate, up, exact=False)


# ---------------------------------------------------------------------------------------------
# the launches fed by TMA (tma_launches.py)

TMA_LAUNCHES = {"first": (True, False), "second": (False, True), "both": (True, True),
                "both, one tile per program": (True, True)}


def _with_tma_launches(T, H, I, which: str):
    """The two-launch design's tiles for T, with the launches ``which`` names fed by TMA (interpreter-sized
    tiles on the CPU)."""
    import dataclasses

    from moe_lib.swiglu_down.launch import choose_config
    from moe_lib.swiglu_down.tma_launches import TmaFirstLaunchConfig, TmaSecondLaunchConfig

    interpreter = not torch.cuda.is_available()
    base = choose_config(T, H, I, interpreter=interpreter, max_programs=0)  # the two-launch design
    first, second = TMA_LAUNCHES.get(which, (False, False))
    persistent = dict(persistent=which != "both, one tile per program")
    first_config = dataclasses.replace(TmaFirstLaunchConfig.for_interpreter() if interpreter
                                       else TmaFirstLaunchConfig(), **persistent)  # fmt: skip
    second_config = dataclasses.replace(TmaSecondLaunchConfig.for_interpreter() if interpreter
                                        else TmaSecondLaunchConfig(), **persistent)  # fmt: skip
    return dataclasses.replace(base, tma_first_launch=first_config if first else None,
                               tma_second_launch=second_config if second else None)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("T, H, I, dtype, which", [
    (21, 48, 32, torch.bfloat16, "first"), (21, 48, 32, torch.bfloat16, "second"),
    (21, 48, 32, torch.bfloat16, "both"), (1, 40, 24, torch.bfloat16, "both"), (13, 40, 24, torch.float32, "both"),
    (40, 32, 40, torch.float16, "both"), (21, 48, 32, torch.bfloat16, "both, one tile per program"),
])  # fmt: skip
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_tma_launches_match_float64(T, H, I, dtype, which, precision, seed, monkeypatch):
    """The outputs with one or both launches fed by TMA (ragged edges on every side, NaN-filled allocations),
    against float64 and against the pointer-based launches (the same products: equal up to summation order)."""
    from moe_lib.swiglu_down import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []

    def spy(name):
        real = getattr(launch, name)
        return lambda *args, **kwargs: calls.append((name, kwargs)) or real(*args, **kwargs)

    for name in ("launch_first_launch_tma", "launch_second_launch_tma"):
        monkeypatch.setattr(launch, name, spy(name))
    monkeypatch.setattr(launch, "allocate", _poisoned)
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=device, dtype=dtype, hidden_size=H,
                                  intermediate_size=I)  # fmt: skip
    got = launch.swiglu_down_backward_triton(*inputs.values(), config=_with_tma_launches(T, H, I, which),
                                             precision=precision)  # fmt: skip
    with_lo = launch.carries_low_halves(dtype, precision)
    expected = [name for name, on in zip(("launch_first_launch_tma", "launch_second_launch_tma"), TMA_LAUNCHES[which],
                                         strict=True) if on]  # fmt: skip
    assert [name for name, _ in calls] == expected and all(k["with_lo"] == with_lo for _, k in calls)
    pointer = launch.swiglu_down_backward_triton(*inputs.values(), config=_with_tma_launches(T, H, I, "none"),
                                                 precision=precision)  # fmt: skip
    want = float64_reference(inputs)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, p, w in zip(OUTPUTS, got, pointer, want, strict=True):
        assert torch.isfinite(g).all(), f"{name}: NaN/Inf (an unwritten element?)"
        assert rel_error(g, w) <= tolerance, name
        # the same products in the same order but for the pointer-based split-K under the interpreter: 16-bit
        # outputs a few roundings apart at most (on the GPU the tensor cores' order within a block differs too)
        same_products = 1e-6 if dtype == torch.float32 else 1e-4 if device == "cpu" else 2e-3
        assert rel_error(g, p) <= same_products, name


@needs_triton
def test_tma_launches_step_aside_where_tma_cannot_address_the_rows(seed, monkeypatch):
    """Rows of H = 33 bf16 elements (66 B) are no 16-byte multiple: the pointer-based launches run instead."""
    from moe_lib.swiglu_down import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("launch_first_launch_tma", "launch_second_launch_tma"):
        monkeypatch.setattr(launch, name, lambda *a, **k: pytest.fail("a TMA launch ran"))
    inputs = problems.make_inputs("swiglu_down_backward", 9, seed=seed, device=device, hidden_size=33,
                                  intermediate_size=24)  # fmt: skip
    got = launch.swiglu_down_backward_triton(*inputs.values(), config=_with_tma_launches(9, 33, 24, "both"))
    for name, g, w in zip(OUTPUTS, got, float64_reference(inputs), strict=True):
        assert rel_error(g, w) <= 2e-2, name


def check_candidate_at_both_scales(candidate: str, T: int, precision: str, seed: int) -> None:
    """A candidate of ``P1_CANDIDATES`` from poisoned memory, at our generator's scale and at the harness's,
    against float64 under its precision's rule."""
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    for distribution in ("forward", "harness"):
        inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
        poison_allocator("cuda", 256 * 2**20)
        got = swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[candidate], precision=precision)
        torch.cuda.synchronize()
        check_against_float64(inputs, got, precision)


def check_deterministic_and_replayed(candidate: str, precision: str, seed: int, T: int = 1087) -> None:
    """Two calls of a candidate bitwise equal; captured in a CUDA graph and replayed on new inputs, the same
    outputs as an eager call."""
    from moe_lib.bench.timing import capture
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    def run(inputs):
        return swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[candidate], precision=precision)

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    for name, a, b in zip(OUTPUTS, run(inputs), run(inputs), strict=True):
        assert torch.equal(a, b), name
    static = {k: v.clone() for k, v in inputs.items()}
    graph, outputs = capture(lambda: run(static))
    fresh = problems.make_inputs("swiglu_down_backward", T, seed=seed + 1, device="cuda")
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    for name, g, e in zip(OUTPUTS, outputs, run(fresh), strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1087, 5000, 8192])
@pytest.mark.parametrize("candidate", ["tma_128", "tma_256", "tma12_a", "tma12_b", "tma12_c", "tma_256_np",
                                       "tma12_b_np"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_tma_launches_at_both_input_scales(T, candidate, precision, seed):
    check_candidate_at_both_scales(candidate, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", ["tma_128", "tma12_a"])
def test_gpu_tma_launches_deterministic_and_replayed_from_a_graph(candidate, seed):
    """The descriptors' scratch memory comes from torch's allocator, so the launches capture in a graph."""
    check_deterministic_and_replayed(candidate, "faithful", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 128, 1087, 2447, 5000, 8192, 12288])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("candidate", ["gluon2", "gluon2_w128", "gluon12_b6_l2m64"])
def test_gpu_gluon_second_launch_at_both_input_scales(T, precision, candidate, seed):
    """Launch 2 in Gluon (one TMA warp, two MMA warpgroups or one with 64-row tiles; its dWg, dWu tiles as wide as
    dx's or half as wide) from poisoned memory, both input scales, within the precision's rule of float64: partial
    tiles along T, I and the ring's last K steps filled with zeros by TMA."""
    check_candidate_at_both_scales(candidate, T, precision, seed)


@pytest.mark.gpu
def test_gpu_gluon_second_launch_deterministic_and_replayed_from_a_graph(seed):
    """The descriptors are built on the host per call and passed by value: a captured graph replays them."""
    check_deterministic_and_replayed("gluon2", "faithful", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 128, 1087, 5000, 8192, 12288])
@pytest.mark.parametrize("candidate", ["lib", "lib_s", "lib_b", "lib_bs", "lib_s2", "lib_bs2", "lib_s3", "lib_bs3",
                                       "lib_bs3_mc", "lib_s3_mc_fl512", "lib_s_gx"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_library_gemms_design_at_both_input_scales(T, candidate, precision, seed):
    check_candidate_at_both_scales(candidate, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", ["lib", "lib_bs", "lib_bs2", "lib_bs3", "lib_bs3_mc", "lib_s_gx"])
def test_gpu_library_gemms_design_deterministic_and_replayed_from_a_graph(candidate, seed):
    """With ``streams`` the capture forks to a second stream and joins it again (with ``stack_aside`` the
    caller's stream also waits for the copy made there, with ``stack_by_memcpy`` two memcpy nodes; with
    ``grad_x_tile`` dx's split-K counters carry over from replay to replay)."""
    check_deterministic_and_replayed(candidate, "fast", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 100, 999, 5000])
@pytest.mark.parametrize("candidate", ["chain_mid8", "chain_f"])
def test_gpu_chained_launch(T, candidate, seed):
    """The chained launch over one to many waves of programs, while a matmul on another stream holds SMs: within
    the element rule at the harness's scale, and the same bits as the two launches with the same tiles, warps
    and stages."""
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    config = P1_CANDIDATES[candidate]
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
    for name, a, b in zip(OUTPUTS, got, two, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_chained_launch_graph_replay_with_new_inputs(seed):
    from moe_lib.bench.timing import capture
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    config = P1_CANDIDATES["chain_f"]
    inputs = problems.make_inputs("swiglu_down_backward", 700, seed=seed, device="cuda")
    static = {k: v.clone() for k, v in inputs.items()}
    graph, outputs = capture(lambda: swiglu_down_backward_triton(*static.values(), config=config))
    fresh = problems.make_inputs("swiglu_down_backward", 700, seed=seed + 1, device="cuda")
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    eager = swiglu_down_backward_triton(*fresh.values(), config=config)
    for name, g, e in zip(OUTPUTS, outputs, eager, strict=True):
        assert torch.equal(g, e), name


def test_library_gemms_grad_down_tile_needs_d_a_tile():
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    with pytest.raises(ValueError, match="config: grad_down_tile .* needs d_a_tile"):
        LibraryGemmsConfig(grad_down_tile=(64, 128, 64, 1))


@pytest.mark.parametrize("fields, message", [(dict(grads_flat_block=96), "power of two, got 96"),
                                             (dict(grads_flat_block=0), "power of two, got 0"),
                                             (dict(grads_flat_block=64, d_a_tile=(64, 64, 64, 1)), "folds")])
def test_library_gemms_config_refuses_what_it_cannot_do(fields, message):
    from moe_lib.swiglu_down.library_gemms import LibraryGemmsConfig

    with pytest.raises(ValueError, match=f"config: .*{message}"):
        LibraryGemmsConfig(**fields)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [17, 128, 1087, 5000])
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("candidate", ["lib_s3_da", "lib_bs_da", "lib_s3_da_dwd", "lib_f_rows"])
def test_gpu_library_gemms_with_triton_d_a(T, distribution, candidate, seed):
    """The design on cuBLAS GEMMs with dA and the dSwiGLU pass as one Triton launch: both paths within their rules,
    from poisoned memory."""
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    for precision in ("faithful", "fast"):
        poison_allocator("cuda", 256 * 2**20)
        got = swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[candidate], precision=precision)
        check_against_float64(inputs, got, precision)




def test_chained_launch_refuses_dwd_first_and_last_at_once():
    import dataclasses

    from moe_lib.swiglu_down import launch

    inputs = problems.make_inputs("swiglu_down_backward", 3, hidden_size=16, intermediate_size=16)
    config = dataclasses.replace(chained_grad_down_last_config(), grad_down_first=True)
    with pytest.raises(ValueError, match="^config: grad_down_first and grad_down_last exclude each other"):
        launch.swiglu_down_backward_triton(*inputs.values(), config=config)


@pytest.mark.gpu
def test_gpu_gluon_second_launch_reuses_one_compiled_kernel_across_token_counts(seed):
    """After the first call launch 2 goes straight to the launcher of the kernel compiled then, its descriptors
    encoded before launch 1: one kernel per device, dtype and precision serves token counts with and without 16 | T,
    each within the rule of float64."""
    from moe_lib.swiglu_down import gluon_launch2

    gluon_launch2.ENCODED_LAUNCHES.clear()
    for T in (128, 1087, 3, 2448):
        check_candidate_at_both_scales("gluon2", T, "faithful", seed + T)
    assert len(gluon_launch2.ENCODED_LAUNCHES) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 128, 1087, 2447, 5000, 8192, 12288])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("candidate", ["gluon12", "gluon12_d64", "gluon12_a256", "gluon12_b6", "gluon12_m64",
                                       "gluon12_m64_l1b8", "gluon12_m64_l2b3", "gluon12_m64_lf", "gluon12_m64_lf_pdl",
                                       "gluon12_l2m64_daf", "gluon12_l2m64_lf", "gluon12_l2m64_lf_pdl",
                                       "gluon12_b6_pdl", "gluon12_b6_pdl_sif", "gluon12_m64_lf_pdl_sif",
                                       "gluon12_a256_sif", "gluon12_m64_lf_pdl_sif_graph", "gluon12_m64_da2_dx2",
                                       "gluon12_m64_da4_dx4", "gluon12_m64_da8_dx4",
                                       "gluon12_m64_lf_pdl_sif_graph_early", "gluon12_b6_pdl_sif_graph_early",
                                       "gluon12_m64_early_dx2", "gluon12_m64_early_dx4", "gluon12_m64_early_dx8",
                                       "gluon12_m64_early_dx1_wp68", "gluon12_m64_early_dx4_wp34",
                                       "gluon12_m64_early_l1k128b4", "gluon12_m64_early_dx1_w128_wp68",
                                       "gluon12_m64_early_dx4_wp68_ibw", "gluon12_m64_early_dx2_wp68_ibw",
                                       "gluon12_m64_early_dx1_wp68_ibw",
                                       "gluon12_m64_lf_pdl_sif_graph_early_ibw", "gluon12_b6_pdl_sif_graph_early_ibw",
                                       "gluon12_b6_l2m64b6_pdl_sif_graph_early_ibw",
                                       "gluon12_m64_early_dx4_wp68_ibw_n64", "gluon12_m64_early_dx4_wp68_ibw_n64d64",
                                       "gluon12_m64_early_dx4_wp68_ibw_n64d64_b12",
                                       "gluon12_m64_early_dx1_wp68_ibw_n64", "gluon_dwd2_from513",
                                       "gluon_dwd2_from1100", "gluon_dwd2_from2300", "gluon_dwd2_from2300_a256",
                                       "gluon_dwd2_from4600_a256_late", "gluon12_m64_early_dx4_wp68_ibw_n32",
                                       "gluon12_m64_early_dx2_wp68_ibw_n32", "gluon_dwd2_from4600_a256_d128",
                                       "gluon_dwd2_from2300_d128", "gluon_dwd2_from513_n64",
                                       "gluon_dwd2_from1400_n64", "gluon_dwd2_from2300_n64", "gluon_dwd2_from1400",
                                       "gluon12_m64_early_dx4_wp68_ibw_n64_dwd2",
                                       "gluon12_m64_early_dx2_wp68_ibw_n64_dwd2",
                                       "gluon12_m64_early_dx1_wp68_ibw_n64_dwd2", "gluon12_m64_early_dx1_wp68_ibw_dwd2",
                                       "gluon_dwd2_from513_dx2"])
def test_gpu_gluon_first_launch_at_both_input_scales(T, precision, candidate, seed):
    """Both launches in Gluon (launch 1: dWd's tiles, as wide as dA's, half as wide or twice, or none of them where
    launch 2 takes them; and dA's with the dSwiGLU epilogue from saved tiles staged in the ring, one or two 128-wide
    halves a tile) from poisoned memory, both input scales, within the precision's rule of float64: partial tiles
    along T and I, the saved tiles' rows beyond T filled with zeros by TMA."""
    check_candidate_at_both_scales(candidate, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 129, 300, 2447, 8192, 12288])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
@pytest.mark.parametrize("candidate", ["gluon_pingpong_from2300", "gluon_pingpong_from3300_d128",
                                       "gluon_pingpong_from2300_b6_f2"])
def test_gpu_gluon_pingpong_first_launch_at_both_input_scales(T, precision, candidate, seed):
    """Launch 1 in the pingpong form (persistent programs, each taking its dA tiles in turn on two warpgroups) from
    poisoned memory, both input scales, within the precision's rule of float64: fewer tiles than programs (1-300
    tokens), one to three tiles a program, odd and even counts (each warpgroup's turn), partial tiles along T."""
    check_candidate_at_both_scales(candidate, T, precision, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [300, 8192])
def test_gpu_gluon_pingpong_deterministic_and_replayed_from_a_graph(T, seed):
    """The pingpong form: bitwise the same outputs call after call, and the same from a replayed CUDA graph on new
    inputs."""
    check_deterministic_and_replayed("gluon_pingpong_from2300", "faithful", seed, T)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 1087])
@pytest.mark.parametrize("candidate", ["gluon12_m64_da4_dx4", "gluon12_m64_da8_dx4", "gluon12_m64_early_dx4",
                                       "gluon12_m64_early_dx4_wp68", "gluon12_m64_early_dx4_wp68_ibw"])
def test_gpu_gluon_split_tiles_deterministic_and_replayed_from_a_graph(candidate, T, seed):
    """dA's and dx's tiles split over programs (the last to arrive sums the partials in split order and runs the
    epilogue): bitwise the same outputs call after call, whichever split arrives last, and the same from a replayed
    CUDA graph on new inputs (the arrival counters carry over from call to call)."""
    check_deterministic_and_replayed(candidate, "faithful", seed, T)


def test_traced_programs_collects_only_gluon_launches_and_does_not_nest():
    """The program-tracing context: calls of designs without Gluon launches (here, on the CPU) append nothing, and it
    refuses to be entered twice."""
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton, traced_programs

    inputs = problems.make_inputs("swiglu_down_backward", 3, seed=0, hidden_size=32, intermediate_size=16)
    with traced_programs() as traces:
        if not torch.cuda.is_available():
            swiglu_down_backward_triton(*inputs.values())
            assert traces == []
        with pytest.raises(RuntimeError, match="already inside"), traced_programs():
            pass
    with traced_programs() as again:  # usable again after the first has ended
        assert again == []


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 2447])
def test_gpu_traced_programs_record_every_program_and_keep_the_results(T, seed):
    """Under traced_programs the default's Gluon launches record one row per program (start ≤ proceed ≤ end on the
    GPU's clock, an SM, a tile kind counted as the programs are), and the call still matches float64."""
    from moe_lib.swiglu_down.gluon_launch2 import TRACE_FIELDS
    from moe_lib.swiglu_down.launch import choose_design, swiglu_down_backward_triton, traced_programs

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    H, I = inputs["x"].shape[1], inputs["gate_weight"].shape[0]
    config = choose_design(T, H, I, interpreter=False, with_lo=True, max_programs=132)
    with traced_programs() as traces:
        for _ in range(2):  # the first call compiles the traced build
            poison_allocator("cuda", 256 * 2**20)
            got = swiglu_down_backward_triton(*inputs.values())
        torch.cuda.synchronize()
    check_against_float64(inputs, got, "faithful")
    assert len(traces) == 2 and set(traces[-1]) == {"launch 1", "launch 2"}
    expected = {"launch 1": (config.gluon_first_launch, H * I // (config.gluon_first_launch.block_m
                                                                  * config.gluon_first_launch.grad_down_block_n)),
                # one row a weight-gradient program: one a tile, or fewer taking the tiles in turn
                "launch 2": (config.gluon_second_launch, config.gluon_second_launch.weight_grad_programs_for(H, I))}
    for name, rows in traces[-1].items():
        launch, weight_tiles = expected[name]
        rows = rows.cpu()
        fields = {field: rows[:, i] for i, field in enumerate(TRACE_FIELDS)}
        assert rows.shape[0] == launch.programs(T, H, I), name
        assert (fields["start_ns"] > 0).all() and (fields["proceed_ns"] >= fields["start_ns"]).all(), name
        assert (fields["end_ns"] >= fields["proceed_ns"]).all(), name
        assert ((fields["sm"] >= 0) & (fields["sm"] < 256)).all(), name
        assert int((fields["kind"] == 0).sum()) == weight_tiles, name


@pytest.mark.gpu
def test_gpu_gluon_launches_as_one_graph_in_eager_calls(seed):
    """With ``gluon_as_one_graph`` an eager call whose kernels are compiled submits both launches as one CUDA graph,
    one kept executable per token count, brought up to each call's inputs: within the rule of float64 on fresh
    inputs every call."""
    from moe_lib import encoded_launch

    encoded_launch.GRAPH_EXECS.clear()
    for T in (200, 200, 1087):  # check_candidate_at_both_scales calls twice: compiled by the first call at the latest
        check_candidate_at_both_scales("gluon12_m64_lf_pdl_sif_graph", T, "faithful", seed + T)
    assert len(encoded_launch.GRAPH_EXECS) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 1321])
def test_gpu_graph_in_eager_calls_back_to_back_each_with_its_own_inputs(T, seed):
    """The default's calls issued one after another with no synchronisation between them, each on inputs of its own:
    the kept executable graph is brought up to a call's arguments while the one before may still run (CUDA applies an
    update to later launches only), so every call's outputs must match float64 on its own inputs."""
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    calls = [problems.make_inputs("swiglu_down_backward", T, seed=seed + i, device="cuda", distribution="harness")
             for i in range(4)]  # fmt: skip
    swiglu_down_backward_triton(*calls[0].values())  # compiled before the calls under test
    torch.cuda.synchronize()
    poison_allocator("cuda", 256 * 2**20)
    outputs = [swiglu_down_backward_triton(*inputs.values()) for inputs in calls]
    torch.cuda.synchronize()
    for inputs, got in zip(calls, outputs, strict=True):
        check_against_float64(inputs, got, "faithful")


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", ["gluon12", "gluon12_a256", "gluon12_m64_l1b8", "gluon12_a256_sif",
                                       "gluon12_m64_lf_pdl_sif", "gluon12_m64_early_dx4_wp68_ibw_n64",
                                       "gluon_dwd2_from513", "gluon_dwd2_from4600_a256", "gluon_dwd2_from2300_n64",
                                       "gluon_dwd2_from1400"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_gluon_first_launch_with_partial_tiles_along_i_and_h(candidate, precision, seed):
    """A shape off the benchmark's (I = 384: the 256-wide dA tiles' right halves wholly beyond I; H = 320: a partial
    dWd row block and a partial K step of dA), from poisoned memory, within the precision's rule of float64."""
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.inputs import make_inputs
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    generator = torch.Generator("cuda").manual_seed(seed)
    sizes = dict(num_tokens=300, hidden_size=320, intermediate_size=384)
    inputs = make_inputs(sizes, torch.bfloat16, "cuda", generator, distribution="harness")
    poison_allocator("cuda", 256 * 2**20)
    got = swiglu_down_backward_triton(*inputs.values(), config=P1_CANDIDATES[candidate], precision=precision)
    torch.cuda.synchronize()
    check_against_float64(inputs, got, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", ["gluon12", "gluon12_a256", "gluon12_m64_l1b8", "gluon12_m64_lf",
                                       "gluon12_m64_lf_pdl", "gluon12_m64_lf_pdl_end", "gluon12_l2m64_lf_pdl",
                                       "gluon12_b6_pdl", "gluon12_b6_pdl_sif", "gluon12_a256_sif",
                                       "gluon12_m64_lf_pdl_sif_graph", "gluon12_l2m64_lf_pdl_sif_graph",
                                       "gluon12_m64_early_dx4_wp68_ibw_n64", "gluon_dwd2_from513",
                                       "gluon_dwd2_from4600_a256", "gluon_dwd2_from2300_n64", "gluon_dwd2_from1400"])
def test_gpu_gluon_first_launch_deterministic_and_replayed_from_a_graph(candidate, seed):
    check_deterministic_and_replayed(candidate, "faithful", seed)


def test_tma_needs_every_input_to_start_on_a_16_byte_boundary():
    from moe_lib.swiglu_down.tma_launches import aligned

    storage = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned(storage, storage[8:])
    assert not aligned(storage, storage[1:]) and not aligned(storage[4:])


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", ["gluon2", "gluon12", "tma12_a", "default"])
def test_gpu_inputs_off_a_16_byte_boundary_take_the_pointer_launches(candidate, seed):
    """An input starting off a 16-byte boundary (a view into a larger tensor) cannot be a TMA operand: the call runs
    the pointer-based Triton launches instead (by default the chained launch, at 1087 tokens), within the rule of
    float64."""
    from moe_lib.bench.tuning import P1_CANDIDATES
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    inputs = problems.make_inputs("swiglu_down_backward", 1087, seed=seed, device="cuda", distribution="harness")
    for name in ("x", "gate_silu"):
        tensor = inputs[name]
        shifted = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device="cuda")[1:].view(tensor.shape)
        inputs[name] = shifted.copy_(tensor)
        assert inputs[name].data_ptr() % 16 != 0
    poison_allocator("cuda", 256 * 2**20)
    config = None if candidate == "default" else P1_CANDIDATES[candidate]
    got = swiglu_down_backward_triton(*inputs.values(), config=config, precision="faithful")
    torch.cuda.synchronize()
    check_against_float64(inputs, got, "faithful")
