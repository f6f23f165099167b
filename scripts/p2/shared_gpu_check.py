"""The grouped weight-gradient launch while another process keeps the same GPU busy (notes/p2/engine-wgrad.md, "A
fault when another process shares the GPU").

    PYTHONPATH=. python3 scripts/p2/shared_gpu_check.py [--cases pair:2048,one:2048,one:8192] [--calls 20]
        [--wait-every-step] [--keep-scratch]

Per case, in a process of its own (a fault ends its CUDA context): the launch's outputs computed once with the GPU to
itself, then a second process started that loops a bf16 8192² matmul on the same GPU, then ``--calls`` launches each
compared bit for bit with the first (the kernel is deterministic). Prints one line a case: ``ok``, ``differs`` or the
CUDA error. Cases: ``pair`` the gate and up products as column views of one [T·K, 2I] tensor against x_s (the layer's
first weight-gradient launch), ``one`` a single product; at P2's shape (H 4096, I 2048, E 256, K 8). Two variants to
tell the fault's cause: ``--wait-every-step`` has the loading warp wait for every step in flight before it rewrites a
descriptor pair (``grouped_wgrad.WAIT_EVERY_STEP``), ``--keep-scratch`` keeps the descriptors' global scratch alive
across calls (one allocation a size, never freed) instead of a fresh one a launch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

H, I, E, K = 4096, 2048, 256, 8


def busy_loop(seconds: float) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()


def keeping_allocator():
    """An allocator for Triton's global scratch (``triton.set_allocator``) that hands out one allocation a size,
    kept alive across calls."""
    import torch

    kept = {}

    def allocate(size: int, alignment: int, stream):
        if size not in kept:
            kept[size] = torch.empty(size, dtype=torch.int8, device="cuda")
        return kept[size]

    return allocate


def run_case(kind: str, tokens: int, calls: int, busy_seconds: float, wait_every_step: bool, kept: bool) -> str:
    import torch

    from moe_lib.engine import grouped_wgrad
    from moe_lib.moe_experts.inputs import route_tokens
    from moe_lib.moe_experts.routing import route_by_expert

    grouped_wgrad.WAIT_EVERY_STEP = wait_every_step
    if kept:
        import triton

        allocate = keeping_allocator()
        grouped_wgrad.install_tma_allocator = lambda device: triton.set_allocator(allocate)

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    rows = tokens * K
    indices = route_tokens(tokens, E, K, device=device, generator=generator)
    offsets = route_by_expert(indices, E).expert_offsets
    x_s = torch.randn((rows, H), generator=generator, device=device).to(torch.bfloat16)
    if kind == "pair":
        d = torch.randn((rows, 2 * I), generator=generator, device=device).to(torch.bfloat16)
        problems = [(d[:, :I], x_s), (d[:, I:], x_s)]
    else:
        problems = [(torch.randn((rows, I), generator=generator, device=device).to(torch.bfloat16), x_s)]
    first = [out.clone() for out in grouped_wgrad.grouped_weight_grad(problems, offsets)]
    torch.cuda.synchronize()
    busy = subprocess.Popen([sys.executable, __file__, "--busy", str(busy_seconds)])
    try:
        time.sleep(2)  # the busy process's first matmuls are queued
        for call in range(calls):
            outs = grouped_wgrad.grouped_weight_grad(problems, offsets)
            torch.cuda.synchronize()
            if not all(torch.equal(a, b) for a, b in zip(outs, first, strict=True)):
                return f"differs at call {call}"
        return f"ok ({calls} calls)"
    except Exception as exc:  # noqa: BLE001 - the CUDA error is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        busy.kill()
        busy.wait()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="pair:2048,one:2048,one:8192", help="comma list of pair|one:tokens")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--busy-seconds", type=float, default=60.0)
    parser.add_argument("--wait-every-step", action="store_true", help="grouped_wgrad.WAIT_EVERY_STEP")
    parser.add_argument("--keep-scratch", action="store_true", help="one global scratch a size, kept across calls")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--busy", type=float, help=argparse.SUPPRESS)  # the busy process
    args = parser.parse_args(argv)
    if args.busy is not None:
        return busy_loop(args.busy)
    if args.case is not None:
        kind, tokens = args.case.split(":")
        print(
            run_case(kind, int(tokens), args.calls, args.busy_seconds, args.wait_every_step, args.keep_scratch),
            flush=True,
        )
        return None
    cases = args.cases.split(",")
    for case in cases:
        kind, _, tokens = case.partition(":")
        if kind not in ("pair", "one") or not tokens.isdigit():
            parser.error(f"--cases: expected pair:<tokens> or one:<tokens>, got {case!r}")
    for case in cases:
        command = [sys.executable, __file__, "--case", case, "--calls", str(args.calls),
                   "--busy-seconds", str(args.busy_seconds)]  # fmt: skip
        command += ["--wait-every-step"] * args.wait_every_step + ["--keep-scratch"] * args.keep_scratch
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.busy_seconds + 120)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        errors = done.stderr.strip().splitlines() or ["nothing printed"]
        print(f"{case:12s} {lines[-1] if lines else 'no result: ' + errors[-1]}", flush=True)
    return None


if __name__ == "__main__":
    main()
