"""Where a faithful P1 call's time goes, program by program: each Gluon launch's programs traced on the GPU's clock.

    PYTHONPATH=. python3 scripts/p1/p1_program_trace.py --tokens 65,128,256,512 --out /tmp/trace

Runs the call under ``designs.gluon.traced_programs()`` (a build of the two Gluon launches that records, per program,
its start, the end of its wait for launch 1 where launch 2 is issued by programmatic dependent launch, its end, its
SM and its tile kind), replayed from a CUDA graph after the benchmark's L2 flush as the tuning runs time it, and prints
per launch and tile kind: programs, when they start and end (µs from launch 1's first program's start), how long
they run, and how busy the SMs are over the launch. Every traced call is checked against float64 first. Writes the
rows (CSV) and a timeline per token count (PNG, one line per program at its SM) to ``--out``.
"""

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.checks import check_outputs, reference_outputs
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.lab import traces as lab_traces
from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
from moe_lib.swiglu_down.designs.gluon import traced_programs
from moe_lib.swiglu_down.gluon_launch2 import TRACE_FIELDS

PROBLEM = "swiglu_down_backward"

KINDS = {
    ("launch 1", 0): "dWd",
    ("launch 1", 1): "dA",
    ("launch 2", 0): "dWg, dWu",
    ("launch 2", 1): "dx",
    ("launch 2", 2): "dWd",
}


def traced_rows(num_tokens: int, config, seed: int) -> pd.DataFrame:
    """One graph replay of the call at ``num_tokens`` after an L2 flush, its programs' rows (times in µs from the
    first program's start)."""
    problem = problems.load(PROBLEM)
    inputs = problem.make_inputs(num_tokens, seed=seed, device="cuda", distribution="harness")
    args = list(inputs.values())
    references, _ = reference_outputs(problem, inputs, small=False)
    with traced_programs() as traces:
        timing.poison_allocator("cuda", 256 * 2**20)
        outputs = swiglu_down_backward_triton(*args, config=config)  # compiles the traced build
        verdict = check_outputs(outputs, references, problem.output_names, problem.element_rule_at(torch.bfloat16))
        if not (verdict["correct"] and verdict["passes_element_rule"]):
            raise SystemExit(
                f"{num_tokens} tokens: the traced call fails the benchmark's rule of float64 "
                f"({verdict['why'] or verdict['element_pass_fraction']})"
            )
        del references
        if not traces:
            raise SystemExit(
                f"{num_tokens} tokens: the call ran no Gluon launch (a Hopper GPU and the faithful path "
                "from 65 tokens run them)"
            )
        graph, _ = timing.capture(lambda: swiglu_down_backward_triton(*args, config=config))
        captured = traces[-1]
        timing.L2Flusher("cuda")()
        graph.replay()
        torch.cuda.synchronize()
    frames = []
    for launch, rows in captured.items():
        frame = pd.DataFrame(rows.cpu().numpy(), columns=list(TRACE_FIELDS))
        frame.insert(0, "launch", launch)
        frame.insert(1, "program", range(len(frame)))
        frame["tiles"] = [KINDS[launch, kind] for kind in frame["kind"]]
        frames.append(frame)
    rows = pd.concat(frames, ignore_index=True)
    origin = rows.loc[rows.launch == "launch 1", "start_ns"].min()
    for field in ("start_ns", "proceed_ns", "end_ns"):
        rows[field.replace("_ns", "_us")] = (rows[field] - origin) / 1e3
    rows["run_us"] = rows.end_us - rows.start_us
    rows["wait_us"] = rows.proceed_us - rows.start_us
    rows.insert(0, "T", num_tokens)
    return rows.drop(columns=["start_ns", "proceed_ns", "end_ns", "kind"])


def timeline(rows: pd.DataFrame, path: Path) -> None:
    """One line per program from its start to its end at its SM, by launch and tile kind (a PNG at ``path``)."""
    fig = lab_traces.program_timeline_figure({f"P1 faithful call, {int(rows['T'].iloc[0])} tokens": rows})
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="65,128,256,512", help="comma list of token counts")
    parser.add_argument(
        "--config",
        default=None,
        choices=sorted(P1_CANDIDATES),
        metavar="CANDIDATE",
        help="a candidate of moe_lib.bench.tuning.P1_CANDIDATES (default: as chosen)",
    )
    parser.add_argument("--out", default="/tmp/p1_program_trace", help="folder for the CSV and the timelines")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("p1_program_trace: needs a CUDA GPU (Hopper: the Gluon launches)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = P1_CANDIDATES[args.config] if args.config else None
    frames = []
    for T in [int(t) for t in args.tokens.split(",")]:
        rows = traced_rows(T, config, seed=T)
        timeline(rows, out / f"p1_program_trace_{T}.png")
        frames.append(rows)
    rows = pd.concat(frames, ignore_index=True)
    rows.to_csv(out / "p1_program_trace.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(lab_traces.program_trace_summary(rows).to_string())
    print(f"wrote {out / 'p1_program_trace.csv'} and a timeline per token count")


if __name__ == "__main__":
    main()
