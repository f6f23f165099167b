"""Notebook 06: the expert-parallel layer (:mod:`moe_lib.distributed`), modelled and measured on several GPUs.

- **Exchanges and cost model**: :func:`exchange_bytes` counts what one rank sends to and receives from the
  other ranks in each exchange of a step, from its rows; :func:`model_step` is the cost model of a step
  (all-to-all bytes over a link bandwidth against the expert work on a roofline).
- **Measured runs**: :func:`load_parallel_results` reads the files of ``python -m moe_lib.bench.parallel``
  (``data/results/<GPU>/<date>-moe_experts_parallel-<dtype>[-<W>gpus].csv`` and the JSON beside it); the tables and
  figures are built from them.
- **One rank's work at larger world sizes**: :func:`load_rank_work` reads the files of ``python -m
  moe_lib.bench.rank_work`` (one GPU: the expert work of rank 0 of a group of W ranks, for W beyond the GPUs at
  hand); :func:`node_scaling_table` can take the expert time from them at each world size it models.

The live run of the layer on CPU processes is in :mod:`.parallel_live`. Times are in milliseconds (``*_ms``),
bandwidths in B/s unless a column says GB/s (10⁹ B/s), rates in FLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib import patches

from .. import problems, roofline
from ..bench.parallel import OUTPUT_NAMES, PROBLEM, PROBLEM_OF_DTYPE
from ..bench.rank_work import PROBLEM as RANK_WORK_PROBLEM
from ..moe_experts.parallel import ALL_TO_ALL_PHASES, EXPERT_PHASES, STATUS_COLUMNS, expert_partition
from .results import RunFiles, read_run_csv, read_run_json, require_keys, resolve_path

COUNT_BYTES = 8  # the counts exchange is int64
# FLOPs per (token, slot) row, in units of H·I: the forward's g, u and down products (three GEMMs of 2·H·I) and
# the backward's eight (moe_lib.roofline's convention for P2, its recomputed forward included)
FORWARD_FLOPS_PER_ROW_HI = 6
BACKWARD_FLOPS_PER_ROW_HI = 16
STEP_FLOPS_PER_ROW_HI = FORWARD_FLOPS_PER_ROW_HI + BACKWARD_FLOPS_PER_ROW_HI
# the expert work's DRAM traffic per step, in units of (local experts)·H·I weights and of rows·H: the forward
# reads the three weights, the backward reads them again and writes their gradients; the forward reads the
# received rows and writes their outputs, the backward reads dy and x rows and writes dx rows
EXPERT_WEIGHT_PASSES = 9
EXPERT_ROW_PASSES = 5
PHASE_COLORS = {
    "all-to-all": "tab:red",
    "expert forward": "tab:blue",
    "expert backward": "tab:green",
    "other": "tab:gray",
    "one GPU, same work": "tab:orange",
}


# ================================================================ exchanges and the cost model


def exchange_bytes(
    rows_sent: list[int],
    rows_received: list[int],
    rank: int,
    *,
    hidden_size: int,
    element_bytes: int,
    weight_bytes: int,
    max_local_experts: int,
) -> pd.DataFrame:
    """What ``rank`` sends to and receives from the *other* ranks in each exchange of one forward + backward
    step, from its rows (``ExpertParallelStats.rows_sent`` / ``rows_received``; the chunk to itself is a local
    copy and not counted). S = rows to other ranks, R = rows from them; a hidden-state row is H·b bytes, a
    routing weight (or its gradient) ``weight_bytes``; the counts are int64 [3 + L_max] per rank."""
    world_size = len(rows_sent)
    out_rows = sum(n for s, n in enumerate(rows_sent) if s != rank)
    in_rows = sum(n for s, n in enumerate(rows_received) if s != rank)
    row, row_and_weight = hidden_size * element_bytes, hidden_size * element_bytes + weight_bytes
    counts = (world_size - 1) * (len(STATUS_COLUMNS) + max_local_experts) * COUNT_BYTES
    table = [
        (
            "counts_exchange",
            "forward",
            "status and rows per local expert, int64 [W, 3 + L_max]",
            world_size - 1,
            counts,
            world_size - 1,
            counts,
        ),
        (
            "dispatch",
            "forward",
            "hidden-state rows [S, H] and their routing weights [S]",
            out_rows,
            out_rows * row_and_weight,
            in_rows,
            in_rows * row_and_weight,
        ),
        (
            "combine",
            "forward",
            "weighted expert outputs [R, H] back to the token's rank",
            in_rows,
            in_rows * row,
            out_rows,
            out_rows * row,
        ),
        (
            "backward_dispatch",
            "backward",
            "output-gradient rows [S, H] to the expert's rank",
            out_rows,
            out_rows * row,
            in_rows,
            in_rows * row,
        ),
        (
            "backward_combine",
            "backward",
            "hidden-state gradient rows [R, H] and routing-weight gradients [R]",
            in_rows,
            in_rows * row_and_weight,
            out_rows,
            out_rows * row_and_weight,
        ),
    ]
    columns = ["exchange", "pass", "what", "rows out", "bytes out", "rows in", "bytes in"]
    return pd.DataFrame(table, columns=columns).set_index("exchange")


def model_step(
    tokens_per_rank,
    *,
    world_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    element_bytes: int,
    weight_bytes: int,
    link_bandwidth: float,
    flops_rate: float,
    memory_bandwidth: float | None = None,
    chunks: int = 1,
    chunk_overhead_s: float = 0.0,
    gpus_per_node: int | None = None,
    network_bandwidth: float | None = None,
) -> dict:
    """The cost model of one forward + backward step on one rank, under balanced routing (every rank sends
    and receives T_r·K rows, a fraction (W − 1)/W of them to or from other ranks); arrays over
    ``tokens_per_rank``:

    - ``all_to_all_bytes`` = T_r·K·(W−1)/W · (4·H·b + 2·b_w) (the counts exchange left out);
    - ``expert_flops`` = 22·T_r·K·H·I (forward 6, backward 16);
    - ``expert_bytes`` = 9·L·H·I·b + 5·T_r·K·H·b with L = ⌈E/W⌉ local experts (the weights read in the forward,
      read again and their gradients written in the backward; chunks by expert group read each weight once);
    - ``all_to_all_s`` = bytes / link_bandwidth; ``expert_s`` = max(FLOPs / flops_rate, bytes /
      memory_bandwidth) (the FLOPs alone when ``memory_bandwidth`` is None);
    - with ``gpus_per_node`` G < W, the ranks in nodes of G: the rows to ranks of the same node (a fraction
      (G − 1)/W) cross ``link_bandwidth`` (NVLink), those to other nodes ((W − G)/W) ``network_bandwidth`` (the
      GPU's network port), both at once, so ``all_to_all_s`` = the longer of the two (``network_s`` the second);
    - ``step_s`` = max(A, X) + min(A, X) / C + (C − 1)·τ for A = all_to_all_s and X = expert_s: C = 1 runs the
      exchanges and the expert work one after the other (A + X); with C chunks (``moe_experts_parallel(chunks=C)``)
      the two streams form a pipeline of C stages in which only one stage of the shorter of the two stays exposed,
      and each further chunk costs τ = ``chunk_overhead_s`` (its launches and exchange calls: fit it to a measured
      run with :func:`chunk_overhead`);
    - ``share`` = (step_s − expert_s) / step_s, the exposed exchange's share of the step. The rest of the step
      (row gathers, sums over K, the host read) is left out.
    """
    tokens = np.asarray(tokens_per_rank, dtype=float)
    rows = tokens * top_k
    remote = rows * (world_size - 1) / world_size
    row_bytes = 4 * hidden_size * element_bytes + 2 * weight_bytes
    all_to_all_bytes = remote * row_bytes
    node = world_size if gpus_per_node is None else gpus_per_node
    if not isinstance(node, int) or isinstance(node, bool) or not 1 <= node <= world_size:
        raise ValueError(
            f"gpus_per_node: expected an integer from 1 to world_size ({world_size}), got {gpus_per_node!r}"
        )
    if node < world_size and not (network_bandwidth and network_bandwidth > 0):
        raise ValueError(
            f"network_bandwidth: expected a positive bandwidth in B/s for {world_size} ranks in nodes of "
            f"{node}, got {network_bandwidth!r}"
        )
    expert_flops = STEP_FLOPS_PER_ROW_HI * rows * hidden_size * intermediate_size
    local_experts = -(-num_experts // world_size)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks: expected a positive integer, got {chunks!r}")
    expert_bytes = (
        EXPERT_WEIGHT_PASSES * local_experts * hidden_size * intermediate_size * element_bytes
        + EXPERT_ROW_PASSES * rows * hidden_size * element_bytes
    )
    network_s = rows * (world_size - node) / world_size * row_bytes / (network_bandwidth or 1.0)
    all_to_all_s = np.maximum(rows * (node - 1) / world_size * row_bytes / link_bandwidth, network_s)
    expert_s = expert_flops / flops_rate
    if memory_bandwidth is not None:
        expert_s = np.maximum(expert_s, expert_bytes / memory_bandwidth)
    step_s = np.maximum(all_to_all_s, expert_s) + np.minimum(all_to_all_s, expert_s) / chunks
    step_s = step_s + (chunks - 1) * chunk_overhead_s
    return dict(
        tokens_per_rank=tokens,
        all_to_all_bytes=all_to_all_bytes,
        expert_flops=expert_flops,
        expert_bytes=expert_bytes,
        all_to_all_s=all_to_all_s,
        network_s=network_s,
        expert_s=expert_s,
        step_s=step_s,
        share=(step_s - expert_s) / step_s,
    )


def asymptotic_share(
    *, world_size: int, intermediate_size: int, element_bytes: int, link_bandwidth: float, flops_rate: float
) -> float:
    """The model's share at large T_r (compute-bound, routing weights neglected): with
    ρ = 4·b·(W−1)/W · F / (22 · I · B_link), share = ρ / (1 + ρ). H and T_r cancel."""
    ratio = (
        4
        * element_bytes
        * (world_size - 1)
        / world_size
        * flops_rate
        / (STEP_FLOPS_PER_ROW_HI * intermediate_size * link_bandwidth)
    )
    return ratio / (1 + ratio)


def measured_model_inputs(run) -> tuple[int, float, float, dict]:
    """What the cost model takes from a measured run, at its largest token count: (that count, the link
    bandwidth its best rank achieved in B/s, the expert rate its best rank measured in FLOP/s, and the run's
    shapes with that link bandwidth as :func:`model_step` keywords)."""
    largest = max(run.cases)
    link = bandwidth_table(run).loc[largest, "GB/s out"].max() * 1e9
    measured_rate = expert_rate_table(run).loc[largest, "TFLOP/s"].max() * 1e12
    shapes = dict(
        hidden_size=run.axes["hidden_size"],
        intermediate_size=run.axes["intermediate_size"],
        num_experts=run.axes["num_experts"],
        top_k=run.axes["top_k"],
        element_bytes=run.element_bytes,
        weight_bytes=run.weight_bytes,
        link_bandwidth=link,
    )
    return largest, link, measured_rate, shapes


def chunk_overhead(run) -> float:
    """τ of :func:`model_step` fitted to a measured run with several chunk counts (seconds): per timed case with
    C > 1, what its total exceeds the ideal pipeline max(A, X) + min(A, X)/C by, per further chunk, with A the
    case's exchange time and X the rest of its step at C = 1; the median over the cases. 0 for a run with no
    chunked cases."""
    table = run.chunked
    samples = []
    for (tokens, chunks), row in table.iterrows():
        if chunks == 1 or (tokens, 1) not in table.index:
            continue
        plain = table.loc[(tokens, 1)]
        a, x = plain["all_to_all_ms"], plain["total_ms"] - plain["all_to_all_ms"]
        samples.append((row["total_ms"] - max(a, x) - min(a, x) / chunks) / (chunks - 1) / 1e3)
    return float(np.median(samples)) if samples else 0.0


def overlap_table(run) -> pd.DataFrame:
    """The measured step per token count (rows) and chunk count (columns): total ms, its ratio to one chunk's,
    and the exchange share (the exchange time the compute stream still waited, over the step)."""
    table = run.chunked
    total = table["total_ms"].unstack("chunks")
    return pd.concat(
        {
            "total ms": total,
            "vs one chunk": total.div(total[1], axis=0),
            "exchange share": (table["all_to_all_ms"] / table["total_ms"]).unstack("chunks"),
        },
        axis=1,
    ).rename_axis("tokens / rank")


def scaling_table(runs: dict) -> pd.DataFrame:
    """Weak scaling, one row per (dtype, world size, tokens per rank) of the given runs (any dict of them, e.g.
    :func:`load_scaling_runs`): the global tokens, the step without overlap and its exchange share, the fastest
    chunk count measured with its step and share, and the same per-rank work on one GPU alone
    (``moe_lib.moe_experts`` on the rows a rank receives, no exchange)."""
    rows = []
    for run in runs.values():
        dtype = run.dtype
        table = run.chunked
        for tokens, plain in run.ok.iterrows():
            by_chunks = table.xs(tokens, level="tokens_per_rank")
            best = int(by_chunks["total_ms"].idxmin())
            fastest = by_chunks.loc[best]
            rows.append(
                {
                    "dtype": dtype,
                    "world size": run.world_size,
                    "tokens / rank": tokens,
                    "global tokens": int(plain["global_tokens"]),
                    "step ms": plain["total_ms"],
                    "exchange share": plain["all_to_all_ms"] / plain["total_ms"],
                    "fastest chunks": best,
                    "step ms, fastest": fastest["total_ms"],
                    "exchange share, fastest": fastest["all_to_all_ms"] / fastest["total_ms"],
                    "one GPU, same work ms": plain["single_gpu_same_work_ms"],
                }
            )
    return pd.DataFrame(rows).set_index(["dtype", "world size", "tokens / rank"])


def timeline_of(run, tokens_per_rank: int, chunks: int) -> list[list[dict]]:
    """Every rank's timeline of the last timed step of one measured case (``timelines_by_rank`` of the JSON)."""
    for case in run.meta["cases"]:
        if case["tokens_per_rank"] == tokens_per_rank and case.get("chunks", 1) == chunks:
            if not case.get("timelines_by_rank"):
                break
            return case["timelines_by_rank"]
    raise KeyError(f"{run.csv.name}: no timeline of {tokens_per_rank} tokens per rank in {chunks} chunk(s)")


def model_curves(runs: dict, *, gpu_key: str, extra_world_size: int, tokens_grid) -> tuple[dict, dict]:
    """The cost model over ``tokens_grid`` for each measured run (dtype), with the run's shapes and the link
    bandwidth it achieved (the best rank's at its largest token count): experts at the rate the run measured
    there (the run's world size), and at the datasheet roofline of ``gpu_key`` (bf16 tensor rate and HBM
    bandwidth; the run's world size and ``extra_world_size``) when :data:`moe_lib.roofline.GPUS` has it.

    Returns (curves: dtype → {label: :func:`model_step` result}, summary: dtype → the link bandwidth in GB/s,
    the measured expert rate in TFLOP/s and the large-T_r share of each curve)."""
    spec = roofline.GPUS.get(gpu_key)
    curves, summary = {}, {}
    for dtype, run in runs.items():
        largest, link, measured_rate, shapes = measured_model_inputs(run)
        settings = {
            f"W = {run.world_size}, experts at the measured {measured_rate / 1e12:.0f} TFLOP/s": dict(
                world_size=run.world_size, flops_rate=measured_rate
            )
        }
        if spec is not None:
            for world_size in dict.fromkeys((run.world_size, extra_world_size)):
                settings[f"W = {world_size}, experts at the {gpu_key} roofline"] = dict(
                    world_size=world_size, flops_rate=spec.bf16_dense_flops, memory_bandwidth=spec.dram_bandwidth
                )
        curves[dtype] = {label: model_step(tokens_grid, **shapes, **s) for label, s in settings.items()}
        intermediate_size = run.axes["intermediate_size"]
        asymptotes = {
            label: asymptotic_share(
                world_size=s["world_size"],
                intermediate_size=intermediate_size,
                element_bytes=run.element_bytes,
                link_bandwidth=link,
                flops_rate=s["flops_rate"],
            )
            for label, s in settings.items()
        }
        summary[dtype] = dict(
            tokens_per_rank=largest,
            link_gb_per_s=link / 1e9,
            asymptotic_share=asymptotes,
            measured_expert_tflop_per_s=measured_rate / 1e12,
        )
    return curves, summary


# ================================================================ measured runs


@dataclass(frozen=True)
class ParallelRun(RunFiles):
    """One run of ``python -m moe_lib.bench.parallel`` for one dtype: its CSV (one row per token count) and JSON."""

    @property
    def axes(self) -> dict:
        return dict(self.meta["axes"])

    @property
    def world_size(self) -> int:
        return int(self.provenance.get("world_size") or self.frame["world_size"].iloc[0])

    @property
    def element_bytes(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def weight_bytes(self) -> int:
        """Bytes of one routing weight (and of its gradient): the problem definition's topk_weights dtype."""
        name = problems.load(PROBLEM_OF_DTYPE[self.dtype]).inputs["topk_weights"]["dtype"]
        return problems.DTYPES[name].itemsize

    @property
    def cases(self) -> dict[int, dict]:
        """The JSON's per-case details (rows and per-rank medians) by tokens per rank, without overlap (chunks 1;
        a run made before the layer had chunks has only those)."""
        return {int(case["tokens_per_rank"]): case for case in self.meta["cases"] if case.get("chunks", 1) == 1}

    @property
    def ok(self) -> pd.DataFrame:
        """The CSV's rows that were timed without overlap (chunks 1), indexed by tokens per rank."""
        timed = self.frame[self.frame["status"].str.startswith(("ok", "timed"))]
        if "chunks" in timed:
            timed = timed[timed["chunks"] == 1]
        return timed.set_index("tokens_per_rank")

    @property
    def chunked(self) -> pd.DataFrame:
        """Every timed row, indexed by (tokens per rank, chunks): the overlap's runs beside the plain ones."""
        timed = self.frame[self.frame["status"].str.startswith(("ok", "timed"))].copy()
        if "chunks" not in timed:
            timed["chunks"] = 1
        return timed.set_index(["tokens_per_rank", "chunks"]).sort_index()


def _full_size_runs(
    results_dir,
    gpu_key: str,
    problem: str = PROBLEM,
    run_class=ParallelRun,
    json_keys=("cases",),
    csv_columns=("tokens_per_rank", "status"),
) -> list:
    """Every full-size run of ``problem`` (by default the multi-GPU benchmark's, as :class:`ParallelRun`) in
    ``<results_dir>/<gpu_key>/`` (``results_dir`` relative to the repository root unless absolute), oldest first;
    its JSON must hold dtype, axes and ``json_keys``, its CSV ``csv_columns``."""
    folder = resolve_path(results_dir) / gpu_key
    runs = []
    for csv_path in sorted(folder.glob(f"*-{problem}-*.csv")):
        json_path = csv_path.with_suffix(".json")
        if not json_path.is_file():
            continue
        meta = read_run_json(json_path)
        if meta.get("problem") != problem or meta.get("provenance", {}).get("small"):
            continue
        require_keys(meta, ("dtype", "axes", *json_keys), json_path)
        runs.append(run_class(csv=csv_path, frame=read_run_csv(csv_path, csv_columns), meta=meta))
    return sorted(runs, key=lambda run: run.date)


def load_parallel_results(
    results_dir="data/results", gpu_key: str = "H200", date: str | None = None, world_size: int | None = None
) -> dict[str, ParallelRun]:
    """The newest full-size run of each dtype in ``<results_dir>/<gpu_key>/`` (``results_dir`` relative to the
    repository root unless absolute), keyed by dtype, the narrowest first (bfloat16, then float32); with
    ``date`` ("YYYY-MM-DD"), the runs of that day; with ``world_size``, the runs on that many GPUs (by default
    on two or more: a run on one GPU has no exchange between GPUs to model)."""
    newest: dict[str, ParallelRun] = {}
    for run in _full_size_runs(results_dir, gpu_key):
        on_gpus = run.world_size >= 2 if world_size is None else run.world_size == world_size
        if (date is None or run.date == date) and on_gpus:
            newest[run.dtype] = run  # oldest first: the newest stays
    if not newest:
        conditions = (f" dated {date}" if date else "") + (f" on {world_size} GPUs" if world_size else "")
        raise FileNotFoundError(
            f"no {PROBLEM} results (CSV with its JSON) in {resolve_path(results_dir) / gpu_key}" + conditions
        )
    return {run.dtype: run for run in sorted(newest.values(), key=lambda run: (run.element_bytes, run.dtype))}


def load_scaling_runs(results_dir="data/results", gpu_key: str = "H200") -> dict[tuple[str, int], ParallelRun]:
    """The newest full-size run of each (dtype, world size) in ``<results_dir>/<gpu_key>/``, ordered by dtype (the
    narrowest first), then world size: the weak-scaling series (:func:`scaling_table`)."""
    newest = {(run.dtype, run.world_size): run for run in _full_size_runs(results_dir, gpu_key)}
    if not newest:
        raise FileNotFoundError(f"no {PROBLEM} results (CSV with its JSON) in {resolve_path(results_dir) / gpu_key}")
    order = sorted(newest, key=lambda key: (newest[key].element_bytes, key))
    return {key: newest[key] for key in order}


def provenance_table(runs: dict[str, ParallelRun]) -> pd.DataFrame:
    """Where, when and with what each file was measured: one column per file."""
    rows = {}
    for run in runs.values():
        p = run.provenance
        environment = p.get("environment") or {}
        rows[run.csv.name] = {
            "dtype": run.dtype,
            "GPU": f"{p.get('gpu_name')} × {run.world_size}",
            "driver": p.get("driver_version"),
            "torch": p.get("torch"),
            "CUDA": p.get("cuda"),
            "NCCL": p.get("nccl"),
            "triton": p.get("triton"),
            "backend": p.get("backend"),
            "world size": run.world_size,
            "commit": (p.get("git_commit") or "unknown")[:10],
            "date (UTC)": p.get("date_utc"),
            "shapes": ", ".join(f"{k} {v}" for k, v in run.axes.items()),
            "tokens per rank": ", ".join(str(t) for t in run.cases),
            "routing · impl · seed": f"{p.get('routing')} · {p.get('impl')} · {p.get('seed')}",
            "warm-up / reps": f"{p.get('warmup')} / {p.get('reps')}",
            "environment": " ".join(f"{k}={v}" for k, v in environment.items() if v is not None),
            "command": p.get("command"),
        }
    return pd.DataFrame.from_dict(rows, orient="index").T


def measured_table(run: ParallelRun) -> pd.DataFrame:
    """The CSV's times per token count (each the largest per-rank median, ms), the all-to-all share of the
    step, the "one GPU, same work" time over the parallel layer's expert time, and correctness."""
    ok = run.ok
    return pd.DataFrame(
        {
            "total": ok["total_ms"],
            "all-to-all": ok["all_to_all_ms"],
            "expert fwd": ok["expert_forward_ms"],
            "expert bwd": ok["expert_backward_ms"],
            "other": ok["other_ms"],
            "one GPU, same work": ok["single_gpu_same_work_ms"],
            "all-to-all share": ok["all_to_all_ms"] / ok["total_ms"],
            "one GPU / expert": ok["single_gpu_same_work_ms"] / ok["expert_ms"],
            "max rel. error": ok["max_rel_error"],
            "correct": ok["correct"],
        }
    ).rename_axis("tokens / rank")


def error_table(runs: dict[str, ParallelRun]) -> pd.DataFrame:
    """‖parallel − one GPU‖/‖one GPU‖ of each output (rows) per dtype and token count (columns), and the
    run's bound for "correct"."""
    columns = {}
    for run in runs.values():
        bound = (run.provenance.get("correct_rel_error") or {}).get(run.dtype, math.nan)
        for tokens, row in run.ok.iterrows():
            errors = {name: row[f"rel_error_{name}"] for name in OUTPUT_NAMES}
            columns[(run.dtype, tokens)] = {**errors, "bound": bound}
    table = pd.DataFrame(columns)
    table.columns.names = ["dtype", "tokens / rank"]
    return table


def measured_summary(run: ParallelRun) -> dict:
    """Per token count (as a string): the CSV's total and all-to-all time, the all-to-all share, the "one
    GPU, same work" time, the correctness, and each rank's achieved bandwidth out (GB/s)."""
    ok, bandwidth = run.ok, bandwidth_table(run)
    return {
        str(tokens): {
            "total_ms": float(row["total_ms"]),
            "all_to_all_ms": float(row["all_to_all_ms"]),
            "all_to_all_share": float(row["all_to_all_ms"] / row["total_ms"]),
            "single_gpu_same_work_ms": float(row["single_gpu_same_work_ms"]),
            "max_rel_error": float(row["max_rel_error"]),
            "correct": bool(row["correct"]),
            "achieved_gb_per_s_out": [float(v) for v in bandwidth.loc[tokens, "GB/s out"]],
        }
        for tokens, row in ok.iterrows()
    }


def provenance_summary(run: ParallelRun) -> dict:
    """The provenance entries that identify a run: GPU, driver, versions, world size, commit, date."""
    keys = ("gpu_name", "driver_version", "torch", "cuda", "nccl", "world_size", "backend", "git_commit", "date_utc")
    return {key: run.provenance.get(key) for key in keys}


def per_rank_table(run: ParallelRun) -> pd.DataFrame:
    """Each rank's medians (ms) per token count, from the JSON: the phases add up to the rank's total
    (up to the medians being taken per metric), which the CSV's largest-over-ranks columns need not."""
    rows = []
    for tokens, case in run.cases.items():
        for rank, times in enumerate(case.get("times_by_rank", [])):
            rows.append(
                {
                    "tokens / rank": tokens,
                    "rank": rank,
                    "total": times["total_ms"],
                    "all-to-all": times["all_to_all_ms"],
                    "expert fwd": times["expert_forward_ms"],
                    "expert bwd": times["expert_backward_ms"],
                    "other": times["other_ms"],
                    "one GPU, same work": case["single_gpu_same_work_ms_by_rank"][rank],
                    "rows received": sum(case["rows_received_by_rank"][rank]),
                }
            )
    return pd.DataFrame(rows).set_index(["tokens / rank", "rank"])


def bandwidth_table(run: ParallelRun) -> pd.DataFrame:
    """Per token count and rank: the bytes the rank sent to and received from the other ranks in one step
    (:func:`exchange_bytes` on its rows), its all-to-all time, and the achieved bandwidth."""
    max_local = max(len(block) for block in expert_partition(run.axes["num_experts"], run.world_size))
    rows = []
    for tokens, case in run.cases.items():
        for rank, times in enumerate(case.get("times_by_rank", [])):
            exchanges = exchange_bytes(
                case["rows_sent_by_rank"][rank],
                case["rows_received_by_rank"][rank],
                rank,
                hidden_size=run.axes["hidden_size"],
                element_bytes=run.element_bytes,
                weight_bytes=run.weight_bytes,
                max_local_experts=max_local,
            )
            out_bytes, in_bytes = int(exchanges["bytes out"].sum()), int(exchanges["bytes in"].sum())
            seconds = times["all_to_all_ms"] / 1e3
            rows.append(
                {
                    "tokens / rank": tokens,
                    "rank": rank,
                    "GB out": out_bytes / 1e9,
                    "GB in": in_bytes / 1e9,
                    "all-to-all ms": times["all_to_all_ms"],
                    "GB/s out": out_bytes / seconds / 1e9,
                    "GB/s out + in": (out_bytes + in_bytes) / seconds / 1e9,
                }
            )
    return pd.DataFrame(rows).set_index(["tokens / rank", "rank"])


def expert_rate_table(run: ParallelRun) -> pd.DataFrame:
    """Per token count and rank: the expert work's FLOPs (22 · rows received · H · I) over its measured
    time (forward + backward), in TFLOP/s."""
    H, I = run.axes["hidden_size"], run.axes["intermediate_size"]
    rows = []
    for tokens, case in run.cases.items():
        for rank, times in enumerate(case.get("times_by_rank", [])):
            flops = STEP_FLOPS_PER_ROW_HI * sum(case["rows_received_by_rank"][rank]) * H * I
            rows.append(
                {
                    "tokens / rank": tokens,
                    "rank": rank,
                    "TFLOP": flops / 1e12,
                    "expert ms": times["expert_ms"],
                    "TFLOP/s": flops / (times["expert_ms"] / 1e3) / 1e12,
                }
            )
    return pd.DataFrame(rows).set_index(["tokens / rank", "rank"])


def all_to_all_anomalies(run: ParallelRun) -> list[str]:
    """The token counts whose all-to-all time (CSV) is larger than at the next larger count, each with what
    the per-rank medians show: every rank's all-to-all and expert forward time."""
    ok = run.ok.sort_index()
    notes = []
    for smaller, larger in zip(ok.index[:-1], ok.index[1:], strict=True):
        if ok.loc[smaller, "all_to_all_ms"] <= ok.loc[larger, "all_to_all_ms"]:
            continue
        ranks = run.cases[int(smaller)].get("times_by_rank", [])
        per_rank = "; ".join(
            f"rank {r}: all-to-all {t['all_to_all_ms']:.2f} ms, expert forward {t['expert_forward_ms']:.2f} ms"
            for r, t in enumerate(ranks)
        )
        notes.append(
            f"{run.dtype}, {smaller} tokens/rank: all-to-all {ok.loc[smaller, 'all_to_all_ms']:.2f} ms, more "
            f"than the {ok.loc[larger, 'all_to_all_ms']:.2f} ms at {larger} ({per_rank})"
        )
    return notes


def wait_table(run: ParallelRun) -> pd.DataFrame:
    """Per token count and rank: how much longer the rank's all-to-all took than the fastest rank's, beside
    how much less local work (expert forward + backward + other) it had than the slowest rank. An exchange
    cannot finish on one rank before every rank has reached it, so a rank with less work waits inside it."""
    rows = []
    for tokens, case in run.cases.items():
        times = case.get("times_by_rank", [])
        if not times:
            continue
        work = [t["expert_ms"] + t["other_ms"] for t in times]
        fastest = min(t["all_to_all_ms"] for t in times)
        for rank, t in enumerate(times):
            rows.append(
                {
                    "tokens / rank": tokens,
                    "rank": rank,
                    "all-to-all": t["all_to_all_ms"],
                    "local work": work[rank],
                    "all-to-all − fastest rank's": t["all_to_all_ms"] - fastest,
                    "slowest rank's work − own": max(work) - work[rank],
                }
            )
    return pd.DataFrame(rows).set_index(["tokens / rank", "rank"])


def forward_scaling_table(run: ParallelRun) -> pd.DataFrame:
    """Per token count and rank: the rows the rank's experts received, its expert forward and backward ms, and
    each per thousand rows. A phase whose time does not grow with its rows is bound by the host (its launches
    and host syncs), not by the GPU, and its speed can differ between two ranks' processes."""
    rows = []
    for tokens, case in sorted(run.cases.items()):
        times, received = case.get("times_by_rank", []), case.get("rows_received_by_rank", [])
        for rank, t in enumerate(times):
            n = sum(received[rank]) if rank < len(received) else float("nan")
            rows.append(
                {
                    "tokens / rank": tokens,
                    "rank": rank,
                    "rows received": n,
                    "expert forward ms": t["expert_forward_ms"],
                    "expert backward ms": t["expert_backward_ms"],
                    "forward ms / 1000 rows": 1e3 * t["expert_forward_ms"] / n,
                    "backward ms / 1000 rows": 1e3 * t["expert_backward_ms"] / n,
                }
            )
    return pd.DataFrame(rows).set_index(["tokens / rank", "rank"])


def styled_measured(run: ParallelRun):
    """:func:`measured_table` formatted, with the file it comes from as the caption."""
    table = measured_table(run)
    formats = {
        name: "{:.2f}" for name in ("total", "all-to-all", "expert fwd", "expert bwd", "other", "one GPU, same work")
    }
    formats.update({"all-to-all share": "{:.1%}", "one GPU / expert": "{:.2f}×", "max rel. error": "{:.1e}"})
    caption = (
        f"{run.csv.name}: ms, each column the largest median over the {run.world_size} ranks "
        "(so the phases need not add up to the total)"
    )
    return table.style.format(formats).set_caption(caption)


# ================================================================ figures


def rows_matrix(ax, matrix, title: str) -> None:
    """A W × W matrix of rows sent (source rank down, destination rank across), numbers in the cells."""
    matrix = np.asarray(matrix)
    ax.imshow(matrix, cmap="Blues", vmin=0, vmax=max(1, matrix.max()) * 2.5)
    size = len(matrix)
    for r in range(size):
        for s in range(size):
            ax.text(
                s, r, f"{matrix[r, s]:,}", ha="center", va="center", fontsize=9, weight="bold" if r == s else "normal"
            )
    ax.set(
        xticks=range(size),
        yticks=range(size),
        xlabel="to rank (holds the expert)",
        ylabel="from rank (holds the token)",
    )
    ax.set_title(title, fontsize=9)


def rows_figure(matrices: dict[str, list[list[int]]]):
    """One rows-sent matrix per entry (title → matrix); the diagonal (bold) is each rank's own experts."""
    fig, axes = plt.subplots(1, len(matrices), figsize=(3.6 * len(matrices), 3.6), layout="constrained")
    for ax, (title, matrix) in zip(np.atleast_1d(axes), matrices.items(), strict=True):
        rows_matrix(ax, matrix, title)
    return fig


def _format_bytes(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def exchange_diagram(
    *,
    tokens_per_rank: int,
    world_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    element_bytes: int,
    weight_bytes: int,
):
    """One step in two panels, forward above and backward below, each with the token's rank's lane above
    the expert's rank's: the exchanges (arrows, with the bytes one rank sends to the other ranks under
    balanced routing) and the local work (boxes)."""
    rows = tokens_per_rank * top_k
    remote = rows * (world_size - 1) / world_size
    local = -(-num_experts // world_size)
    row, row_w = hidden_size * element_bytes, hidden_size * element_bytes + weight_bytes
    counts = (world_size - 1) * (len(STATUS_COLUMNS) + local) * COUNT_BYTES
    fig, (forward, backward) = plt.subplots(2, 1, figsize=(13, 6.8))
    top, bottom = 3.0, 0.8

    def lanes(ax, title):
        ax.set(xlim=(0, 12.4), ylim=(0.1, 4.0))
        ax.axis("off")
        ax.set_title(title, fontsize=11, weight="bold", loc="left")
        ax.text(0.05, top, "token's rank\n(T_r tokens)", ha="left", va="center", fontsize=9.5, weight="bold")
        ax.text(0.05, bottom, "expert's rank\n(L experts)", ha="left", va="center", fontsize=9.5, weight="bold")

    def box(ax, x, y, text, color, width):
        ax.add_patch(
            patches.FancyBboxPatch(
                (x - width / 2, y - 0.5),
                width,
                1.0,
                boxstyle="round,pad=0.05",
                facecolor=color,
                alpha=0.2,
                edgecolor=color,
            )
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=9)

    def exchange(ax, x, down, text, color="tab:red", both=False):
        start, end = (top - 0.55, bottom + 0.55) if down else (bottom + 0.55, top - 0.55)
        style = "<|-|>" if both else "-|>"
        ax.annotate("", (x, end), (x, start), arrowprops=dict(arrowstyle=style, color=color, lw=2))
        ax.text(x + 0.1, (top + bottom) / 2, text, ha="left", va="center", fontsize=9, color=color)

    lanes(forward, "forward")
    box(forward, 2.7, top, f"rows sorted by expert\nN = T_r·K = {rows:,}", "tab:gray", 2.2)
    exchange(forward, 4.1, True, f"counts\nint64 [W, 3+L]\n{_format_bytes(counts)}", "tab:purple", both=True)
    exchange(forward, 5.9, True, f"dispatch\nx [S, H], w [S]\n{_format_bytes(remote * row_w)}")
    box(forward, 8.4, bottom, "local experts\nw · Wd(silu(Wg x) ⊙ Wu x)\n[R, H]", "tab:blue", 2.8)
    exchange(forward, 9.9, False, f"combine\n[R, H]\n{_format_bytes(remote * row)}")
    box(forward, 11.4, top, "y_t = Σ_k rows\n[T_r, H]", "tab:gray", 1.7)

    lanes(backward, "backward: the adjoints, in reverse order")
    box(backward, 2.7, top, "dy copied to each\ntoken's K rows [N, H]", "tab:gray", 2.2)
    exchange(backward, 4.1, True, f"backward dispatch\ndy [S, H]\n{_format_bytes(remote * row)}")
    box(backward, 7.2, bottom, "moe_experts_backward\ndX [R, H], dw [R]; dW_e (stay here)", "tab:green", 3.6)
    exchange(backward, 9.3, False, f"backward combine\ndX [R, H], dw [R]\n{_format_bytes(remote * row_w)}")
    box(backward, 11.4, top, "dx_t = Σ_k dX rows\ndw in slot order", "tab:gray", 1.7)

    fig.text(
        0.01,
        0.01,
        f"T_r = {tokens_per_rank:,} tokens per rank, W = {world_size}, H = {hidden_size}, "
        f"I = {intermediate_size}, E = {num_experts} (L = {local} per rank), K = {top_k}; {element_bytes}-byte "
        f"rows, {weight_bytes}-byte routing weights.\nBytes: what one rank sends to the other ranks in each "
        f"exchange, with S = R = T_r·K·(W−1)/W = {remote:,.0f} rows (balanced routing).",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def measured_figure(runs: dict[str, ParallelRun]):
    """Per dtype (rows) and token count (columns): each rank's step split into all-to-all, expert forward,
    expert backward and other (its medians, from the JSON), beside the rank's "one GPU, same work" time."""
    ncols = max(len(run.cases) for run in runs.values())
    fig, axes = plt.subplots(
        len(runs), ncols, figsize=(3.9 * ncols, 3.6 * len(runs)), squeeze=False, layout="constrained"
    )
    phases = {
        "all-to-all": "all_to_all_ms",
        "expert forward": "expert_forward_ms",
        "expert backward": "expert_backward_ms",
        "other": "other_ms",
    }
    for row_axes, run in zip(axes, runs.values(), strict=True):
        for ax, (tokens, case) in zip(row_axes, run.cases.items(), strict=False):
            for rank, times in enumerate(case.get("times_by_rank", [])):
                x = 2.6 * rank
                bottom = 0.0
                for label, key in phases.items():
                    ax.bar(
                        x,
                        times[key],
                        bottom=bottom,
                        color=PHASE_COLORS[label],
                        width=0.9,
                        label=label if rank == 0 else None,
                    )
                    bottom += times[key]
                ax.bar(
                    x + 1,
                    case["single_gpu_same_work_ms_by_rank"][rank],
                    color=PHASE_COLORS["one GPU, same work"],
                    width=0.9,
                    hatch="//",
                    label="one GPU, same work" if rank == 0 else None,
                )
            ranks = len(case.get("times_by_rank", []))
            ax.set_xticks(
                [2.6 * r + dx for r in range(ranks) for dx in (0, 1)],
                [f"rank {r}\nparallel" if dx == 0 else f"rank {r}\none GPU" for r in range(ranks) for dx in (0, 1)],
                fontsize=8,
            )
            ax.set_title(f"{run.dtype} · {tokens} tokens / rank", fontsize=10)
            ax.set_ylabel("ms (median)")
            ax.grid(axis="y", alpha=0.3)
        for ax in row_axes[len(run.cases) :]:
            ax.axis("off")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncols=len(PHASE_COLORS), fontsize=9)
    first = next(iter(runs.values()))
    fig.suptitle(f"{PROBLEM} on {first.world_size} × {first.gpu_key}: forward + backward per rank", fontsize=11)
    return fig


def overlap_curves(runs: dict, *, gpu_key: str, world_size: int, chunk_counts, tokens_grid) -> dict:
    """The cost model of the overlapped exchange (:func:`model_step` with ``chunks``) for each measured run's
    shapes and achieved link bandwidth (as :func:`model_curves`), ``world_size`` ranks, experts at the datasheet
    roofline of ``gpu_key`` (at the run's measured rate where :data:`moe_lib.roofline.GPUS` lacks it), each further
    chunk at the cost :func:`chunk_overhead` fits to the run.
    Returns dtype → {chunks: model}, each model with ``relative_step``: its step time over the C = 1 step's."""
    spec = roofline.GPUS.get(gpu_key)
    curves = {}
    for dtype, run in runs.items():
        _, _, measured_rate, shapes = measured_model_inputs(run)
        if spec is not None:
            rates = dict(flops_rate=spec.bf16_dense_flops, memory_bandwidth=spec.dram_bandwidth)
        else:
            rates = dict(flops_rate=measured_rate)
        models = {
            chunks: model_step(
                tokens_grid,
                **shapes,
                world_size=world_size,
                **rates,
                chunks=chunks,
                chunk_overhead_s=chunk_overhead(run),
            )
            for chunks in chunk_counts
        }
        plain = models[min(models)]["step_s"]
        for model in models.values():
            model["relative_step"] = model["step_s"] / plain
        curves[dtype] = models
    return curves


def node_scaling_table(
    runs: dict,
    *,
    gpu_key: str,
    tokens_per_rank: int,
    gpus_per_node: int,
    network_bandwidth: float,
    chunk_counts=(1, 4),
    rank_work: dict | None = None,
) -> pd.DataFrame:
    """The cost model's exposed exchange share of a step at ``tokens_per_rank``, from each measured run (its
    shapes and achieved link bandwidth, as :func:`model_curves`), for the run's world size, one node of
    ``gpus_per_node`` ranks (the measured link between them) and two such nodes (``network_bandwidth`` per GPU
    between nodes); experts at the rate the run measured and at the datasheet roofline of ``gpu_key`` (bf16
    tensor rate and HBM bandwidth, as :func:`model_curves`; where :data:`moe_lib.roofline.GPUS` has it); per chunk
    count of ``chunk_counts``. One row per setting, dtype, expert rate and chunk count (tidy: pivot it to show),
    with the link bandwidth the run achieved and whether the network is the longer leg of the exchange; each further
    chunk at the cost :func:`chunk_overhead` fits to the run, which counts in the share. With ``rank_work``
    (:func:`load_rank_work`), a third expert rate, "measured at W": at each setting's world size the rate of one
    rank's work measured there on one GPU at ``tokens_per_rank`` (:func:`rank_work_rate`), where measured."""
    spec = roofline.GPUS.get(gpu_key)
    rows = []
    for dtype, run in runs.items():
        _, link, measured_rate, shapes = measured_model_inputs(run)
        rates = {"as measured": dict(flops_rate=measured_rate)}
        if spec is not None:
            rates[f"{gpu_key} roofline"] = dict(flops_rate=spec.bf16_dense_flops, memory_bandwidth=spec.dram_bandwidth)
        if rank_work is not None and dtype in rank_work:
            rates["measured at W"] = None  # the rate of each setting's own world size
        settings = {
            f"W = {run.world_size}, as measured": dict(world_size=run.world_size),
            f"W = {gpus_per_node}, one node": dict(world_size=gpus_per_node),
            f"W = {2 * gpus_per_node}, two nodes ({network_bandwidth / 1e9:.0f} GB/s network per GPU)": dict(
                world_size=2 * gpus_per_node, gpus_per_node=gpus_per_node, network_bandwidth=network_bandwidth
            ),
        }
        for setting, where in settings.items():
            for experts, rate in rates.items():
                if rate is None:
                    at_world_size = rank_work_rate(rank_work[dtype], where["world_size"], tokens_per_rank)
                    if at_world_size is None:
                        continue
                    rate = dict(flops_rate=at_world_size)
                for chunks in chunk_counts:
                    model = model_step(
                        [tokens_per_rank],
                        **shapes,
                        **where,
                        **rate,
                        chunks=chunks,
                        chunk_overhead_s=chunk_overhead(run),
                    )
                    network_bound = bool(model["network_s"][0] >= model["all_to_all_s"][0] > 0)
                    rows.append(
                        dict(
                            setting=setting,
                            dtype=dtype,
                            link_gb_per_s=link / 1e9,
                            experts=experts,
                            chunks=chunks,
                            share=float(model["share"][0]),
                            step_ms=float(model["step_s"][0]) * 1e3,
                            network_bound=network_bound,
                        )
                    )
    return pd.DataFrame(rows)


# ================================================================ one rank's work at larger world sizes


@dataclass(frozen=True)
class RankWorkRun(RunFiles):
    """One run of ``python -m moe_lib.bench.rank_work`` for one dtype: one row per (world size, tokens per rank)."""

    @property
    def axes(self) -> dict:
        return dict(self.meta["axes"])

    @property
    def ok(self) -> pd.DataFrame:
        """The timed rows, indexed by (world size, tokens per rank), with the rate of the expert work
        (``TFLOP/s``: :data:`STEP_FLOPS_PER_ROW_HI` · rows · H · I over the measured time)."""
        timed = self.frame[self.frame["status"] == "ok"].copy()
        flops = (
            STEP_FLOPS_PER_ROW_HI * timed["rows_received"] * self.axes["hidden_size"] * self.axes["intermediate_size"]
        )
        timed["TFLOP/s"] = flops / (timed["same_work_ms"] * 1e-3) / 1e12
        return timed.set_index(["world_size", "tokens_per_rank"]).sort_index()


def load_rank_work(results_dir="data/results", gpu_key: str = "H200") -> dict[str, RankWorkRun]:
    """The newest full-size run of ``python -m moe_lib.bench.rank_work`` per dtype in ``<results_dir>/<gpu_key>/``
    (``results_dir`` relative to the repository root unless absolute), the narrowest dtype first."""
    runs = _full_size_runs(
        results_dir,
        gpu_key,
        RANK_WORK_PROBLEM,
        RankWorkRun,
        json_keys=(),
        csv_columns=("world_size", "tokens_per_rank", "rows_received", "same_work_ms", "status"),
    )
    newest = {run.dtype: run for run in runs}  # oldest first: the newest stays
    if not newest:
        folder = resolve_path(results_dir) / gpu_key
        raise FileNotFoundError(f"no {RANK_WORK_PROBLEM} results (CSV with its JSON) in {folder}")
    return dict(sorted(newest.items(), key=lambda item: (getattr(torch, item[0]).itemsize, item[0])))


def rank_work_rate(run: RankWorkRun, world_size: int, tokens_per_rank: int) -> float | None:
    """The expert work's rate (FLOP/s) one rank of ``world_size`` ranks reached at ``tokens_per_rank``, or None
    where that case was not measured."""
    table = run.ok
    if (world_size, tokens_per_rank) not in table.index:
        return None
    return float(table.loc[(world_size, tokens_per_rank), "TFLOP/s"]) * 1e12


def rank_work_table(runs: dict[str, RankWorkRun]) -> pd.DataFrame:
    """Per dtype and world size (rows) and tokens per rank (columns): the local experts, the rows per expert, the
    measured ms of one rank's forward + backward and its TFLOP/s."""
    frames = {}
    for dtype, run in runs.items():
        table = run.ok
        frames[dtype] = pd.concat(
            {
                "rows / expert": table["rows_per_expert"].unstack(),
                "ms": table["same_work_ms"].unstack(),
                "TFLOP/s": table["TFLOP/s"].unstack(),
            },
            axis=1,
        )
        frames[dtype].insert(0, ("local experts", ""), table["local_experts"].groupby(level=0).first())
    return pd.concat(frames, names=["dtype", "world size"]).rename_axis(columns=["", "tokens / rank"])


def rank_work_figure(runs: dict[str, RankWorkRun]):
    """The rate of one rank's expert work against the world size (one panel per dtype, one line per tokens per
    rank): more ranks, fewer experts each, more rows per expert."""
    fig, axes = plt.subplots(1, len(runs), figsize=(6.0 * len(runs), 3.8), squeeze=False, layout="constrained")
    for ax, (dtype, run) in zip(axes[0], runs.items(), strict=True):
        table = run.ok
        for tokens, by_world in table["TFLOP/s"].groupby(level="tokens_per_rank"):
            world_sizes = by_world.index.get_level_values("world_size")
            ax.plot(world_sizes, by_world.values, marker="o", label=f"T_r = {tokens}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(table.index.get_level_values("world_size"))))
        ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
        ax.set(
            xlabel="world size W (experts per rank E / W)",
            ylabel="expert work, TFLOP/s",
            title=f"{dtype}: one rank's forward + backward, one GPU",
            ylim=(0, None),
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return fig


def overlap_figure(curves: dict[str, dict], title: str):
    """:func:`overlap_curves` as step time relative to no overlap against tokens per rank, one panel per dtype:
    below 1 the overlap pays, above it the further chunks' own cost exceeds the exchange they hide."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.0), squeeze=False, layout="constrained")
    for ax, (dtype, models) in zip(axes[0], curves.items(), strict=True):
        for chunks, model in models.items():
            ax.plot(model["tokens_per_rank"], model["relative_step"], marker=".", label=f"C = {chunks}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="tokens per rank T_r", ylabel="step time / step without overlap", title=f"{dtype}: {title}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return fig


def step_timeline(timeline: list[dict]) -> pd.DataFrame:
    """One rank's timeline of a step (``moe_lib.bench.parallel``'s ``timelines_by_rank`` entry: phases and the
    "<exchange> issued" marks, ms from the step's start) as spans: columns lane ("experts", "waits" or
    "in flight"), name, start_ms, end_ms. An exchange is in flight from its issue to the end of the compute
    stream's wait for it (an upper bound of its time on the wire): per dispatch its own wait, per combine the
    one wait for every chunk's combine that follows the last chunk."""
    spans = []
    waits = {name: [entry for entry in timeline if entry["name"] == name] for name in ALL_TO_ALL_PHASES}
    for entry in timeline:
        if entry["name"] in EXPERT_PHASES:
            spans.append(dict(lane="experts", name=entry["name"], start_ms=entry["start_ms"], end_ms=entry["end_ms"]))
        elif entry["name"] in ALL_TO_ALL_PHASES and entry["end_ms"] > entry["start_ms"]:
            spans.append(dict(lane="waits", name=entry["name"], start_ms=entry["start_ms"], end_ms=entry["end_ms"]))
    for name, ends in waits.items():
        issued = [entry["start_ms"] for entry in timeline if entry["name"] == f"{name} issued"]
        for k, start in enumerate(issued):
            if not ends:
                break
            end = ends[min(k, len(ends) - 1)]["end_ms"]  # dispatches: one wait each; combines: the last wait
            spans.append(dict(lane="in flight", name=name, start_ms=start, end_ms=end))
    return pd.DataFrame(spans, columns=["lane", "name", "start_ms", "end_ms"])


TIMELINE_COLORS = {
    "expert_forward": "tab:blue",
    "expert_backward": "tab:green",
    "dispatch": "tab:red",
    "combine": "tab:purple",
    "backward_dispatch": "tab:orange",
    "backward_combine": "tab:brown",
    "counts_exchange": "tab:gray",
}


def timeline_figure(timelines_by_rank: list[list[dict]], title: str):
    """Every rank's step as three lanes (:func:`step_timeline`): the experts' compute, the compute stream's
    waits for exchanges, and the exchanges in flight (translucent: they overlap one another)."""
    lanes = ("experts", "waits", "in flight")
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(lanes) * len(timelines_by_rank)), layout="constrained")
    labels, seen = [], set()
    for rank, timeline in enumerate(timelines_by_rank):
        spans = step_timeline(timeline)
        for lane in lanes:
            y = len(labels)
            labels.append(f"rank {rank}: {lane}")
            for span in spans[spans["lane"] == lane].itertuples():
                label = span.name if span.name not in seen else None
                seen.add(span.name)
                ax.barh(
                    y,
                    span.end_ms - span.start_ms,
                    left=span.start_ms,
                    height=0.6,
                    color=TIMELINE_COLORS.get(span.name, "black"),
                    alpha=0.35 if lane == "in flight" else 0.9,
                    edgecolor="black",
                    linewidth=0.3,
                    label=label,
                )
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the step's start", title=title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def share_figure(curves: dict[str, dict], measured: dict[str, pd.Series]):
    """The cost model's all-to-all share against tokens per rank (one panel per dtype): ``curves`` maps
    dtype → {label: :func:`model_step` result}; ``measured`` maps dtype → the measured shares by token count."""
    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4.2), squeeze=False, layout="constrained")
    styles = ["-", "--", ":", "-."]
    for ax, (dtype, by_label) in zip(axes[0], curves.items(), strict=True):
        for style, (label, model) in zip(styles, by_label.items(), strict=False):
            ax.plot(model["tokens_per_rank"], model["share"], linestyle=style, color="black", label=label)
        if dtype in measured:
            shares = measured[dtype]
            ax.plot(
                shares.index,
                shares.values,
                "o",
                color=PHASE_COLORS["all-to-all"],
                markersize=8,
                label="measured: all-to-all / total (CSV)",
            )
        highest = max(
            [float(np.max(model["share"])) for model in by_label.values()]
            + [float(measured[dtype].max()) if dtype in measured else 0.0]
        )
        ax.set_xscale("log", base=2)
        ax.set(
            xlabel="tokens per rank T_r",
            ylabel="all-to-all share of the step",
            title=dtype,
            ylim=(0, min(1.0, 1.6 * highest)),
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    return fig
