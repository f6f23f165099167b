"""Where the P1 Triton backward spends its time at a few token counts.

    PYTHONPATH=. python3 scripts/p1/p1_profile.py            # timing: dirty vs clean L2 flush
    PYTHONPATH=. ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread \
        python3 scripts/p1/p1_profile.py --once               # per-kernel durations and DRAM bytes

The benchmark's flush overwrites a large buffer, which leaves the L2 full of dirty lines that the
timed kernels must write back as they evict them; a read-only flush shows what that costs. With --once each call
follows that flush, so under ``ncu --cache-control none`` the profiled kernels meet the L2 as the benchmark leaves it
(ncu's default, ``--cache-control all``, cleans the L2 before each kernel instead).
"""

import argparse

import torch

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

TOKENS = (1, 16, 128, 1087, 8192)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--once", action="store_true", help="one call per token count (for ncu)")
    parser.add_argument("--tokens", default=None, help="comma list (default: 1,16,128,1087,8192)")
    parser.add_argument(
        "--config",
        default=None,
        choices=sorted(P1_CANDIDATES),
        help="a candidate of moe_lib.bench.tuning.P1_CANDIDATES (default: chosen)",
    )
    parser.add_argument(
        "--precision",
        default="faithful",
        choices=["faithful", "fast"],
        help="the path: faithful (the benchmark function's default) or fast",
    )
    args = parser.parse_args()
    config = P1_CANDIDATES[args.config] if args.config else None
    dirty = timing.L2Flusher("cuda")  # the benchmark's flush: overwrites 512 MiB
    total = torch.zeros((), device="cuda")
    flushes = {
        "dirty (fill)": dirty,
        "clean (read)": lambda: total.copy_(dirty.buffer.sum()),
        "none (warm L2)": None,
    }
    for T in [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS:
        inputs = list(problems.make_inputs("swiglu_down_backward", T, seed=0, device="cuda").values())
        if args.once:
            dirty()
            swiglu_down_backward_triton(*inputs, config=config, precision=args.precision)
            torch.cuda.synchronize()
            continue
        call = lambda a=inputs: swiglu_down_backward_triton(*a, config=config, precision=args.precision)  # noqa: E731
        cells = [f"{name} {timing.graph_median_ms(call, flush) * 1e3:7.1f} us" for name, flush in flushes.items()]
        print(f"T={T:5d}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
