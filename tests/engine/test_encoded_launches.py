"""The grouped engine's launches through Triton's JIT or through encoded launches (``gluon_gemm.ENCODED_LAUNCHES``,
``moe_lib.encoded_launch.KernelLaunches``): on the CPU, the switch, the compile keys of the engine's arguments, one
descriptor per tensor, and the trusted callers' unchecked sizes against the checks' own; on a Hopper GPU (``gpu``),
every epilogue of ``grouped_gemm`` and ``grouped_weight_grad`` (plain, gathered, bf16 and fp32 out) bit for bit the
same through both paths, on fresh tensors each call (the encoded arguments never stale), and captured in a CUDA
graph."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_encoded_launch import StandInCompiled, StandInJit  # the JIT and its compiled kernel, stood in

from moe_lib import encoded_launch
from moe_lib.encoded_launch import KernelLaunches
from moe_lib.engine import gluon_gemm
from moe_lib.engine import grouped_gemm as gemm_module
from moe_lib.engine import grouped_wgrad as wgrad_module
from moe_lib.engine.gathered import Gathered
from moe_lib.engine.gluon_gemm import launch_kernel
from moe_lib.engine.grouped_gemm import DSWIGLU_CONFIG, default_config, grouped_gemm, held_transposed, partial_rows
from moe_lib.engine.grouped_wgrad import grouped_weight_grad, unchecked_sizes

ROOT = Path(__file__).resolve().parents[2]
I32 = torch.int32


def offsets_of(counts, device="cpu"):
    """int32 [E + 1]: the exclusive prefix of the experts' row counts, then M_total."""
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=I32, device=device)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


# --- the host logic -------------------------------------------------------------------------------------------------


def test_the_switch_takes_the_jit_path_or_the_kept_encoded_launches(monkeypatch):
    monkeypatch.setattr(encoded_launch, "EncodedLaunch", StandInCompiled)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    kernel = StandInJit()
    launches = KernelLaunches(kernel)
    device = torch.device("cuda", 0)
    x = torch.empty(64, dtype=torch.bfloat16)
    arguments, constexprs = dict(x_ptr=x, n=32), dict(BLOCK=64, num_warps=8)
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", False)
    for _ in range(2):
        launch_kernel(launches, 4, arguments, constexprs, maxnreg=168, device=device)
    assert kernel.calls == [((4,), dict(x_ptr=x, n=32, BLOCK=64, num_warps=8, maxnreg=168))] * 2
    assert not launches.compiled  # the JIT's own cache only
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", True)
    for _ in range(3):
        launch_kernel(launches, 4, arguments, constexprs, maxnreg=168, device=device)
    assert len(kernel.calls) == 3  # the first call of the key compiled (here: found) by the JIT
    (encoded,) = launches.compiled.values()
    assert encoded.launches == [(4, ["encoded", x, 32, 64, 8], 7)] * 2


def test_a_repeated_call_reuses_its_encoded_arguments_and_holds_no_tensor(monkeypatch):
    """launch_memoised: the first call of a kernel key compiles through the JIT; later calls build and encode once per
    call key, and a repeated call key launches the kept arguments without building them (``make`` not called), its
    tensors kept as addresses; a new address is a new call key; the JIT path never keeps anything."""
    monkeypatch.setattr(encoded_launch, "EncodedLaunch", StandInCompiled)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=7))
    launches, device = KernelLaunches(StandInJit()), torch.device("cuda", 0)
    built = []

    def call(x):
        def make():
            built.append(x)
            return 4, dict(x_ptr=x, n=32), dict(BLOCK=64, num_warps=8)

        key = (device, encoded_launch.signature((x, 32)))
        gluon_gemm.launch_memoised(launches, key, make, maxnreg=168, device=device)

    x, y = torch.empty(64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", True)
    for tensor in (x, x, x, y, x, y):
        call(tensor)
    assert len(launches.kernel.calls) == 1  # compiled (here: found) by the JIT once
    assert [t is x for t in built] == [True, True, False]  # the JIT's call, x's and y's encodings: no more
    (encoded,) = launches.compiled.values()
    want_x, want_y = ["encoded", x.data_ptr(), 32, 64, 8], ["encoded", y.data_ptr(), 32, 64, 8]
    assert [launch[1] for launch in encoded.launches] == [want_x, want_x, want_y, want_x, want_y]
    assert not any(isinstance(a, torch.Tensor) for _, _, arguments in launches.memo.values() for a in arguments)
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", False)
    call(x)
    assert len(launches.kernel.calls) == 2 and len(launches.memo) == 2


def test_the_signature_of_a_call_changes_with_what_its_launch_is_made_of():
    x = torch.empty(4, 8, dtype=torch.bfloat16)
    sig = encoded_launch.signature
    assert sig((x, 3)) == sig((x, 3)) == sig((x.view(4, 8), 3))  # a view of the same memory, the same shape
    for other in (x.t(), x[:, :4], x.view(8, 4), x.float(), x[1:], x.clone()):
        assert sig((other, 3)) != sig((x, 3))
    assert sig((x, 3)) != sig((x, 4))
    assert sig([(x, None)]) == ((sig(x), None),)


def test_the_engines_launches_are_kept_per_kernel():
    for module, kernel in (
        (gemm_module, gemm_module.grouped_gemm_kernel),
        (wgrad_module, wgrad_module.grouped_wgrad_kernel),
    ):
        assert module.LAUNCHES.kernel is kernel
        assert module.LAUNCHES.names == tuple(kernel.arg_names)
        assert module.LAUNCHES.names[-1] == "num_warps" and module.LAUNCHES.constexprs[-1]


def gemm_key(config, a, b, offsets, epilogue, b_transposed, **tensors):
    arguments, constexprs = gemm_module.launch_arguments(config, a, b, offsets, epilogue, b_transposed, **tensors)
    merged = arguments | constexprs
    values = [merged[name] for name in gemm_module.LAUNCHES.names]
    return gemm_module.LAUNCHES.key(values, config.maxnreg, torch.device("cuda", 0))


def test_a_gemm_compile_key_holds_for_new_tensors_and_changes_with_what_the_jit_specialises():
    config = gemm_module.DEFAULT_CONFIG

    def key(experts=4, rows=96, out_dtype=torch.bfloat16, epilogue="none", **tensors):
        a = torch.randn(rows, 64).to(torch.bfloat16)
        b = torch.randn(experts, 48, 64).to(torch.bfloat16)
        out = torch.empty(rows, 48, dtype=out_dtype)
        return gemm_key(config, a, b, offsets_of([rows] + [0] * (experts - 1)), epilogue, True, out=out, **tensors)

    assert key() == key(rows=160)  # new tensors, other sizes: the same kernel
    assert key() != key(experts=1)  # num_experts 1: a constant to Triton's JIT
    assert key() != key(out_dtype=torch.float32)  # another output dtype and OUT_BUFS
    assert key() != key(epilogue="row_scale", scale=torch.rand(96))
    assert key(epilogue="row_scale", scale=torch.rand(97)[1:]) != key(epilogue="row_scale", scale=torch.rand(96))


def test_a_weight_gradient_compile_key_holds_for_new_tensors_and_changes_with_the_strides_specialisation():
    config = wgrad_module.DEFAULT_CONFIG

    def key(rows=96, inter=48, hidden=64, gathered=False):
        dgdu, x = torch.randn(rows, 2 * inter).to(torch.bfloat16), torch.randn(rows, hidden).to(torch.bfloat16)
        if gathered:
            x = Gathered(x, torch.randint(0, rows, (rows,), dtype=I32))
        outs = [torch.empty(3, inter, hidden, dtype=torch.bfloat16) for _ in range(2)]
        pairs = [(dgdu[:, :inter], x), (dgdu[:, inter:], x)]
        arguments, constexprs = wgrad_module.launch_arguments(config, pairs, offsets_of([rows, 0, 0]), outs)
        merged = arguments | constexprs
        values = [merged[name] for name in wgrad_module.LAUNCHES.names]
        return wgrad_module.LAUNCHES.key(values, config.maxnreg, torch.device("cuda", 0))

    assert key() == key(rows=200)
    assert key() == key(inter=64)  # dg's row stride 96 → 128: multiples of 16 both
    assert key() != key(inter=36)  # 72: not a multiple of 16 (the JIT specialises the strides on it)
    assert key() != key(gathered=True)


def test_launch_arguments_give_each_tensor_one_descriptor():
    """A descriptor standing in for another argument is that argument's own object: an encoded launch encodes it
    once (the JIT path encodes every argument)."""
    config, offsets = gemm_module.DEFAULT_CONFIG, meta(5, dtype=I32)
    pair = (meta(4, 48, 64), meta(4, 48, 64))
    gate_out, up_out = meta(96, 96)[:, :48], meta(96, 96)[:, 48:]
    arguments, _ = gemm_module.launch_arguments(
        config, meta(96, 64), pair, offsets, "swiglu", True, gate_out=gate_out, up_out=up_out
    )
    assert arguments["g_desc"] is arguments["c_desc"] and arguments["c_desc"].base is gate_out  # g stands in for c
    assert arguments["u_desc"] is not arguments["c_desc"] and arguments["u_desc"].base is up_out
    assert arguments["gin_desc"] is arguments["a_desc"] is arguments["uin_desc"]
    arguments, _ = gemm_module.launch_arguments(
        config, meta(96, 64), meta(4, 48, 64), offsets, "none", True, out=meta(96, 48)
    )
    assert arguments["b2_desc"] is arguments["b_desc"] and arguments["g_desc"] is arguments["c_desc"]
    saved = meta(96, 96)
    tensors = dict(
        gate=saved[:, :48],
        up=saved[:, 48:],
        scale=meta(96, dtype=torch.float32),
        dgate_out=meta(96, 48),
        dup_out=meta(96, 48),
        scaled_act_out=meta(96, 48),
    )
    arguments, _ = gemm_module.launch_arguments(
        DSWIGLU_CONFIG, meta(96, 64), meta(4, 64, 48), offsets, "dswiglu", False, **tensors
    )
    descriptors = [
        arguments[name] for name in ("a_desc", "b_desc", "c_desc", "g_desc", "u_desc", "gin_desc", "uin_desc")
    ]
    assert len({id(d) for d in descriptors}) == 7
    one = [(meta(96, 48), meta(96, 64))]
    arguments, _ = wgrad_module.launch_arguments(wgrad_module.DEFAULT_CONFIG, one, offsets, [meta(4, 48, 64)])
    assert arguments["c1_desc"] is arguments["c0_desc"] is arguments["c2_desc"]
    two = one * 2
    arguments, _ = wgrad_module.launch_arguments(wgrad_module.DEFAULT_CONFIG, two, offsets, [meta(4, 48, 64)] * 2)
    assert arguments["c2_desc"] is arguments["c0_desc"] is not arguments["c1_desc"]


HELD = [
    # (a, b, keyword arguments) that check_arguments takes
    (meta(96, 64), meta(4, 48, 64), {}),  # [E, N, K]
    (meta(96, 64), meta(4, 64, 48), {}),  # [E, K, N]
    (meta(96, 64), meta(4, 64, 64), dict(b_transposed=False)),
    (meta(96, 64), meta(4, 64, 64), dict(b_transposed=True)),
    (meta(96, 64), meta(4, 64, 64), dict(out=meta(96, 64), b_transposed=True)),
    (meta(96, 64), meta(4, 96, 64), dict(epilogue="swiglu")),  # stacked [gate; up]
    (meta(96, 64), (meta(4, 48, 64), meta(4, 48, 64)), dict(epilogue="swiglu", gate_out=meta(96, 48))),
    (meta(96, 128), (meta(4, 64, 48), meta(4, 64, 48)), dict(out=meta(96, 48, dtype=torch.float32))),  # along K
    (meta(96, 64), meta(4, 48, 64), dict(epilogue="row_scale", scale=meta(96, dtype=torch.float32))),
    (
        meta(96, 64),
        meta(4, 64, 48),
        dict(epilogue="dswiglu", gate=meta(96, 48), up=meta(96, 48), scale=meta(96), b_transposed=False),
    ),
]


@pytest.mark.parametrize(("a", "b", "kwargs"), HELD)
def test_held_transposed_is_what_check_arguments_finds(a, b, kwargs):
    found = gemm_module.check_arguments(a, b, meta(5, dtype=I32), **kwargs)
    assert held_transposed(a, b, kwargs.get("epilogue", "none"), kwargs.get("b_transposed"), kwargs.get("out")) is found


def test_unchecked_sizes_are_what_check_arguments_returns():
    index = meta(96, dtype=I32)
    dgdu = meta(96, 96)
    cases = [
        ([(dgdu[:, :48], meta(96, 64)), (dgdu[:, 48:], meta(96, 64))], None, torch.bfloat16),
        ([(meta(96, 64), meta(96, 48))], [meta(4, 64, 48, dtype=torch.float32)], torch.bfloat16),
        ([(Gathered(meta(9, 64), index), meta(96, 48))], None, torch.float32),
        ([(dgdu[:, :48], Gathered(meta(9, 64), index))] * 3, None, torch.bfloat16),
    ]
    for problems, outs, out_dtype in cases:
        offsets = meta(5, dtype=I32)
        checked = wgrad_module.check_arguments(problems, offsets, outs=outs, out_dtype=out_dtype)
        assert unchecked_sizes(problems, offsets, outs, out_dtype) == checked


def test_host_time_measures_each_row_through_both_paths(tmp_path):
    """``scripts/host_time.py --encoded both``: each phase's row twice, through the JIT and encoded (a CPU smoke run:
    the layer's reference path there, the switch set all the same)."""
    arguments = ["--device", "cpu", "--impl", "reference", "--cases", "tiny", "--layers", "moe_experts", "--calls", "1",
                 "--repeats", "1", "--profile-calls", "1", "--encoded", "both", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "host_time.py"), *arguments],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    assert [(r["phase"], r["launches"]) for r in rows[:2]] == [("forward", "jit"), ("forward", "encoded")]
    assert len(rows) == 8 and (tmp_path / "moe_experts-tiny-forward-encoded.txt").is_file()
    assert "moe_experts    tiny        forward              encoded" in done.stdout


# --- on a Hopper GPU ------------------------------------------------------------------------------------------------

H, I = 256, 192  # K = H and a pair's K/2 = I multiples of 64; 192 columns: a partial column tile
# row counts per expert: an expert without rows; one expert (num_experts a constant to the JIT); single rows
COUNTS = {
    "with_an_empty_expert": [37, 0, 200, 91],
    "one_expert": [150],
    "single_rows": [1, 128, 0, 1, 257],
}
GEMM_FORMS = ["none", "none_pair_fp32", "row_scale", "swiglu", "swiglu_gate_up", "dswiglu"]
WGRAD_FORMS = ["plain", "gathered", "gathered_fp32"]


def nan(*size, dtype=torch.bfloat16):
    return torch.full(size, float("nan"), dtype=dtype, device="cuda")


def gemm_case(form: str, counts, generator):
    """Fresh random inputs of one of the layer's products: (a, b, offsets, grouped_gemm's keyword inputs, a
    function making its outputs afresh, NaN, by keyword)."""
    M, E = sum(counts), len(counts)

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=generator, device="cuda") * scale).to(torch.bfloat16)

    def halves():  # g and u (dg and du) as the layer keeps them: column halves of one tensor
        both = nan(M, 2 * I)
        return both[:, :I], both[:, I:]

    weight_pair = (randn(E, I, H, scale=H**-0.5), randn(E, I, H, scale=H**-0.5))
    scale = torch.rand(M, generator=generator, device="cuda") + 0.5
    if form == "none":  # B [E, K, N] as it lies
        return randn(M, H), randn(E, H, I, scale=H**-0.5), offsets_of(counts, "cuda"), {}, lambda: dict(out=nan(M, I))
    if form == "none_pair_fp32":  # the backward's dX: [dg | du] · (Wg, Wu) along K, fp32 out
        outputs = lambda: dict(out=nan(M, H, dtype=torch.float32))  # noqa: E731
        return randn(M, 2 * I), weight_pair, offsets_of(counts, "cuda"), {}, outputs
    if form == "row_scale":  # the forward's down projection with the routing weights
        inputs = dict(epilogue="row_scale", scale=scale, b_transposed=True)
        return (
            randn(M, I),
            randn(E, H, I, scale=I**-0.5),
            offsets_of(counts, "cuda"),
            inputs,
            lambda: dict(out=nan(M, H)),
        )
    if form in ("swiglu", "swiglu_gate_up"):  # the forward keeping g and u; the backward recomputing them

        def outputs():
            g, u = halves()
            return dict(out=nan(M, I), gate_out=g, up_out=u) if form == "swiglu" else dict(gate_out=g, up_out=u)

        return randn(M, H), weight_pair, offsets_of(counts, "cuda"), dict(epilogue="swiglu"), outputs
    saved = randn(M, 2 * I, scale=2.0)
    inputs = dict(epilogue="dswiglu", gate=saved[:, :I], up=saved[:, I:], scale=scale, b_transposed=False)

    def outputs():
        dg, du = halves()
        partial = nan(partial_rows(I, default_config("dswiglu")), M, dtype=torch.float32)  # the launch's tiles
        return dict(dgate_out=dg, dup_out=du, scaled_act_out=nan(M, I), topk_partial=partial)

    return randn(M, H), randn(E, H, I, scale=H**-0.5), offsets_of(counts, "cuda"), inputs, outputs


def wgrad_case(form: str, counts, generator):
    """Fresh random inputs of the layer's weight gradients: (problems, offsets, a function making NaN outputs)."""
    M, E, tokens = sum(counts), len(counts), 301

    def randn(*size):
        return torch.randn(size, generator=generator, device="cuda").to(torch.bfloat16)

    index = torch.randint(0, tokens, (M,), generator=generator, device="cuda", dtype=I32)
    offsets = offsets_of(counts, "cuda")
    if form == "gathered_fp32":  # dWd = dy_sᵀ · aw, dy read through the routing, fp32 out
        problems = [(Gathered(randn(tokens, H), index), randn(M, I))]
        return problems, offsets, lambda: [nan(E, H, I, dtype=torch.float32)]
    dgdu = randn(M, 2 * I)
    x = Gathered(randn(tokens, H), index) if form == "gathered" else randn(M, H)
    problems = [(dgdu[:, :I], x), (dgdu[:, I:], x)]  # dWg, dWu
    return problems, offsets, lambda: [nan(E, I, H), nan(E, I, H)]


class Unreachable:
    """A kernel whose launch through Triton's JIT fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("a launch went through Triton's JIT")


def both_paths(run, cases, launches: KernelLaunches, monkeypatch):
    """Each case's outputs through Triton's JIT (checked calls), then through encoded launches (unchecked calls, as
    a trusted caller makes them) from an empty cache: one compiling call of the key first, then the JIT made
    unreachable, each case on tensors of its own."""
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", False)
    by_jit = [run(case, True) for case in cases]
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", True)
    monkeypatch.setattr(launches, "compiled", {})
    run(cases[0], False)  # the key's first call: through the JIT, its compiled kernel kept
    assert len(launches.compiled) == 1
    monkeypatch.setattr(launches, "kernel", Unreachable())
    by_encoded = [run(case, False) for case in cases]
    assert len(launches.compiled) == 1  # new tensors, one key
    torch.cuda.synchronize()
    return by_jit, by_encoded


def assert_same_bits(by_jit, by_encoded):
    for jit, encoded in zip(by_jit, by_encoded, strict=True):
        for ours, theirs in zip(encoded, jit, strict=True):
            assert not theirs.isnan().any()  # every element written
            assert torch.equal(ours, theirs)
    first, second = by_encoded
    assert all(not torch.equal(x, y) for x, y in zip(first, second, strict=True))  # each call's own tensors


def run_gemm(case, check):
    a, b, offsets, inputs, outputs = case
    outs = outputs()
    grouped_gemm(a, b, offsets, **inputs, **outs, check=check)
    return list(outs.values())


def run_wgrad(case, check):
    problems, offsets, outputs = case
    return grouped_weight_grad(problems, offsets, outs=outputs(), check=check)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("form", GEMM_FORMS)
def test_gpu_grouped_gemm_encoded_launches_give_the_jits_bits(form, counts, seed, monkeypatch):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cases = [gemm_case(form, COUNTS[counts], generator) for _ in range(2)]
    assert_same_bits(*both_paths(run_gemm, cases, gemm_module.LAUNCHES, monkeypatch))


@pytest.mark.gpu
@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("form", WGRAD_FORMS)
def test_gpu_weight_grad_encoded_launches_give_the_jits_bits(form, counts, seed, monkeypatch):
    """The loading warp's descriptors made on the device: the encoded launch hands the kernel its global scratch."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cases = [wgrad_case(form, COUNTS[counts], generator) for _ in range(2)]
    by_jit, by_encoded = both_paths(run_wgrad, cases, wgrad_module.LAUNCHES, monkeypatch)
    assert_same_bits(by_jit, by_encoded)
    for e, count in enumerate(COUNTS[counts]):
        if count == 0:  # an expert without rows: exact zeros
            assert all(torch.equal(out[e], torch.zeros_like(out[e])) for out in by_encoded[1])


def graph_case(kind: str, generator):
    """One product on fresh tensors: (its call, taking ``check``; the inputs new values are drawn into; its outputs;
    its kernel's launches)."""
    counts = COUNTS["with_an_empty_expert"]
    if kind == "dswiglu":
        a, b, offsets, inputs, outputs = gemm_case("dswiglu", counts, generator)
        outs = outputs()

        def call(check):
            grouped_gemm(a, b, offsets, **inputs, **outs, check=check)

        return call, [a, inputs["gate"], inputs["up"]], list(outs.values()), gemm_module.LAUNCHES
    problems, offsets, outputs = wgrad_case("gathered", counts, generator)
    outs = outputs()

    def call(check):
        grouped_weight_grad(problems, offsets, outs=outs, check=check)

    (dg, x), (du, _) = problems
    return call, [dg, du, x.source], outs, wgrad_module.LAUNCHES


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dswiglu", "gathered"])
def test_gpu_encoded_launches_replay_in_a_cuda_graph(kind, seed, monkeypatch):
    """Captured through an encoded launch (the weight gradient's scratch allocated in the capture), replayed after
    new values were drawn into its inputs: the JIT path's bits on the same inputs."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    call, inputs, outs, launches = graph_case(kind, generator)
    with monkeypatch.context() as patched:
        patched.setattr(gluon_gemm, "ENCODED_LAUNCHES", True)
        patched.setattr(launches, "compiled", {})
        call(False)  # compiled outside the capture
        patched.setattr(launches, "kernel", Unreachable())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(False)
    monkeypatch.setattr(gluon_gemm, "ENCODED_LAUNCHES", False)
    for _ in range(2):
        for tensor in inputs:
            tensor.normal_(generator=generator)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        replayed = [out.clone() for out in outs]
        for out in outs:
            out.fill_(float("nan"))
        call(True)  # through the JIT
        torch.cuda.synchronize()
        for ours, theirs in zip(replayed, outs, strict=True):
            assert not theirs.isnan().any()
            assert torch.equal(ours, theirs)
