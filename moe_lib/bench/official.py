"""NVIDIA's own harness as a ruler: any implementation exported as a SOL-ExecBench solution, run by its CLI.

    python -m moe_lib.bench.official export --problem P --impl LABEL [--out DIR]
    python -m moe_lib.bench.official run --problem P --impl LABEL [--harness .sol-execbench/src]

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
workload: status, latency, speedup over the reference), and a table is printed.

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
from .results import DEFAULT_OUT, format_ms, geomean, write_json

DEFAULT_HARNESS = provenance.REPO_ROOT / ".sol-execbench" / "src"
DEFAULT_EXPORT = provenance.REPO_ROOT / "build" / "official"
LANGUAGES = {"triton": "triton", "triton_fast": "triton"}  # other labels are PyTorch code

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
    source = KERNEL_SOURCE.format(problem=problem.name, impl=impl, description=peer.description,
                                  arguments=", ".join(problem.input_names))  # fmt: skip
    return dict(
        name=f"moe_lib_{impl}",
        definition=problem.name,
        author="moe_lib",
        description=f"moe_lib.bench.peers label {impl!r}: {peer.description}",
        spec=dict(languages=[LANGUAGES.get(impl, "pytorch")], target_hardware=["LOCAL"], entry_point="kernel.py::run",
                  dependencies=["torch"], destination_passing_style=False),  # fmt: skip
        sources=[dict(path="kernel.py", content=source)],
    )


def export(problem_name: str, impl: str, out: Path) -> Path:
    """Writes the problem folder the harness reads (definition, workloads, solution); returns it."""
    problem = problems.load(problem_name)
    document = solution_document(problem, impl)  # checks impl before anything is written
    folder = Path(out) / f"{problem_name}-{impl}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("definition.json", "workload.jsonl"):
        shutil.copyfile(problems.PROBLEMS_DIR / problem_name / name, folder / name)
    (folder / "solution.json").write_text(json.dumps(document, indent=2) + "\n")
    return folder


def trace_rows(traces: list[dict]) -> list[dict]:
    """One row per workload trace: its token count, status, latency (ms), reference latency and errors."""
    rows = []
    for trace in traces:
        evaluation = trace.get("evaluation") or {}
        performance = evaluation.get("performance") or {}
        correctness = evaluation.get("correctness") or {}
        rows.append(dict(
            num_tokens=(trace.get("workload") or {}).get("axes", {}).get("num_tokens"),
            status=evaluation.get("status"),
            latency_ms=performance.get("latency_ms"),
            reference_latency_ms=performance.get("reference_latency_ms"),
            speedup=performance.get("speedup_factor"),
            max_abs_error=correctness.get("max_absolute_error"),
            max_rel_error=correctness.get("max_relative_error"),
        ))  # fmt: skip
    return rows


def summary(rows: list[dict]) -> dict:
    """Workloads passed, and the geomean of the latencies of the passing ones (ms)."""
    passed = [row for row in rows if row["status"] == "PASSED"]
    latencies = [row["latency_ms"] for row in passed if row["latency_ms"] is not None]
    return dict(workloads=len(rows), passed=len(passed),
                geomean_latency_ms=geomean(latencies) if len(latencies) == len(rows) else math.nan)  # fmt: skip


def format_table(rows: list[dict], title: str) -> str:
    lines = [title, f"{'T':>6}  {'status':<22} {'latency':>10} {'reference':>10} {'max abs err':>12}"]
    for row in sorted(rows, key=lambda r: r["num_tokens"] or 0):
        error = "-" if row["max_abs_error"] is None else f"{row['max_abs_error']:.3g}"
        lines.append(f"{row['num_tokens']:>6}  {str(row['status']):<22} {format_ms(row['latency_ms']):>10} "
                     f"{format_ms(row['reference_latency_ms']):>10} {error:>12}")  # fmt: skip
    result = summary(rows)
    lines.append(f"{result['passed']}/{result['workloads']} passed; geomean latency "
                 f"{format_ms(result['geomean_latency_ms'])} (every workload passing)")  # fmt: skip
    return "\n".join(lines)


def run(problem_name: str, impl: str, *, harness: Path, export_dir: Path, results: Path, timeout_s: int) -> dict:
    """Exports, runs the harness's CLI, keeps its traces and a summary; returns dict(rows, summary, paths)."""
    if not (Path(harness) / "sol_execbench").is_dir():
        raise ValueError(f"harness: no sol_execbench package under {harness} (copy NVIDIA/SOL-ExecBench's src/ there)")
    if not torch.cuda.is_available():
        raise ValueError("run: NVIDIA's harness times CUDA kernels; this machine has no CUDA GPU (export works)")
    started = datetime.datetime.now(datetime.timezone.utc)
    folder = export(problem_name, impl, export_dir)
    traces_path = folder / "traces.jsonl"
    python_path = os.pathsep.join([str(harness), str(provenance.REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "sol_execbench.cli.main", str(folder), "--solution", str(folder / "solution.json"),
               "-o", str(traces_path), "--timeout", str(timeout_s)]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": python_path}, capture_output=True, text=True)
    if not traces_path.is_file():
        raise RuntimeError(f"the harness wrote no traces (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    traces = [json.loads(line) for line in traces_path.read_text().splitlines() if line.strip()]
    rows = trace_rows(traces)
    device = torch.device("cuda", torch.cuda.current_device())
    stem = f"{started:%Y-%m-%d}-{problem_name}-official-{impl}"
    target = Path(results) / provenance.gpu_key(device)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(traces_path, target / f"{stem}.jsonl")
    harness_commit = Path(harness).parent / "COMMIT"
    document = dict(
        problem=problem_name, impl=impl, timing="official",
        provenance=dict(provenance.run_context(device, started, "moe_lib.bench.official"),
                        harness=str(harness), harness_commit=harness_commit.read_text().strip()
                        if harness_commit.is_file() else None, harness_exit_code=done.returncode),
        summary=summary(rows), workloads=rows,
    )  # fmt: skip
    write_json(target / f"{stem}.json", document)
    return dict(rows=rows, summary=document["summary"], jsonl=target / f"{stem}.jsonl", json=target / f"{stem}.json",
                log=done.stdout + done.stderr)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_lib.bench.official", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("export", "run"))
    parser.add_argument("--problem", required=True, choices=problems.PROBLEM_NAMES)
    parser.add_argument("--impl", default="triton", help="a label of moe_lib.bench.peers (default: triton)")
    parser.add_argument("--out", type=Path, default=DEFAULT_EXPORT, help=f"export folder (default: {DEFAULT_EXPORT})")
    parser.add_argument("--harness", type=Path, default=DEFAULT_HARNESS, help="the harness's src/ folder")
    parser.add_argument("--results", type=Path, default=DEFAULT_OUT, help="results root (default: data/results)")
    parser.add_argument("--timeout", type=int, default=600, help="the harness's evaluation timeout in seconds")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.impl not in peers.labels(args.problem):
        parser.error(f"--impl: unknown implementation {args.impl!r} for {args.problem} "
                     f"(known: {', '.join(peers.labels(args.problem))})")  # fmt: skip
    if args.action == "export":
        print(export(args.problem, args.impl, args.out))
        return
    try:
        result = run(args.problem, args.impl, harness=args.harness, export_dir=args.out, results=args.results,
                     timeout_s=args.timeout)  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    print(format_table(result["rows"], f"{args.problem} · {args.impl} · NVIDIA's harness (CUPTI, eager calls)"))
    print(f"\nwrote {result['jsonl']}\n      {result['json']}")


if __name__ == "__main__":
    main()
