"""The engine layer's routing, host time per call: the packed routing's three launches against its torch form.

    PYTHONPATH=. python3 scripts/p2/routing_host_time.py [--tokens 8192] [--experts 64] [--top-k 8] [--calls 200]

Both forms on the same fresh routing, checked bit-equal first; then, per form, the CPU µs a call (calls issued back
to back, one sync after, best of five) and the GPU µs a call (events, the calls queued behind a sleep so that the GPU
never waits for the host). Notebook 07's GPU shape by default (notes/p2/host-time.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_lib.moe_experts.inputs import route_tokens
from moe_lib.moe_experts.packed_routing import packed_routing, packed_routing_reference


def host_and_gpu_us(call, calls: int) -> tuple[float, float]:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    host = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host = min(host, time.perf_counter() - start)
        torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(3e9 * host) + 1_000_000)
    begin.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return host / calls * 1e6, begin.elapsed_time(end) / calls * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    T, E, K = args.tokens, args.experts, args.top_k
    indices = route_tokens(T, E, K, device="cuda")
    weights = torch.softmax(torch.randn(T, K, device="cuda"), dim=-1).to(torch.bfloat16)
    if not torch.equal(packed_routing(indices, weights, E), packed_routing_reference(indices, weights, E)):
        raise SystemExit("the two forms differ")
    print(f"T={T} E={E} K={K}: CPU µs / GPU µs a call")
    for name, form in (("packed (3 launches)", packed_routing), ("torch form", packed_routing_reference)):
        host, gpu = host_and_gpu_us(lambda form=form: form(indices, weights, E), args.calls)
        print(f"  {name:22s} {host:8.1f} {gpu:8.1f}")


if __name__ == "__main__":
    main()
