"""Whether the layer's host path waits for the GPU, and where its host time goes (notes/p2/host-time.md).

    PYTHONPATH=. python3 scripts/p2/host_sync_check.py [--case model] [--calls 30] [--profile 22] [--sections]

For the forward and the forward + backward of ``moe_experts`` at ``scripts/host_time.py``'s case: the synchronising
calls torch reports (``torch.cuda.set_sync_debug_mode("warn")``), then the host time of one call issued behind a
50 ms GPU sleep (a call that waits for the GPU takes at least the sleep), then, with ``--profile N``, cProfile's
top N functions by own time over ``--calls`` calls. With ``--sections``: the host time of each of the layer's main
functions (:data:`SECTIONS`, inclusive: an outer one holds the inner ones), µs a call, over ``--calls`` calls each
issued behind its own sleep (so that no launch waits for room in the GPU's queue); cProfile's own times put most of
a call in torch's custom-op frame, which these wrappers split.
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
# (module, attribute) of the functions --sections times, outer before inner
SECTIONS = (
    ("moe_lib.moe_experts.api", "_layer_forward"),
    ("moe_lib.moe_experts.api", "_backward_of"),
    ("moe_lib.moe_experts.launch", "moe_experts_forward_triton"),
    ("moe_lib.moe_experts.launch", "moe_experts_backward_triton"),
    ("moe_lib.moe_experts.engine_layer", "forward"),
    ("moe_lib.moe_experts.engine_layer", "backward"),
    ("moe_lib.moe_experts.engine_layer", "packed_routing"),
    ("moe_lib.moe_experts.engine_layer", "sum_slot_rows"),
    ("moe_lib.engine.grouped_gemm", "grouped_gemm"),
    ("moe_lib.engine.grouped_gemm", "launch_memoised"),
    ("moe_lib.engine.grouped_wgrad", "grouped_weight_grad"),
    ("moe_lib.engine.grouped_wgrad", "launch_memoised"),
)


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


def section_times(call, calls: int) -> list[tuple[str, int, float]]:
    """(section, calls of it a layer call, host µs a layer call) for each of :data:`SECTIONS` that ``call`` reaches,
    and the whole call first; each of ``calls`` calls behind its own GPU sleep."""
    import functools
    import importlib

    spent: dict[str, list[float]] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - start)

        return wrapper

    originals = []
    for module_name, attribute in SECTIONS:
        module = importlib.import_module(module_name)
        originals.append((module, attribute, getattr(module, attribute)))
        setattr(module, attribute, timed(f"{module_name.rsplit('.', 1)[-1]}.{attribute}", getattr(module, attribute)))
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            timed("the whole call", call)()
        torch.cuda.synchronize()
    finally:
        for module, attribute, original in originals:
            setattr(module, attribute, original)
    return [(name, len(times) // calls, sum(times) / calls * 1e6) for name, times in spent.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="model", choices=[c for c in host_time.MOE_CASES if c != "tiny"])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (0: none)")
    parser.add_argument("--sections", action="store_true", help="the host time of the layer's main functions")
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
        if args.sections:
            print(f"--- host µs a call by section (inclusive), {phase}, {args.calls} calls behind a sleep each")
            for name, count, micros in sorted(section_times(calls[phase], args.calls), key=lambda row: -row[2]):
                print(f"    {name:40s} {count:3d}× {micros:9.1f} µs")


if __name__ == "__main__":
    main()
