"""NVIDIA's own harness as a ruler: any implementation exported as a SOL-ExecBench solution, run by its CLI.

    python -m moe_lib.bench.official export --problem P --impl LABEL [--out DIR]
    python -m moe_lib.bench.official run --problem P --impl LABEL [--harness .sol-execbench/src] [--tokens 2048,8192]

``export`` writes ``DIR/<problem>-<impl>/``: the problem's ``definition.json`` and ``workload.jsonl``
copied unchanged (they are in the harness's schema) and a ``solution.json`` whose ``kernel.py`` runs the
implementation registered under ``LABEL`` in :mod:`moe_lib.bench.peers` (ours or a peer) through
``Peer.call``, the whole call timed. The solution imports ``moe_lib``: the repository root must be on
``PYTHONPATH`` where the harness runs.

``run`` exports, then runs the harness's command line on it (``python -m sol_execbench.cli.main DIR
-o traces.jsonl``): the harness draws each workload's inputs itself (its ``random`` inputs, or the
definition's ``custom_inputs_entrypoint``), checks the outputs against the definition's reference with
the workload's tolerance, and times eager calls on fresh input pointers with CUPTI, from a call's first
kernel start to its last kernel end (host gaps between launches count). Its traces are kept as
``data/results/<gpu>/<date>-<problem>-official-<impl>.jsonl`` with a JSON beside it (provenance, and per
workload: status, latency, speedup over the reference), and a table is printed. The harness's own output
goes to ``harness.log`` in the export folder as it runs, so a run cut short still leaves it.

``--tokens`` runs only the workloads with those token counts (for a suite that does not fit one sitting: P2's
fp32 workloads take minutes each). Their rows join the same day's file of the same problem, implementation
and commit (a workload run again replaces its row); a file of another commit is replaced. The summary
counts every workload of the suite, so a partial file says how many are still missing.

The harness is not on the package index: its source is the public repository NVIDIA/SOL-ExecBench; keep
its ``src/`` in the ignored folder ``.sol-execbench/`` (``--harness`` points elsewhere). It needs
``pydantic`` and ``cupti-python`` besides torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .. import problems
from . import peers, provenance
from .results import DEFAULT_OUT, format_ms, geomean, write_json, write_text

DEFAULT_HARNESS = provenance.REPO_ROOT / ".sol-execbench" / "src"
DEFAULT_EXPORT = provenance.REPO_ROOT / "build" / "official"
LANGUAGES = {"triton": "triton", "triton_fast": "triton", "triton_engine": "triton"}  # other labels: PyTorch code

KERNEL_SOURCE = '''"""{problem} by moe_lib's `{impl}` implementation ({description})."""

from moe_lib.bench.peers import peers_for

_PEER = peers_for("{problem}")["{impl}"]


def run({arguments}):
    return tuple(_PEER.call({arguments}))
'''


def solution_document(problem: problems.Problem, impl: str) -> dict:
    """The harness's solution.json for implementation ``impl`` of ``problem``."""
    registry = peers.peers_for(problem.name)
    if impl not in registry:
        raise ValueError(f"impl: {impl!r} is not an implementation of {problem.name} (known: {', '.join(registry)})")
    peer = registry[impl]
    source = KERNEL_SOURCE.format(
        problem=problem.name, impl=impl, description=peer.description, arguments=", ".join(problem.input_names)
    )
    return dict(
        name=f"moe_lib_{impl}",
        definition=problem.name,
        author="moe_lib",
        description=f"moe_lib.bench.peers label {impl!r}: {peer.description}",
        spec=dict(
            languages=[LANGUAGES.get(impl, "pytorch")],
            target_hardware=["LOCAL"],
            entry_point="kernel.py::run",
            dependencies=["torch"],
            destination_passing_style=False,
        ),
        sources=[dict(path="kernel.py", content=source)],
    )


def workload_lines(problem_name: str, tokens=None) -> list[str]:
    """The lines of the problem's ``workload.jsonl``, unchanged; with ``tokens`` only those whose num_tokens is
    in it (ValueError naming a count that is no workload of the problem)."""
    lines = [
        line
        for line in (problems.PROBLEMS_DIR / problem_name / "workload.jsonl").read_text().splitlines()
        if line.strip()
    ]
    if tokens is None:
        return lines
    counts = [json.loads(line)["axes"]["num_tokens"] for line in lines]
    unknown = sorted(set(tokens) - set(counts))
    if unknown:
        raise ValueError(
            f"tokens: {unknown} not among the workloads of {problem_name} (its token counts: {sorted(set(counts))})"
        )
    return [line for line, count in zip(lines, counts, strict=True) if count in set(tokens)]


def export(problem_name: str, impl: str, out: Path, tokens=None) -> Path:
    """Writes the problem folder the harness reads (definition, workloads, solution); returns it.
    ``tokens``: only the workloads with those token counts (:func:`workload_lines`)."""
    problem = problems.load(problem_name)
    document = solution_document(problem, impl)  # checks impl before anything is written
    workloads = workload_lines(problem_name, tokens)  # and the token counts
    folder = Path(out) / f"{problem_name}-{impl}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(problems.PROBLEMS_DIR / problem_name / "definition.json", folder / "definition.json")
    if tokens is None:
        shutil.copyfile(problems.PROBLEMS_DIR / problem_name / "workload.jsonl", folder / "workload.jsonl")
    else:
        (folder / "workload.jsonl").write_text("\n".join(workloads) + "\n")
    (folder / "solution.json").write_text(json.dumps(document, indent=2) + "\n")
    return folder


def trace_rows(traces: list[dict]) -> list[dict]:
    """One row per workload trace: its token count, status, latency (ms), reference latency and errors."""
    rows = []
    for trace in traces:
        evaluation = trace.get("evaluation") or {}
        performance = evaluation.get("performance") or {}
        correctness = evaluation.get("correctness") or {}
        rows.append(
            dict(
                num_tokens=(trace.get("workload") or {}).get("axes", {}).get("num_tokens"),
                status=evaluation.get("status"),
                latency_ms=performance.get("latency_ms"),
                reference_latency_ms=performance.get("reference_latency_ms"),
                speedup=performance.get("speedup_factor"),
                max_abs_error=correctness.get("max_absolute_error"),
                max_rel_error=correctness.get("max_relative_error"),
            )
        )
    return rows


def summary(rows: list[dict], suite_size: int | None = None) -> dict:
    """Workloads run and passed, and the geomean of the latencies (ms) where every workload of the suite
    (``suite_size``, default: the rows) ran and passed; NaN otherwise."""
    suite_size = len(rows) if suite_size is None else suite_size
    passed = [row for row in rows if row["status"] == "PASSED"]
    latencies = [row["latency_ms"] for row in passed if row["latency_ms"] is not None]
    complete = len(latencies) == len(rows) == suite_size
    return dict(
        workloads=len(rows),
        passed=len(passed),
        suite_workloads=suite_size,
        geomean_latency_ms=geomean(latencies) if complete else math.nan,
    )


def format_table(rows: list[dict], title: str, suite_size: int | None = None) -> str:
    lines = [title, f"{'T':>6}  {'status':<22} {'latency':>10} {'reference':>10} {'max abs err':>12}"]
    for row in sorted(rows, key=lambda r: r["num_tokens"] or 0):
        error = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.3g}"
        lines.append(
            f"{row['num_tokens']:>6}  {str(row['status']):<22} {format_ms(row['latency_ms']):>10} "
            f"{format_ms(row['reference_latency_ms']):>10} {error:>12}"
        )
    result = summary(rows, suite_size)
    missing = result["suite_workloads"] - result["workloads"]
    lines.append(
        f"{result['passed']}/{result['workloads']} passed"
        + (f" ({missing} of the suite's {result['suite_workloads']} not run yet)" if missing > 0 else "")
        + f"; geomean latency {format_ms(result['geomean_latency_ms'])} (every workload passing)"
    )
    return "\n".join(lines)


def merged_rows(earlier: dict | None, rows: list[dict], traces: list[str], commit: str | None):
    """The rows and trace lines of a partial run joined to an earlier file's (``earlier``: its JSON document
    with its trace lines under "traces") where that file was written at the same ``commit``; a workload run
    again replaces its earlier row and trace. Returns (rows by token count, trace lines, joined: bool)."""
    same_commit = (
        earlier is not None and commit is not None and (earlier.get("provenance") or {}).get("git_commit") == commit
    )
    if not same_commit:
        return rows, traces, False
    run_now = {row["num_tokens"] for row in rows}
    kept = [
        (row, trace)
        for row, trace in zip(earlier["workloads"], earlier["traces"], strict=True)
        if row["num_tokens"] not in run_now
    ]
    joined = sorted([*kept, *zip(rows, traces, strict=True)], key=lambda pair: pair[0]["num_tokens"] or 0)
    return [row for row, _ in joined], [trace for _, trace in joined], True


def run(
    problem_name: str, impl: str, *, harness: Path, export_dir: Path, results: Path, timeout_s: int, tokens=None
) -> dict:
    """Exports, runs the harness's CLI, keeps its traces and a summary; returns dict(rows, summary, paths).
    ``tokens``: only those workloads, joined to the same day's file of the same commit (module docstring)."""
    if not (Path(harness) / "sol_execbench").is_dir():
        raise ValueError(f"harness: no sol_execbench package under {harness} (copy NVIDIA/SOL-ExecBench's src/ there)")
    if not torch.cuda.is_available():
        raise ValueError("run: NVIDIA's harness times CUDA kernels; this machine has no CUDA GPU (export works)")
    started = datetime.datetime.now(datetime.timezone.utc)
    folder = export(problem_name, impl, export_dir, tokens)
    traces_path, log_path = folder / "traces.jsonl", folder / "harness.log"
    traces_path.unlink(missing_ok=True)  # an earlier run's traces must not pass for this one's
    python_path = os.pathsep.join([str(harness), str(provenance.REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "sol_execbench.cli.main",
        str(folder),
        "--solution",
        str(folder / "solution.json"),
        "-o",
        str(traces_path),
        "--timeout",
        str(timeout_s),
    ]
    with log_path.open("w") as log:
        done = subprocess.run(
            command, env={**os.environ, "PYTHONPATH": python_path}, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    if not traces_path.is_file():
        raise RuntimeError(
            f"the harness wrote no traces (exit {done.returncode}; its output: {log_path}):\n"
            f"{log_path.read_text()[-4000:]}"
        )
    trace_lines = [line for line in traces_path.read_text().splitlines() if line.strip()]
    rows = trace_rows([json.loads(line) for line in trace_lines])
    device = torch.device("cuda", torch.cuda.current_device())
    stem = f"{started:%Y-%m-%d}-{problem_name}-official-{impl}"
    target = Path(results) / provenance.gpu_key(device)
    target.mkdir(parents=True, exist_ok=True)
    context = provenance.run_context(device, started, "moe_lib.bench.official")
    joined = False
    if tokens is not None and (target / f"{stem}.json").is_file() and (target / f"{stem}.jsonl").is_file():
        earlier = json.loads((target / f"{stem}.json").read_text())
        earlier["traces"] = [line for line in (target / f"{stem}.jsonl").read_text().splitlines() if line.strip()]
        if len(earlier["traces"]) == len(earlier.get("workloads", ())):
            rows, trace_lines, joined = merged_rows(earlier, rows, trace_lines, context.get("git_commit"))
    (target / f"{stem}.json").unlink(missing_ok=True)  # the traces and their summary: of one run, or no summary
    write_text(target / f"{stem}.jsonl", "\n".join(trace_lines) + "\n")
    harness_commit = Path(harness).parent / "COMMIT"
    document = dict(
        problem=problem_name,
        impl=impl,
        timing="official",
        provenance=dict(
            context,
            harness=str(harness),
            harness_commit=harness_commit.read_text().strip() if harness_commit.is_file() else None,
            harness_exit_code=done.returncode,
            tokens_run_last=sorted(tokens) if tokens is not None else None,
            joined_earlier_rows=joined,
        ),
        summary=summary(rows, len(workload_lines(problem_name))),
        workloads=rows,
    )
    write_json(target / f"{stem}.json", document)
    return dict(
        rows=rows,
        summary=document["summary"],
        jsonl=target / f"{stem}.jsonl",
        json=target / f"{stem}.json",
        log=log_path,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_lib.bench.official", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("export", "run"))
    parser.add_argument("--problem", required=True, choices=problems.PROBLEM_NAMES)
    parser.add_argument("--impl", default="triton", help="a label of moe_lib.bench.peers (default: triton)")
    parser.add_argument("--out", type=Path, default=DEFAULT_EXPORT, help=f"export folder (default: {DEFAULT_EXPORT})")
    parser.add_argument("--harness", type=Path, default=DEFAULT_HARNESS, help="the harness's src/ folder")
    parser.add_argument("--results", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    parser.add_argument("--timeout", type=int, default=600, help="the harness's evaluation timeout in seconds")
    parser.add_argument(
        "--tokens",
        type=parse_tokens,
        default=None,
        help="comma-separated token counts: only those workloads, joined to the day's file of the "
        "same commit (default: every workload)",
    )
    return parser


def parse_tokens(text: str) -> list[int]:
    """``2048,8192`` as [2048, 8192]; argparse reports the ValueError of anything else."""
    try:
        counts = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts:
        raise argparse.ArgumentTypeError("expected at least one token count")
    return counts


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.impl not in peers.labels(args.problem):
        parser.error(
            f"--impl: unknown implementation {args.impl!r} for {args.problem} "
            f"(known: {', '.join(peers.labels(args.problem))})"
        )
    try:
        if args.action == "export":
            print(export(args.problem, args.impl, args.out, args.tokens))
            return
        result = run(
            args.problem,
            args.impl,
            harness=args.harness,
            export_dir=args.out,
            results=args.results,
            timeout_s=args.timeout,
            tokens=args.tokens,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(
        format_table(
            result["rows"],
            f"{args.problem} · {args.impl} · NVIDIA's harness (CUPTI, eager calls)",
            result["summary"]["suite_workloads"],
        )
    )
    print(f"\nwrote {result['jsonl']}\n      {result['json']}")


if __name__ == "__main__":
    main()
