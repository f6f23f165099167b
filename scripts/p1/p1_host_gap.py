"""Where P1's time goes between graph replay and NVIDIA's method: the host's share of a call.

    PYTHONPATH=. python scripts/p1/p1_host_gap.py [--tokens 1,16,128,512,1087,2447,8192] [--precision faithful]
        [--configs default,library_gemms_faithful,chained_wide]

Per token count and design (``--configs``: "default", the one ``swiglu_down_backward`` picks, or names
of ``moe_lib.bench.tuning.P1_CANDIDATES``): GPU time (graph replay, cold L2), the official span (eager
calls on fresh input addresses, CUPTI first kernel start to last kernel end;
:mod:`moe_lib.bench.official_timing`), their difference (the host's share), and the host time of one
call (wall clock of the Python call alone, the GPU idle before it). Needs CUDA and cupti-python.
Prints one table; with $OUT set, also writes it as JSON there.
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lib import problems
from moe_lib.bench import official_timing, timing
from moe_lib.bench.cli import token_list
from moe_lib.bench.tuning import p1_call, p1_candidate_names, write_out


def host_us(call, reps: int = 50) -> float:
    """Median wall-clock µs of the Python call alone (synchronised before each, so the queue is empty)."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = call()
        samples.append((time.perf_counter() - start) * 1e6)
        del out
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def profile_calls(call, calls: int) -> str:
    """cProfile's table of ``calls`` calls (after one warm-up call), the 25 costliest functions by own time."""
    call()
    torch.cuda.synchronize()
    return timing.cprofile_table(call, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_list, default=[1, 16, 128, 512, 1087, 2447, 8192])
    parser.add_argument("--precision", default="faithful", choices=("faithful", "fast"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--configs", default="default", help="comma list: default and/or P1_CANDIDATES names")
    parser.add_argument("--profile", type=int, default=0, help="profile this many calls per design instead")
    args = parser.parse_args()
    try:
        names = p1_candidate_names(args.configs)
    except ValueError as exc:
        raise SystemExit(f"--configs: {exc}") from None
    reason = official_timing.unavailable(torch.device("cuda"))
    if reason:
        raise SystemExit(f"official timing unavailable: {reason}")
    problem = problems.load("swiglu_down_backward")
    flush = timing.L2Flusher("cuda")
    rows = []
    for T in args.tokens:
        inputs = problem.make_inputs(T, seed=T, device="cuda", distribution="harness")
        for name in names:

            def make_call(fresh, name=name):
                return p1_call(name, fresh, args.precision)

            if args.profile:
                print(f"=== T={T} {name}: {args.profile} calls, by own time")
                print(profile_calls(make_call(inputs), args.profile), flush=True)
                continue
            row = dict(T=T, config=name)
            try:
                row["graph_us"] = timing.graph_median_ms(make_call(inputs), flush) * 1e3
                measured = official_timing.time_official(make_call, inputs, "cuda", warmup=5, reps=args.reps)
                row["official_us"] = timing.summarize(measured["samples_ms"])["median_ms"] * 1e3
                row["gap_us"] = row["official_us"] - row["graph_us"]
                row["kernels"] = measured["activities"]
                row["host_us"] = host_us(make_call(inputs))
            except Exception as exc:  # a candidate that cannot run here (e.g. too much shared memory): say so, go on
                lines = str(exc).strip().splitlines() or [""]
                row["error"] = f"{type(exc).__name__}: {lines[-1][:160]}"
            rows.append(row)
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    header = ["T", "config", "graph_us", "official_us", "gap_us", "kernels", "host_us"]
    print("\n" + " ".join(f"{h:>18}" for h in header))
    for row in rows:
        if "error" in row:
            print(f"{row['T']:>18} {row['config']:>18} failed: {row['error']}")
            continue
        print(" ".join(f"{row[h]:>18.1f}" if isinstance(row[h], float) else f"{row[h]:>18}" for h in header))
    write_out("p1_host_gap.json", rows)


if __name__ == "__main__":
    main()
