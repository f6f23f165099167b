"""Host µs a layer call spends in torch's op dispatch: the layer through its op (``torch.ops.moe_lib.moe_experts``,
as ``torch.compile`` sees it) against the eager path (:class:`moe_lib.moe_experts.api._EagerLayer`, the op's body
without the dispatch), forward and forward + backward, on the reference path with tiny CPU tensors (so that the
dispatch is most of the call; runs anywhere).

    PYTHONPATH=. python3 scripts/p2/dispatch_host_time.py [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_lib import problems
from moe_lib.moe_experts import api

INPUTS = ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")


def per_call_us(call, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.calls < 10 or args.repeats < 1:
        parser.error("--calls: at least 10; --repeats: at least 1")
    inputs = problems.make_inputs(
        "moe_experts_backward", 4, seed=0, hidden_size=8, intermediate_size=8, num_experts=2, top_k=1
    )
    leaves = [inputs[name].requires_grad_() for name in ("hidden_states", "topk_weights")]
    layer_args = [inputs[name] for name in INPUTS]
    flags = ("reference", False, False, False)
    op = torch.ops.moe_lib.moe_experts

    def through_op():
        return op(*layer_args, *flags)[0]

    def eager():
        return api._layer_call("moe_experts", *layer_args, *flags)[0]

    print(f"host µs a call (median of {args.repeats} × {args.calls} calls), reference path, T 4, H 8, I 8, E 2, K 1")
    for label, call in (("through the op", through_op), ("eager (_EagerLayer)", eager)):
        forward = per_call_us(call, args.calls, args.repeats)
        both = per_call_us(lambda call=call: torch.autograd.grad(call().sum(), leaves), args.calls, args.repeats)
        print(f"  {label:22s} forward {forward:7.1f}   forward + backward {both:7.1f}")


if __name__ == "__main__":
    main()
