"""Issue 48's grouped engine probe: the Gluon grouped GEMM (``moe_lib/engine/grouped_gemm.py``) against
torch._grouped_mm at P2's, Qwen3-30B-A3B's and Mixtral's expert shapes.

    PYTHONPATH=. python scripts/p2/grouped_probe.py [--configs A,B] [--shapes X,Y] [--timeout 200] [--stall 60]
        [--budget 480] [--reps 20] [--seed S] [--out DIR]
    PYTHONPATH=. python scripts/p2/grouped_probe.py --compile-only [--configs ...] [--out DIR]

Shapes (:data:`SHAPES`): T tokens routed uniformly at random to K of E experts (each token K distinct experts, the
rows sorted by expert: M_total = T·K rows, an expert's count binomial around T·K/E), in the products a MoE layer
needs: ``gate_up`` x·[Wg;Wu]ᵀ (B [E, 2I, H] held transposed, N = 2I), ``down`` a·Wdᵀ (B [E, H, I] held transposed,
N = H), ``dap`` dy·Wd (B [E, H, I] as it lies, N = I) and ``dx`` [dg|du]·[Wg;Wu] (B [E, 2I, H] as it lies, N = H);
``down_scaled`` is ``down`` with the routing weight per row (the ``row_scale`` epilogue) and ``swiglu`` is
``gate_up`` with silu(gate)·up in its epilogue (C [T·K, I]); the baseline applies those to torch._grouped_mm's
output afterwards, in torch (its output is its own allocation, no copy is timed).
Models: P2 (E 256, K 8, H 4096, I 2048) at 8192 and 32768 tokens, Qwen3-30B-A3B (E 128, K 8, H 2048, I 768) at
8192, Mixtral (E 8, K 2, H 4096, I 14336) at 4096.

On a GPU: first every config compiled for sm_90 on the host (as ``--compile-only``; a config that fails is left
out), then torch._grouped_mm and each config in a child process of its own, killed when it has finished no shape
for ``--stall`` seconds, when it has run ``--timeout`` seconds, or when the run's ``--budget`` is spent. Per shape,
small ones first: fresh random operands and routing (the seed's), the output poisoned with NaN, one call checked
against an fp32 per-expert torch.mm (relative Frobenius error ≤ 1e-2, no NaN), then timed by CUDA-graph replay with
the L2 flushed before each replay, the replays' output checked bitwise against the first call's. Logs and
``grouped_probe.json`` go to --out ($OUT by default); one table (shape × config: TFLOP/s and the fraction of
torch._grouped_mm's) is printed last, with the geometric mean over the shapes.

--compile-only (no GPU: triton's ptxas and cuobjdump): each config in each B form (nt, nn) and epilogue, compiled
for sm_90: registers at launch and after setmaxnreg per partition, stack (a spill), shared memory, wgmma per K step
and whether ptxas serialised them; exits 1 where one fails, spills, is over 227 KB or is serialised.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the dense probe's child watch and helpers

import gemm_probe  # noqa: E402

from moe_lib.engine.gluon_gemm import GemmConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "grouped_mm"
TOLERANCE = 1e-2  # relative Frobenius error against fp32 per-expert torch.mm (bf16 output rounding alone ~2e-3)

# the dense probe's best configs at large and at small M, as grouped kernels
CONFIGS = {
    "coop_m128n256k64_s3": GemmConfig(128, 256, 64, 3, "cooperative"),
    "coop_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "cooperative"),
    "pp_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "pingpong"),
}


@dataclass(frozen=True)
class Shape:
    """One grouped product: T tokens, K of E experts each, C [T·K, n] = A [T·K, k] · B_e."""

    tokens: int
    experts: int
    top_k: int
    n: int
    k: int
    b_t: bool  # B [E, n, k] (held transposed) rather than [E, k, n]
    epilogue: str
    what: str

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def width(self) -> int:
        """C's columns: n, or half of it with swiglu (B's rows are [gate; up])."""
        return self.n // 2 if self.epilogue == "swiglu" else self.n

    @property
    def form(self) -> str:
        """ "nt" (B held transposed) or "nn"."""
        return "nt" if self.b_t else "nn"

    @property
    def flop(self) -> int:
        return 2 * self.rows * self.n * self.k


def model_shapes(name: str, T: int, E: int, K: int, H: int, I: int, fused: bool = False) -> dict[str, Shape]:
    """A model's four grouped products at T tokens (and the two with an epilogue where ``fused``)."""
    shapes = {
        f"{name}_gate_up": Shape(T, E, K, 2 * I, H, True, "none", "x·[Wg;Wu]ᵀ"),
        f"{name}_down": Shape(T, E, K, H, I, True, "none", "a·Wdᵀ"),
        f"{name}_dap": Shape(T, E, K, I, H, False, "none", "dy·Wd"),
        f"{name}_dx": Shape(T, E, K, H, 2 * I, False, "none", "[dg|du]·[Wg;Wu]"),
    }
    if fused:
        shapes[f"{name}_down_scaled"] = Shape(T, E, K, H, I, True, "row_scale", "(a·Wdᵀ)·w")
        shapes[f"{name}_swiglu"] = Shape(T, E, K, 2 * I, H, True, "swiglu", "silu(x·Wgᵀ)·(x·Wuᵀ)")
    return shapes


SHAPES = {
    **model_shapes("p2_t8192", 8192, 256, 8, 4096, 2048, fused=True),
    **model_shapes("p2_t32768", 32768, 256, 8, 4096, 2048),
    **model_shapes("qwen3_t8192", 8192, 128, 8, 2048, 768),
    **model_shapes("mixtral_t4096", 4096, 8, 2, 4096, 14336, fused=True),
}


# --- compiling for sm_90 on the host ----------------------------------------------------------------------------


def compile_report(config: GemmConfig, b_t: bool, epilogue: str) -> dict:
    """``config``'s kernel for B held transposed (b_t) or not, with ``epilogue``, compiled for sm_90."""
    import torch

    from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, resource_usage, wgmma_serialized
    from moe_lib.engine.grouped_gemm import grouped_gemm_kernel, launch_arguments

    def meta(*size, dtype=torch.bfloat16):
        return torch.empty(size, dtype=dtype, device="meta")

    E, M, K, N = 8, 4096, 1024, 512  # the kernel depends on none of these
    b = meta(E, N, K) if b_t else meta(E, K, N)
    scale = meta(M, dtype=torch.float32) if epilogue == "row_scale" else None
    out = meta(M, N // 2 if epilogue == "swiglu" else N)
    arguments, constexprs = launch_arguments(
        config, meta(M, K), b, meta(E + 1, dtype=torch.int32), epilogue, b_t, out=out, scale=scale
    )
    # the pointers and the scalar as the launcher specialises them
    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
    arguments = {
        name: pointer[value.dtype] if isinstance(value, torch.Tensor) else value for name, value in arguments.items()
    }
    arguments["num_experts"] = "i32"
    start = time.perf_counter()
    try:
        compiled = compile_gluon_for_sm90(
            grouped_gemm_kernel, arguments, constexprs, warps=config.warps, maxnreg=config.maxnreg
        )
    except Exception as exc:  # reported; the config is left out of the GPU run
        return dict(error=first_error_line(exc))
    ptx = compiled.asm["ptx"]
    partitions = sorted({int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)})
    return dict(
        resource_usage(compiled),
        partition_registers=partitions,
        wgmma=ptx.count("wgmma.mma_async"),
        serialized=wgmma_serialized(compiled),
        seconds=round(time.perf_counter() - start, 2),
        error=None,
    )


def compile_all(config_names: list[str], shape_names: list[str]) -> list[dict]:
    """Each config in each (B form, epilogue) of the shapes, compiled once (printing a line each)."""
    variants = sorted({(SHAPES[name].b_t, SHAPES[name].epilogue) for name in shape_names}, reverse=True)
    rows = []
    print(f"{'config':22s} form epilogue   launch  setmaxnreg  stack  smem   wgmma  serialised  s", flush=True)
    for config_name in config_names:
        for b_t, epilogue in variants:
            form = "nt" if b_t else "nn"
            report = compile_report(CONFIGS[config_name], b_t, epilogue)
            row = dict(config=config_name, form=form, epilogue=epilogue, **report)
            row["problems"] = gemm_probe.compile_problems(row)
            rows.append(row)
            if report["error"]:
                print(f"{config_name:22s} {form:4s} {epilogue:10s} FAIL {report['error']}", flush=True)
                continue
            parts = "/".join(map(str, row["partition_registers"]))
            print(
                f"{config_name:22s} {form:4s} {epilogue:10s} {row['registers']:6d}  {parts:10s}  {row['stack']:5d}  "
                f"{row['shared'] // 1024:3d}K  {row['wgmma']:5d}  {row['serialized']:10s}  {row['seconds']:.1f}"
                + (f"  PROBLEM: {'; '.join(row['problems'])}" if row["problems"] else ""),
                flush=True,
            )
    return rows


# --- one config's shapes on the GPU (a child process) -------------------------------------------------------------


def routed_offsets(shape: Shape, generator, device):
    """Each token's K distinct experts drawn uniformly: (offsets int32 [E + 1] of the rows sorted by expert, and
    the per-row routing weights [T·K] fp32)."""
    import torch

    choice = torch.rand((shape.tokens, shape.experts), generator=generator, device=device).topk(shape.top_k).indices
    counts = torch.bincount(choice.flatten(), minlength=shape.experts)
    offsets = torch.zeros(shape.experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = counts.cumsum(0)
    weights = torch.rand(shape.rows, generator=generator, device=device)
    return offsets, weights


def operands(shape: Shape, generator, device):
    """Fresh operands: A [T·K, k] and B ([E, n, k] or [E, k, n]) N(0, 1) in bf16, B scaled by 1/√k."""
    import torch

    def randn(*size, scale=1.0):
        return (torch.randn(size, generator=generator, device=device) * scale).to(torch.bfloat16)

    a = randn(shape.rows, shape.k)
    b_size = (shape.experts, shape.n, shape.k) if shape.b_t else (shape.experts, shape.k, shape.n)
    return a, randn(*b_size, scale=shape.k**-0.5)


def reference(a, b, offsets, shape: Shape, weights):
    """C in fp32 by a torch.mm per expert (one host sync for the offsets: outside the timed part)."""
    import torch

    out = torch.zeros((shape.rows, shape.n), dtype=torch.float32, device=a.device)
    bounds = offsets.tolist()
    for e in range(shape.experts):
        begin, end = bounds[e], bounds[e + 1]
        if end > begin:
            w = b[e].float()
            out[begin:end] = a[begin:end].float() @ (w.t() if shape.b_t else w)
    if shape.epilogue == "swiglu":
        return torch.nn.functional.silu(out[:, : shape.width]) * out[:, shape.width :]
    return out * weights[:, None] if shape.epilogue == "row_scale" else out


def grouped_mm_operand(a, b, ends, shape: Shape):
    """B as torch._grouped_mm takes it ([E, k, n], a transposed view where B is held [E, n, k]), and a note where it
    refused that layout and took a column-major copy made here, outside the timed call (as weights kept so)."""
    import torch

    b_mm = b.transpose(1, 2) if shape.b_t else b
    try:
        torch._grouped_mm(a, b_mm, offs=ends)
    except RuntimeError as exc:
        copy = b_mm.transpose(1, 2).contiguous().transpose(1, 2)
        return copy, f"B copied column-major beforehand ({str(exc).splitlines()[0][:120]})"
    return b_mm, None


def run_child(name: str, shape_names: list[str], reps: int, seed: int) -> None:
    """Checks and times ``name`` (a config or the baseline) at each shape, small ones first, printing a RESULT line
    as each shape starts and one as it ends."""
    import torch

    from moe_lib.bench.timing import L2Flusher, time_graph
    from moe_lib.engine.grouped_gemm import grouped_gemm

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    flush = L2Flusher(device)
    config = CONFIGS.get(name)

    for shape_name in sorted(shape_names, key=lambda s: SHAPES[s].flop):
        shape = SHAPES[shape_name]
        gemm_probe.emit(event="start", shape=shape_name)
        generator = torch.Generator(device=device).manual_seed(seed)  # every child the same operands a shape
        try:
            offsets, weights = routed_offsets(shape, generator, device)
            a, b = operands(shape, generator, device)
            scale = weights if shape.epilogue == "row_scale" else None
            ends = offsets[1:]  # torch._grouped_mm's offs: each group's end row
            b_mm, note = grouped_mm_operand(a, b, ends, shape) if config is None else (None, None)

            def call(out):
                """C (``out`` for the Gluon kernel; the baseline returns its own allocation, no copy timed)."""
                if config is not None:
                    return grouped_gemm(
                        a,
                        b,
                        offsets,
                        out=out,
                        scale=scale,
                        epilogue=shape.epilogue,
                        b_transposed=shape.b_t,
                        config=config,
                    )
                result = torch._grouped_mm(a, b_mm, offs=ends)
                if shape.epilogue == "swiglu":
                    return torch.nn.functional.silu(result[:, : shape.width]) * result[:, shape.width :]
                return result if scale is None else result * scale[:, None]

            row = check_and_time(shape, call, reference(a, b, offsets, shape, weights), flush, reps, time_graph)
            if note:
                row["note"] = note
        except Exception as exc:  # reported; a CUDA error leaves the context unusable and the next shapes fail too
            row = dict(check=f"ERROR: {type(exc).__name__}: {str(exc)[-300:]}")
        gemm_probe.emit(event="result", shape=shape_name, **row)


def check_and_time(shape: Shape, call, expected, flush, reps: int, time_graph) -> dict:
    """One shape: a first call (into a NaN-poisoned output) checked against ``expected``, then CUDA-graph replays
    timed (the L2 flushed before each), the replays' output checked against the first call's bit for bit."""
    import torch

    out = torch.full((shape.rows, shape.width), float("nan"), dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    result = call(out)
    torch.cuda.synchronize()
    row = dict(first_call_s=round(time.perf_counter() - start, 3))
    row["rel_error"] = error = gemm_probe.relative_error(result, expected)
    if not error <= TOLERANCE:
        return dict(row, check=f"WRONG: relative error {error:.3g} (NaN: {bool(result.isnan().any())})")
    first = result.clone()
    out.fill_(float("nan"))

    def replays_wrong(outputs):
        return None if torch.equal(outputs, first) else "replays differ from the first call"

    stats = time_graph(lambda: call(out), flush, reps=reps, check_replay=replays_wrong)
    check = "ok" if stats["replay_wrong"] is None else f"WRONG: {stats['replay_wrong']}"
    return dict(
        row,
        check=check,
        tflops=shape.flop / (stats["median_ms"] * 1e-3) / 1e12,
        **{key: stats[key] for key in ("median_ms", "p20_ms", "p80_ms", "reps")},
    )


# --- the parent: children under watch, the table ------------------------------------------------------------------


def watch_child(name: str, args, shape_names: list[str], seed: int, time_left: float) -> dict:
    """One child's run of ``name`` (its log in --out) under the dense probe's watch: {"status", "seconds",
    "results"}."""
    log_path = Path(args.out) / f"grouped_probe-{name}.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--shapes",
        ",".join(shape_names),
        "--reps",
        str(args.reps),
        "--seed",
        str(seed),
    ]
    start = time.monotonic()
    status = gemm_probe.watch(command, log_path, args.stall, min(args.timeout, time_left))
    results = gemm_probe.results_in(log_path, status)
    return dict(status=status, seconds=round(time.monotonic() - start, 1), results=results)


def table(runs: dict, shape_names: list[str]) -> str:
    """shape × (torch._grouped_mm, each config as c1, c2, ...): TFLOP/s and the fraction of the baseline's; the
    geometric mean fraction over the shapes last."""
    columns = list(runs)
    labels = {name: "gmm" if name == BASELINE else f"c{i}" for i, name in enumerate(columns)}
    lines = [f"{labels[name]} = {name}" for name in columns if name != BASELINE]
    lines.append(f"{'shape':26s} {'rows×N×K':20s} " + " ".join(f"{labels[c]:>9s}" for c in columns))
    baselines = runs.get(BASELINE, {}).get("results", {})
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        base = baselines.get(shape_name)
        cells = [gemm_probe.cell(runs[c]["results"].get(shape_name), None if c == BASELINE else base) for c in columns]
        size = f"{shape.rows}×{shape.n}×{shape.k}"
        lines.append(f"{shape_name:26s} {size:20s} " + " ".join(f"{c:>9s}" for c in cells))
    means = []
    for column in columns:
        fractions = []
        for shape_name in shape_names:
            row, base = runs[column]["results"].get(shape_name), baselines.get(shape_name)
            if row and base and row.get("check") == "ok" and base.get("check") == "ok":
                fractions.append(row["tflops"] / base["tflops"])
        means.append(f"{math.exp(sum(map(math.log, fractions)) / len(fractions)):.3f}" if fractions else "-")
    lines.append(f"{'geomean':47s} " + " ".join(f"{m:>9s}" for m in means))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="configs: " + ", ".join(CONFIGS) + "\nshapes: " + ", ".join(SHAPES),
    )
    parser.add_argument("--configs", default="all", help="comma list of configs (grouped_mm always runs), or all")
    parser.add_argument("--shapes", default="all", help="comma list of shapes, or all")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90, no GPU")
    parser.add_argument("--timeout", type=float, default=200.0, help="seconds one config's child may run")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds a child may go without finishing a shape")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds the whole run may take")
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays a shape")
    parser.add_argument("--seed", type=int, default=None, help="the operands' and routing's seed (fresh by default)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory of the logs and JSON ($OUT)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gemm_probe.drive(
        args,
        parser,
        program="grouped_probe",
        baseline=BASELINE,
        peer="torch._grouped_mm",
        shapes=SHAPES,
        configs=CONFIGS,
        compile_all=compile_all,
        run_child=run_child,
        watch_child=watch_child,
        table=table,
        name_width=22,
    )


if __name__ == "__main__":
    main()
