"""P1's engine design (``moe_lib/swiglu_down/designs/engine.py``): the fast path as three launches of the grouped
GEMM engine with one expert.

CPU: the engine's plain-Triton twins under the interpreter on small shapes (T of one token, odd, a whole tile and
past it; H and I multiples of 64), Wg and Wu apart (dx's B a pair along K) and as the halves of one buffer (a view),
every output and workspace from NaN-filled memory, against the float64 reference within the fast path's rule; the
two B forms bit for bit; the saved gate_sigmoid and gate_silu read as given (a NaN in one reaches the outputs that
depend on it), so that on the harness's independent saved tensors it follows P1's definition; ``supports``' reasons,
the faithful path refused; the chooser's hook (``choose.ENGINE_FROM``), empty: never chosen; the tiles picked by
the rounds over the SMs; the launches a call makes; the offsets and ones kept on the device; ``p1_tune --peers``.
GPU (``gpu`` marker): the benchmark's shape (H 2048, I 768) at 1, 100, 2767 and 8192 tokens and a larger expert's
(H 4096, I 1536), from poisoned memory, against float64 (our generator's inputs and the harness's); side by side
and in turn, the engine's wide tiles; from a
caller's stream of its own; deterministic and replayed from a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.swiglu_down import choose, runtime
from moe_lib.swiglu_down.backward import allocate_outputs, swiglu_down_backward_triton
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.designs import EngineDesign, Inputs
from moe_lib.swiglu_down.designs.engine import SQUARE, WIDE, one_expert, tiles_beside, tiles_in_turn
from moe_lib.swiglu_down.runtime import INTERPRETER_DEVICE, Device

from .helpers import DEVICE, OUTPUTS, check_against_float64

ROOT = Path(__file__).resolve().parents[2]
H200 = Device("cuda", 132, 232448, (9, 0), "H200")
A100 = Device("cuda", 108, 166912, (8, 0), "A100")
CPU = Device("cpu", sms=1, shared_memory=0)
BF16 = torch.bfloat16


def engine_runs_here() -> bool:
    """The interpreter (the engine's Triton twins), or a Hopper GPU (its Gluon kernels)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0] == 9
    return interpreter_enabled()


needs_engine = pytest.mark.skipif(not engine_runs_here(), reason="needs the Triton interpreter or a Hopper GPU")


def engine_inputs(T: int, H: int, I: int, seed: int, *, fused: bool = False, distribution: str = "forward") -> dict:
    """P1's inputs at this shape; ``fused``: Wg and Wu the two row halves of one [2I, H] buffer."""
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        hidden_size=H,
        intermediate_size=I,
        distribution=distribution,
    )
    if fused:
        gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
        inputs |= dict(gate_weight=gate_up[:I], up_weight=gate_up[I:])
    return inputs


def engine_call(inputs: dict, design: EngineDesign | None = None):
    return swiglu_down_backward_triton(*inputs.values(), config=design or EngineDesign(), precision="fast")


# (T, H, I): one token; odd token counts, within one 64-row tile of the twins and past it; a whole tile; H and I
# each one and two K steps of 64 (dA's K = H, the pair's halves K = I)
SMALL = [(1, 64, 64), (37, 64, 128), (64, 128, 64), (130, 128, 128)]


@needs_engine
@pytest.mark.parametrize("beside", [True, False], ids=["beside", "in_turn"])
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("T, H, I", SMALL)
def test_small_shapes_match_float64(T, H, I, fused, beside, seed, poisoned):
    """Through the call with the design as ``config``: every output written (NaN-filled allocations), within the fast
    path's rule of float64 (at most twice the careful bf16 PyTorch's error), the weight gradients the row halves of
    one buffer. (On the CPU both forms launch in turn: a second stream is CUDA's.)"""
    inputs = engine_inputs(T, H, I, seed, fused=fused)
    got = engine_call(inputs, EngineDesign(beside=beside))
    check_against_float64(inputs, got, "fast")
    assert got[2].data_ptr() == got[1].data_ptr() + got[1].numel() * got[1].element_size()


@needs_engine
def test_gate_up_as_one_buffer_or_apart_gives_the_same_bits(seed):
    """dx's B as a [1, 2I, H] view of a fused gate-up weight or as the pair (Wg, Wu) along K: the same K steps in
    the same order."""
    apart = engine_inputs(37, 64, 128, seed)
    gate_up = torch.cat([apart["gate_weight"], apart["up_weight"]])
    fused = apart | dict(gate_weight=gate_up[:128], up_weight=gate_up[128:])
    for name, a, b in zip(OUTPUTS, engine_call(apart), engine_call(fused), strict=True):
        assert torch.equal(a, b), name


def check_saved_tensors_are_read(inputs: dict) -> None:
    """A NaN at (row 5, column 7) of gate_sigmoid reaches dG[5, 7], so dx's row 5 and dWg's row 7 and nothing else;
    one in gate_silu dU[5, 7], so dx's row 5 and dWu's row 7: each saved tensor read, at its own element."""
    clean = engine_call(inputs)
    for name, reached in (("gate_sigmoid", "grad_gate_weight"), ("gate_silu", "grad_up_weight")):
        saved = inputs[name].clone()
        saved[5, 7] = float("nan")
        got = dict(zip(OUTPUTS, engine_call(inputs | {name: saved}), strict=True))
        for output, want in zip(OUTPUTS, clean, strict=True):
            row = {"grad_x": 5, reached: 7}.get(output)
            if row is None:  # an output the saved tensor does not feed: the same bits
                assert torch.equal(got[output], want), (name, output)
                continue
            nan_rows = got[output].isnan().any(1).nonzero().flatten().tolist()
            assert nan_rows == [row] and got[output][row].isnan().all(), (name, output, nan_rows)


@needs_engine
def test_saved_sigmoid_and_silu_are_read(seed):
    check_saved_tensors_are_read(engine_inputs(37, 64, 128, seed, distribution="harness"))


@needs_engine
@pytest.mark.parametrize("T, H, I", [(1, 64, 128), (130, 64, 128), (64, 128, 64)])
def test_harness_inputs_match_float64(T, H, I, seed, poisoned):
    """On the harness's independent std-1 saved tensors (gate_sigmoid and gate_silu not those of the gate): P1's
    definition, within the fast path's rule of float64."""
    inputs = engine_inputs(T, H, I, seed, distribution="harness")
    check_against_float64(inputs, engine_call(inputs), "fast")


# (call (T, H, I, dtype, device, aligned), its reason or None)
REASONS = [
    ((8192, 2048, 768, BF16, H200, True), None),
    ((1, 64, 64, BF16, INTERPRETER_DEVICE, True), None),
    ((100, 2048, 768, torch.float16, H200, True), "the engine's operands are bfloat16, got torch.float16"),
    ((100, 64, 64, torch.float32, INTERPRETER_DEVICE, True), "the engine's operands are bfloat16, got torch.float32"),
    (
        (100, 2048, 768, BF16, A100, True),
        "the engine's Gluon kernels need a Hopper GPU (sm_90), or the interpreter for their Triton twins",
    ),
    (
        (100, 2048, 768, BF16, CPU, True),
        "the engine's Gluon kernels need a Hopper GPU (sm_90), or the interpreter for their Triton twins",
    ),
    ((100, 2000, 768, BF16, H200, True), "H = 2000: the engine's [E, K, N] operands take multiples of 64"),
    ((100, 2048, 800, BF16, H200, True), "I = 800: the engine's [E, K, N] operands take multiples of 64"),
    ((100, 2048, 768, BF16, H200, False), "TMA needs every operand to start on a 16-byte boundary"),
    ((0, 2048, 768, BF16, H200, True), "no tokens: the engine's products need at least one row"),
]


@pytest.mark.parametrize("call, reason", REASONS)
def test_supports_reasons_by_value(call, reason):
    *shape, aligned = call
    assert EngineDesign().supports(*shape, aligned=aligned) == reason


@needs_engine
def test_faithful_path_is_refused(seed):
    """The engine's epilogue has no hi/lo halves: asked for the faithful path, the design raises, it does not compute
    the fast path's outputs instead."""
    inputs = engine_inputs(5, 64, 64, seed)
    message = r"^with_lo: the engine design runs the fast path only .* call it with precision='fast'$"
    with pytest.raises(ValueError, match=message):
        swiglu_down_backward_triton(*inputs.values(), config=EngineDesign(), precision="faithful")
    out = allocate_outputs(inputs["x"], 64)
    with pytest.raises(ValueError, match=message):
        EngineDesign().run(Inputs(*inputs.values()), with_lo=True, out=out)


TOKENS = [1, 64, 65, 128, 129, 999, 1000, 2767, 8192]


def test_chooser_takes_the_engine_only_from_a_measured_token_count(monkeypatch):
    """With ``ENGINE_FROM`` empty (nothing measured yet) no call gets the engine; with an entry, the fast path of
    that shape class on that SM count from that many tokens (beyond the few-token band), never the faithful path,
    fp16 or another class."""
    calls = [
        (T, H, I, dtype, precision, device)
        for T in TOKENS
        for H, I in ((2048, 768), (4096, 1536))
        for dtype in (BF16, torch.float16)
        for precision in ("fast", "faithful")
        for device in (H200, A100, INTERPRETER_DEVICE)
    ]

    def chosen():
        choose_design.cache_clear()
        return {call: choose_design(*call[:3], dtype=call[3], precision=call[4], device=call[5]).name for call in calls}

    assert choose.ENGINE_FROM == {}
    assert EngineDesign.name not in set(chosen().values())
    monkeypatch.setitem(choose.ENGINE_FROM, (2048, 768, 132), 1000)
    try:
        engine = {call for call, name in chosen().items() if name == EngineDesign.name}
    finally:
        monkeypatch.undo()
        choose_design.cache_clear()
    assert engine == {(T, 2048, 768, BF16, "fast", H200) for T in TOKENS if T >= 1000}


def test_tiles_one_after_the_other_by_their_rounds_over_the_sms():
    """At the benchmark's shape on 132 SMs: dx in 128 × 256 tiles where their rounds are as few (8192 tokens: 4 of
    512 tiles; 1087: one of 72), in 128 × 128 where they are fewer (2767: 176 tiles of 128 × 256 take 2 rounds, 352 of
    128 × 128 take 3 of half the work); the weight gradients always in 128 × 128 (144 tiles of 128 × 256 take two
    rounds, 288 of 128 × 128 three of half the work). A config's tiles are its own."""
    assert WIDE.tiles(2 * 768, 2048) + WIDE.tiles(2048, 768) == 144
    assert SQUARE.tiles(2 * 768, 2048) + SQUARE.tiles(2048, 768) == 288
    assert tiles_in_turn(8192, 2048, 768, 132) == (WIDE, SQUARE)
    assert tiles_in_turn(2767, 2048, 768, 132) == (SQUARE, SQUARE)
    assert tiles_in_turn(1087, 2048, 768, 132) == (WIDE, SQUARE)
    assert EngineDesign(beside=False).tiles(2767, 2048, 768, 132) == (SQUARE, SQUARE)
    wide = EngineDesign(beside=False, grad_x_tiles=WIDE, weight_grad_tiles=WIDE)
    assert wide.tiles(2767, 2048, 768, 132) == (WIDE, WIDE)


def tiles_and_programs(config):
    return config.block_m, config.block_n, config.programs


def test_tiles_side_by_side_split_the_sms():
    """At the benchmark's shape from 512 tokens the weight gradients' 144 tiles of 128 × 256 on 72 SMs (two whole
    rounds, each tile K = T long) and dx on the others, as few programs as take its rounds: 8192 tokens, 512 tiles
    of 128 × 256 in 9 rounds of 57 programs; 2767, 176 in 3 rounds of 59; 1087, 144 of 128 × 128 in 3 rounds of
    48. Together never more programs than SMs, at model shapes and SM counts; tiles named by the config kept, only
    their programs chosen."""
    wide_72 = (128, 256, 72)
    assert [tiles_and_programs(c) for c in tiles_beside(8192, 2048, 768, 132)] == [(128, 256, 57), wide_72]
    assert [tiles_and_programs(c) for c in tiles_beside(2767, 2048, 768, 132)] == [(128, 256, 59), wide_72]
    assert [tiles_and_programs(c) for c in tiles_beside(1087, 2048, 768, 132)] == [(128, 128, 48), wide_72]
    for T in (1, 64, 512, 1087, 2767, 8192, 16384):
        for H, I in ((2048, 768), (4096, 1536), (7168, 2048)):
            for sms in (2, 72, 132, 144):  # 72 and 144: the 144 wide weight-gradient tiles in whole rounds of all SMs
                grad_x, weight_grads = EngineDesign().tiles(T, H, I, sms)
                assert 1 <= grad_x.programs and 1 <= weight_grads.programs
                assert grad_x.programs + weight_grads.programs <= sms, (T, H, I, sms)
    square_dx = EngineDesign(grad_x_tiles=SQUARE, weight_grad_tiles=SQUARE).tiles(8192, 2048, 768, 132)
    assert [(c.block_m, c.block_n) for c in square_dx] == [(128, 128), (128, 128)]
    assert EngineDesign().tiles(8192, 2048, 768, 1) == tiles_in_turn(8192, 2048, 768, 1)  # one SM: in turn


@pytest.mark.parametrize("beside", [True, False])
def test_a_call_makes_three_launches_on_one_dgate_dup_buffer(beside, seed):
    """dswiglu writes [dG | dU] as the column halves of one [T, 2I] buffer, which dx reads as A over K = 2I and the
    weight-gradient launch as its first product's A; that launch writes [dWg; dWu] and dWd in place (views of the
    outputs), side by side with dx on the second stream (launched first) or after it; dA's B is Wd as it lies; the
    scale is ones. No launch is made here."""
    T, H, I = 37, 64, 128
    inputs = Inputs(*engine_inputs(T, H, I, seed).values())
    out = allocate_outputs(inputs.x, I)
    calls = EngineDesign(beside=beside).calls(inputs, out, sms=132)
    assert [(call.kind, call.side) for call in calls] == (
        [("gemm", False), ("weight_grad", True), ("gemm", False)]
        if beside
        else [("gemm", False), ("gemm", False), ("weight_grad", False)]
    )
    d_a = calls[0]
    grad_x, weight_grads = (calls[2], calls[1]) if beside else (calls[1], calls[2])
    d_gate_up = grad_x.arguments["a"]
    assert d_gate_up.shape == (T, 2 * I)
    assert d_a.arguments["dgate_out"].data_ptr() == d_gate_up.data_ptr()
    assert d_a.arguments["dup_out"].data_ptr() == d_gate_up[:, I:].data_ptr()
    assert d_a.arguments["epilogue"] == "dswiglu" and d_a.arguments["b"].shape == (1, H, I)
    assert d_a.arguments["gate"] is inputs.gate and d_a.arguments["up"] is inputs.up
    assert d_a.arguments["gate_sigmoid"] is inputs.gate_sigmoid and d_a.arguments["gate_silu"] is inputs.gate_silu
    assert torch.equal(d_a.arguments["scale"], torch.ones(T, device=inputs.x.device))
    assert grad_x.arguments["out"] is out.grad_x
    assert [b.shape for b in grad_x.arguments["b"]] == [(1, I, H)] * 2  # Wg, Wu apart: the pair along K
    (a0, b0), (a1, b1) = weight_grads.arguments["problems"]
    assert a0 is d_gate_up and b0 is inputs.x and a1 is inputs.grad_output and b1 is inputs.intermediate
    grad_gate_up, grad_down = weight_grads.arguments["outs"]
    assert grad_gate_up.shape == (1, 2 * I, H) and grad_gate_up.data_ptr() == out.grad_gate_weight.data_ptr()
    assert grad_down.shape == (1, H, I) and grad_down.data_ptr() == out.grad_down_weight.data_ptr()
    offsets = d_a.arguments["offsets"]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, T]
    assert grad_x.arguments["offsets"] is offsets is weight_grads.arguments["offsets"]
    programs = grad_x.arguments["config"].programs + weight_grads.arguments["config"].programs
    assert (0 < programs <= 132) if beside else programs == 0


def test_offsets_and_ones_are_made_once_and_kept():
    """One expert of T rows: offsets [0, T] kept per token count, ones sliced from buffers of power-of-two lengths,
    each kept (a CUDA graph captured with one reads it on every replay)."""
    device = torch.device("cpu")
    offsets, ones = one_expert(1000, device)
    assert offsets.tolist() == [0, 1000] and ones.shape == (1000,) and bool((ones == 1).all())
    again, fewer = one_expert(1000, device)[0], one_expert(600, device)[1]
    assert again is offsets and fewer.data_ptr() == ones.data_ptr() and fewer.shape == (600,)
    assert one_expert(1, device)[0].tolist() == [0, 1]


def test_p1_tune_peers_are_named_and_checked():
    """``p1_tune.py --peers``: P1's peers of the benchmark beside the candidates (torch_compile for the engine's A/B),
    each once; an unknown one is named (before any GPU work)."""
    sys.path.insert(0, str(ROOT / "scripts" / "p1"))
    try:
        from p1_tune import peer_names
    finally:
        sys.path.remove(str(ROOT / "scripts" / "p1"))
    assert peer_names(None) == [] and peer_names("torch_compile, torch_eager,torch_compile") == [
        "torch_compile",
        "torch_eager",
    ]
    with pytest.raises(ValueError, match=r"^unknown peer\(s\) \['triton_fast'\]"):
        peer_names("triton_fast")


# ---------------------------------------------------------------------------------------------
# GPU: the Gluon kernels on a Hopper GPU


def check_on_the_gpu(T: int, H: int, I: int, seed: int, design: EngineDesign | None = None) -> None:
    """From poisoned memory, within the fast path's rule of float64: on our generator's inputs (the saved tensors the
    forward's) and on the harness's (gate_sigmoid and gate_silu drawn apart from the gate)."""
    from moe_lib.bench.timing import poison_allocator

    for distribution in ("forward", "harness"):
        inputs = engine_inputs(T, H, I, seed, distribution=distribution)
        poison_allocator("cuda", 256 * 2**20)
        got = engine_call(inputs, design)
        torch.cuda.synchronize()
        check_against_float64(inputs, got, "fast")


@pytest.mark.gpu
@pytest.mark.parametrize("beside", [True, False], ids=["beside", "in_turn"])
@pytest.mark.parametrize("T", [1, 100, 2767, 8192])
def test_gpu_engine_at_the_benchmarks_shape(T, beside, seed, poisoned):
    assert EngineDesign().supports(T, 2048, 768, BF16, runtime.device_of(torch.empty(1, device="cuda"))) is None
    check_on_the_gpu(T, 2048, 768, seed, EngineDesign(beside=beside))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 777, 4096])
def test_gpu_engine_at_a_larger_experts_shape(T, seed, poisoned):
    """H 4096, I 1536: two more K steps per product, 12 column tiles of dA, 192 + 96 weight-gradient tiles of
    128 × 256."""
    check_on_the_gpu(T, 4096, 1536, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 2767])
def test_gpu_engine_with_the_wide_tiles_and_a_fused_gate_up_weight(T, seed, poisoned):
    """The engine's 128 × 256 tiles for dx and the weight gradients one after the other (``engine_wide``); Wg and Wu
    as the halves of one buffer give the same bits as apart."""
    check_on_the_gpu(T, 2048, 768, seed, EngineDesign(beside=False, grad_x_tiles=WIDE, weight_grad_tiles=WIDE))
    apart = engine_inputs(T, 2048, 768, seed)
    gate_up = torch.cat([apart["gate_weight"], apart["up_weight"]])
    fused = apart | dict(gate_weight=gate_up[:768], up_weight=gate_up[768:])
    for name, a, b in zip(OUTPUTS, engine_call(apart), engine_call(fused), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
def test_gpu_engine_side_by_side_from_a_callers_stream_of_its_own(seed):
    """Called on a stream other than the default one, while that stream still runs a long matmul: the second stream
    forks from the caller's (after the matmul and dA) and the caller's waits for it; the same bits as a call on the
    default stream."""
    inputs = engine_inputs(2767, 2048, 768, seed)
    want = engine_call(inputs)
    big = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        busy = big @ big
        got = engine_call(inputs)
        done = [g.clone() for g in got]  # on the caller's stream: after the join
    torch.cuda.synchronize()
    assert torch.isfinite(busy).all()
    for name, a, b in zip(OUTPUTS, done, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 2767])
def test_gpu_engine_reads_the_saved_sigmoid_and_silu(T, seed):
    check_saved_tensors_are_read(engine_inputs(T, 2048, 768, seed, distribution="harness"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["engine", "engine_in_turn", "engine_wide"])
@pytest.mark.parametrize("T", [1087, 8192])
def test_gpu_engine_deterministic_and_replayed_from_a_graph(name, T, seed):
    """Two calls bitwise equal; captured in a CUDA graph (the offsets and ones kept from the eager calls; side by
    side, the second stream forked and joined in the capture) and replayed on new inputs, the outputs of an eager
    call."""
    from .test_designs import check_deterministic_and_replayed

    check_deterministic_and_replayed(name, "fast", seed, T)
