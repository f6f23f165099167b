"""One rank's expert work in groups larger than the machine: measured on one GPU, for the cost model.

In a group of W ranks under balanced routing every rank receives about T_r·K rows and holds L = E/W experts, so
as W grows a rank's experts get more rows each (T_r·K/L = T_r·K·W/E) and fewer weights are read per row. The
expert time X of :func:`moe_lib.lab.parallel.model_step` is therefore not one rate for every W. This module
measures it where no group of W GPUs is at hand, on one GPU: for each W of ``--world-sizes`` and T_r of
``--tokens``, rank 0's share of the group's uniform inputs exactly as ``moe_lib.bench.parallel`` builds it (the
global inputs of W·T_r tokens from ``--seed``, the experts ``expert_partition(E, W)[0]`` and the rows whose expert
is among them), then ``moe_lib.moe_experts`` forward + backward on those rows, one expert per row (that
benchmark's "one GPU, same work"; no exchange)::

    python -m moe_lib.bench.rank_work                                    # W 2, 4, 8, 16; T_r 2048, 8192, 32768
    python -m moe_lib.bench.rank_work --small --device cpu               # tiny shapes (the test)

Each case: ``--warmup`` untimed steps, then ``--reps`` steps timed by CUDA events around the whole step (median).
Correctness, before the timing of each case: the output and the gradients of the rows and of the local experts
must be finite; at the smallest token count of each (dtype, W) they are also compared with ``impl="reference"``
in float64 on the same rows (relative Frobenius error per output, correct below :data:`FLOAT64_REL_ERROR` of the
dtype).

Outputs under ``<out>/<gpu key>/``: ``<YYYY-MM-DD>-moe_experts_rank_work-<dtype>[-small].csv`` (one row per
(W, T_r), columns :data:`CSV_COLUMNS`) and a ``.json`` beside it with the provenance.
"""

from __future__ import annotations

import argparse
import datetime
import math
from pathlib import Path

import pandas as pd
import torch

from ..dispatch import IMPLS
from .checks import error_sums, relative_error
from .cli import non_negative, positive, token_list
from .parallel import (
    FULL_AXES,
    MEMORY_HEADROOM,
    OUTPUT_NAMES,
    SMALL_AXES,
    global_inputs,
    local_share,
    resolve_shared_args,
    same_work_step,
    time_same_work_on_one_gpu,
)
from .provenance import gpu_key, run_context
from .results import DEFAULT_OUT, result_paths, result_stem, working_tree_state, write_run

PROBLEM = "moe_experts_rank_work"
# bound of each output's relative error against float64: the Triton path's products are bf16 (with fp32 inputs,
# g and u from bf16×3 and Wd·a from plain bf16 products, ≈ 2e-3 relative: moe_lib.moe_experts), the bounds of
# the property tests
FLOAT64_REL_ERROR = {"bfloat16": 3e-2, "float32": 8e-3}
FULL_WORLD_SIZES = [2, 4, 8, 16]
SMALL_WORLD_SIZES = [2, 4]
CSV_COLUMNS = [
    "problem",
    "dtype",
    "world_size",
    "local_experts",
    "tokens_per_rank",
    "rows_received",
    "rows_per_expert",
    "hidden_size",
    "intermediate_size",
    "num_experts",
    "top_k",
    "routing",
    "impl",
    "same_work_ms",
    "check",
    *(f"rel_error_{name}" for name in OUTPUT_NAMES),
    "max_rel_error",
    "correct",
    "status",
    "warmup",
    "reps",
    "device",
    "gpu",
    "small",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lib.bench.rank_work",
        description="Time one rank's expert work (moe_experts forward + backward on the rows rank 0 of a group of "
        "W ranks receives) on one device, for each world size and tokens per rank.",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (H 32, I 16, E 8, K 2; 16 and 64 tokens)")
    parser.add_argument(
        "--world-sizes", type=token_list, help="group sizes W, comma-separated (default 2,4,8,16; --small: 2,4)"
    )
    parser.add_argument("--tokens", type=token_list, help="tokens per rank, comma-separated")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    parser.add_argument(
        "--impl",
        default="auto",
        choices=IMPLS,
        help="the expert layer's path (auto: triton on CUDA, the reference on CPU)",
    )
    parser.add_argument("--seed", type=non_negative, default=0)
    parser.add_argument("--warmup", type=non_negative, help="untimed runs per case (default 2; CPU 1)")
    parser.add_argument("--reps", type=positive, help="timed runs per case (default 5; CPU 3)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each case's timing, one more step under torch.profiler: its kernels' device "
        "times go to the JSON (key 'kernels') and are printed",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_shared_args(parser, args)
    if not args.dtypes:
        parser.error("--dtypes: expected at least one of bfloat16, float32")
    axes = SMALL_AXES if args.small else FULL_AXES
    if args.world_sizes is None:
        args.world_sizes = SMALL_WORLD_SIZES if args.small else FULL_WORLD_SIZES
    for world_size in args.world_sizes:
        if not 1 <= world_size <= axes["num_experts"]:
            parser.error(
                f"--world-sizes: expected 1 to {axes['num_experts']} (the experts to share out), got {world_size}"
            )
    if 0 in args.tokens:
        parser.error("--tokens: expected positive token counts, got 0")
    args.routing = "uniform"  # balanced routing, the cost model's (moe_lib.bench.parallel.global_inputs reads it)
    return args


def memory_needed(tokens_per_rank: int, world_size: int, element_bytes: int, axes: dict) -> int:
    """Rough peak bytes of one case: the group's global inputs (all E experts' weights, W·T_r tokens' rows), rank
    0's received rows and the layer's forward + backward on them (weight gradients, ~10 row buffers of [rows, H],
    an fp32 dX workspace and three bf16 [rows, I] workspaces)."""
    H, I, E, K = (axes[name] for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"))
    expert_bytes = 3 * I * H * element_bytes
    rows = tokens_per_rank * K
    inputs = E * expert_bytes + 2 * world_size * tokens_per_rank * H * element_bytes
    layer = 2 * -(-E // world_size) * expert_bytes + rows * H * (10 * element_bytes + 8) + 3 * rows * I * 2
    return inputs + layer


def _float64_errors(rows: dict, shard: list, got: tuple) -> dict[str, float]:
    """Each output's relative Frobenius error against ``impl="reference"`` in float64 on the same rows."""
    rows64 = dict(
        rows,
        grad_output=rows["grad_output"].double(),
        hidden_states=rows["hidden_states"].detach().double().requires_grad_(),
        topk_weights=rows["topk_weights"].detach().double().requires_grad_(),
    )
    shard64 = [w.detach().double().requires_grad_() for w in shard]
    want = same_work_step(rows64, shard64, "reference")
    errors = {}
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        sums = error_sums(g, w)
        errors[name] = relative_error(sums["diff_sq"], sums["ref_sq"])
    return errors


def run_case(dtype_name: str, world_size: int, tokens_per_rank: int, args, device, *, check: bool) -> dict:
    """One (dtype, W, T_r) case: its CSV row."""
    axes = SMALL_AXES if args.small else FULL_AXES
    E = axes["num_experts"]
    row = dict(
        problem=PROBLEM,
        dtype=dtype_name,
        world_size=world_size,
        local_experts=-(-E // world_size),
        tokens_per_rank=tokens_per_rank,
        **axes,
        routing="uniform",
        impl=args.impl,
        warmup=args.warmup,
        reps=args.reps,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0] * MEMORY_HEADROOM
        needed = memory_needed(tokens_per_rank, world_size, getattr(torch, dtype_name).itemsize, axes)
        if needed > free:
            row["status"] = f"skipped: needs ~{needed / 2**30:.0f} GiB, less is free"
            return row
    share = local_share(
        global_inputs(dtype_name, tokens_per_rank, world_size, args, device), 0, world_size, tokens_per_rank
    )
    rows, shard = share["received_rows"], share["shard"]
    received = rows["hidden_states"].shape[0]
    row.update(rows_received=received, rows_per_expert=received / shard[0].shape[0])

    got = same_work_step(rows, shard, args.impl)
    finite = all(bool(torch.isfinite(t).all()) for t in got)
    errors = _float64_errors(rows, shard, got) if check and finite else {}
    del got
    row["check"] = "float64" if check else "finite"
    row.update({f"rel_error_{name}": value for name, value in errors.items()})
    row["max_rel_error"] = max(errors.values()) if errors else math.nan
    row["correct"] = finite and (not errors or row["max_rel_error"] < FLOAT64_REL_ERROR[dtype_name])
    if not row["correct"]:
        error = "non-finite outputs" if not finite else f"max rel. error {row['max_rel_error']:.2e}"
        row["status"] = f"wrong: {error}"
        return row

    row["same_work_ms"] = time_same_work_on_one_gpu(share, args, device)
    row["status"] = "ok"
    if args.profile:
        row["kernels"] = kernel_times(lambda: same_work_step(rows, shard, args.impl), device)
    return row


def kernel_times(step, device, top: int = 12) -> list[dict]:
    """One more ``step`` under torch.profiler: its ``top`` kernels (and other device work) by total device time
    (on CPU: the operators by their own CPU time), each with its name, calls and ms."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiled:
        outputs = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    del outputs

    def self_us(event) -> float:  # on CPU the operators' own time
        return event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total

    events = sorted((event for event in profiled.key_averages() if self_us(event) > 0), key=self_us, reverse=True)
    return [dict(name=event.key, calls=event.count, ms=self_us(event) / 1e3) for event in events[:top]]


def write_results(rows: list[dict], dtype_name: str, args, device, started) -> tuple[Path, Path]:
    """The CSV and JSON of one dtype's cases (and their table, printed); returns their paths."""
    stem = result_stem(PROBLEM, dtype_name, small=args.small, tag=None, date=started.strftime("%Y-%m-%d"))
    csv_path, json_path = result_paths(args.out, device, stem)
    frame = pd.DataFrame(
        [dict(row, device=device.type, gpu=gpu_key(device), small=args.small) for row in rows]
    ).reindex(columns=CSV_COLUMNS)
    document = dict(
        problem=PROBLEM,
        dtype=dtype_name,
        axes=SMALL_AXES if args.small else FULL_AXES,
        world_sizes=args.world_sizes,
        tokens_per_rank=args.tokens,
        provenance=dict(
            run_context(device, started, "moe_lib.bench.rank_work"),
            **working_tree_state(),
            seed=args.seed,
            impl=args.impl,
            warmup=args.warmup,
            reps=args.reps,
            small=args.small,
            correct_rel_error=FLOAT64_REL_ERROR,
        ),
    )
    if args.profile:
        document["kernels"] = [
            dict(world_size=row["world_size"], tokens_per_rank=row["tokens_per_rank"], kernels=row.get("kernels", []))
            for row in rows
        ]
    write_run(csv_path, frame, json_path, document)
    shown = frame[
        [
            "world_size",
            "local_experts",
            "tokens_per_rank",
            "rows_per_expert",
            "same_work_ms",
            "check",
            "max_rel_error",
            "status",
        ]
    ]
    print(f"{PROBLEM} · {dtype_name} · {gpu_key(device)} · one rank's expert work, forward + backward, median ms")
    print(shown.to_string(index=False, float_format=lambda value: f"{value:.4g}"), flush=True)
    for row in rows if args.profile else []:
        kernels = ", ".join(f"{k['name'][:40]} {k['ms']:.2f} ms ×{k['calls']}" for k in row.get("kernels", []))
        print(f"W={row['world_size']} T_r={row['tokens_per_rank']}: {kernels}", flush=True)
    print(f"wrote {csv_path}\n      {json_path}", flush=True)
    return csv_path, json_path


def main(argv=None) -> list[Path]:
    args = parse_args(argv)
    device = torch.device(args.device)
    started = datetime.datetime.now(datetime.timezone.utc)
    written = []
    for dtype_name in args.dtypes:
        rows = []
        for world_size in args.world_sizes:
            for tokens in args.tokens:
                rows.append(run_case(dtype_name, world_size, tokens, args, device, check=tokens == min(args.tokens)))
                print(
                    f"{dtype_name} W={world_size} T_r={tokens}: {rows[-1].get('same_work_ms', math.nan):.3f} ms "
                    f"({rows[-1]['status']})",
                    flush=True,
                )
        written.extend(write_results(rows, dtype_name, args, device, started))
        wrong = [row for row in rows if str(row["status"]).startswith("wrong")]
        if wrong:
            cases = ", ".join(f"W={row['world_size']} T_r={row['tokens_per_rank']}: {row['status']}" for row in wrong)
            raise SystemExit(f"{dtype_name}: wrong results, not timed ({cases})")
    return written


if __name__ == "__main__":
    main()
