"""P1's few-token design (``moe_lib/swiglu_down/few_tokens.py``): one launch, 2-D weight tiles, waits per I-block.

CPU: the kernel under the Triton interpreter (its two phases as two launches there) on small shapes whose
tiles leave ragged edges along H and I, with several tiles along each: against the float64 reference,
both precisions, both input distributions (``inputs.py``), every output and workspace from NaN-filled
memory, two calls bitwise equal (the arrival counters carry over from call to call). The straight-line
form (T ≤ block_t) and the token-loop form (T > block_t); tilings where phase-1 tiles straddle phase-2
I-blocks and the other way round, with programs that hold a tile of one phase only.
GPU (``gpu`` marker): the benchmark's shape at few tokens against float64, with the rules of the
existing P1 tests; determinism; CUDA-graph replay with new inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_error

from moe_lib import problems
from moe_lib.bench.checks import compare_output
from moe_lib.dispatch import interpreter_enabled

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
OUTPUTS = ("grad_x", "grad_gate_weight", "grad_up_weight", "grad_down_weight")
ELEMENT_RULE = problems.load("swiglu_down_backward").element_rule
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I = 72, 56  # with 32-wide blocks: 3 tiles along H (the last 8 wide), 2 along I (the last 24 wide)


@pytest.fixture
def poisoned(monkeypatch):
    """Every output and workspace the launcher allocates starts as NaN: what comes back was written."""
    from moe_lib.swiglu_down import launch

    def nan_filled(size, *, dtype, device):
        return torch.full(size, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "allocate", nan_filled)


def float64_reference(inputs: dict):
    from moe_lib import reference

    return reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])


def run(inputs: dict, config, precision: str):
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    return swiglu_down_backward_triton(*inputs.values(), config=config, precision=precision)


def interpreter_config():
    from moe_lib.swiglu_down.few_tokens import choose_few_tokens_config

    return choose_few_tokens_config(1, H, I, interpreter=True, with_lo=True)


def check_small(got, again, want, precision: str, dtype=torch.bfloat16) -> list[float]:
    """The CPU rules: finite, two calls bitwise equal, relative error ≤ 2e-2 in bf16 (1e-5 in fp32) and, on
    the faithful path, the benchmark's element rule. Returns the relative errors."""
    errors = []
    for name, g, a, w in zip(OUTPUTS, got, again, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert torch.equal(g, a), f"{name}: two calls differ"
        error = rel_error(g, w)
        assert error <= (1e-5 if dtype == torch.float32 else 2e-2), f"{name}: {error:.3g}"
        if precision == "faithful" and dtype != torch.float32:
            result = compare_output(g, w, ELEMENT_RULE)
            assert result["pass_fraction"] >= ELEMENT_RULE["required_fraction"], f"{name}: {result}"
        errors.append(error)
    return errors


@needs_triton
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("T", [1, 3, 16, 20])
def test_matches_float64_reference(T, distribution, seed, poisoned):
    """16-token blocks: T ≤ 16 runs the straight-line form, T = 20 the token loops (two blocks, the second
    ragged). Faithful twice (bitwise equal), fast twice; at the harness's scale the faithful path is at
    least as close as the fast one."""
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=DEVICE, hidden_size=H,
                                  intermediate_size=I, distribution=distribution)  # fmt: skip
    want = float64_reference(inputs)
    config = interpreter_config()
    errors = {}
    for precision in ("faithful", "fast"):
        got, again = run(inputs, config, precision), run(inputs, config, precision)
        errors[precision] = check_small(got, again, want, precision)
    if distribution == "harness":
        for name, faithful, fast in zip(OUTPUTS, errors["faithful"], errors["fast"], strict=True):
            assert faithful <= fast + 1e-7, name


def other_tilings():
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    return {
        # 16-wide phase-1 I-blocks, two in each 32-wide phase-2 I-block; 12 phase-1 tiles, 6 phase-2 ones
        "straddled": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=16, block_i2=32, block_h2=32, weights_ahead="after_phase1", warps=1
        ),
        # 32-wide phase-1 I-blocks arriving on two 16-wide phase-2 I-blocks each; 6 phase-1 tiles, 12 phase-2
        "straddling": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=32, block_i2=16, block_h2=32, weights_ahead="after_phase1", warps=1
        ),
        # H covered in spans shorter than the blocks: 4 phase-1 tiles of 20 rows in 32-row blocks, 3 phase-2
        # tiles of 28 columns (the last one 16): a block's masked rows belong to the next tile
        "spans": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=32, block_i2=32, block_h2=32, weights_ahead="after_phase1", warps=1,
            span_h1=20, span_h2=28,
        ),
        # Wg, Wu loaded into registers at the start
        "registers": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=32, block_i2=32, block_h2=32, weights_ahead="registers", warps=1
        ),
        # the GPU-only staging by identity moves asked for (the interpreter keeps the selects), with the launch
        # count read late and phase 2 staged before the wait
        "moves": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=32, block_i2=32, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, once_by_move=True,
        ),
        # the token loops in one pass: each token block's dGate, dUp into the dx partial and into dWg, dWu
        "one pass": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=16, block_i2=32, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, one_pass=True, stages=2,
        ),
        # one token block, the saved gate, sigmoid, silu, up tiles loaded after phase 1
        "saved late": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=16, block_i2=32, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, saved_late=True,
        ),
        # one token block, dx's sum over the I-blocks split by rows: over 2 programs per column block (8 rows each of
        # a 16-token block), or over 4 of the 4 I-blocks of 16 rows (4 rows each; the last I-block 8 wide)
        "sliced sum": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=32, block_i2=32, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, dx_sum_slices=2,
        ),
        "sliced sum 4": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=16, block_i2=16, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, saved_late=True, dx_sum_slices=4,
        ),
        # one token block, phase 1's dWd tile after phase 2's stores (the interpreter: in its phase-2 launch); with
        # more tokens than a block, dWd before the wait as without it
        "dWd late": FewTokensConfig(
            block_t=16, block_h1=32, block_i1=16, block_i2=32, block_h2=32, weights_ahead="registers", warps=1,
            count_late=True, stage_before_wait=True, saved_late=True, dx_sum_slices=2, grad_down_late=True,
        ),
    }


@needs_triton
@pytest.mark.parametrize("T, tiling", [(5, "straddled"), (3, "straddling"), (20, "registers"), (4, "spans"),
                                        (18, "spans"), (3, "moves"), (37, "one pass"), (11, "saved late"),
                                        (11, "sliced sum"), (13, "sliced sum 4"), (37, "sliced sum"),
                                        (9, "dWd late"), (20, "dWd late")])
def test_other_tilings(T, tiling, seed, poisoned):
    """Tile counts that differ between the phases (programs with one phase's tile only), I-blocks of the two
    phases that do not line up, Wg, Wu loaded at the start with T = 20 (the loop form), the loop form in one pass
    over three token blocks (the last one partial), the saved tiles loaded after phase 1, dx's sum split by rows (and
    with more tokens than a block, where the last arrival sums it all), dWd after phase 2: faithful, harness inputs."""
    config = other_tilings()[tiling]
    n_h1, n_i1, n_i2, n_h2 = config.tiles(H, I)
    assert n_h1 * n_i1 != n_i2 * n_h2 or tiling in ("registers", "moves", "saved late", "sliced sum", "sliced sum 4",
                                                    "dWd late")
    assert tiling != "spans" or (n_h1, n_h2) == (4, 3)
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device=DEVICE, hidden_size=H,
                                  intermediate_size=I, distribution="harness")  # fmt: skip
    got, again = run(inputs, config, "faithful"), run(inputs, config, "faithful")
    check_small(got, again, float64_reference(inputs), "faithful")


def one_token_config(tiling: str = "even"):
    """The one-token CUDA-core form at the interpreter's 32-wide tiles, a tiling whose phases' I-blocks do not line
    up, or tiles covering less than their blocks along both H and I (20 and 28 rows of H, 24 and 20 columns of I in
    32-wide blocks: phase-1 I-tiles straddle the phase-2 ones)."""
    import dataclasses

    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    if tiling == "spans":
        return FewTokensConfig(block_h1=32, span_h1=20, block_i1=32, span_i1=24, block_i2=32, span_i2=20, block_h2=32,
                               span_h2=28, warps=1, cuda_cores=True)  # fmt: skip
    base = interpreter_config() if tiling == "even" else other_tilings()[tiling]
    return dataclasses.replace(base, cuda_cores=True)


@needs_triton
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("tiling", ["even", "straddled", "straddling", "spans", "dWd late"])
def test_one_token_on_cuda_cores_matches_float64_reference(tiling, distribution, seed, poisoned):
    """Every product on the CUDA cores in fp32: both paths the same bits, twice, within the faithful path's rules at
    either scale, and as close to float64 as the tensor-core form's faithful path (hi/lo products) on the same tiles
    (both leave little more than the outputs' rounding)."""
    import dataclasses

    inputs = problems.make_inputs("swiglu_down_backward", 1, seed=seed, device=DEVICE, hidden_size=H,
                                  intermediate_size=I, distribution=distribution)  # fmt: skip
    want = float64_reference(inputs)
    config = one_token_config(tiling)
    faithful, again = run(inputs, config, "faithful"), run(inputs, config, "faithful")
    errors = check_small(faithful, again, want, "faithful")
    fast = run(inputs, config, "fast")
    for name, a, b in zip(OUTPUTS, faithful, fast, strict=True):
        assert torch.equal(a, b), f"{name}: the paths differ"
    tensor_cores = dataclasses.replace(config, cuda_cores=False, span_i1=0, span_i2=0)
    if config.span_i1 or config.span_i2:  # the tensor-core form takes whole I-blocks: its own tiles then
        tensor_cores = interpreter_config()
    for name, g, w, error in zip(OUTPUTS, run(inputs, tensor_cores, "faithful"), want, errors, strict=True):
        assert error <= rel_error(g, w) + 2e-4, f"{name}: {error:.3g} against the tensor cores' {rel_error(g, w):.3g}"


def test_cuda_cores_refuse_more_than_one_token_and_odd_spans():
    import dataclasses

    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    inputs = problems.make_inputs("swiglu_down_backward", 2, hidden_size=H, intermediate_size=I)
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    config = FewTokensConfig(block_h1=32, block_i1=32, block_i2=32, block_h2=32, cuda_cores=True)
    with pytest.raises(ValueError, match="cuda_cores takes one token, got 2"):
        config.run(*inputs.values(), *outputs, with_lo=True)
    with pytest.raises(ValueError, match="span_i1, span_i2 need cuda_cores"):
        dataclasses.replace(config, cuda_cores=False, span_i1=20).run(*inputs.values(), *outputs, with_lo=True)
    with pytest.raises(ValueError, match="span_i2 must be between 1 and its block"):
        dataclasses.replace(config, span_i2=33).run(*inputs.values(), *outputs, with_lo=True)


@needs_triton
def test_fp32_inputs_are_exact(seed, poisoned):
    inputs = problems.make_inputs("swiglu_down_backward", 7, seed=seed, device=DEVICE, dtype=torch.float32,
                                  hidden_size=H, intermediate_size=I)  # fmt: skip
    config = interpreter_config()
    got, again = run(inputs, config, "faithful"), run(inputs, config, "faithful")
    check_small(got, again, float64_reference(inputs), "faithful", dtype=torch.float32)


@needs_triton
@pytest.mark.parametrize("cuda_cores", [False, True])
def test_no_tokens(cuda_cores, seed, poisoned):
    inputs = problems.make_inputs("swiglu_down_backward", 0, seed=seed, device=DEVICE, hidden_size=H,
                                  intermediate_size=I)  # fmt: skip
    config = one_token_config() if cuda_cores else interpreter_config()
    grad_x, *weight_grads = run(inputs, config, "faithful")
    assert grad_x.shape == (0, H)
    for grad in weight_grads:
        assert torch.count_nonzero(grad) == 0


def test_choose_few_tokens_config():
    from moe_lib.swiglu_down.few_tokens import choose_few_tokens_config

    for T in (1, 16, 17, 32, 33, 64, 65, 128, 129):
        config = choose_few_tokens_config(T, 2048, 768, interpreter=False, with_lo=True)
        assert config.grid_size(2048, 768) == 96
        assert config.block_t >= T if T <= 128 else (config.block_t, config.one_pass) == (16, True)
        one_block = 2 <= T <= 128
        assert config.saved_late == one_block
        assert config.dx_sum_slices == (8 if one_block else 1)  # 12 I-blocks of 64 rows: 8 slices
        assert (config.block_i2, config.block_h2) == ((64, 256) if one_block else (128, 128))
        assert config.block_i1 * 2 >= 128 and config.block_h2 * 2 >= 128  # ≥ 128 contiguous bytes per weight row
        assert config.cooperative and config.cuda_cores == (T == 1)
        assert config.cuda_cores or (config.count_late and config.stage_before_wait and config.once_by_move)
    narrow = choose_few_tokens_config(1, 2048, 768, interpreter=False, with_lo=True, max_programs=60)
    assert narrow.grid_size(2048, 768) <= 60
    # no more slices than I-blocks to sum: 4 at I = 256 (64-row phase-2 blocks), 2 at I = 128
    assert choose_few_tokens_config(8, 2048, 256, interpreter=False, with_lo=True).dx_sum_slices == 4
    assert choose_few_tokens_config(8, 2048, 128, interpreter=False, with_lo=True).dx_sum_slices == 2


def test_swiglu_down_backward_chooses_it_for_few_16_bit_tokens():
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig
    from moe_lib.swiglu_down.launch import FEW_TOKENS_MAX_TOKENS, GLUON_MIN_TOKENS, TileConfig, choose_config

    assert FEW_TOKENS_MAX_TOKENS == {"fast": 64, "faithful": 128} and GLUON_MIN_TOKENS == 65
    for with_lo, gluon, last in ((True, False, FEW_TOKENS_MAX_TOKENS["faithful"]), (True, True, GLUON_MIN_TOKENS - 1),
                                 (False, True, FEW_TOKENS_MAX_TOKENS["fast"])):  # fmt: skip
        for T in (1, 16, 17, last):
            config = choose_config(T, 2048, 768, interpreter=False, with_lo=with_lo, max_programs=132, gluon=gluon)
            assert isinstance(config, FewTokensConfig), (T, with_lo, gluon)
            assert T <= config.block_t <= max(16, 2 * T)  # one token block, at most twice the tokens
        beyond = choose_config(last + 1, 2048, 768, interpreter=False, with_lo=with_lo, max_programs=132, gluon=gluon)
        assert not isinstance(beyond, FewTokensConfig)
    # fp32 inputs, a GPU too small for the grid, and the interpreter take the tiled launches
    assert isinstance(choose_config(1, 2048, 768, interpreter=False, max_programs=132, element_bytes=4), TileConfig)
    assert isinstance(choose_config(1, 2048, 768, interpreter=False, with_lo=True, max_programs=0), TileConfig)
    assert isinstance(choose_config(1, 2048, 768, interpreter=True, max_programs=132), TileConfig)


def test_spans_longer_than_their_blocks_are_refused():
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    inputs = problems.make_inputs("swiglu_down_backward", 1, hidden_size=H, intermediate_size=I)
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    with pytest.raises(ValueError, match="span_h2 must be between 1 and its block"):
        FewTokensConfig(block_h2=32, span_h2=33).run(*inputs.values(), *outputs, with_lo=True)


@pytest.mark.parametrize("slices", [0, 3, 4])
def test_dx_sum_slices_out_of_range_are_refused(slices):
    """Not a power of two, or more slices than the phase-2 I-blocks (2 at I = 56 in 32-row blocks)."""
    import dataclasses

    inputs = problems.make_inputs("swiglu_down_backward", 1, hidden_size=H, intermediate_size=I)
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    config = dataclasses.replace(interpreter_config(), dx_sum_slices=slices)
    with pytest.raises(ValueError, match="^config: dx_sum_slices must be a power of two"):
        config.run(*inputs.values(), *outputs, with_lo=True)


def test_unknown_weights_ahead_is_refused():
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    inputs = problems.make_inputs("swiglu_down_backward", 1, hidden_size=H, intermediate_size=I)
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    with pytest.raises(ValueError, match="weights_ahead"):
        FewTokensConfig(weights_ahead="soon").run(*inputs.values(), *outputs, with_lo=True)


def test_trace_is_refused_under_the_interpreter_or_in_the_wrong_shape():
    from moe_lib.swiglu_down.few_tokens import TRACE_SLOTS

    inputs = problems.make_inputs("swiglu_down_backward", 1, hidden_size=H, intermediate_size=I)
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    trace = torch.zeros((1, TRACE_SLOTS), dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="^trace: expected an int64 tensor"):
        interpreter_config().run(*inputs.values(), *outputs, with_lo=True, trace=trace)


# ---------------------------------------------------------------------------------------------
# GPU


def gpu_config(T: int, precision: str):
    from moe_lib.swiglu_down.few_tokens import choose_few_tokens_config

    return choose_few_tokens_config(T, 2048, 768, interpreter=False, with_lo=precision == "faithful")


def checked_from_poison(T: int, config, precision: str, seed: int, distribution: str | None = None):
    """(inputs, outputs) of ``config`` at the benchmark's shape, run from poisoned memory and checked against float64
    under the precision's rule (GPU)."""
    from test_swiglu_down_backward_triton import check_against_float64

    from moe_lib.bench.timing import poison_allocator

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    poison_allocator("cuda", 256 * 2**20)
    got = run(inputs, config, precision)
    check_against_float64(inputs, got, precision)
    return inputs, got


def assert_replayed_as_eager(T: int, config, precision: str, seed: int, distribution: str | None = None):
    """``config`` captured in a CUDA graph, its inputs then overwritten with new ones and the graph replayed three
    times (the counters move on with every replay): the outputs of an eager call on the new inputs, bitwise (GPU)."""
    from moe_lib.bench.timing import capture

    static = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    graph, outputs = capture(lambda: run(static, config, precision))
    fresh = problems.make_inputs("swiglu_down_backward", T, seed=seed + 1, device="cuda", distribution=distribution)
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for name, g, e in zip(OUTPUTS, outputs, run(fresh, config, precision), strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8, 16, 3, 17, 32, 33, 64, 65, 100, 128, 200])
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_benchmark_shape_against_float64(T, distribution, precision, seed):
    """The tiles chosen for T at the benchmark's shape: every token in one block up to 128 (the saved tiles after phase
    1 from 33), beyond that the token loops in one pipelined pass."""
    from test_swiglu_down_backward_triton import check_against_float64

    from moe_lib.bench.timing import poison_allocator

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    poison_allocator("cuda", 256 * 2**20)
    got = run(inputs, gpu_config(T, precision), precision)
    check_against_float64(inputs, got, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("distribution", ["forward", "harness"])
def test_gpu_one_token_on_cuda_cores_against_float64(distribution, seed):
    """The one-token CUDA-core form at the benchmark's shape: within both paths' rules, both paths the same bits,
    twice, and replayed from a CUDA graph on new inputs as called eagerly."""
    import dataclasses

    from test_swiglu_down_backward_triton import check_against_float64

    config = dataclasses.replace(gpu_config(1, "faithful"), cuda_cores=True)
    inputs, got = checked_from_poison(1, config, "faithful", seed, distribution)
    check_against_float64(inputs, got, "fast")
    for name, a, b, c in zip(OUTPUTS, got, run(inputs, config, "faithful"), run(inputs, config, "fast"), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert_replayed_as_eager(1, config, "faithful", seed, distribution)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_grad_down_late_against_float64(T, distribution, precision, seed):
    """The chosen tiles with phase 1's dWd tile after phase 2's stores (``grad_down_late``): within the path's rules
    from poisoned memory, and twice the same bits."""
    import dataclasses

    config = dataclasses.replace(gpu_config(T, precision), grad_down_late=True)
    inputs, got = checked_from_poison(T, config, precision, seed, distribution)
    for name, a, b in zip(OUTPUTS, got, run(inputs, config, precision), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_spans_fill_the_sms(T, precision, seed):
    """132 programs with H in spans shorter than the blocks. The interpreter runs the programs in order, so a
    block's masked rows written over the next tile's would be overwritten again there: only the GPU, where
    the tiles race, shows such a store."""
    from test_swiglu_down_backward_triton import check_against_float64

    from moe_lib.bench.timing import poison_allocator
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig

    config = FewTokensConfig(block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94)
    if config.grid_size(2048, 768) > torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("fewer SMs than the 132 programs")
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    poison_allocator("cuda", 256 * 2**20)
    got = run(inputs, config, precision)
    check_against_float64(inputs, got, precision)
    again = run(inputs, config, precision)
    for name, a, b in zip(OUTPUTS, got, again, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 100])
def test_gpu_deterministic(T, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    config = gpu_config(T, "faithful")
    first, second = run(inputs, config, "faithful"), run(inputs, config, "faithful")
    for name, a, b in zip(OUTPUTS, first, second, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 16])
def test_gpu_cuda_graph_replay_with_new_inputs(T, seed):
    assert_replayed_as_eager(T, gpu_config(T, "faithful"), "faithful", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_trace_stamps_in_order_and_changes_nothing(T, seed):
    """Traced, the launch gives the same outputs bitwise, and every program stamps every point, in order."""
    from moe_lib.swiglu_down.few_tokens import TRACE_POINTS, TRACE_SLOTS

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    config = gpu_config(T, "faithful")
    plain = run(inputs, config, "faithful")
    trace = torch.zeros((config.grid_size(2048, 768), TRACE_SLOTS), dtype=torch.int64, device="cuda")
    outputs = [torch.empty_like(inputs[k]) for k in ("x", "gate_weight", "up_weight", "down_weight")]
    traced = config.run(*inputs.values(), *outputs, with_lo=True, trace=trace)
    for name, a, b in zip(OUTPUTS, plain, traced, strict=True):
        assert torch.equal(a, b), name
    times = trace[:, : len(TRACE_POINTS)].cpu()
    assert (times > 0).all() and (times.diff(dim=1) >= 0).all()
    assert (trace[:, -1] < torch.cuda.get_device_properties(0).multi_processor_count).all()  # an SM's number


CONCURRENT_SCRIPT = """
import sys
import torch
from moe_lib import problems
from moe_lib.swiglu_down.few_tokens import FewTokensConfig
from moe_lib.swiglu_down.one_launch import OneLaunchConfig
from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

num_tokens, config = int(sys.argv[1]), eval(sys.argv[2])
inputs = problems.make_inputs("swiglu_down_backward", num_tokens, seed=0, device="cuda", distribution="harness")
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
@pytest.mark.parametrize("num_tokens, config", [
    (8, "FewTokensConfig(cooperative=True)"),
    (100, "OneLaunchConfig(64, 16, 32, 16, 256, 128, 4, 3, cooperative=True)"),
])  # fmt: skip
def test_gpu_cooperative_launch_beside_another_stream(num_tokens, config):
    """The waits between programs need every program resident: with another stream's kernel holding SMs, a
    cooperative launch of either one-launch design still completes (in a child process, so that a hang fails
    the test)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", CONCURRENT_SCRIPT, str(num_tokens), config],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
