"""Issue 48's engine probe: the Gluon GEMM (``moe_lib/engine/gluon_gemm.py``) against torch.mm at P1's and P2's shapes.

    PYTHONPATH=. python scripts/p2/gemm_probe.py [--configs A,B] [--shapes X,Y] [--timeout 150] [--stall 45]
        [--budget 420] [--reps 30] [--seed S] [--out DIR]
    PYTHONPATH=. python scripts/p2/gemm_probe.py --compile-only [--configs ...] [--shapes ...] [--out DIR]

Shapes (:data:`SHAPES`): one expert's dense GEMMs at P2's H 4096, I 2048 with M = 256, 1024 (P2's rows per expert
at 8192 and 32768 tokens) and 8192 rows, in each product form P2 needs (A as it lies or transposed, B as it lies
or transposed: ``moe_lib/moe_experts/kernels.py`` lists the products), and P1's at 8192 tokens (H 2048, I 768).
Configs (:data:`CONFIGS`): cooperative and ping-pong consumers, tiles, ring depth, persistent or one program a
tile; ``torch_mm`` (cuBLAS) is the baseline, always run.

On a GPU: first every config compiled for sm_90 on the host (as ``--compile-only``; a config that fails is left
out), then torch.mm and each config in a child process of its own, killed when it has finished no shape for
``--stall`` seconds (a hung kernel: the Gluon kernel W hung before, notes/p2/runs-design-04.md), when it has run
``--timeout`` seconds, or when the run's ``--budget`` is spent (the run then ends). Per shape, small ones first:
fresh random operands (never zeros), the output poisoned with NaN, one call checked against torch.mm in fp32
(relative Frobenius error ≤ 1e-2, no NaN), then timed by CUDA-graph replay with the L2 flushed before each replay
(``moe_lib.bench.timing.time_graph``), the replays' output checked bitwise against the first call's. Logs and
``gemm_probe.json`` go to --out ($OUT by default); one table (shape × config: TFLOP/s and the fraction of
torch.mm's) is printed last. Expected: ~3 minutes; at most --budget (7 minutes) and the table.

--compile-only (no GPU: triton's ptxas and cuobjdump): each config in each operand form the shapes need, compiled
for sm_90: registers at launch and after setmaxnreg per partition, stack (a spill), shared memory, wgmma per K step
and whether ptxas serialised them; exits 1 where one fails, spills, is over 227 KB or is serialised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_lib.engine.gluon_gemm import GemmConfig

ROOT = Path(__file__).resolve().parents[2]

BASELINE = "torch_mm"
RESULT = "RESULT "  # a child's result lines on stdout start so
TOLERANCE = 1e-2  # relative Frobenius error against torch.mm in fp32 (bf16 output rounding alone is ~2e-3)

# the configs timed; each compiles to one kernel per operand form (``programs`` aside, which is a launch argument)
CONFIGS = {
    # two warpgroups on a 128 × 256 tile, 64 rows each: cuBLAS's and the Gluon tutorial's Hopper tile (208 KB)
    "coop_m128n256k64_s3": GemmConfig(128, 256, 64, 3, "cooperative"),
    # the same, one program a tile (not persistent): P1's launch-2 form, within 3-4% of cuBLAS
    # (notes/p1/design-13.md)
    "coop_m128n256k64_s3_pertile": GemmConfig(128, 256, 64, 3, "cooperative", programs=1 << 30),
    # two warpgroups on a 256 × 128 tile, 128 rows each (208 KB)
    "coop_m256n128k64_s3": GemmConfig(256, 128, 64, 3, "cooperative"),
    # smaller tiles: twice the tiles for small M, a deeper ring (192 KB)
    "coop_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "cooperative"),
    # ping-pong: each warpgroup a 128 × 128 tile of its own, one's epilogue under the other's K loop (224 KB)
    "pp_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "pingpong"),
    # ping-pong with 64 × 256 tiles (224 KB)
    "pp_m64n256k64_s4": GemmConfig(64, 256, 64, 4, "pingpong"),
}


@dataclass(frozen=True)
class Shape:
    """C [m, n] = A [m, k] · B [k, n]; A held transposed ([k, m] row-major) with a_t, B ([n, k]) with b_t."""

    m: int
    n: int
    k: int
    a_t: bool
    b_t: bool
    what: str

    @property
    def form(self) -> str:
        """ "nn", "nt" or "tn": A's and B's layouts (t: held transposed)."""
        return ("t" if self.a_t else "n") + ("t" if self.b_t else "n")

    @property
    def flop(self) -> int:
        return 2 * self.m * self.n * self.k


def p2_shapes(rows: int, H: int = 4096, I: int = 2048) -> dict[str, Shape]:
    """One expert's products at P2's shape with ``rows`` routed rows (slots)."""
    return {
        f"p2_gate_m{rows}": Shape(rows, I, H, False, True, "g = x·Wgᵀ (u likewise)"),
        f"p2_dap_m{rows}": Shape(rows, I, H, False, False, "dA' = dy·Wd"),
        f"p2_dx_m{rows}": Shape(rows, H, 2 * I, False, False, "dX = [dg|du]·[Wg;Wu]"),
        f"p2_dwgu_m{rows}": Shape(2 * I, H, rows, True, False, "[dWg;dWu] = [dg|du]ᵀ·x"),
        f"p2_dwd_m{rows}": Shape(H, I, rows, True, False, "dWd = dyᵀ·aw"),
    }


def p1_shapes(T: int = 8192, H: int = 2048, I: int = 768) -> dict[str, Shape]:
    """P1's four products at ``T`` tokens."""
    return {
        "p1_da": Shape(T, I, H, False, False, "dA = dy·Wd"),
        "p1_dx": Shape(T, H, 2 * I, False, False, "dx = [dG|dU]·[Wg;Wu]"),
        "p1_dwgu": Shape(2 * I, H, T, True, False, "[dWg;dWu] = [dG|dU]ᵀ·x"),
        "p1_dwd": Shape(H, I, T, True, False, "dWd = dyᵀ·intermediate"),
    }


SHAPES = {**p2_shapes(256), **p2_shapes(1024), **p2_shapes(8192), **p1_shapes()}
LARGE = [name for name in SHAPES if name.endswith("_m8192") or name.startswith("p1_")]  # the ≥ 95% target's shapes
# of those, the ones with ≥ 512 output tiles of 128 × 256 (≈ 4 waves on 132 SMs); the others, 48-256 tiles, are
# bound by the tile count without a split of K, which the probe's kernel does not do
FILLING = [name for name in LARGE if SHAPES[name].m * SHAPES[name].n >= 512 * 128 * 256]


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def names(text: str, known: dict, option: str, parser) -> list[str]:
    """A comma list of keys of ``known`` ("all": every one), or the parser's error naming ``option``."""
    chosen = list(known) if text == "all" else [name for name in text.split(",") if name]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        parser.error(f"{option}: unknown name(s) {unknown} (known: {', '.join(known)})")
    return chosen


# --- compiling for sm_90 on the host ----------------------------------------------------------------------------


def compile_report(config: GemmConfig, shape: Shape) -> dict:
    """``config``'s kernel in ``shape``'s operand form compiled for sm_90: its resources, or the error."""
    import torch

    from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, resource_usage, wgmma_serialized
    from moe_lib.engine.gluon_gemm import gemm_kernel, launch_arguments

    def meta(*size):
        return torch.empty(size, dtype=torch.bfloat16, device="meta")

    a = meta(shape.k, shape.m).t() if shape.a_t else meta(shape.m, shape.k)
    b = meta(shape.n, shape.k).t() if shape.b_t else meta(shape.k, shape.n)
    descriptors, constexprs = launch_arguments(config, a, b, meta(shape.m, shape.n))
    start = time.perf_counter()
    try:
        compiled = compile_gluon_for_sm90(
            gemm_kernel, descriptors, constexprs, warps=config.warps, maxnreg=config.maxnreg
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


def compile_problems(row: dict) -> list[str]:
    """What keeps a compiled kernel from the probe: an error, a spill, too much shared memory, serialised wgmma."""
    from moe_lib.bench.sm90 import SHARED_MEMORY_LIMIT

    if row["error"]:
        return [row["error"]]
    problems = []
    if row["stack"]:
        problems.append(f"spills ({row['stack']} B of stack)")
    if row["shared"] > SHARED_MEMORY_LIMIT:
        problems.append(f"{row['shared']} B of shared memory")
    if row["serialized"] != "no":
        problems.append(f"wgmma {row['serialized']}")
    return problems


def compile_all(config_names: list[str], shape_names: list[str]) -> list[dict]:
    """Each config in each operand form of the shapes, compiled once (printing a line each)."""
    forms = {}
    for name in shape_names:
        forms.setdefault(SHAPES[name].form, SHAPES[name])
    rows, done = [], {}
    print(f"{'config':30s} form  launch  setmaxnreg     stack  smem   wgmma  serialised  s", flush=True)
    for config_name in config_names:
        config = CONFIGS[config_name]
        for form, shape in forms.items():
            key = (config.block_m, config.block_n, config.block_k, config.stages, config.consumers, form)
            report = done.get(key) or compile_report(config, shape)
            done[key] = report
            row = dict(config=config_name, form=form, **report, problems=compile_problems(report))
            rows.append(row)
            if report["error"]:
                print(f"{config_name:30s} {form:5s} FAIL {report['error']}", flush=True)
                continue
            parts = "/".join(map(str, row["partition_registers"]))
            print(
                f"{config_name:30s} {form:5s} {row['registers']:6d}  {parts:13s}  {row['stack']:5d}  "
                f"{row['shared'] // 1024:3d}K  {row['wgmma']:5d}  {row['serialized']:10s}  {row['seconds']:.1f}"
                + (f"  PROBLEM: {'; '.join(row['problems'])}" if row["problems"] else ""),
                flush=True,
            )
    return rows


# --- one config's shapes on the GPU (a child process) -------------------------------------------------------------


def emit(**fields) -> None:
    print(RESULT + json.dumps(fields), flush=True)


def operands(shape: Shape, generator, device):
    """Fresh N(0, 1) bf16 operands in the shape's form (a transposed one a view of a row-major tensor)."""
    import torch

    def randn(*size):
        return torch.randn(size, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16)

    a = randn(shape.k, shape.m).t() if shape.a_t else randn(shape.m, shape.k)
    b = randn(shape.n, shape.k).t() if shape.b_t else randn(shape.k, shape.n)
    return a, b


def relative_error(out, reference) -> float:
    """‖out − reference‖ / ‖reference‖ in float64; inf where out has a NaN or an infinity."""
    import torch

    out, reference = out.double(), reference.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - reference).norm() / reference.norm()).item()


def run_child(name: str, shape_names: list[str], reps: int, seed: int) -> None:
    """Checks and times ``name`` (a config or the baseline) at each shape, small ones first (a hang shows early),
    printing a RESULT line as each shape starts and one as it ends."""
    import torch

    from moe_lib.bench.timing import L2Flusher
    from moe_lib.engine.gluon_gemm import gemm

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32 (torch.mm in bf16 as it comes)
    flush = L2Flusher(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    config = CONFIGS.get(name)

    def call(a, b, out):
        if config is None:
            return torch.mm(a, b, out=out)
        return gemm(a, b, config, out=out)

    for shape_name in sorted(shape_names, key=lambda s: SHAPES[s].flop):
        emit(event="start", shape=shape_name)
        try:
            emit(event="result", shape=shape_name, **check_and_time(SHAPES[shape_name], call, generator, flush, reps))
        except Exception as exc:  # reported; a CUDA error leaves the context unusable and the next shapes fail too
            emit(event="result", shape=shape_name, check=f"ERROR: {type(exc).__name__}: {str(exc)[-300:]}")


def check_and_time(shape: Shape, call, generator, flush, reps: int) -> dict:
    """One shape: fresh operands, a first call checked against torch.mm in fp32 (its output poisoned with NaN
    before), then CUDA-graph replays timed, the L2 flushed before each, their output checked against the first
    call's bit for bit."""
    import torch

    from moe_lib.bench.timing import time_graph

    a, b = operands(shape, generator, torch.device("cuda"))
    reference = torch.mm(a.float(), b.float())
    out = torch.full((shape.m, shape.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    call(a, b, out)
    torch.cuda.synchronize()
    row = dict(first_call_s=round(time.perf_counter() - start, 3))  # with the kernel's compilation, once a form
    row["rel_error"] = error = relative_error(out, reference)
    if not error <= TOLERANCE:
        return dict(row, check=f"WRONG: relative error {error:.3g} (NaN: {bool(out.isnan().any())})")
    first = out.clone()
    out.fill_(float("nan"))

    def replays_wrong(_):
        return None if torch.equal(out, first) else "replays differ from the first call"

    stats = time_graph(lambda: call(a, b, out), flush, reps=reps, check_replay=replays_wrong)
    check = "ok" if stats["replay_wrong"] is None else f"WRONG: {stats['replay_wrong']}"
    return dict(
        row,
        check=check,
        tflops=shape.flop / (stats["median_ms"] * 1e-3) / 1e12,
        **{key: stats[key] for key in ("median_ms", "p20_ms", "p80_ms", "reps")},
    )


# --- the parent: children under watch, the table ------------------------------------------------------------------


def watch(command: list[str], log_path: Path, stall: float, limit: float) -> str:
    """Runs ``command`` (its output into ``log_path``), killing its process group when it has finished no shape for
    ``stall`` seconds or has run ``limit`` seconds; returns how it ended ("ok", "exit N", "killed: ...")."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        progress, seen = start, 0
        while True:
            try:
                child.wait(timeout=0.5)
                return "ok" if child.returncode == 0 else f"exit {child.returncode}"
            except subprocess.TimeoutExpired:
                finished = log_path.read_text().count('"event": "result"')
                if finished > seen:
                    seen, progress = finished, time.monotonic()
                now = time.monotonic()
                if now - progress > stall or now - start > limit:
                    os.killpg(child.pid, signal.SIGKILL)  # the child and any compiler it started
                    child.wait()
                    return (
                        f"killed: no shape finished in {stall:.0f} s"
                        if now - progress > stall
                        else f"killed: over {limit:.0f} s"
                    )


def results_in(log_path: Path, status: str) -> dict:
    """{shape: row} from a child's log; the shape it had started and not finished marked HUNG (killed) or DIED."""
    results, started = {}, None
    for line in log_path.read_text().splitlines():
        if line.startswith(RESULT):
            row = json.loads(line[len(RESULT) :])
            if row["event"] == "start":
                started = row["shape"]
            else:
                results[row["shape"]] = row
                started = None
    if started is not None:
        results[started] = dict(shape=started, check=("HUNG: " if status.startswith("killed") else "DIED: ") + status)
    return results


def watch_child(
    script: Path, program: str, name: str, args, shape_names: list[str], seed: int, time_left: float
) -> dict:
    """One child's run of ``name`` by ``script`` (its log ``<program>-<name>.log`` in --out) under :func:`watch`:
    {"status", "seconds", "results"}."""
    log_path = Path(args.out) / f"{program}-{name}.log"
    command = [
        sys.executable,
        str(script),
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
    status = watch(command, log_path, args.stall, min(args.timeout, time_left))
    return dict(status=status, seconds=round(time.monotonic() - start, 1), results=results_in(log_path, status))


def geomean_fraction(runs: dict, column: str, shape_names, baselines: dict) -> str:
    """The geometric mean of ``column``'s TFLOP/s over the baseline's at the shapes both ran correctly ("-": none)."""
    fractions = []
    for shape_name in shape_names:
        row, base = runs[column]["results"].get(shape_name), baselines.get(shape_name)
        if row and base and row.get("check") == "ok" and base.get("check") == "ok":
            fractions.append(row["tflops"] / base["tflops"])
    return f"{math.exp(sum(map(math.log, fractions)) / len(fractions)):.3f}" if fractions else "-"


def cell(row: dict | None, baseline: dict | None) -> str:
    """A table cell: TFLOP/s and the fraction of torch.mm's, or what went wrong."""
    if row is None:
        return "-"
    if row.get("check") != "ok":
        return row.get("check", "?").split(":")[0]
    text = f"{row['tflops']:.0f}"
    if baseline and baseline.get("check") == "ok":
        text += f" {row['tflops'] / baseline['tflops']:.2f}"
    return text


def table(runs: dict, shape_names: list[str]) -> str:
    """shape × (torch.mm, each config as c1, c2, ...): TFLOP/s and the fraction of torch.mm's; the geometric mean
    fraction over the large shapes (:data:`LARGE`) and over those of them that fill the GPU (:data:`FILLING`) last."""
    columns = list(runs)
    labels = {name: "mm" if name == BASELINE else f"c{i}" for i, name in enumerate(columns)}
    lines = [f"{labels[name]} = {name}" for name in columns if name != BASELINE]
    lines.append(f"{'shape':15s} {'M×N×K':16s} " + " ".join(f"{labels[c]:>9s}" for c in columns))
    baselines = runs.get(BASELINE, {}).get("results", {})
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        base = baselines.get(shape_name)
        cells = [cell(runs[c]["results"].get(shape_name), None if c == BASELINE else base) for c in columns]
        lines.append(f"{shape_name:15s} {f'{shape.m}×{shape.n}×{shape.k}':16s} " + " ".join(f"{c:>9s}" for c in cells))
    for label, group in (("geomean, large", LARGE), ("geomean, filling", FILLING)):
        in_group = [s for s in shape_names if s in group]
        means = [geomean_fraction(runs, column, in_group, baselines) for column in columns]
        lines.append(f"{label:32s} " + " ".join(f"{m:>9s}" for m in means))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="configs: " + ", ".join(CONFIGS) + "\nshapes: " + ", ".join(SHAPES),
    )
    parser.add_argument("--configs", default="all", help="comma list of configs (torch_mm always runs), or all")
    parser.add_argument("--shapes", default="all", help="comma list of shapes, or all")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90, no GPU")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds one config's child may run")
    parser.add_argument("--stall", type=float, default=45.0, help="seconds a child may go without finishing a shape")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds the whole run may take (a child still running then is killed)",
    )
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays a shape")
    parser.add_argument("--seed", type=int, default=None, help="the operands' seed (fresh by default)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory of the logs and JSON ($OUT)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    drive(
        args,
        parser,
        program="gemm_probe",
        baseline=BASELINE,
        peer="torch.mm",
        shapes=SHAPES,
        configs=CONFIGS,
        compile_all=compile_all,
        run_child=run_child,
        script=Path(__file__).resolve(),
        table=table,
        name_width=30,
    )


def drive(
    args,
    parser,
    *,
    program: str,
    baseline: str,
    peer: str,
    shapes: dict,
    configs: dict,
    compile_all,
    run_child,
    script: Path,
    table,
    name_width: int,
) -> None:
    """A probe's run from its parsed arguments (this script's and ``grouped_probe.py``'s): as a child, ``run_child``
    on the shapes; else the arguments checked, every config compiled for sm_90 (``compile_all``), and unless
    --compile-only ``baseline`` (``peer`` in the table's title) and each config that compiled run by ``script`` as a
    watched child within --budget, ``<program>.json`` rewritten after each, ``table`` printed last."""
    started = time.monotonic()
    shape_names = names(args.shapes, shapes, "--shapes", parser)
    if args.child is not None:
        if args.child != baseline and args.child not in configs:
            parser.error(f"--child: unknown config {args.child!r}")
        run_child(args.child, shape_names, args.reps, fresh_seed() if args.seed is None else args.seed)
        return
    config_names = names(args.configs, configs, "--configs", parser)
    for option in ("timeout", "stall", "budget"):
        if not getattr(args, option) > 0:
            parser.error(f"--{option}: expected a positive number of seconds, got {getattr(args, option)}")
    if args.reps < 1:
        parser.error(f"--reps: expected a positive integer, got {args.reps}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1: the Gluon kernel compiles and runs only without Triton's interpreter")
    if not args.compile_only:
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"{program}: no CUDA GPU here; run it on a Hopper GPU, or use --compile-only")
    out = Path(args.out or tempfile.mkdtemp(prefix=f"{program}-"))
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    compiled = compile_all(config_names, shape_names)
    record = dict(
        configs={name: asdict(configs[name]) for name in config_names},
        shapes={name: asdict(shapes[name]) for name in shape_names},
        compile=compiled,
    )
    failing = sorted({row["config"] for row in compiled if row["problems"]})
    if args.compile_only:
        (out / f"{program}_compile.json").write_text(json.dumps(record, indent=1))
        print(f"written: {out / f'{program}_compile.json'}")
        sys.exit(1 if failing else 0)
    import torch

    seed = fresh_seed() if args.seed is None else args.seed
    record.update(seed=seed, device=torch.cuda.get_device_name(), torch=torch.__version__, runs={})
    print(f"seed {seed}; logs in {out}; configs left out after compiling: {failing or 'none'}", flush=True)
    for name in [baseline] + [c for c in config_names if c not in failing]:
        time_left = args.budget - (time.monotonic() - started)
        if time_left <= 0:
            record["runs"][name] = dict(status="not run: --budget spent", seconds=0, results={})
            continue
        run = watch_child(script, program, name, args, shape_names, seed, time_left)
        record["runs"][name] = run
        print(f"{name:{name_width}s} {run['status']} in {run['seconds']} s", flush=True)
        (out / f"{program}.json").write_text(json.dumps(record, indent=1))  # what is measured so far survives
    print(
        f"\nTFLOP/s and fraction of {peer}'s (graph replay after an L2 flush; seed {seed}); "
        f"{time.monotonic() - started:.0f} s in all, JSON: {out / f'{program}.json'}"
    )
    print(table(record["runs"], shape_names))


if __name__ == "__main__":
    main()
