"""Benchmark harness: ``python -m moe_lib.bench --problem P [--impl a,b] [--tokens n,m | --suite] ...``

For every case (a token count) it draws seeded inputs on the device with :mod:`moe_lib.problems`,
computes the reference outputs once, then for every implementation (:mod:`moe_lib.peers`):

1. checks it: the caching allocator is poisoned with NaN, the implementation runs once, and each
   output is compared with the reference: relative Frobenius error ‖out − ref‖/‖ref‖ and the
   element rule ``|out − ref| ≤ atol + rtol·|ref|`` on ≥ 99% of elements (P1: atol 1e-2, rtol 1e-2;
   P2 fp32: atol 0.11, rtol 1e-5; the bf16 variant has none and is judged by relative error).
   NaN/Inf (including unwritten, poisoned outputs) or a relative error above 5e-2 is ``wrong`` and
   not timed; failing only the element rule is flagged in ``passes_element_rule`` and still timed.
   The reference is float64 for P1 and for P2 at small shapes, and the fp32 reference with TF32 off
   at P2's full size (float64 would not fit).
2. times it (:mod:`moe_lib.timing`): captured in a CUDA graph and replayed (``timing="graph"``)
   when the peer declares itself capturable (a failed capture is an error, never a silent
   fallback; the replayed outputs are checked again afterwards), else CUDA events around each call
   after a synchronize (``"events"``); L2 flushed before each run; median and p20/p80 of ``--reps``
   runs after ``--warmup`` (cases over 10 ms: as many runs as fit in ~2 s, at least 5). Without
   CUDA: wall clock (``"cpu"``), scaled-down shapes and a three-case suite (``small=True``).

Ceilings (copy bandwidth, bf16 GEMM rate) are measured in the same run (:mod:`moe_lib.roofline`).

Outputs, under ``<out>/<gpu key>/`` (``H200``, ``H100-SXM``, ..., ``cpu``):
``<YYYY-MM-DD>-<problem>-<dtype>[-small][-<tag>].csv``, long form, one row per implementation ×
case, with the columns of :data:`CSV_COLUMNS` plus ``rel_error_<output>`` for each output (``wall_s``: the
wall-clock seconds the row took, setup, compilation and autotuning included); and a
``.json`` beside it: provenance (GPU, driver, versions, git commit, date, host, command line,
ceilings, seed, suite) and per implementation geomean_ms (over its correct cases),
roofline_fraction (geomean of T_sol/T, measured ceilings), sol_score (geomeans of T, the best
PyTorch peer correct on every case, and T_sol), all_correct and n_cases. A table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from . import peers, problems, reference, roofline, timing

WRONG_REL_ERROR = 5e-2
COMPARE_CHUNK = 2**26  # elements compared at a time (bounded float64 temporaries)
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = problems.DATA_DIR / "results"

SMALL_AXES = {
    "swiglu_down_backward": dict(hidden_size=256, intermediate_size=96),
    "moe_experts_backward": dict(hidden_size=128, intermediate_size=64, num_experts=16, top_k=4),
}
SMALL_SUITES = {"swiglu_down_backward": [1, 128, 1024], "moe_experts_backward": [32, 128, 512]}
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                 "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}  # fmt: skip
RECORDED_ENVIRONMENT = ("LIGER_FUSED_MOE_AUTOTUNE", "TRITON_CACHE_AUTOTUNING", "TRITON_INTERPRET",
                        "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")  # fmt: skip
DATASHEET_GPUS = {"sol_ms_datasheet_h100": "H100-SXM", "sol_ms_datasheet_h200": "H200"}

CSV_COLUMNS = [
    "problem", "impl", "num_tokens", "dtype", "median_ms", "p20_ms", "p80_ms", "reps", "timing",
    "sol_ms", "roofline_fraction", "sol_ms_datasheet_h100", "sol_ms_datasheet_h200", "flops", "bytes",
    "rel_error", "element_pass_fraction", "correct", "passes_element_rule", "status", "small", "device", "gpu",
    "wall_s",
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# device and naming


def gpu_key_from_name(name: str) -> str:
    """The results folder of a GPU: "NVIDIA H200" -> "H200", "NVIDIA H100 80GB HBM3" -> "H100-SXM"."""
    upper = name.upper()
    if "GH200" not in upper and "H200" in upper:
        return "H200"
    if "H100" in upper and "PCIE" in upper:
        return "H100-PCIe"
    if "H100" in upper and ("HBM3" in upper or "SXM" in upper):
        return "H100-SXM"
    if "B200" in upper and "GB200" not in upper:
        return "B200"
    return re.sub(r"[^A-Za-z0-9]+", "-", name.replace("NVIDIA", "")).strip("-") or "unknown-gpu"


def gpu_key(device: torch.device) -> str:
    return gpu_key_from_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"


def result_stem(problem: str, dtype_name: str, *, small: bool, tag: str | None, date: str) -> str:
    """``<YYYY-MM-DD>-<problem>-<dtype>[-small][-<tag>]``."""
    return f"{date}-{problem}-{dtype_name}" + ("-small" if small else "") + (f"-{tag}" if tag else "")


# ---------------------------------------------------------------------------------------------
# command line


def _token_list(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    counts = []
    for part in parts:
        if not re.fullmatch(r"\d+", part):
            raise argparse.ArgumentTypeError(f"expected non-negative integers separated by commas, got {part!r}")
        counts.append(int(part))
    return counts


def _non_negative(text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tag(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(f"expected letters, digits, '_', '.', '-' only, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moe_lib.bench",
        description="Check and time the implementations of one problem against its reference; "
        "write a long-form CSV and a JSON summary under <out>/<gpu key>/.",
    )
    parser.add_argument("--problem", default="swiglu_down_backward", choices=problems.PROBLEM_NAMES)
    parser.add_argument("--impl", help="comma-separated implementation labels (default: every one available)")
    cases = parser.add_mutually_exclusive_group()
    cases.add_argument("--tokens", type=_token_list, help="comma-separated token counts, e.g. 1,128,8192")
    cases.add_argument("--suite", action="store_true",
                       help="the problem's workload suite (default; with --small, a three-case suite)")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), help="override the problem's floating dtype")
    parser.add_argument("--seed", type=_non_negative, default=0)
    parser.add_argument("--warmup", type=_non_negative, help="warm-up runs per case (default 10 on CUDA, 1 on CPU)")
    parser.add_argument("--reps", type=_positive, help="timed runs per case (default 50 on CUDA, 3 on CPU)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    parser.add_argument("--tag", type=_tag, help="suffix of the result file names")
    parser.add_argument("--small", action="store_true", help="scaled-down shapes (automatic without CUDA)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parses and checks the command line; errors name the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device: CUDA is not available on this machine")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())
    if args.device.type != "cuda":
        args.small = True
    known = peers.labels(args.problem)
    if args.impl is None:
        args.impls = peers.available_labels(args.problem, args.device)
        if not args.impls:
            parser.error(f"--impl: no implementation of {args.problem} is available on {args.device}")
    else:
        args.impls = [label.strip() for label in args.impl.split(",") if label.strip()]
        if not args.impls:
            parser.error(f"--impl: expected comma-separated labels among {known}, got {args.impl!r}")
        for label in args.impls:
            if label not in known:
                parser.error(f"--impl: unknown implementation {label!r} for {args.problem} (known: {', '.join(known)})")
        if len(set(args.impls)) != len(args.impls):
            parser.error(f"--impl: a label is repeated in {args.impl!r}")
    if args.tokens is not None and len(set(args.tokens)) != len(args.tokens):
        parser.error(f"--tokens: a token count is repeated in {args.tokens}")
    if args.dtype is not None:
        args.dtype = DTYPE_ALIASES[args.dtype]
    if args.warmup is None:
        args.warmup = 10 if args.device.type == "cuda" else 1
    if args.reps is None:
        args.reps = 50 if args.device.type == "cuda" else 3
    return args


# ---------------------------------------------------------------------------------------------
# correctness


def element_rule(problem: str, dtype: torch.dtype) -> dict | None:
    """The benchmark's element rule (atol, rtol, required_fraction) of ``problem`` at its own dtype;
    None where it has none (the bf16 variant) or the dtype is overridden."""
    definition = json.loads((problems.PROBLEMS_DIR / problem / "definition.json").read_text())
    tolerance = definition.get("tolerance", {})
    if "atol" not in tolerance or dtype != problems.load(problem).dtype:
        return None
    return dict(atol=tolerance["atol"], rtol=tolerance["rtol"], required_fraction=tolerance["required_fraction"])


def compare_output(out: torch.Tensor, ref: torch.Tensor, rule: dict | None) -> dict:
    """Compares one output with its reference in float64, a chunk at a time.

    Returns dict(rel_error = ‖out − ref‖/‖ref‖ (the norm of the difference where ref is all zero;
    inf if out has NaN/Inf), finite, pass_fraction = share of elements within atol + rtol·|ref|
    (None without a rule)).
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape {list(out.shape)}, expected {list(ref.shape)}")
    flat_out, flat_ref = out.reshape(-1), ref.to(out.device).reshape(-1)
    total = flat_out.numel()
    sums = torch.zeros(2, dtype=torch.float64, device=out.device)  # Σ diff², Σ ref²
    counts = torch.zeros(2, dtype=torch.int64, device=out.device)  # non-finite, passing
    for start in range(0, total, COMPARE_CHUNK):
        o = flat_out[start : start + COMPARE_CHUNK].double()
        r = flat_ref[start : start + COMPARE_CHUNK].double()
        diff = o - r
        counts[0] += (~torch.isfinite(o)).sum()
        sums[0] += (diff * diff).sum()
        sums[1] += (r * r).sum()
        if rule is not None:
            counts[1] += (diff.abs() <= rule["atol"] + rule["rtol"] * r.abs()).sum()
        del o, r, diff
    diff_sq, ref_sq = sums.tolist()
    non_finite, passing = counts.tolist()
    finite = non_finite == 0
    if not finite:
        rel = math.inf
    else:
        rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)
    pass_fraction = None if rule is None else (passing / total if total else 1.0)
    return dict(rel_error=rel, finite=finite, pass_fraction=pass_fraction)


def check_outputs(outputs, references, names, rule) -> dict:
    """Checks every output; returns per-output errors, the worst ones and the verdicts."""
    if not isinstance(outputs, tuple | list) or len(outputs) != len(references):
        count = len(outputs) if isinstance(outputs, tuple | list) else type(outputs).__name__
        return dict(rel_errors={}, pass_fractions={}, correct=False, passes_element_rule=None,
                    rel_error=math.nan, element_pass_fraction=math.nan,
                    why=f"returned {count} outputs, expected {len(references)}")  # fmt: skip
    rel_errors, pass_fractions, problems_found = {}, {}, []
    for name, out, ref in zip(names, outputs, references, strict=True):
        try:
            result = compare_output(out, ref, rule)
        except (TypeError, ValueError) as exc:
            problems_found.append(f"{name}: {exc}")
            rel_errors[name] = math.nan
            continue
        rel_errors[name] = result["rel_error"]
        pass_fractions[name] = result["pass_fraction"]
        if not result["finite"]:
            problems_found.append(f"{name} has NaN/Inf (or unwritten elements)")
        elif result["rel_error"] > WRONG_REL_ERROR:
            problems_found.append(f"{name} rel. error {result['rel_error']:.3g} > {WRONG_REL_ERROR:g}")
    worst_rel = max(rel_errors.values(), default=math.nan, key=lambda v: math.inf if math.isnan(v) else v)
    fractions = [f for f in pass_fractions.values() if f is not None]
    worst_fraction = min(fractions) if fractions and rule is not None else math.nan
    passes = None if rule is None or len(fractions) != len(names) else worst_fraction >= rule["required_fraction"]
    return dict(rel_errors=rel_errors, pass_fractions=pass_fractions, correct=not problems_found,
                passes_element_rule=passes, rel_error=worst_rel, element_pass_fraction=worst_fraction,
                why="; ".join(problems_found))  # fmt: skip


def reference_outputs(problem: problems.Problem, inputs: dict, small: bool) -> tuple[tuple, str]:
    """The high-precision reference outputs and their dtype name: float64 for P1 and small P2,
    the fp32 reference with TF32 off for P2 at full size."""
    if problem.op == "swiglu_down_backward" or small:
        precision = torch.float64
    else:
        precision = torch.float32
    upcast = [t.to(precision) if t.is_floating_point() else t for t in inputs.values()]
    with reference.tf32_disabled():
        if problem.op == "swiglu_down_backward":
            outputs = reference.swiglu_down_backward_reference(*upcast)
        else:
            outputs = reference.moe_experts_backward_reference(*upcast)
    del upcast
    return tuple(outputs), problems.dtype_name(precision)


# ---------------------------------------------------------------------------------------------
# one implementation on one case


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _message(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text[:300]


def time_callable(fn, capturable: bool, device: torch.device, flush: timing.L2Flusher, *, warmup: int, reps: int,
                  check_replay=None) -> dict:  # fmt: skip
    """Times ``fn``: graph replays when ``capturable`` on CUDA, events otherwise, wall clock on CPU.

    ``check_replay(outputs)`` returns a reason (str) when the outputs of the replayed graph are wrong.
    Returns :func:`timing.summarize`'s dict plus ``timing`` (the mode) and ``replay_wrong``.
    """
    if device.type != "cuda":
        return dict(timing.measure(fn, "cpu", flush, warmup=warmup, reps=reps), timing="cpu", replay_wrong=None)
    if not capturable:
        return dict(timing.measure(fn, "events", flush, warmup=warmup, reps=reps), timing="events", replay_wrong=None)
    graph, outputs = timing.capture(fn)
    try:
        stats = timing.measure(graph.replay, "graph", flush, warmup=warmup, reps=reps)
        torch.cuda.synchronize(device)
        replay_wrong = check_replay(outputs) if check_replay is not None else None
    finally:
        del graph, outputs
    return dict(stats, timing="graph", replay_wrong=replay_wrong)


def run_case_impl(peer: peers.Peer | None, label: str, inputs: dict, references: tuple, names: list[str], rule,
                  device: torch.device, flush: timing.L2Flusher, *, warmup: int, reps: int, poison_bytes: int,
                  log=print) -> dict:  # fmt: skip
    """Checks, then times one implementation on one case; returns the row's measured fields."""
    row = dict(impl=label, status="ok", timing=None, median_ms=math.nan, p20_ms=math.nan, p80_ms=math.nan,
               reps=0, correct=False, passes_element_rule=None, rel_error=math.nan,
               element_pass_fraction=math.nan, rel_errors={})  # fmt: skip
    reason = peer.unavailable(device) if peer is not None else "not registered"
    if reason is not None:
        row["status"] = f"unavailable: {reason}"
        return row
    fn = None
    try:
        fn = peer.prepare(inputs)
        _synchronize(device)
        timing.poison_allocator(device, poison_bytes)
        outputs = fn()
        _synchronize(device)
        check = check_outputs(outputs, references, names, rule)
        del outputs
    except Exception as exc:
        log(f"[{label}] error while running:\n{traceback.format_exc()}")
        row["status"] = f"error: {_message(exc)}"
        del fn
        _free_memory(device)
        return row
    row.update(correct=check["correct"], passes_element_rule=check["passes_element_rule"],
               rel_error=check["rel_error"], element_pass_fraction=check["element_pass_fraction"],
               rel_errors=check["rel_errors"])  # fmt: skip
    if not check["correct"]:
        row["status"] = f"wrong: {check['why']}"
        del fn
        _free_memory(device)
        return row

    def check_replay(replayed):
        result = check_outputs(replayed, references, names, rule)
        return None if result["correct"] else result["why"]

    try:
        _free_memory(device)
        stats = time_callable(fn, peer.capturable, device, flush, warmup=warmup, reps=reps, check_replay=check_replay)
    except Exception as exc:
        log(f"[{label}] error while timing:\n{traceback.format_exc()}")
        row["status"] = f"error: {_message(exc)}"
    else:
        row["timing"] = stats["timing"]
        if stats["replay_wrong"] is not None:
            row.update(status=f"wrong: CUDA graph replay: {stats['replay_wrong']}", correct=False)
        else:
            row.update(median_ms=stats["median_ms"], p20_ms=stats["p20_ms"], p80_ms=stats["p80_ms"],
                       reps=stats["reps"])  # fmt: skip
    finally:
        del fn
        _free_memory(device)
    return row


# ---------------------------------------------------------------------------------------------
# a run


def geomean(values) -> float:
    """Geometric mean of positive values (NaN when empty or when any is not positive)."""
    values = [float(v) for v in values]
    if not values or any(not v > 0 for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize_impls(frame: pd.DataFrame, impls: list[str]) -> tuple[dict, dict]:
    """Per implementation: geomean_ms over its correct cases, roofline_fraction (geomean of T_sol/T),
    sol_score against the best baseline peer correct on every case, all_correct, n_cases.
    Returns (per-impl summaries, baseline description)."""
    summary = {}
    sol_geomean = geomean(frame.drop_duplicates("num_tokens")["sol_ms"])
    for label in impls:
        rows = frame[frame["impl"] == label]
        ok = rows[rows["status"] == "ok"]
        element = [v for v in ok["passes_element_rule"] if v is not None and not pd.isna(v)]
        summary[label] = dict(
            geomean_ms=geomean(ok["median_ms"]),
            roofline_fraction=geomean(ok["sol_ms"] / ok["median_ms"]),
            sol_score=None,
            all_correct=bool(len(rows) > 0 and len(ok) == len(rows)),
            passes_element_rule=bool(all(element)) if element else None,
            n_cases=int(len(rows)),
            n_correct=int(len(ok)),
            timing=sorted(set(ok["timing"].dropna())),
        )
    candidates = {label: s["geomean_ms"] for label, s in summary.items()
                  if label in peers.BASELINE_LABELS and s["all_correct"]}  # fmt: skip
    baseline = dict(impl=None, geomean_ms=None, sol_geomean_ms=sol_geomean)
    if candidates:
        best = min(candidates, key=candidates.get)
        baseline.update(impl=best, geomean_ms=candidates[best])
        for s in summary.values():
            if s["all_correct"] and candidates[best] > sol_geomean:
                s["sol_score"] = roofline.sol_score(s["geomean_ms"], candidates[best], sol_geomean)
    return summary, baseline


def _git(*command) -> str | None:
    try:
        done = subprocess.run(["git", *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def provenance(args, device, ceilings, suite, reference_dtype, started) -> dict:
    """Where, when and how the run was made."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".", ":(exclude)data/results") if commit else None
    return dict(
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        gpu_key=gpu_key(device),
        device=str(device),
        driver_version=_driver_version() if device.type == "cuda" else None,
        torch=torch.__version__,
        triton=_version("triton"),
        liger_kernel=_version("liger-kernel"),
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        # GIT_COMMIT, when set, wins: a copy of the tree may carry a .git whose HEAD is not what runs
        git_commit=os.environ.get("GIT_COMMIT") or commit,
        git_dirty=None if status is None else bool(status),
        date_utc=started.isoformat(timespec="seconds"),
        hostname=socket.gethostname(),
        command=shlex.join([sys.executable, "-m", "moe_lib.bench", *sys.argv[1:]]),
        ceilings=ceilings,
        seed=args.seed,
        suite=suite,
        small=args.small,
        reference_precision=reference_dtype,
        allow_tf32=torch.backends.cuda.matmul.allow_tf32,
        timing=dict(
            warmup=args.warmup,
            reps=args.reps,
            l2_flush_bytes=timing.L2_FLUSH_BYTES,
            long_case_ms=timing.LONG_CASE_MS,
            min_long_case_reps=timing.MIN_LONG_CASE_REPS,
        ),
        wrong_rel_error=WRONG_REL_ERROR,
        environment={name: os.environ.get(name) for name in RECORDED_ENVIRONMENT},
    )


def _json_ready(value):
    """NaN/inf -> None, recursively, so the JSON is standard."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def format_ms(ms, missing: str = "-") -> str:
    """A time in ms as "12.3 µs", "4.56 ms" or "1.23 s"; ``missing`` when there is none."""
    if ms is None or pd.isna(ms):
        return missing
    if ms < 1:
        return f"{ms * 1e3:.1f} µs"
    if ms < 1000:
        return f"{ms:.2f} ms"
    return f"{ms / 1e3:.2f} s"


def _is_false(value) -> bool:
    return value is not None and not pd.isna(value) and not bool(value)


def _cell(row) -> str:
    status = row["status"]
    if status == "ok":
        return format_ms(row["median_ms"]) + (" *" if _is_false(row["passes_element_rule"]) else "")
    return status.split(":")[0].upper()


def format_tables(frame: pd.DataFrame, summary: dict, baseline: dict, title: str) -> str:
    """The per-case table (median per implementation) and the summary table, as text."""
    cells = frame.assign(cell=frame.apply(_cell, axis=1))
    per_case = cells.pivot(index="num_tokens", columns="impl", values="cell")
    order = list(dict.fromkeys(frame["num_tokens"]))
    per_case = per_case.reindex(index=order, columns=list(dict.fromkeys(frame["impl"])))
    sol = frame.drop_duplicates("num_tokens").set_index("num_tokens")["sol_ms"].reindex(order)
    per_case["sol (measured)"] = sol.map(format_ms)
    rows = []
    for label, s in summary.items():
        rows.append(dict(impl=label, geomean=format_ms(s["geomean_ms"]),
                         roofline_fraction="-" if pd.isna(s["geomean_ms"]) else f"{s['roofline_fraction']:.3f}",
                         score="-" if s["sol_score"] is None else f"{s['sol_score']:.3f}",
                         all_correct=s["all_correct"], element_rule=s["passes_element_rule"],
                         cases=f"{s['n_correct']}/{s['n_cases']}", timing=",".join(s["timing"]) or "-"))  # fmt: skip
    table = pd.DataFrame(rows).set_index("impl")
    lines = [title, "", per_case.to_string(), "", table.to_string()]
    base = baseline["impl"]
    if base:
        lines.append(f"score baseline: {base} ({format_ms(baseline['geomean_ms'])} geomean), "
                     f"T_sol geomean {format_ms(baseline['sol_geomean_ms'])}")  # fmt: skip
    else:
        lines.append("score baseline: none (no baseline peer correct on every case)")
    lines.append("* = passes the 5e-2 rule but fails the element rule; WRONG = not timed")
    problems_found = frame[~frame["status"].isin(["ok"])]
    for _, row in problems_found.iterrows():
        lines.append(f"  {row['impl']} @ {row['num_tokens']}: {row['status']}")
    return "\n".join(lines)


def results_frame(rows: list[dict], output_names: list[str]) -> pd.DataFrame:
    """The long-form table: :data:`CSV_COLUMNS` with ``rel_error_<output>`` after ``rel_error``."""
    split = CSV_COLUMNS.index("rel_error") + 1
    columns = CSV_COLUMNS[:split] + [f"rel_error_{name}" for name in output_names] + CSV_COLUMNS[split:]
    return pd.DataFrame(rows).reindex(columns=columns)


def run(args: argparse.Namespace, log=None) -> dict:
    """Runs the benchmark the parsed ``args`` describe; writes the CSV and JSON; returns
    dict(csv=path, json=path, frame=DataFrame, summary=dict, table=str)."""
    log = log or (lambda message: tqdm.write(message, file=sys.stderr))
    started = datetime.datetime.now(datetime.timezone.utc)
    device = args.device
    problem = problems.load(args.problem)
    dtype = problem.dtype if args.dtype is None else problems.DTYPES[args.dtype]
    dtype_label = problems.dtype_name(dtype)
    axes = SMALL_AXES[problem.op] if args.small else {}
    if args.tokens is not None:
        tokens, suite = args.tokens, dict(source="--tokens", provenance="custom")
    elif args.small and not args.suite:
        tokens, suite = SMALL_SUITES[problem.op], dict(source="small suite", provenance="custom")
    else:
        tokens, suite = problem.suite, dict(source="workloads", provenance=problem.suite_provenance)
    suite["tokens"] = list(tokens)
    names = list(problem.outputs)
    rule = element_rule(args.problem, dtype)
    registry = peers.peers_for(args.problem)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    log(f"measuring ceilings on {device} ...")
    ceilings = roofline.measure_ceilings(device, reps=10 if device.type == "cuda" else 3)
    measured = roofline.GPUSpec.from_measured(ceilings["copy_bandwidth"], ceilings["bf16_matmul_flops"],
                                              name=f"measured on {device}")  # fmt: skip
    flush = timing.L2Flusher(device)
    folder = Path(args.out) / gpu_key(device)
    folder.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.problem, dtype_label, small=args.small, tag=args.tag, date=started.strftime("%Y-%m-%d"))
    csv_path, json_path = folder / f"{stem}.csv", folder / f"{stem}.json"
    rows, reference_dtype = [], None
    progress = tqdm(total=len(tokens) * len(args.impls), desc=args.problem, unit="run", file=sys.stderr)
    for num_tokens in tokens:
        case = dict(problem=args.problem, num_tokens=num_tokens, dtype=dtype_label, small=args.small,
                    device=str(device), gpu=gpu_key(device))  # fmt: skip
        work, traffic = roofline.cost(args.problem, num_tokens, dtype, **axes)
        case.update(flops=work, bytes=traffic,
                    sol_ms=roofline.sol_time(args.problem, num_tokens, measured, dtype, **axes) * 1e3)  # fmt: skip
        for column, key in DATASHEET_GPUS.items():
            case[column] = roofline.sol_time(args.problem, num_tokens, key, dtype, **axes) * 1e3
        inputs = references = None
        try:
            inputs = problem.make_inputs(num_tokens, seed=args.seed, device=device, dtype=dtype, **axes)
            references, reference_dtype = reference_outputs(problem, inputs, args.small)
            poison_bytes = 2 * sum(r.numel() for r in references) * 4 + 256 * 2**20
            _free_memory(device)
        except Exception as exc:
            log(f"[case {num_tokens}] reference failed:\n{traceback.format_exc()}")
            for label in args.impls:
                rows.append(dict(case, impl=label, status=f"error: reference failed: {_message(exc)}", correct=False))
                progress.update(1)
            del inputs, references
            _free_memory(device)
            continue
        for label in args.impls:
            progress.set_postfix_str(f"T={num_tokens} {label}")
            wall_start = time.perf_counter()
            measured_row = run_case_impl(registry.get(label), label, inputs, references, names, rule, device, flush,
                                         warmup=args.warmup, reps=args.reps, poison_bytes=poison_bytes,
                                         log=log)  # fmt: skip
            rel_errors = measured_row.pop("rel_errors")
            row = dict(case, **measured_row, wall_s=time.perf_counter() - wall_start)
            row.update({f"rel_error_{name}": rel_errors.get(name, math.nan) for name in names})
            row["roofline_fraction"] = row["sol_ms"] / row["median_ms"] if row["status"] == "ok" else math.nan
            rows.append(row)
            results_frame(rows, names).to_csv(csv_path, index=False)  # so far: survives a run cut short
            progress.update(1)
        del inputs, references
        _free_memory(device)
    progress.close()

    frame = results_frame(rows, names)
    frame.to_csv(csv_path, index=False)
    summary, baseline = summarize_impls(frame, args.impls)
    sizes = {name: value for name, value in problem.sizes(0, **axes).items() if name != "num_tokens"}
    document = dict(problem=args.problem, dtype=dtype_label, axes=sizes,
                    impls=args.impls, element_rule=rule,
                    provenance=provenance(args, device, ceilings, suite, reference_dtype, started),
                    baseline=baseline, summary=summary)  # fmt: skip
    json_path.write_text(json.dumps(_json_ready(document), indent=2, ensure_ascii=False) + "\n")
    clock = "wall clock" if device.type != "cuda" else "cold L2; graph replays or events: see timing"
    shapes = " · small shapes" if args.small else ""
    title = f"{args.problem} · {dtype_label} · {gpu_key(device)}{shapes} · median per case ({clock})"
    table = format_tables(frame, summary, baseline, title)
    return dict(csv=csv_path, json=json_path, frame=frame, summary=summary, baseline=baseline, table=table)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(result["table"])
    print(f"\nwrote {result['csv']}\n      {result['json']}")
    return result


if __name__ == "__main__":
    main()
