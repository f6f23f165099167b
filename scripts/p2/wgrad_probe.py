"""The grouped engine's weight-gradient probe: the Gluon varlen-K kernel (``moe_lib/engine/grouped_wgrad.py``)
against torch._grouped_mm (or a loop of torch.mm) at P2's, Qwen3-30B-A3B's and Mixtral's expert shapes.

    PYTHONPATH=. python scripts/p2/wgrad_probe.py [--configs A,B] [--shapes X,Y] [--timeout 120] [--stall 60]
        [--budget 240] [--reps 20] [--seed S] [--out DIR]
    PYTHONPATH=. python scripts/p2/wgrad_probe.py --compile-only [--configs ...] [--out DIR]

Shapes (:data:`SHAPES`): T tokens routed uniformly at random to K of E experts (M_total = T·K rows sorted by
expert, binomial counts), each model's weight gradients: ``gate_up`` dWg = dgᵀ·x_s and dWu = duᵀ·x_s (two products
in one launch; dg and du column views of one [T·K, 2I] tensor), ``down`` dWd = dy_sᵀ·aw (one), ``all`` the three.
Models: P2 (E 256, K 8, H 4096, I 2048) at 8192 and 32768 tokens, Qwen3-30B-A3B (E 128, K 8, H 2048, I 768) at
8192, Mixtral (E 8, K 2, H 4096, I 14336) at 4096. The baseline (``torch``): torch._grouped_mm(Aᵀ, B, offs) per
product ([E, M_p, N_p], the CUTLASS varlen-K grouped GEMM); where it refuses dg's and du's column views, the same
on contiguous copies made beforehand; where it refuses those too, a torch.mm per expert (its bounds read once on
the host, outside the timed call); the JSON notes which.
A config named with ``+gather`` reads x_s and dy_s through the routing (``moe_lib/engine/gathered.py``: its rows
gathered from [T, H] sources by cp.async in the loading partition), the rest as the config; its checks use the
rows written out.

On a GPU: first every config compiled for sm_90 on the host (as ``--compile-only``; a config that fails is left
out), then the baseline and each config in a child process of its own (``scripts/p2/gemm_probe.py``'s watch: killed
when it has finished no shape for ``--stall`` seconds, has run ``--timeout`` seconds, or the run's ``--budget`` is
spent). Per shape, small ones first: fresh random operands and routing (the seed's), the outputs poisoned with NaN,
one call checked (every element written and finite; six experts, the smallest and largest among them, against an
fp32 torch.mm: relative Frobenius error ≤ 1e-2), then timed by CUDA-graph replay with the L2 flushed before each
replay, the replays' outputs checked bitwise against the first call's. Logs and ``wgrad_probe.json`` go to --out
($OUT by default); one table (shape × config: TFLOP/s and the fraction of the baseline's) is printed last, with the
geometric mean over the shapes. Expected: 2-3 minutes, at most --budget.

--compile-only (no GPU: triton's ptxas and cuobjdump): each config for 1, 2 and 3 products with bf16 outputs (and
3 with fp32 outputs where the fp32 tile fits in shared memory), compiled for sm_90: registers at launch and after
setmaxnreg per partition, stack (a spill), shared memory, wgmma per K step and whether ptxas serialised them; exits
1 where one fails, spills, is over 227 KB or is serialised.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the dense probe's driver and the grouped probe's routing

import gemm_probe  # noqa: E402
import grouped_probe  # noqa: E402

from moe_lib.engine.gluon_gemm import GemmConfig  # noqa: E402

BASELINE = "torch"
TOLERANCE = 1e-2  # relative Frobenius error against fp32 torch.mm (bf16 output rounding alone ~2e-3)
CHECKED_EXPERTS = 6

CONFIGS = {
    # two warpgroups on a 128 × 256 tile (208 KB): the dense probe's best at large sizes
    "coop_m128n256k64_s3": GemmConfig(128, 256, 64, 3, "cooperative"),
    # a 128 × 128 tile, a deeper ring (192 KB): twice the tiles, half the output a tile
    "coop_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "cooperative"),
    # 256 rows of A (dg, du) by 128 columns of B: a gathered x tile a step half the 128 × 256 tile's
    "coop_m256n128k64_s3": GemmConfig(256, 128, 64, 3, "cooperative"),
    # ping-pong: each warpgroup a 128 × 128 tile of its own, one's store under the other's K loop (224 KB)
    "pp_m128n128k64_s5": GemmConfig(128, 128, 64, 5, "pingpong"),
}
GATHERED = "+gather"  # a config's name with this suffix: x_s and dy_s read through the routing (cp.async gathers)
# cooperative only: ping-pong's two accumulators leave the gathering partition too few registers (a spill)
CONFIGS.update({name + GATHERED: config for name, config in list(CONFIGS.items()) if not config.pingpong})
PRODUCTS = {"gate_up": "dWg = dgᵀ·x_s, dWu = duᵀ·x_s", "down": "dWd = dy_sᵀ·aw", "all": "dWg, dWu, dWd"}


@dataclass(frozen=True)
class Shape:
    """A model's weight gradients at T tokens: T·K rows over E experts, the products of ``products``."""

    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    products: str  # a key of PRODUCTS

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def outputs(self) -> list[tuple[int, int]]:
        """(M_p, N_p) of each product: [I, H] for dWg and dWu, [H, I] for dWd."""
        gate_up = [(self.inter, self.hidden)] * 2
        down = [(self.hidden, self.inter)]
        return {"gate_up": gate_up, "down": down, "all": gate_up + down}[self.products]

    @property
    def flop(self) -> int:
        return 2 * self.rows * sum(m * n for m, n in self.outputs)


def model_shapes(name: str, T: int, E: int, K: int, H: int, I: int) -> dict[str, Shape]:
    return {f"{name}_{products}": Shape(T, E, K, H, I, products) for products in PRODUCTS}


SHAPES = {
    **model_shapes("p2_t8192", 8192, 256, 8, 4096, 2048),
    **model_shapes("p2_t32768", 32768, 256, 8, 4096, 2048),
    **model_shapes("qwen3_t8192", 8192, 128, 8, 2048, 768),
    **model_shapes("qwen3_t32768", 32768, 128, 8, 2048, 768),
    **model_shapes("deepseek_t32768", 32768, 64, 6, 2048, 1408),
    **model_shapes("mixtral_t4096", 4096, 8, 2, 4096, 14336),
}


# --- compiling for sm_90 on the host ----------------------------------------------------------------------------


def compile_report(config: GemmConfig, problems: int, out_dtype, gathered: bool = False) -> dict:
    """``config``'s kernel for ``problems`` products with ``out_dtype`` outputs (``gathered``: x_s and dy_s read
    through an index), compiled for sm_90."""
    import torch

    from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, resource_usage, wgmma_serialized
    from moe_lib.engine.gathered import Gathered
    from moe_lib.engine.grouped_wgrad import grouped_wgrad_kernel, launch_arguments

    def meta(*size, dtype=torch.bfloat16):
        return torch.empty(size, dtype=dtype, device="meta")

    E, M, H, I = 8, 4096, 2048, 768  # the kernel depends on none of these
    gate_up = meta(M, 2 * I)
    index = meta(M, dtype=torch.int32)
    x, dy = (Gathered(meta(M // 4, H), index) for _ in range(2)) if gathered else (meta(M, H), meta(M, H))
    pairs = [(gate_up[:, :I], x), (gate_up[:, I:], x), (dy, meta(M, I))][:problems]
    outs = [meta(E, a.shape[1], b.shape[1], dtype=out_dtype) for a, b in pairs]
    arguments, constexprs = launch_arguments(config, pairs, meta(E + 1, dtype=torch.int32), outs)
    for name in arguments:  # the pointers and the scalars as the launcher specialises them
        if name.endswith("_ptr"):
            arguments[name] = "*i32" if name in ("offsets_ptr", "index_ptr") else "*bf16"
        elif name.endswith("_stride") or name == "num_experts":
            arguments[name] = "i32"
    start = time.perf_counter()
    try:
        compiled = compile_gluon_for_sm90(
            grouped_wgrad_kernel, arguments, constexprs, warps=config.warps, maxnreg=config.maxnreg
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
        descriptors=ptx.count("tensormap.cp_fenceproxy"),
        scratch=compiled.metadata.global_scratch_size,
        seconds=round(time.perf_counter() - start, 2),
        error=None,
    )


def variants(config: GemmConfig, shape_names: list[str]) -> list[tuple[int, str]]:
    """(products, output dtype) compiled for a config: the product counts of the shapes in bf16, and three
    products with fp32 outputs where that config's fp32 tiles fit in shared memory."""
    import torch

    from moe_lib.bench.sm90 import SHARED_MEMORY_LIMIT
    from moe_lib.engine.grouped_wgrad import shared_bytes

    counts = sorted({len(SHAPES[name].outputs) for name in shape_names})
    found = [(count, "bf16") for count in counts]
    if shared_bytes(config, torch.float32) <= SHARED_MEMORY_LIMIT:
        found.append((max(counts), "fp32"))
    return found


def compile_all(config_names: list[str], shape_names: list[str]) -> list[dict]:
    """Each config in each variant the shapes need, compiled once (printing a line each)."""
    import torch

    rows = []
    print(f"{'config':22s} prod out   launch  setmaxnreg  stack  smem   wgmma  serialised  desc  s", flush=True)
    for config_name in config_names:
        config = CONFIGS[config_name]
        for problems, out in variants(config, shape_names):
            dtype = torch.float32 if out == "fp32" else torch.bfloat16
            report = compile_report(config, problems, dtype, config_name.endswith(GATHERED))
            row = dict(config=config_name, problems_in_launch=problems, out=out, **report)
            row["problems"] = gemm_probe.compile_problems(row)
            rows.append(row)
            if report["error"]:
                print(f"{config_name:22s} {problems:4d} {out:5s} FAIL {report['error']}", flush=True)
                continue
            parts = "/".join(map(str, row["partition_registers"]))
            print(
                f"{config_name:22s} {problems:4d} {out:5s} {row['registers']:6d}  {parts:10s}  {row['stack']:5d}  "
                f"{row['shared'] // 1024:3d}K  {row['wgmma']:5d}  {row['serialized']:10s}  {row['descriptors']:4d}  "
                f"{row['seconds']:.1f}" + (f"  PROBLEM: {'; '.join(row['problems'])}" if row["problems"] else ""),
                flush=True,
            )
    return rows


# --- one config's shapes on the GPU (a child process) -------------------------------------------------------------


def operands(shape: Shape, generator, device) -> list[tuple]:
    """Fresh N(0, 1) bf16 operands of the shape's products, rows in sorted order: dg and du column views of one
    [T·K, 2I] tensor, x_s [T·K, H] shared by both; dy_s [T·K, H], aw [T·K, I]."""
    import torch

    def randn(*size):
        return torch.randn(size, generator=generator, device=device).to(torch.bfloat16)

    pairs = []
    if shape.products in ("gate_up", "all"):
        gate_up, x_s = randn(shape.rows, 2 * shape.inter), randn(shape.rows, shape.hidden)
        pairs += [(gate_up[:, : shape.inter], x_s), (gate_up[:, shape.inter :], x_s)]
    if shape.products in ("down", "all"):
        pairs.append((randn(shape.rows, shape.hidden), randn(shape.rows, shape.inter)))
    return pairs


def gathered_operands(shape: Shape, generator, device) -> tuple:
    """(the products with x_s and dy_s as Gathered rows of [T, H] sources through the routing's token of each row,
    the same products with those rows written out, offsets): each token's K distinct experts drawn uniformly, its
    slots sorted by expert (tokens ascending inside an expert, as the layer's routing sorts them)."""
    import torch

    from moe_lib.engine.gathered import Gathered

    def randn(*size):
        return torch.randn(size, generator=generator, device=device).to(torch.bfloat16)

    choice = torch.rand((shape.tokens, shape.experts), generator=generator, device=device).topk(shape.top_k).indices
    sorted_slot = torch.sort(choice.flatten(), stable=True).indices
    index = torch.div(sorted_slot, shape.top_k, rounding_mode="floor").int()
    offsets = torch.zeros(shape.experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.bincount(choice.flatten(), minlength=shape.experts).cumsum(0)
    gathered = []
    if shape.products in ("gate_up", "all"):
        gate_up, x = randn(shape.rows, 2 * shape.inter), Gathered(randn(shape.tokens, shape.hidden), index)
        gathered += [(gate_up[:, : shape.inter], x), (gate_up[:, shape.inter :], x)]
    if shape.products in ("down", "all"):
        gathered.append((Gathered(randn(shape.tokens, shape.hidden), index), randn(shape.rows, shape.inter)))
    written = [tuple(x.materialise() if isinstance(x, Gathered) else x for x in pair) for pair in gathered]
    return gathered, written, offsets


def checked_experts(bounds: list[int], generator) -> list[int]:
    """Up to CHECKED_EXPERTS experts to check: the fewest rows, the most, the first, the last and random ones."""
    import torch

    counts = [end - begin for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]
    chosen = [counts.index(min(counts)), counts.index(max(counts)), 0, len(counts) - 1]
    extra = torch.randperm(len(counts), generator=generator, device=generator.device).tolist()
    return list(dict.fromkeys(chosen + extra))[:CHECKED_EXPERTS]


def wrong(pairs, outs, bounds: list[int], experts: list[int]) -> str | None:
    """Why the outputs are wrong (a NaN or an infinity anywhere; a checked expert's relative error against fp32
    torch.mm over TOLERANCE), else None."""
    import torch

    for p, out in enumerate(outs):
        if not torch.isfinite(out).all():
            return f"product {p}: non-finite elements (NaN poison left, or a leak)"
        expected, got = [], []
        for e in experts:
            a, b = pairs[p][0][bounds[e] : bounds[e + 1]], pairs[p][1][bounds[e] : bounds[e + 1]]
            expected.append((a.float().t() @ b.float()).flatten())
            got.append(out[e].float().flatten())
        expected, got = torch.cat(expected), torch.cat(got)
        error = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
        if not error <= TOLERANCE:
            return f"product {p}: relative error {error:.3g} over experts {experts}"
    return None


def grouped_mm_refuses(pairs, ends) -> str | None:
    """Why torch._grouped_mm(Aᵀ, B, offs) refuses these operands (its first line), or None where it takes them."""
    import torch

    try:
        for a, b in pairs:
            torch._grouped_mm(a.t(), b, offs=ends)
    except (RuntimeError, AttributeError, TypeError) as exc:
        return str(exc).splitlines()[0][:120]
    return None


def baseline(pairs, offsets, bounds: list[int]):
    """(a call writing the products into given outputs, a note): torch._grouped_mm(Aᵀ, B, offs) per product; where
    it refuses a column view of A, the same on contiguous copies of A made here (outside the timed call, as a
    caller would keep dg and du); where it refuses those too, a torch.mm per expert."""
    import torch

    ends = offsets[1:]
    refused = grouped_mm_refuses(pairs, ends)
    note = None
    if refused is not None:
        copies = [(a.contiguous(), b) for a, b in pairs]
        if grouped_mm_refuses(copies, ends) is None:
            pairs, note = copies, f"A copied contiguous beforehand (torch._grouped_mm: {refused})"
        else:

            def loop(outs):
                for (a, b), out in zip(pairs, outs, strict=True):
                    for e in range(len(bounds) - 1):
                        if bounds[e + 1] > bounds[e]:
                            torch.mm(a[bounds[e] : bounds[e + 1]].t(), b[bounds[e] : bounds[e + 1]], out=out[e])
                        else:
                            out[e].zero_()
                return outs

            return loop, f"a torch.mm per expert (torch._grouped_mm: {refused})"

    def grouped(outs):
        return [torch._grouped_mm(a.t(), b, offs=ends) for a, b in pairs]  # its own allocations, no copy timed

    return grouped, note


def run_child(name: str, shape_names: list[str], reps: int, seed: int) -> None:
    """Checks and times ``name`` (a config or the baseline) at each shape, small ones first, printing a RESULT line
    as each shape starts and one as it ends."""
    import torch

    from moe_lib.bench.timing import L2Flusher

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    flush = L2Flusher(device)
    for shape_name in sorted(shape_names, key=lambda s: SHAPES[s].flop):
        gemm_probe.emit(event="start", shape=shape_name)
        try:
            row = check_and_time(SHAPES[shape_name], CONFIGS.get(name), seed, flush, reps, name.endswith(GATHERED))
        except Exception as exc:  # reported; a CUDA error leaves the context unusable and the next shapes fail too
            row = dict(check=f"ERROR: {type(exc).__name__}: {str(exc)[-300:]}")
        gemm_probe.emit(event="result", shape=shape_name, **row)
        torch.cuda.empty_cache()  # the shape's tensors are gone with check_and_time's frame


def check_and_time(
    shape: Shape, config: GemmConfig | None, seed: int, flush, reps: int, gathered: bool = False
) -> dict:
    """One shape for a config (None: the baseline): fresh operands and routing (``gathered``: x_s and dy_s read
    through it), a first call into NaN-poisoned outputs checked (:func:`wrong`), then CUDA-graph replays timed (the
    L2 flushed before each), their outputs checked against the first call's bit for bit."""
    import torch

    from moe_lib.bench.timing import time_graph
    from moe_lib.engine.grouped_wgrad import grouped_weight_grad

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)  # every child the same operands a shape
    if gathered:
        operands_in, pairs, offsets = gathered_operands(shape, generator, device)  # pairs: the rows written out
    else:
        offsets, _ = grouped_probe.routed_offsets(shape, generator, device)
        operands_in = pairs = operands(shape, generator, device)
    bounds = offsets.tolist()  # the checks' and the torch.mm loop's bounds: outside the timed calls
    note = None
    if config is None:
        call, note = baseline(pairs, offsets, bounds)
    else:

        def call(outs):
            return grouped_weight_grad(operands_in, offsets, outs=outs, config=config)

    outs = [
        torch.full((shape.experts, m, n), float("nan"), dtype=torch.bfloat16, device=device) for m, n in shape.outputs
    ]
    start = time.perf_counter()
    result = call(outs)
    torch.cuda.synchronize()
    row = dict(first_call_s=round(time.perf_counter() - start, 3))  # with the kernel's compilation, once
    if note:
        row["note"] = note
    problem = wrong(pairs, result, bounds, checked_experts(bounds, generator))
    if problem:
        return dict(row, check=f"WRONG: {problem}")
    first = [out.clone() for out in result]
    for out in outs:
        out.fill_(float("nan"))

    def replays_wrong(replayed):
        same = all(torch.equal(x, y) for x, y in zip(replayed, first, strict=True))
        return None if same else "replays differ from the first call"

    stats = time_graph(lambda: call(outs), flush, reps=reps, check_replay=replays_wrong)
    return dict(
        row,
        check="ok" if stats["replay_wrong"] is None else f"WRONG: {stats['replay_wrong']}",
        tflops=shape.flop / (stats["median_ms"] * 1e-3) / 1e12,
        **{key: stats[key] for key in ("median_ms", "p20_ms", "p80_ms", "reps")},
    )


# --- the parent: the table (gemm_probe.drive runs and watches the children) -------------------------------------------


def table(runs: dict, shape_names: list[str]) -> str:
    """shape × (the baseline, each config as c1, c2, ...): TFLOP/s and the fraction of the baseline's; the
    geometric mean fraction over the shapes last."""
    columns = list(runs)
    labels = {name: "torch" if name == BASELINE else f"c{i}" for i, name in enumerate(columns)}
    lines = [f"{labels[name]} = {name}" for name in columns if name != BASELINE]
    lines.append(f"{'shape':24s} {'rows':>6s} {'products':12s} " + " ".join(f"{labels[c]:>9s}" for c in columns))
    baselines = runs.get(BASELINE, {}).get("results", {})
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        base = baselines.get(shape_name)
        cells = [gemm_probe.cell(runs[c]["results"].get(shape_name), None if c == BASELINE else base) for c in columns]
        lines.append(f"{shape_name:24s} {shape.rows:6d} {shape.products:12s} " + " ".join(f"{c:>9s}" for c in cells))
    means = [gemm_probe.geomean_fraction(runs, column, shape_names, baselines) for column in columns]
    lines.append(f"{'geomean':44s} " + " ".join(f"{m:>9s}" for m in means))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawTextHelpFormatter,
        epilog="configs: " + ", ".join(CONFIGS) + "\nshapes: " + ", ".join(SHAPES),
    )
    parser.add_argument("--configs", default="all", help="comma list of configs (the baseline always runs), or all")
    parser.add_argument("--shapes", default="all", help="comma list of shapes, or all")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90, no GPU")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one config's child may run")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds a child may go without finishing a shape")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds the whole run may take")
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays a shape")
    parser.add_argument("--seed", type=int, default=None, help="the operands' and routing's seed (fresh by default)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory of the logs and JSON ($OUT)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gemm_probe.drive(
        args,
        parser,
        program="wgrad_probe",
        baseline=BASELINE,
        peer="torch._grouped_mm (or torch.mm per expert)",
        shapes=SHAPES,
        configs=CONFIGS,
        compile_all=compile_all,
        run_child=run_child,
        script=Path(__file__).resolve(),
        table=table,
        name_width=22,
    )


if __name__ == "__main__":
    main()
