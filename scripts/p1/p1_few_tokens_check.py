"""P1's few-token design (``moe_lib/swiglu_down/designs/few_tokens.py``): compile it offline, or check and time it.

    PYTHONPATH=. python scripts/p1/p1_few_tokens_check.py --compile-only [--shapes 2048x768,4096x1536] [--tokens 1,7]
        [--sms 132] [--json PATH] [CANDIDATE ...]
    PYTHONPATH=. python scripts/p1/p1_few_tokens_check.py [--shapes ...] [--tokens 1,2,4,8,16,32,64,128] [CANDIDATE ...]

Configs: "chosen" (``FewTokensConfig.for_shape`` for the shape, the token count and the SMs: what the chooser runs)
and each named CANDIDATE: a variant of the chosen tiles (:data:`VARIANTS`, any shape) or tiles of its own at the
benchmark's shape (:data:`CANDIDATES`, H 2048, I 768 only).

--compile-only (no GPU needed: triton's ptxas and cuobjdump): each config compiled for sm_90 per shape, token count
and precision (bf16); prints registers, stack (a spill shows as a non-zero STACK), shared memory, the wgmma count,
the grid and the H-chunks per tile of each phase. A config the design's ``supports`` refuses on an H200-like device
(--sms SMs, 227 KB of shared memory) is reported with the reason instead. Kernels with the same compile-time
arguments are compiled once. ``--json PATH`` writes the rows there.

On a GPU, per shape, token count and precision: each config (and the default path,
``swiglu_down_backward(..., precision=...)``) is checked against the float64 reference on the harness's input
distribution (faithful: the benchmark's element rule and at most the careful PyTorch bf16 error + 1e-4; fast: at
most 2× that error + 1e-4), twice (bitwise equal), then timed by CUDA-graph replay with the L2 flushed before each
replay (and the weights' bytes over that time), and by the official span (eager calls on fresh input addresses,
first kernel start to last kernel end) where cupti-python imports. A config that fails to compile, hangs in a first
call (a watchdog ends the run after 60 s, naming it), or is wrong is reported, and the run goes on. Prints one
table; with $OUT set, writes the rows as JSON there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import threading

BENCHMARK_SHAPE = (2048, 768)
CHOSEN = "chosen"
# the default's tiles at the benchmark's shape from 2 tokens (d_late_s8 below): what the candidates vary
MOVES = dict(
    block_h1=256,
    block_i1=64,
    block_i2=128,
    block_h2=128,
    weights_ahead="registers",
    count_late=True,
    stage_before_wait=True,
    once_by_move=True,
)
# name -> FewTokensConfig fields at H 2048, I 768 (block_t is set per token count); what each measured:
# notes/p1/design-05.md, design-09.md to design-12.md
CANDIDATES = {
    # 96 programs: a 256×64 Wd tile (128 B rows) and a 128×128 Wg/Wu tile (256 B rows) each, Wg, Wu in registers
    "a_reg": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, weights_ahead="registers"),
    # 132 programs, one per SM of an H200: 11 phase-1 tiles of 187 rows along H (256-row blocks, the rest masked)
    # × 12 of 64 columns; phase 2 in 6 × 22 tiles of 128 rows × 94 columns, or 12 × 11 tiles of 64 × 187
    "a_reg_132": dict(
        block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94, weights_ahead="registers"
    ),
    "a_pf_132": dict(
        block_h1=256, span_h1=187, block_i1=64, block_i2=128, block_h2=128, span_h2=94, weights_ahead="prefetch"
    ),
    "a_reg_132b": dict(
        block_h1=256, span_h1=187, block_i1=64, block_i2=64, block_h2=256, span_h2=187, weights_ahead="registers"
    ),
    # the launch count read late, phase 2 staged before the wait, by identity moves
    "a_reg_cl_st_mv": dict(MOVES),
    # the default from 2 tokens: 64-row phase-2 tiles of 256 columns, the saved tiles after phase 1, dx's sum by rows
    "d_late_s8": dict(MOVES, block_i2=64, block_h2=256, saved_late=True, dx_sum_slices=8, cooperative=True),
    "d_late_s8_gdl": dict(
        MOVES, block_i2=64, block_h2=256, saved_late=True, dx_sum_slices=8, cooperative=True, grad_down_late=True
    ),
    # one token: every product on the CUDA cores (the default at 1 token), and variants of its tiles
    "fma": dict(block_h1=256, block_i1=64, block_i2=128, block_h2=128, cooperative=True, cuda_cores=True),
    "fma_128": dict(
        block_h1=128,
        block_i1=128,
        span_i1=96,
        block_i2=128,
        span_i2=96,
        block_h2=128,
        cooperative=True,
        cuda_cores=True,
    ),
    "fma_132": dict(
        block_h1=256,
        span_h1=187,
        block_i1=64,
        block_i2=64,
        block_h2=256,
        span_h2=187,
        cooperative=True,
        cuda_cores=True,
    ),
    "fma_gdl": dict(
        block_h1=256, block_i1=64, block_i2=128, block_h2=128, cooperative=True, cuda_cores=True, grad_down_late=True
    ),
}
# name -> fields replaced in the chosen config (any shape): the streamed chunk loops' pipelining depth
VARIANTS = {
    "stages1": dict(chunk_stages=1),
    "stages2": dict(chunk_stages=2),
    "stages4": dict(chunk_stages=4),
}
DEFAULT_CANDIDATES = []
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]
DEFAULT_SMS = 132  # an H200


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """ "2048x768,4096x1536" -> [(2048, 768), (4096, 1536)]."""
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"expected a comma list of HxI, e.g. 2048x768,4096x1536; got {text!r}")
    return shapes


def candidate_config(name: str, num_tokens: int, shape: tuple[int, int] = BENCHMARK_SHAPE, sms: int = DEFAULT_SMS):
    """The config ``name`` stands for at ``num_tokens`` and ``shape`` (None where a CANDIDATE's fixed tiles are for
    the benchmark's shape only)."""
    from moe_lib.swiglu_down.designs.few_tokens import FewTokensConfig

    chosen = FewTokensConfig.for_shape(num_tokens, *shape, sms)
    if name == CHOSEN:
        return chosen
    if name in VARIANTS:
        return dataclasses.replace(chosen, **VARIANTS[name])
    if shape != BENCHMARK_SHAPE:
        return None
    fields = dict(CANDIDATES[name])
    fields.setdefault("block_t", max(16, chosen.block_t))
    return FewTokensConfig(**fields)


def h200_like(sms: int):
    """The device ``supports`` is asked about offline: ``sms`` SMs, sm_90's shared memory."""
    from moe_lib.bench.sm90 import SHARED_MEMORY_LIMIT
    from moe_lib.swiglu_down.runtime import Device

    return Device("cuda", sms, SHARED_MEMORY_LIMIT, (9, 0), "offline sm_90")


# ---------------------------------------------------------------------------------------------
# offline compile


def compile_config(config, hidden_size: int, intermediate_size: int, *, with_lo: bool):
    """The kernel ``config`` launches for bf16 inputs at H × I, compiled for sm_90 (PHASE 0, as the GPU runs it)."""
    from moe_lib.bench.sm90 import compile_for_sm90
    from moe_lib.swiglu_down.designs.few_tokens import kernel_argument_types

    kernel, constexprs = config.launch(hidden_size, intermediate_size, with_lo=with_lo)
    types = kernel_argument_types(kernel)
    aligned = [name for name in types if name.endswith("_ptr")]
    return compile_for_sm90(kernel, types, constexprs, aligned, warps=config.warps, stages=config.stages)


def usage(compiled) -> dict[str, int]:
    """{registers, stack, shared, wgmma} of a compiled kernel: per thread, bytes per thread (a spill), bytes per
    program, wgmma instructions."""
    from moe_lib.bench.sm90 import resources

    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", resources(compiled)).groups()
    return dict(
        registers=int(registers),
        stack=int(stack),
        shared=compiled.metadata.shared,
        wgmma=compiled.asm["ptx"].count("wgmma.mma_async"),
    )


def compile_rows(names: list[str], shapes: list[tuple[int, int]], tokens: list[int], sms: int) -> list[dict]:
    """One row per (config, shape, T, precision): its resources compiled for sm_90, or why it was not compiled."""
    import torch

    from moe_lib.bench.sm90 import first_error_line

    device = h200_like(sms)
    compiled = {}  # (kernel, constexprs, warps, stages) -> resources or error: each distinct kernel compiled once
    rows = []
    for H, I in shapes:
        for T in tokens:
            for name in names:
                config = candidate_config(name, T, (H, I), sms)
                if config is None:
                    continue
                for precision, with_lo in (("faithful", True), ("fast", False)):
                    row = dict(
                        config=name,
                        H=H,
                        I=I,
                        T=T,
                        precision=precision,
                        grid=config.grid_size(H, I),
                        chunks=list(config.chunks),
                        blocks=[config.block_h1, config.block_i1, config.block_i2, config.block_h2],
                    )
                    reason = config.supports(T, H, I, torch.bfloat16, device)
                    if reason is not None:
                        rows.append(dict(row, refused=reason))
                        continue
                    kernel, constexprs = config.launch(H, I, with_lo=with_lo)
                    key = (kernel.__name__, tuple(sorted(constexprs.items())), config.warps, config.stages)
                    if key not in compiled:
                        try:
                            compiled[key] = usage(compile_config(config, H, I, with_lo=with_lo))
                        except Exception as exc:  # report and go on
                            compiled[key] = dict(error=first_error_line(exc, 160))
                    rows.append(dict(row, **compiled[key]))
    return rows


def compile_only(names: list[str], shapes, tokens, sms: int, json_path: str | None) -> None:
    print(f"bf16, sm_90, {sms} SMs; REG registers per thread, STACK bytes (a spill), smem bytes per program")
    print(f"{'config':14s} {'H':>6s} {'I':>6s} {'T':>4s} {'precision':9s} {'grid':>4s} {'chunks':>8s}  resources")
    rows = compile_rows(names, shapes, tokens, sms)
    for row in rows:
        if "refused" in row:
            report = "refused: " + row["refused"]
        elif "error" in row:
            report = "FAIL " + row["error"]
        else:
            report = f"REG:{row['registers']} STACK:{row['stack']} smem={row['shared']} wgmma={row['wgmma']}"
        chunks = "×".join(map(str, row["chunks"]))
        print(
            f"{row['config']:14s} {row['H']:6d} {row['I']:6d} {row['T']:4d} {row['precision']:9s} "
            f"{row['grid']:4d} {chunks:>8s}  {report}",
            flush=True,
        )
    if json_path:
        from moe_lib.bench.tuning import write_out

        write_out("p1_few_tokens_compile.json", rows, path=json_path)


# ---------------------------------------------------------------------------------------------
# GPU


def check(got, want, yardstick, precision: str, rule) -> tuple[bool, float, str]:
    """(ok, worst relative error, why not ok) of the four outputs under the precision's rule."""
    from moe_lib.bench.checks import compare_output

    worst, why = 0.0, ""
    for name, g, w, y in zip(("dx", "dWg", "dWu", "dWd"), got, want, yardstick, strict=True):
        result = compare_output(g, w, rule)
        worst = max(worst, result["rel_error"])
        if not result["finite"]:
            why += f"{name}: NaN/Inf; "
        elif precision == "faithful" and (
            result["pass_fraction"] < rule["required_fraction"] or result["rel_error"] > y + 1e-4
        ):
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


def on_gpu(names: list[str], shapes, tokens: list[int], reps: int) -> None:
    import torch

    from moe_lib import problems, reference
    from moe_lib.bench import official_timing, timing
    from moe_lib.bench.checks import compare_output
    from moe_lib.bench.peers.swiglu_down import swiglu_down_backward_eager
    from moe_lib.bench.tuning import write_out
    from moe_lib.swiglu_down import swiglu_down_backward
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    problem = problems.load("swiglu_down_backward")
    rule = problem.element_rule
    flush = timing.L2Flusher("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    official_reason = official_timing.unavailable(torch.device("cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, f"official timing: {official_reason or 'yes'}", flush=True)
    scratch = torch.zeros(1, device="cuda")
    floor = timing.graph_median_ms(lambda: scratch.add_(1), flush) * 1e3
    print(f"timing floor (graph of one tiny kernel): {floor:.2f} us", flush=True)
    rows = []
    for H, I in shapes:
        for T in tokens:
            inputs = problem.make_inputs(
                T, seed=T, device="cuda", distribution="harness", hidden_size=H, intermediate_size=I
            )
            weight_bytes = 3 * H * I * inputs["x"].element_size()
            want = reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])
            w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
            careful = swiglu_down_backward_eager(
                inputs["grad_output"],
                inputs["x"],
                w_gate_up,
                inputs["down_weight"],
                inputs["gate"],
                inputs["gate_sigmoid"],
                inputs["gate_silu"],
                inputs["up"],
                inputs["intermediate"],
            )
            yardstick = [compare_output(c, w, None)["rel_error"] for c, w in zip(careful, want, strict=True)]
            del careful
            for precision in ("faithful", "fast"):
                runs = {"default": lambda fresh, p=precision: swiglu_down_backward(*fresh.values(), precision=p)}
                for name in names:
                    config = candidate_config(name, T, (H, I), sms)
                    if config is not None:
                        runs[name] = lambda fresh, c=config, p=precision: swiglu_down_backward_triton(
                            *fresh.values(), config=c, precision=p
                        )
                for name, run in runs.items():
                    row = dict(H=H, I=I, T=T, precision=precision, config=name)
                    try:
                        timing.poison_allocator("cuda", 256 * 2**20)
                        label = f"{name} H={H} I={I} T={T} {precision}"
                        got = first_call_with_watchdog(label, lambda: run(inputs))
                        again = run(inputs)
                        row["ok"], row["max_err"], why = check(got, want, yardstick, precision, rule)
                        row["deterministic"] = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
                        if why:
                            row["why"] = why
                        del got, again
                        row["graph_us"] = timing.graph_median_ms(lambda: run(inputs), flush, reps=reps) * 1e3
                        row["weight_tb_s"] = weight_bytes / row["graph_us"] / 1e6
                        if official_reason is None:
                            measured = official_timing.time_official(
                                lambda fresh: lambda: run(fresh), inputs, "cuda", warmup=5, reps=reps
                            )
                            row["official_us"] = timing.summarize(measured["samples_ms"])["median_ms"] * 1e3
                    except Exception as exc:  # a config that fails to compile or run: report it and go on
                        lines = str(exc).strip().splitlines() or [""]
                        row["error"] = f"{type(exc).__name__}: {lines[-1][:200]}"
                    rows.append(row)
                    print({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    print_table(rows)
    write_out("p1_few_tokens_check.json", dict(floor_us=floor, rows=rows))


def print_table(rows: list[dict]) -> None:
    """One line per (shape, T, precision): graph µs (official µs) per config; '!' marks a wrong or failed one."""
    configs = list(dict.fromkeys(row["config"] for row in rows))
    print("\ngraph-replay µs (official span µs); ! = wrong or failed, ~ = not deterministic")
    print(f"{'H':>6s} {'I':>6s} {'T':>4s} {'precision':9s} " + " ".join(f"{c:>16s}" for c in configs))
    keys = list(dict.fromkeys((row["H"], row["I"], row["T"], row["precision"]) for row in rows))
    for key in keys:
        cells = []
        for c in configs:
            row = next((r for r in rows if (r["H"], r["I"], r["T"], r["precision"], r["config"]) == (*key, c)), None)
            if row is None or "graph_us" not in row:
                cells.append(f"{'!error' if row else '-':>16s}")
                continue
            text = f"{row['graph_us']:.1f}" + (f" ({row['official_us']:.1f})" if "official_us" in row else "")
            mark = ("" if row.get("ok") else "!") + ("" if row.get("deterministic") else "~")
            cells.append(f"{mark + text:>16s}")
        H, I, T, precision = key
        print(f"{H:6d} {I:6d} {T:4d} {precision:9s} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 on this machine, no GPU")
    parser.add_argument("--shapes", type=parse_shapes, default=[BENCHMARK_SHAPE], help="comma list of HxI")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma list of token counts")
    parser.add_argument("--sms", type=int, default=DEFAULT_SMS, help="--compile-only: the SMs the tiles are for")
    parser.add_argument("--json", help="--compile-only: write the rows as JSON to this path")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "candidates",
        nargs="*",
        metavar="CANDIDATE",
        help=f"of {', '.join([*VARIANTS, *CANDIDATES])} (besides {CHOSEN}, always)",
    )
    args = parser.parse_args()
    unknown = [name for name in args.candidates if name not in CANDIDATES and name not in VARIANTS]
    if unknown:
        parser.error(f"CANDIDATE: unknown {unknown} (known: {', '.join([*VARIANTS, *CANDIDATES])})")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    if any(not 0 <= T <= 128 for T in tokens):
        parser.error(f"--tokens: the few-token design takes 0 to 128 tokens, got {args.tokens}")
    names = [CHOSEN, *args.candidates]
    if args.compile_only:
        return compile_only(names, args.shapes, tokens, args.sms, args.json)
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    on_gpu(names, args.shapes, tokens, args.reps)


if __name__ == "__main__":
    main()
