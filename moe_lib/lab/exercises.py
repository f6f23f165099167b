"""The lesson notebooks' exercises, each with a checker a learner calls on their answer (no solutions here).

Every ``check_*`` takes the learner's function, runs it on fresh random inputs against this project's oracles
(float64 autograd, ``moe_lib.roofline``, ``moe_lib.tiling``, the parallel layer's partition, the ring model of
:mod:`.ring`), prints one line — ✓ passed, ✗ what is wrong, or ○ not attempted yet (the function returns None or
raises NotImplementedError, as the notebooks' stubs do) — and returns whether it passed, so that a notebook with
unsolved exercises still runs from top to bottom. Everything runs on the CPU; the Triton exercise under the
interpreter (``TRITON_INTERPRET=1``, as notebook 04 sets it).

    notebook 01  check_d_gate_recomputed, check_geglu_backward, check_hi_lo_split
    notebook 02  check_grad_topk_weights, check_router_backward, check_expected_empty_experts
    notebook 03  check_p1_cost, check_ridge_crossing, check_expert_intensity
    notebook 04  check_grad_down_kernel, check_split_ranges, check_ring_schedule
    notebook 06  check_expert_partition, check_rows_sent, check_exchange_bytes
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from .. import problems, roofline
from ..moe_experts.inputs import route_tokens
from ..moe_experts.parallel import expert_partition
from ..tiling import split_ranges
from .derivations import relative_error
from .ring import simulate


class NotAttempted(Exception):
    """The learner's function is still the notebook's stub."""


def _seed(seed: int | None) -> int:
    return random.SystemRandom().randrange(2**31) if seed is None else seed


def _answer(value):
    if value is None:
        raise NotAttempted
    return value


def _check(name: str, attempt) -> bool:
    """Run ``attempt()`` (which raises AssertionError with what is wrong) and print one line about it."""
    try:
        detail = attempt()
    except (NotAttempted, NotImplementedError):
        print(f"○ {name}: not attempted yet")
        return False
    except AssertionError as wrong:
        print(f"✗ {name}: {wrong}")
        return False
    except Exception as error:  # the learner's code raised: say what, do not stop the notebook
        print(f"✗ {name}: your function raised {type(error).__name__}: {error}")
        return False
    print(f"✓ {name}" + (f": {detail}" if detail else ""))
    return True


def _close(name: str, got, want: torch.Tensor, tolerance: float) -> float:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    error = relative_error(got, want)
    if not error <= tolerance:
        raise AssertionError(f"{name}: relative error {error:.1e} against float64 autograd (at most {tolerance:.0e})")
    return error


def _normal(*shape, generator) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


# ================================================================ notebook 01


def check_d_gate_recomputed(fn, seed: int | None = None) -> bool:
    """Exercise 01.1: ``fn(dA, G, U) -> dG`` for A = silu(G) ⊙ U, evaluating σ(G) itself (no saved S).
    Checked against float64 autograd on random [T, I] tensors."""

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        d_a, gate, up = (_normal(7, 5, generator=generator) for _ in range(3))
        leaf = gate.clone().requires_grad_()
        (want,) = torch.autograd.grad(F.silu(leaf) * up, leaf, d_a)
        error = _close("dG", _answer(fn(d_a, gate, up)), want, 1e-10)
        return f"relative error {error:.1e}"

    return _check("dG with σ(G) recomputed", attempt)


def check_geglu_backward(fn, seed: int | None = None) -> bool:
    """Exercise 01.2: ``fn(dA, G, U) -> (dG, dU)`` for a GeGLU expert, A = gelu(G) ⊙ U with the exact (erf) GELU,
    gelu(z) = z Φ(z). Checked against float64 autograd."""

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        d_a, gate, up = (_normal(6, 9, generator=generator) for _ in range(3))
        leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
        want = torch.autograd.grad(F.gelu(leaves[0]) * leaves[1], leaves, d_a)
        got = _answer(fn(d_a, gate, up))
        if not isinstance(got, tuple | list) or len(got) != 2:
            raise AssertionError("expected a pair (dG, dU)")
        errors = [_close(name, g, w, 1e-10) for name, g, w in zip(("dG", "dU"), got, want, strict=True)]
        return f"relative errors {errors[0]:.1e}, {errors[1]:.1e}"

    return _check("GeGLU backward", attempt)


def check_hi_lo_split(fn, seed: int | None = None) -> bool:
    """Exercise 01.3: ``fn(v) -> (hi, lo)``, two bf16 tensors with hi = bf16(v) and lo = bf16(v − hi), the faithful
    path's representation of dG and dU (fp32 ``v``). Checked element by element, and hi + lo against v."""

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        v = (_normal(64, 48, generator=generator) * torch.exp(_normal(64, 48, generator=generator))).float()
        got = _answer(fn(v))
        if not isinstance(got, tuple | list) or len(got) != 2:
            raise AssertionError("expected a pair (hi, lo)")
        hi, lo = got
        if hi.dtype != torch.bfloat16 or lo.dtype != torch.bfloat16:
            raise AssertionError(f"hi and lo must be bf16, got {hi.dtype} and {lo.dtype}")
        if not torch.equal(hi, v.to(torch.bfloat16)):
            raise AssertionError("hi is not v rounded to bf16")
        if not torch.equal(lo, (v - hi.float()).to(torch.bfloat16)):
            raise AssertionError("lo is not (v − hi) rounded to bf16")
        pair = relative_error(hi.double() + lo.double(), v)
        alone = relative_error(hi, v)
        return f"‖hi + lo − v‖/‖v‖ = {pair:.1e}, against {alone:.1e} for hi alone"

    return _check("hi/lo split", attempt)


# ================================================================ notebook 02


def _p2_inputs(seed: int):
    return problems.make_inputs(
        "moe_experts_backward",
        9,
        seed=seed,
        dtype=torch.float64,
        hidden_size=12,
        intermediate_size=8,
        num_experts=5,
        top_k=2,
    )


def check_grad_topk_weights(fn, seed: int | None = None) -> bool:
    """Exercise 02.1: ``fn(dy, x, topk_indices, W_g, W_u, W_d) -> dw`` [T, K], the routing-weight gradient
    dw_tk = ⟨W_d,e^T dy_t, a_tk⟩ (no o formed). Checked against float64 autograd of the layer."""

    def attempt():
        inputs = _p2_inputs(_seed(seed))
        weights = inputs["topk_weights"].clone().requires_grad_()
        from .. import reference

        y = reference.moe_experts_forward_reference(
            inputs["hidden_states"],
            inputs["topk_indices"],
            weights,
            inputs["gate_weights"],
            inputs["up_weights"],
            inputs["down_weights"],
        )
        (want,) = torch.autograd.grad(y, weights, inputs["grad_output"])
        got = fn(
            inputs["grad_output"],
            inputs["hidden_states"],
            inputs["topk_indices"],
            inputs["gate_weights"],
            inputs["up_weights"],
            inputs["down_weights"],
        )
        return f"relative error {_close('dw', _answer(got), want, 1e-10):.1e}"

    return _check("grad_topk_weights", attempt)


def check_router_backward(fn, seed: int | None = None) -> bool:
    """Exercise 02.2: the router before the experts, w = softmax(logits) over each token's K chosen logits:
    ``fn(logits, dw) -> d_logits`` [T, K]. Checked against float64 autograd."""

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        logits, d_w = _normal(11, 4, generator=generator), _normal(11, 4, generator=generator)
        leaf = logits.clone().requires_grad_()
        (want,) = torch.autograd.grad(torch.softmax(leaf, dim=-1), leaf, d_w)
        return f"relative error {_close('d_logits', _answer(fn(logits, d_w)), want, 1e-10):.1e}"

    return _check("router backward", attempt)


def check_expected_empty_experts(fn, seed: int | None = None) -> bool:
    """Exercise 02.3: ``fn(T, E, K) -> float``, the expected number of experts no token chose when each of T tokens
    picks K distinct experts of E uniformly. Checked against the exact value at several (T, E, K) and against a
    count over many draws of ``route_tokens``."""

    def attempt():
        for T, E, K in ((1, 8, 2), (16, 64, 4), (64, 256, 8), (2048, 256, 8)):
            want = E * (1 - K / E) ** T
            got = float(_answer(fn(T, E, K)))
            if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
                raise AssertionError(f"T={T}, E={E}, K={K}: {got:.6g}, expected {want:.6g}")
        generator = torch.Generator().manual_seed(_seed(seed))
        draws = [
            int((torch.bincount(route_tokens(32, 64, 4, generator=generator).flatten(), minlength=64) == 0).sum())
            for _ in range(400)
        ]
        mean = sum(draws) / len(draws)
        return f"T=32, E=64, K=4: {fn(32, 64, 4):.2f} expected, {mean:.2f} over 400 draws"

    return _check("expected empty experts", attempt)


# ================================================================ notebook 03


def check_p1_cost(fn) -> bool:
    """Exercise 03.1: ``fn(T, H, I) -> (flops, bytes)`` of P1 in bf16: its GEMMs' FLOPs (two per multiply-add) and
    every input read and output written once. Checked against ``moe_lib.roofline.cost``."""

    def attempt():
        for T, H, I in ((1, 2048, 768), (4093, 2048, 768), (300, 1000, 300), (64, 4096, 1536)):
            want = roofline.cost("swiglu_down_backward", T, hidden_size=H, intermediate_size=I)
            got = tuple(_answer(fn(T, H, I)))
            if tuple(map(int, got)) != tuple(map(int, want)):
                raise AssertionError(f"T={T}, H={H}, I={I}: {got}, expected {want}")
        return ""

    return _check("P1's FLOPs and bytes", attempt)


def check_ridge_crossing(fn) -> bool:
    """Exercise 03.2: ``fn(H, I, peak_flops, bandwidth) -> T*``, the token count where P1's intensity reaches the
    ridge peak / bandwidth (inf where it never does). Checked against ``moe_lib.lab.roofline.ridge_crossing``."""
    from .roofline import ridge_crossing

    def attempt():
        for gpu in ("H100-SXM", "H200", "B200"):
            spec = roofline.GPUS[gpu]
            for H, I in ((2048, 768), (4096, 1536), (7168, 2048)):
                want = ridge_crossing("swiglu_down_backward", spec, hidden_size=H, intermediate_size=I)
                got = float(_answer(fn(H, I, spec.bf16_dense_flops, spec.dram_bandwidth)))
                if not math.isclose(got, want, rel_tol=1e-9):
                    raise AssertionError(f"{gpu}, H={H}, I={I}: {got:.2f}, expected {want:.2f}")
        return ""

    return _check("ridge crossing", attempt)


def check_expert_intensity(fn) -> bool:
    """Exercise 03.3: ``fn(T, H, I, E, K) -> AI``, the arithmetic intensity (FLOP/byte, bf16) of one expert's
    up-projection [T·K/E, H] × [H, 2I] under uniform routing (SonicMoE's view). Checked against
    ``moe_lib.lab.roofline.expert_gemm_intensity``."""
    from .roofline import expert_gemm_intensity

    def attempt():
        for T, H, I, E, K in ((2048, 4096, 2048, 256, 8), (4096, 2048, 768, 128, 8), (4096, 4096, 14336, 8, 2)):
            want = float(expert_gemm_intensity(T, H, I, E, K))
            got = float(_answer(fn(T, H, I, E, K)))
            if not math.isclose(got, want, rel_tol=1e-9):
                raise AssertionError(f"T={T}, H={H}, I={I}, E={E}, K={K}: {got:.2f}, expected {want:.2f}")
        return ""

    return _check("an expert's arithmetic intensity", attempt)


# ================================================================ notebook 04


def check_grad_down_kernel(fn, seed: int | None = None) -> bool:
    """Exercise 04.1: ``fn(dy, a) -> dWd``, dWd = dyᵀ · a [H, I] (a reduction over the T tokens) by a Triton kernel
    of your own, fp32 in and out. Checked against float64 on shapes whose T, H and I are no multiple of 16 (the
    masks must hold)."""

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        worst = 0.0
        for T, H, I in ((5, 48, 32), (37, 20, 24), (16, 33, 17)):
            dy = torch.randn(T, H, generator=generator)
            a = torch.randn(T, I, generator=generator)
            want = dy.double().T @ a.double()
            worst = max(worst, _close(f"dWd at T={T}, H={H}, I={I}", _answer(fn(dy, a)), want, 1e-5))
        return f"worst relative error {worst:.1e}"

    return _check("dWd kernel", attempt)


def check_split_ranges(fn) -> bool:
    """Exercise 04.2: ``fn(K, SPLIT, BLOCK_K) -> [(start, end), ...]``, the piece of a reduction of length K each of
    SPLIT programs takes: BLOCK_K-aligned starts, in order, covering [0, K) once (trailing pieces may be empty), as
    the kernels' ``split_range`` cuts it. Checked against ``moe_lib.tiling.split_ranges``."""

    def attempt():
        for K, split, block in ((2048, 4, 64), (1536, 8, 64), (100, 4, 16), (16, 8, 16), (768, 3, 32)):
            want = split_ranges(K, split, block)
            got = [tuple(piece) for piece in _answer(fn(K, split, block))]
            if got != want:
                raise AssertionError(f"K={K}, SPLIT={split}, BLOCK_K={block}: {got}, expected {want}")
        return ""

    return _check("split ranges", attempt)


def check_ring_schedule(fn, buffers=(2, 3, 4, 6), steps: int = 23, runs: int = 40, seed: int | None = None) -> bool:
    """Exercise 04.3: ``fn(step, BUFFERS) -> (buffer, ready_parity, empty_parity)``: which buffer of the ring ring
    step ``step`` uses, the parity the multiplying warps wait for on its *ready* barrier and the parity the loading
    warp waits for on its *empty* barrier (``load_steps``, ``mma_steps``). Checked by running a producer and a
    consumer over the ring in many random orders (:func:`moe_lib.lab.ring.simulate`): no deadlock, no buffer read
    before it is written or overwritten before it is read."""

    def attempt():
        _answer(fn(0, 2))
        rng = random.Random(_seed(seed))
        for depth in buffers:
            for _ in range(runs):
                run = simulate(fn, depth, steps, seed=rng.randrange(2**31))
                if run.error:
                    raise AssertionError(f"BUFFERS={depth}: {run.error}")
        return f"{runs} random orders at each of BUFFERS = {', '.join(map(str, buffers))}"

    return _check("ring schedule", attempt)


# ================================================================ notebook 06


def check_expert_partition(fn) -> bool:
    """Exercise 06.1: ``fn(E, W) -> [range, ...]``, the experts each of W ranks holds: contiguous blocks, the first
    E mod W ranks one expert more. Checked against ``moe_lib.distributed.expert_partition``."""

    def attempt():
        for E, W in ((8, 2), (6, 4), (256, 3), (3, 4), (5, 5)):
            want = [list(block) for block in expert_partition(E, W)]
            got = [list(block) for block in _answer(fn(E, W))]
            if got != want:
                raise AssertionError(f"E={E}, W={W}: {got}, expected {want}")
        return ""

    return _check("expert partition", attempt)


def check_rows_sent(fn, seed: int | None = None) -> bool:
    """Exercise 06.2: ``fn(topk_indices, E, W) -> [[int]] (W × W)``: the rows rank r sends to rank s in the dispatch,
    rank r holding the r-th block of tokens and rank s the experts of ``expert_partition(E, W)[s]``. Checked
    against the count the live run's test makes."""
    from .parallel_live import expected_rows_sent

    def attempt():
        generator = torch.Generator().manual_seed(_seed(seed))
        for tokens_per_rank, E, K, W in ((5, 8, 2, 2), (7, 5, 2, 3), (4, 16, 4, 4)):
            indices = route_tokens(tokens_per_rank * W, E, K, routing="skewed", generator=generator)
            want = expected_rows_sent(indices, E, W)
            got = [[int(n) for n in row] for row in _answer(fn(indices, E, W))]
            if got != want:
                raise AssertionError(f"E={E}, K={K}, W={W}: {got}, expected {want}")
        return ""

    return _check("rows sent", attempt)


def check_exchange_bytes(fn) -> bool:
    """Exercise 06.3: ``fn(T_r, K, H, W, b, b_w) -> bytes``: what one rank sends to the *other* ranks in a forward +
    backward step when the routing is balanced (T_r·K·(W−1)/W rows each way), hidden rows of H·b bytes and a routing
    weight or its gradient of b_w bytes in the forward dispatch and the backward combine; the small counts exchange
    left out. Checked against ``moe_lib.lab.parallel.exchange_bytes``."""
    from .parallel import exchange_bytes

    def attempt():
        for tokens, K, H, W, b, b_w in ((8192, 8, 4096, 2, 2, 4), (2048, 8, 7168, 8, 2, 4), (64, 2, 32, 4, 8, 8)):
            rows = tokens * K // W  # to each rank, itself included
            table = exchange_bytes(
                [rows] * W, [rows] * W, 0, hidden_size=H, element_bytes=b, weight_bytes=b_w, max_local_experts=1
            ).drop(index="counts_exchange")
            want = int(table["bytes out"].sum())
            got = int(_answer(fn(tokens, K, H, W, b, b_w)))
            if got != want:
                raise AssertionError(f"T_r={tokens}, K={K}, H={H}, W={W}: {got:,} bytes, expected {want:,}")
        return ""

    return _check("exchange bytes", attempt)
