"""Whether the layer's host path waits for the GPU, and where its host time goes (notes/p2/host-time.md).

    PYTHONPATH=. python3 scripts/p2/host_sync_check.py [--case model] [--calls 30] [--profile 22]

For the forward and the forward + backward of ``moe_experts`` at ``scripts/host_time.py``'s case: the synchronising
calls torch reports (``torch.cuda.set_sync_debug_mode("warn")``), then the host time of one call issued behind a
50 ms GPU sleep (a call that waits for the GPU takes at least the sleep), then, with ``--profile N``, cProfile's
top N functions by own time over ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from moe_lib.bench.timing import cprofile_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import host_time  # noqa: E402

SLEEP_CYCLES = 100_000_000  # ≈ 50 ms at the H200's clock


def sync_warnings(call) -> list[str]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [f"{str(w.message)[:160]} ({w.filename}:{w.lineno})" for w in caught]


def host_ms_behind_sleep(call) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="model", choices=[c for c in host_time.MOE_CASES if c != "tiny"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (0: none)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    calls = host_time.layer_calls("moe_experts", args.case, torch.device("cuda"))
    for phase in ("forward", "forward+backward"):
        for _ in range(3):  # compiled, cached, allocator warm
            calls[phase]()
        found = sync_warnings(calls[phase])
        print(f"{phase}: {len(found)} synchronising calls")
        for line in found[:10]:
            print(f"    {line}")
        print(f"{phase}: {host_ms_behind_sleep(calls[phase]):.2f} ms of host behind a 50 ms sleep")
        if args.profile:
            print(f"--- cProfile, {phase}, {args.calls} calls, by own time")
            print(cprofile_table(calls[phase], args.calls, args.profile))


if __name__ == "__main__":
    main()
