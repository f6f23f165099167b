"""P1's few-token design (``moe_lib/swiglu_down/few_tokens.py``): compile it offline, or check and time it on a GPU.

    PYTHONPATH=. python scripts/p1_few_tokens_check.py --compile-only [CANDIDATE ...]
    PYTHONPATH=. python scripts/p1_few_tokens_check.py [--tokens 1,2,4,8,16,32,64,128] [CANDIDATE ...]

--compile-only (no GPU needed: triton's ptxas and cuobjdump): each candidate compiled for sm_90 at H =
2048, I = 768 in bf16, both precisions, the straight-line form (T ≤ block_t) and the token-loop form;
prints registers, stack (a spill shows as a non-zero STACK), shared memory and the wgmma count.

On a GPU, per token count and precision: each candidate (and the current default path,
``swiglu_down_backward(..., precision=...)``) is checked against the float64 reference on the harness's
input distribution (faithful: the benchmark's element rule and at most the careful PyTorch bf16 error
+ 1e-4; fast: at most 2× that error + 1e-4), twice (bitwise equal), then timed by CUDA-graph replay with
the L2 flushed before each replay, and by the official span (eager calls on fresh input addresses,
first kernel start to last kernel end) where cupti-python imports. A candidate that fails to compile,
hangs in a first call (a watchdog ends the run after 60 s, naming it), or is wrong is reported, and the
run goes on. Prints one table; with $OUT set, writes the rows as JSON there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading

H, I = 2048, 768

# the default's tiles and the staging of its operands (a_reg_cl_st_mv below): what the later candidates vary
MOVES = dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers", count_late=True,
             stage_before_wait=True, once_by_move=True)
# name -> FewTokensConfig fields (block_t is set per token count where the name does not fix it)
CANDIDATES = {
    # 96 programs: a 256×64 Wd tile (128 B rows) and a 128×128 Wg/Wu tile (256 B rows) each
    "a_pf": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="prefetch"),
    "a_reg": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers"),
    "a_late": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="after_phase1"),
    "a_pf_w4": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="prefetch", warps=4),
    # 96 programs, other splits: more dA partials and 256 B Wd rows / fewer dA partials and 64 B Wd rows
    "b_pf": dict(block_h1=128, block_i1=128, block_i2=128, block_h2=128, weights_ahead="prefetch"),
    "c_pf": dict(block_h1=512, block_i1=32, block_i2=128, block_h2=128, weights_ahead="prefetch"),
    # 96 programs: 64-row phase-2 tiles (12 dx partials of 512 B rows)
    "d_pf": dict(block_h1=256, block_i1=64, block_i2=64, block_h2=256, weights_ahead="prefetch"),
    # 132 programs, one per SM of an H200: 11 phase-1 tiles of 187 rows along H (256-row blocks, the rest masked)
    # × 12 of 64 columns; phase 2 in 6 × 22 tiles of 128 rows × 94 columns, or 12 × 11 tiles of 64 × 187.
    # The run-time H bounds cost registers: 72–168 bytes of stack at 16 tokens (a_reg: none), 700 with 187 columns
    "a_reg_132": dict(block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94,
                      weights_ahead="registers"),
    # a_reg as a cooperative launch (CUDA guarantees every program resident, or refuses the launch)
    "a_reg_coop": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers",
                       cooperative=True),
    # a_reg on 16 warps: half the instructions per warp, four warps per scheduler to hide each other's latency
    # (ncu at 1 token: ≈ 2200 instructions per warp at 9 cycles each on 8 warps, two per scheduler)
    "a_reg_w16": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers", warps=16),
    "a_pf_w16": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="prefetch", warps=16),
    # a_reg reading the launch count just before the wait: the weight tiles' staging no longer waits for that atomic
    "a_reg_cl": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers", count_late=True),
    "a_late_cl": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="after_phase1",
                      count_late=True),
    # a_reg_cl with phase 2's operands staged in shared memory before the wait
    "a_reg_cl_st": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers",
                        count_late=True, stage_before_wait=True),
    # a_reg_cl_st with the dot operands' staging placed by identity moves instead of selects (18% fewer instructions)
    "a_reg_cl_st_mv": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers",
                           count_late=True, stage_before_wait=True, once_by_move=True),
    # the same with Wg, Wu prefetched into L2 at the start instead of loaded into registers (phase 1 then waits for
    # fewer bytes of its own: 5.1 against 5.9 µs to the dA partial in the trace, before count_late)
    "a_pf_cl_st_mv": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="prefetch",
                          count_late=True, stage_before_wait=True, once_by_move=True),
    # the default as a cooperative launch (CUDA guarantees residency: no hang beside another stream's kernel)
    "a_reg_cl_st_coop": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers",
                             count_late=True, stage_before_wait=True, cooperative=True),
    # the default with its token loops (more tokens than block_t) software-pipelined by Triton (num_stages=2: every
    # load of a loop issued one token block ahead, into shared memory by cp.async); compiled for sm_90 no spill, 152 KB
    "a_mv_s2": dict(MOVES, stages=2),
    # the same with phase 2's token loop done in one pass (dx partial and dWg, dWu from each block's dGate, dUp);
    # compiled for sm_90 no spill on the fast path, 104 B of stack on the faithful one
    "a_mv_s2_1p": dict(MOVES, stages=2, one_pass=True),
    # the one pass without the pipelining (compiled for sm_90: 152 B of stack on the faithful path)
    "a_mv_1p": dict(MOVES, one_pass=True),
    # a_mv_s2 with Wg, Wu prefetched into L2 at the start instead of held in registers through phase 1
    "a_pf_mv_s2": dict(MOVES, weights_ahead="prefetch", stages=2),
    # up to 64 tokens in one straight-line block (compiled for sm_90: 24-32 B of stack)
    "a_mv_t64": dict(MOVES, block_t=64),
    # up to 128 tokens in one straight-line block (compiled for sm_90: 700 B of stack on 8 warps; 400-530 B on 16)
    "a_mv_t128": dict(MOVES, block_t=128),
    "a_mv_t128_w16": dict(MOVES, block_t=128, warps=16),
    # the default (all tokens in one block to 128) with the saved gate, sigmoid, silu, up tiles loaded after phase 1
    # instead of at the start: compiled for sm_90, 88 B of stack at 128 tokens (700 without), none at 64 (24-32)
    "a_mv_late": dict(MOVES, saved_late=True),
    # the same with Wg, Wu prefetched into L2 at the start (72 B of stack at 128 tokens; 122 registers at 16)
    "a_pf_late": dict(MOVES, weights_ahead="prefetch", saved_late=True),
    # dx's sum over the I-blocks split by rows over 2 or 4 programs of each column block instead of the last to arrive
    # summing all of them (at 128 tokens the last arrival's 393 KB sum took 10 µs, "Design 10" in NOTES)
    "a_mv_late_s2": dict(MOVES, saved_late=True, dx_sum_slices=2, cooperative=True),
    "a_mv_late_s4": dict(MOVES, saved_late=True, dx_sum_slices=4, cooperative=True),
    # the same with 4 phase-1 tiles along H instead of 8 (512×32 Wd tiles, 64 B rows): half the dA partials for each
    # phase-2 program to sum (at 128 tokens 256 KB against 512); compiled for sm_90 its Wd tile spills (152 B of stack
    # at 64 tokens, 1.2 KB at 128): not run
    "c_late_s4": dict(MOVES, block_h1=512, block_i1=32, saved_late=True, dx_sum_slices=4, cooperative=True),
    # 64-row phase-2 tiles of 256 columns (12 × 8): each phase-2 program sums half the dA partial bytes (the same 8
    # H-blocks, 64 of I's columns instead of 128), dx's sum over 12 I-blocks split by rows over 8 programs
    "d_late_s8": dict(MOVES, block_i2=64, block_h2=256, saved_late=True, dx_sum_slices=8, cooperative=True),
    # the same with the saved tiles loaded at the start (the default's placement up to 32 tokens), or dx's sum over 4
    "d_s8": dict(MOVES, block_i2=64, block_h2=256, dx_sum_slices=8, cooperative=True),
    "d_late_s4": dict(MOVES, block_i2=64, block_h2=256, saved_late=True, dx_sum_slices=4, cooperative=True),
    # 32-row phase-2 tiles of 512 columns (24 × 4): a quarter of the default's dA partial bytes per program, dx's sum
    # over 24 I-blocks split by rows over 8 or 16 programs
    "e_late_s8": dict(MOVES, block_i2=32, block_h2=512, saved_late=True, dx_sum_slices=8, cooperative=True),
    "e_late_s16": dict(MOVES, block_i2=32, block_h2=512, saved_late=True, dx_sum_slices=16, cooperative=True),
    "a_mv_s4": dict(MOVES, dx_sum_slices=4, cooperative=True),
    # one token: the default's tiles with every product on the CUDA cores (fp32 FMAs): no staging of operands in
    # shared memory, no transposed tiles converted before their stores (refuses more tokens)
    "fma": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, cooperative=True, cuda_cores=True),
    "fma_w16": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, cooperative=True, cuda_cores=True, warps=16),
    # 64-row phase-2 tiles (512 B rows): shorter sums down the rows for dx, 12 dx partials to add at the end
    "fma_d": dict(block_h1=256, block_i1=64, block_i2=64, block_h2=256, cooperative=True, cuda_cores=True),
    # 128 and 132 programs, a smaller share of the weights each (72 and 71 KB against 96): 96 of 128 columns of I per
    # tile (16 × 8 tiles in both phases), or 187 of 256 rows of H (11 × 12 and 12 × 11)
    "fma_128": dict(block_h1=128, block_i1=128, span_i1=96, block_i2=128, span_i2=96, block_h2=128, cooperative=True,
                    cuda_cores=True),
    "fma_132": dict(block_h1=256, span_h1=187, block_i1=64, block_i2=64, block_h2=256, span_h2=187, cooperative=True,
                    cuda_cores=True),
    "a_pf_132": dict(block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94,
                     weights_ahead="prefetch"),
    "a_reg_132b": dict(block_h1=256, span_h1=187, block_i1=64, block_i2=64, block_h2=256, span_h2=187,
                       weights_ahead="registers"),
    # the defaults (d_late_s8 from 2 tokens, fma at 1) with phase 1's dWd tile after phase 2's stores instead of
    # before the wait, where it held up each program's first poll (NOTES, "Design 5 traced")
    "d_late_s8_gdl": dict(MOVES, block_i2=64, block_h2=256, saved_late=True, dx_sum_slices=8, cooperative=True,
                          grad_down_late=True),
    "fma_gdl": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, cooperative=True, cuda_cores=True,
                    grad_down_late=True),
    # 48 programs with twice the weight bytes each (fewer, larger tiles), for comparison
    "e_pf": dict(block_h1=256, block_i1=128, block_i2=128, block_h2=256, weights_ahead="prefetch"),
}
# the two-launch design with its own tiles for the token count (what runs from 129 tokens on): whether the
# faithful path's one launch up to 128 tokens (ONE_LAUNCH_MAX_TOKENS) still pays in the official span now that
# both launches' workspaces are allocated before the first (GPU runs only)
TWO_LAUNCHES = "two_launches"
# a_pf_w4 and e_pf spill (see --compile-only)
DEFAULT_CANDIDATES = ["a_reg", "a_reg_coop", "a_reg_132", "a_pf_132", "a_reg_132b"]
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]


def candidate_config(name: str, num_tokens: int, precision: str = "faithful"):
    from moe_lib.swiglu_down.few_tokens import FewTokensConfig, choose_few_tokens_config
    from moe_lib.swiglu_down.launch import choose_config

    if name == TWO_LAUNCHES:  # no one-launch design fits in zero resident programs
        return choose_config(num_tokens, H, I, interpreter=False, with_lo=precision == "faithful", max_programs=0)
    fields = dict(CANDIDATES[name])
    fields.setdefault("block_t", choose_few_tokens_config(num_tokens, H, I, interpreter=False, with_lo=True).block_t)
    return FewTokensConfig(**fields)


# ---------------------------------------------------------------------------------------------
# offline compile


def compile_candidate(config, *, with_lo: bool, single_block: bool, trace: bool = False):
    """The kernel of ``config`` for bf16 inputs at H × I, compiled for sm_90 (PHASE 0, as the GPU runs it)."""
    from moe_lib.bench.sm90 import compile_for_sm90, runtime_names
    from moe_lib.swiglu_down.few_tokens import WEIGHTS_AHEAD, few_tokens_kernel, one_token_kernel

    n_h1, n_i1, n_i2, n_h2 = config.tiles(H, I)
    span_h1, span_h2 = config.spans
    kernel = one_token_kernel if config.cuda_cores else few_tokens_kernel
    if config.cuda_cores:  # one form (T ≤ block_t), one precision (exact fp32 products)
        constexprs = dict(PHASE=0, BLOCK_H1=config.block_h1, BLOCK_I1=config.block_i1, BLOCK_I2=config.block_i2,
                          BLOCK_H2=config.block_h2, SPAN_H1=span_h1, SPAN_I1=config.i_spans[0],
                          SPAN_I2=config.i_spans[1], SPAN_H2=span_h2, N_H1=n_h1, N_I1=n_i1, N_I2=n_i2, N_H2=n_h2,
                          THREADS=32 * config.warps, TRACE=trace, GRAD_DOWN_LATE=config.grad_down_late, H=H,
                          I=I)  # fmt: skip
    else:
        constexprs = dict(PHASE=0, BLOCK_T=config.block_t, BLOCK_H1=config.block_h1, BLOCK_I1=config.block_i1,
                          SPAN_H1=span_h1, SPAN_H2=span_h2, BLOCK_I2=config.block_i2, BLOCK_H2=config.block_h2,
                          N_H1=n_h1, N_I1=n_i1, N_I2=n_i2, N_H2=n_h2,
                          SINGLE_BLOCK=single_block, WEIGHTS_AHEAD=WEIGHTS_AHEAD[config.weights_ahead],
                          THREADS=32 * config.warps, UPCAST=False, PRECISION="tf32", WITH_LO=with_lo,
                          TRACE=trace, COUNT_LATE=config.count_late, STAGE_EARLY=config.stage_before_wait,
                          ONCE_BY_MOVE=config.once_by_move, ONE_PASS=config.one_pass, SAVED_LATE=config.saved_late,
                          DX_SUM_SLICES=config.dx_sum_slices if single_block else 1,
                          GRAD_DOWN_LATE=config.grad_down_late and single_block, H=H, I=I)  # fmt: skip

    def kind(name: str) -> str:
        if name.endswith("partials_ptr"):
            return "*fp32"
        if name in ("counters_ptr", "trace_ptr"):
            return "*i64"
        return "*bf16" if name.endswith("_ptr") else "i32"

    names = runtime_names(kernel)
    types = {name: kind(name) for name in names}
    aligned = [name for name in names if name.endswith("_ptr")]
    return compile_for_sm90(kernel, types, constexprs, aligned, warps=config.warps, stages=config.stages)


def compile_only(names: list[str]) -> None:
    from moe_lib.bench.sm90 import first_error_line, resources

    print(f"H={H} I={I} bf16, sm_90; forms: T ≤ block_t (straight line) and T > block_t (token loops)")
    print(f"{'candidate':10s} {'grid':>4s} {'block_t':>7s} {'precision':9s} {'form':8s} resources")
    for name in names:
        for block_t in (1,) if CANDIDATES[name].get("cuda_cores") else (16, 32, 64):
            config = dataclasses.replace(candidate_config(name, 1), block_t=block_t)
            for precision, with_lo in (("faithful", True), ("fast", False)):
                if CANDIDATES[name].get("cuda_cores") and not with_lo:
                    continue  # exact fp32 products: one kernel for both paths
                for form, single in (("T<=bt", True), ("loop", False)):
                    if (block_t > 16 or CANDIDATES[name].get("cuda_cores")) and not single and name != "a_pf":
                        continue  # the loop form's block_t: a_pf's alone
                    try:
                        report = resources(compile_candidate(config, with_lo=with_lo, single_block=single))
                    except Exception as exc:  # report and go on
                        report = "FAIL " + first_error_line(exc, 120)
                    print(f"{name:10s} {config.grid_size(H, I):4d} {block_t:7d} {precision:9s} {form:8s} {report}",
                          flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# GPU


def check(got, inputs: dict, want, yardstick, precision: str, rule) -> tuple[bool, float, str]:
    """(ok, worst relative error, why not ok) of the four outputs under the precision's rule."""
    from moe_lib.bench.checks import compare_output

    worst, why = 0.0, ""
    for name, g, w, y in zip(("dx", "dWg", "dWu", "dWd"), got, want, yardstick, strict=True):
        result = compare_output(g, w, rule)
        worst = max(worst, result["rel_error"])
        if not result["finite"]:
            why += f"{name}: NaN/Inf; "
        elif precision == "faithful" and (result["pass_fraction"] < rule["required_fraction"]
                                          or result["rel_error"] > y + 1e-4):  # fmt: skip
            why += f"{name}: pass {result['pass_fraction']:.4f} err {result['rel_error']:.3g} vs {y:.3g}; "
        elif precision == "fast" and result["rel_error"] > 2 * y + 1e-4:
            why += f"{name}: err {result['rel_error']:.3g} vs {y:.3g}; "
    return not why, worst, why


def first_call_with_watchdog(label: str, call, seconds: float = 60.0):
    """Runs ``call`` and synchronises; ends the process (exit 3) if that takes more than ``seconds`` (a
    spin-wait that never ends cannot be interrupted otherwise)."""
    import torch

    def give_up():
        print(f"HANG: {label} did not finish within {seconds:.0f} s; ending the run", flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, give_up)
    timer.start()
    try:
        out = call()
        torch.cuda.synchronize()
    finally:
        timer.cancel()
    return out


def on_gpu(names: list[str], tokens: list[int], reps: int) -> None:
    import torch

    from moe_lib import problems, reference
    from moe_lib.bench import official_timing, timing
    from moe_lib.bench.checks import compare_output
    from moe_lib.bench.peers.swiglu_down import swiglu_down_backward_eager
    from moe_lib.swiglu_down import swiglu_down_backward
    from moe_lib.swiglu_down.launch import swiglu_down_backward_triton

    problem = problems.load("swiglu_down_backward")
    rule = problem.element_rule
    flush = timing.L2Flusher("cuda")
    official_reason = official_timing.unavailable(torch.device("cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, f"official timing: {official_reason or 'yes'}", flush=True)
    scratch = torch.zeros(1, device="cuda")
    floor = timing.graph_median_ms(lambda: scratch.add_(1), flush) * 1e3
    print(f"timing floor (graph of one tiny kernel): {floor:.2f} us", flush=True)
    rows = []
    for T in tokens:
        inputs = problem.make_inputs(T, seed=T, device="cuda", distribution="harness")
        want = reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])
        w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
        careful = swiglu_down_backward_eager(
            inputs["grad_output"], inputs["x"], w_gate_up, inputs["down_weight"], inputs["gate"],
            inputs["gate_sigmoid"], inputs["gate_silu"], inputs["up"], inputs["intermediate"])  # fmt: skip
        yardstick = [compare_output(c, w, None)["rel_error"] for c, w in zip(careful, want, strict=True)]
        for precision in ("faithful", "fast"):
            runs = {"default": lambda fresh, p=precision: swiglu_down_backward(*fresh.values(), precision=p)}
            for name in names:
                config = candidate_config(name, T, precision)
                runs[name] = lambda fresh, c=config, p=precision: swiglu_down_backward_triton(
                    *fresh.values(), config=c, precision=p
                )
            for name, run in runs.items():
                row = dict(T=T, precision=precision, config=name)
                try:
                    timing.poison_allocator("cuda", 256 * 2**20)
                    got = first_call_with_watchdog(f"{name} T={T} {precision}", lambda: run(inputs))
                    again = run(inputs)
                    row["ok"], row["max_err"], why = check(got, inputs, want, yardstick, precision, rule)
                    row["deterministic"] = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
                    if why:
                        row["why"] = why
                    del got, again
                    row["graph_us"] = timing.graph_median_ms(lambda: run(inputs), flush, reps=reps) * 1e3
                    if official_reason is None:
                        measured = official_timing.time_official(lambda fresh: (lambda: run(fresh)), inputs, "cuda",
                                                                 warmup=5, reps=reps)  # fmt: skip
                        row["official_us"] = timing.summarize(measured["samples_ms"])["median_ms"] * 1e3
                except Exception as exc:  # a candidate that fails to compile or run: report it and go on
                    lines = str(exc).strip().splitlines() or [""]
                    row["error"] = f"{type(exc).__name__}: {lines[-1][:200]}"
                rows.append(row)
                print({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    print_table(rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "p1_few_tokens_check.json"), "w") as f:
            json.dump(dict(floor_us=floor, rows=rows), f, indent=1)


def print_table(rows: list[dict]) -> None:
    """One line per (T, precision): graph µs (official µs) per config; '!' marks a wrong or failed one."""
    configs = list(dict.fromkeys(row["config"] for row in rows))
    print("\ngraph-replay µs (official span µs); ! = wrong or failed, ~ = not deterministic")
    print(f"{'T':>5s} {'precision':9s} " + " ".join(f"{c:>16s}" for c in configs))
    keys = list(dict.fromkeys((row["T"], row["precision"]) for row in rows))
    for T, precision in keys:
        cells = []
        for c in configs:
            row = next((r for r in rows if (r["T"], r["precision"], r["config"]) == (T, precision, c)), None)
            if row is None or "graph_us" not in row:
                cells.append(f"{'!error':>16s}")
                continue
            text = f"{row['graph_us']:.1f}" + (f" ({row['official_us']:.1f})" if "official_us" in row else "")
            mark = ("" if row.get("ok") else "!") + ("" if row.get("deterministic") else "~")
            cells.append(f"{mark + text:>16s}")
        print(f"{T:5d} {precision:9s} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 on this machine, no GPU")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of token counts")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("candidates", nargs="*", metavar="CANDIDATE",
                        help=f"of {', '.join(CANDIDATES)}, {TWO_LAUNCHES} (default: all few-token ones with "
                             f"--compile-only, else "
                             f"{', '.join(DEFAULT_CANDIDATES)})")  # fmt: skip
    args = parser.parse_args()
    unknown = [name for name in args.candidates if name not in CANDIDATES and name != TWO_LAUNCHES]
    if unknown:
        parser.error(f"CANDIDATE: unknown {unknown} (known: {', '.join(CANDIDATES)}, {TWO_LAUNCHES})")
    if args.compile_only and TWO_LAUNCHES in args.candidates:
        parser.error(f"CANDIDATE: {TWO_LAUNCHES} is compiled by scripts/p1_compile_check.py, not here")
    if args.compile_only:
        return compile_only(args.candidates or list(CANDIDATES))
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    on_gpu(args.candidates or DEFAULT_CANDIDATES, [int(t) for t in args.tokens.split(",")], args.reps)


if __name__ == "__main__":
    main()
