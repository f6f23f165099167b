"""Host time of P1's launch 2 in Gluon, piece by piece, with and without CUPTI tracing the API (NVIDIA's method).

    PYTHONPATH=. python scripts/p1_gluon_host_probe.py [--tokens 2447] [--calls 200]

In NVIDIA's method every host microsecond between launch 1 and launch 2 beyond launch 1's GPU time shows in the
span. Per piece (the 14 descriptors; the launch through Triton's JIT; the same launch through the compiled kernel;
the descriptors encoded for Triton's C launcher and the launch from those, as the library does; the whole faithful
call with launch 2 in Gluon and the default call): mean host µs per call over ``--calls`` calls issued back to
back, once plain and once with CUPTI recording runtime, driver and kernel activity as the harness
does. Needs a Hopper GPU and cupti-python.
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lib import problems
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.encoded_launch import EncodedLaunch
from moe_lib.swiglu_down.gluon_launch2 import second_launch_kernel
from moe_lib.swiglu_down.launch import SplitWorkspace, swiglu_down_backward_triton


def mean_host_us(piece, calls: int) -> float:
    """Mean wall-clock µs of ``piece()`` over ``calls`` calls in a row (after one call and a synchronisation)."""
    piece()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        piece()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


class CuptiTracing:
    """CUPTI recording runtime, driver and kernel activity, its records dropped: the harness's tracing cost."""

    def __enter__(self):
        from cupti import cupti

        self.cupti = cupti
        self.kinds = (cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER, cupti.ActivityKind.CONCURRENT_KERNEL)
        for kind in self.kinds:
            cupti.activity_enable(kind)
        cupti.activity_register_callbacks(lambda: (8 * 2**20, 0), lambda records: None)
        return self

    def __exit__(self, *exc):
        self.cupti.activity_flush_all(1)
        for kind in self.kinds:
            self.cupti.activity_disable(kind)
        self.cupti.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2447)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    T = args.tokens
    inputs = problems.load("swiglu_down_backward").make_inputs(T, seed=T, device="cuda", distribution="harness")
    x, gate_weight, up_weight = inputs["x"], inputs["gate_weight"], inputs["up_weight"]
    H, I = x.shape[1], gate_weight.shape[0]
    config = P1_CANDIDATES["gluon2"]
    launch2 = config.gluon_second_launch
    d_gate, d_up = (torch.randn(2, T, I, device="cuda", dtype=x.dtype) for _ in range(2))
    outputs = (torch.empty_like(x), torch.empty_like(gate_weight), torch.empty_like(up_weight))
    descriptor_args = (x, gate_weight, up_weight, d_gate, d_up, *outputs, inputs["grad_output"],
                       inputs["intermediate"], torch.empty_like(inputs["down_weight"]))  # fmt: skip
    descriptors = launch2.descriptors(*descriptor_args)
    grid = (launch2.programs(T, H, I),)
    unsplit = SplitWorkspace.placeholders(x.device)  # the dx splits' workspace, unused unsplit
    untraced = unsplit[1]  # the trace's placeholder (TRACE off)
    scalars = (*unsplit, untraced, T, I, *launch2.constexprs(with_lo=True).values())
    options = dict(num_warps=launch2.warps, maxnreg=launch2.maxnreg)
    compiled = second_launch_kernel[grid](*descriptors, *scalars, **options)
    encoded = EncodedLaunch(compiled)
    arguments = encoded.encode(*descriptors, *scalars, launch2.warps)
    stream = torch.cuda.current_stream().cuda_stream

    pieces = {
        "17 descriptors": lambda: launch2.descriptors(*descriptor_args),
        "launch 2 via the JIT": lambda: second_launch_kernel[grid](*descriptors, *scalars, **options),
        "launch 2 via the compiled kernel": lambda: compiled[(grid[0], 1, 1)](*descriptors, *scalars, launch2.warps),
        "17 descriptors encoded": lambda: encoded.encode(*descriptors, *scalars, launch2.warps),
        "launch 2, encoded ahead": lambda: encoded.launch(grid[0], arguments, stream),
        "whole call, gluon2": lambda: swiglu_down_backward_triton(*inputs.values(), config=config),
        "whole call, default": lambda: swiglu_down_backward_triton(*inputs.values()),
    }
    rows = []
    for name, piece in pieces.items():
        try:
            plain = mean_host_us(piece, args.calls)
            with CuptiTracing():
                traced = mean_host_us(piece, args.calls)
            rows.append((name, f"{plain:8.1f}", f"{traced:8.1f}"))
        except Exception as exc:  # a piece that cannot run this way: say why, go on
            rows.append((name, "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"))
    print(f"T = {T}: mean host µs per call over {args.calls} calls")
    print(f"{'piece':36} {'plain':>8} {'CUPTI':>8}")
    for name, plain, traced in rows:
        print(f"{name:36} {plain:>8} {traced:>8}")


if __name__ == "__main__":
    main()
