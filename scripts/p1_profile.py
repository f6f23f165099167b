"""Where the P1 Triton backward spends its time at a few token counts.

    PYTHONPATH=. python3 scripts/p1_profile.py            # timing: dirty vs clean L2 flush
    PYTHONPATH=. ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread \
        python3 scripts/p1_profile.py --once               # per-kernel durations and DRAM bytes

The benchmark's flush overwrites a large buffer, which leaves the L2 full of dirty lines that the
timed kernels must write back as they evict them; a read-only flush shows what that costs.
"""

import argparse

import torch

from moe_lib import problems
from moe_lib.kernels.swiglu_down_backward import swiglu_down_backward_triton

TOKENS = (1, 16, 128, 1087, 8192)


def time_replays(fn, flush, reps=30):
    graph = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps + 3):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times[3:])[len(times[3:]) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--once", action="store_true", help="one call per token count (for ncu)")
    parser.add_argument("--tokens", default=None, help="comma list (default: 1,16,128,1087,8192)")
    parser.add_argument("--config", default=None, help="a candidate name of scripts/p1_tune.py (default: chosen)")
    args = parser.parse_args()
    config = None
    if args.config:
        from p1_tune import CANDIDATES

        config = CANDIDATES[args.config]
    buffer = torch.empty(128 * 2**20, dtype=torch.float32, device="cuda")
    total = torch.zeros((), device="cuda")
    flushes = {
        "dirty (fill)": lambda: buffer.fill_(1.0),
        "clean (read)": lambda: total.copy_(buffer.sum()),
        "none (warm L2)": lambda: None,
    }
    for T in [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS:
        inputs = list(problems.make_inputs("swiglu_down_backward", T, seed=0, device="cuda").values())
        if args.once:
            swiglu_down_backward_triton(*inputs, config=config)
            torch.cuda.synchronize()
            continue
        call = lambda a=inputs: swiglu_down_backward_triton(*a, config=config)  # noqa: E731
        cells = [f"{name} {time_replays(call, flush):7.1f} us" for name, flush in flushes.items()]
        print(f"T={T:5d}  " + "   ".join(cells))


if __name__ == "__main__":
    main()
