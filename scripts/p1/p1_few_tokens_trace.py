"""Where P1's few-token launch (design 5, ``moe_lib/swiglu_down/designs/few_tokens.py``) spends its time, by program.

    PYTHONPATH=. python scripts/p1/p1_few_tokens_trace.py [--tokens 1,16] [--shape 2048x768] [--runs 30]
        [--candidates stages2,d_late_s8]

On a GPU, per token count and precision, the few-token tiles for the shape (``FewTokensConfig.for_shape``; or each
named candidate of ``scripts/p1/p1_few_tokens_check.py``, faithful path only) run with ``trace=`` (each program stamps
the GPU's global clock at each of ``TRACE_POINTS``), captured in a CUDA graph and replayed after an L2 flush, as
the benchmark times it. Prints, per point, the median and the latest program in µs since the first program
started (the median of ``--runs`` replays; ``--flush`` says what precedes each), the launch's graph-replay time
with and without the stamps, and the SMs the programs ran on. With $OUT set, writes every run's raw stamps as JSON
there.
"""

from __future__ import annotations

import argparse

import torch

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.tuning import write_out
from moe_lib.swiglu_down.backward import allocate_outputs
from moe_lib.swiglu_down.designs import Inputs
from moe_lib.swiglu_down.designs.few_tokens import TRACE_POINTS, TRACE_SLOTS, FewTokensConfig, trace_timeline
from moe_lib.swiglu_down.runtime import carries_low_halves


def flusher(kind: str):
    """Before each replay: "dirty" overwrites a buffer larger than the L2 (the benchmark's flush: the L2 is left full
    of dirty lines, which the launch writes back as it evicts them), "clean" reads it, "none" leaves the L2 warm."""
    dirty = timing.L2Flusher("cuda")
    total = torch.zeros((), device="cuda")
    return {"dirty": dirty, "clean": lambda: total.copy_(dirty.buffer.sum()), "none": lambda: None}[kind]


def traced_runs(
    T: int,
    precision: str,
    runs: int,
    candidate: str | None = None,
    flush_kind: str = "dirty",
    shape: tuple[int, int] = (2048, 768),
) -> dict:
    H, I = shape
    problem = problems.load("swiglu_down_backward")
    inputs = problem.make_inputs(T, seed=T, device="cuda", distribution="harness", hidden_size=H, intermediate_size=I)
    with_lo = carries_low_halves(inputs["x"].dtype, precision)
    config = FewTokensConfig.for_shape(T, H, I, torch.cuda.get_device_properties(0).multi_processor_count)
    if candidate is not None:
        from p1_few_tokens_check import candidate_config  # this script's folder is on the path

        config = candidate_config(candidate, T, shape)
        if config is None:
            raise SystemExit(f"--candidates: {candidate} has tiles for H 2048, I 768 only")
    out = allocate_outputs(inputs["x"], I)
    trace = torch.zeros((config.grid_size(H, I), TRACE_SLOTS), dtype=torch.int64, device="cuda")
    flush = flusher(flush_kind)

    def call(with_trace: bool):
        return lambda: config.run(
            Inputs(*inputs.values()), with_lo=with_lo, out=out, trace=trace if with_trace else None
        )

    graph, _ = timing.capture(call(True))
    stamps = []
    for _ in range(runs):
        trace.zero_()
        flush()
        graph.replay()
        torch.cuda.synchronize()
        stamps.append(trace.clone())
    stamps = torch.stack(stamps).cpu()
    return dict(
        T=T,
        H=H,
        I=I,
        precision=precision,
        label=f"{candidate or precision} {flush_kind}",
        config=str(config),
        timeline=trace_timeline(stamps),
        graph_us=timing.graph_median_ms(call(False), flush) * 1e3,
        graph_traced_us=timing.graph_median_ms(call(True), flush) * 1e3,
        sms=len(set(stamps[0, :, -1].tolist())),
        stamps=stamps.tolist(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16", help="comma list of token counts (at most 128)")
    parser.add_argument("--shape", default="2048x768", help="HxI")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--candidates", default="", help="comma list of scripts/p1/p1_few_tokens_check.py candidates")
    parser.add_argument("--flush", default="dirty", help="comma list of dirty, clean, none (see flusher)")
    args = parser.parse_args()
    from p1_few_tokens_check import CANDIDATES, VARIANTS, parse_shapes  # this script's folder is on the path

    try:
        (shape,) = parse_shapes(args.shape)
    except (argparse.ArgumentTypeError, ValueError):
        raise SystemExit(f"--shape: expected one HxI, e.g. 2048x768; got {args.shape!r}") from None
    unknown = [name for name in filter(None, args.candidates.split(",")) if name not in CANDIDATES | VARIANTS]
    if unknown:
        raise SystemExit(f"--candidates: unknown candidate(s) {unknown}; see scripts/p1/p1_few_tokens_check.py")
    flushes = args.flush.split(",")
    if not set(flushes) <= {"dirty", "clean", "none"}:
        raise SystemExit(f"--flush: expected a comma list of dirty, clean, none; got {args.flush!r}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the stamps are inline PTX)")
    tokens = [int(T) for T in args.tokens.split(",")]
    if args.candidates:
        results = [
            traced_runs(T, "faithful", args.runs, name, f, shape)
            for T in tokens
            for f in flushes
            for name in args.candidates.split(",")
        ]
    else:
        results = [
            traced_runs(T, precision, args.runs, None, f, shape)
            for T in tokens
            for f in flushes
            for precision in ("faithful", "fast")
        ]
    print(f"\nµs since the first program started: median program / latest program (median of {args.runs} runs)")
    print(f"{'point':20s} " + " ".join(f"{r['label'][:11]} {r['T']}".rjust(14) for r in results))
    for point in TRACE_POINTS:
        print(
            f"{point:20s} "
            + " ".join(f"{r['timeline'][point][0]:6.2f}/{r['timeline'][point][1]:6.2f}".rjust(14) for r in results)
        )
    print(f"{'graph replay':20s} " + " ".join(f"{r['graph_us']:.2f}".rjust(14) for r in results))
    print(f"{'graph, traced':20s} " + " ".join(f"{r['graph_traced_us']:.2f}".rjust(14) for r in results))
    print(f"{'SMs used':20s} " + " ".join(f"{r['sms']}".rjust(14) for r in results))
    write_out(
        "p1_few_tokens_trace.json",
        dict(points=TRACE_POINTS, device=torch.cuda.get_device_name(), results=results),
        indent=None,
    )


if __name__ == "__main__":
    main()
