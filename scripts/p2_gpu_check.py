"""P2 (moe_experts_backward) Triton path on a GPU: correctness at full size, then timing.

    PYTHONPATH=. python3 scripts/p2_gpu_check.py [--cases fp32:2048,fp32:8192,bf16:2048] [--reps 7]

For each case (the benchmark's shape: H = 4096, I = 2048, E = 256, K = 8; uniform routing):
1. correctness: the fp32 reference (TF32 off; for bf16, from the bf16-rounded inputs) against the
   Triton path called with a NaN-filled allocator cache, per output: relative Frobenius error,
   the benchmark's element rule (atol 0.11, rtol 1e-5; ≥ 99% of elements), NaN/Inf;
2. memory: the peak of torch.cuda.max_memory_allocated during one call, over what was allocated
   before it (outputs included) and without the outputs (the workspace);
3. timing: the call captured in a CUDA graph; before each replay a 512 MB buffer is overwritten
   (cold L2); median (and p20/p80) of the replays, timed with CUDA events.
The floor is what the benchmark's roofline counts: every input read once and every output written
once (fp32: 51.5 GB at T = 2048), and the achieved rate is that floor over the measured time.
A full log is printed as it goes; the summary table comes last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton

import moe_lib
from moe_lib import problems, reference
from moe_lib.bench import compare_output

OUTPUT_NAMES = ("grad_hidden_states", "grad_topk_weights", "grad_gate_weights", "grad_up_weights", "grad_down_weights")
FP32_REL_LIMIT = {name: 5e-3 for name in OUTPUT_NAMES} | {"grad_topk_weights": 1e-4}
BF16_REL_LIMIT = 2e-2
COPY_BANDWIDTH_REFERENCE = 4.21e12  # B/s, device-to-device copy measured on the H200 (docs: measuring.md)


def log(message: str) -> None:
    print(message, flush=True)


ELEMENT_RULE = dict(atol=0.11, rtol=1e-5)  # the benchmark's, as reported for P2 fp32


def floor_bytes(inputs: dict) -> int:
    """Inputs read once + outputs written once (outputs have the shapes and dtypes of their inputs)."""
    read = sum(t.numel() * t.element_size() for t in inputs.values())
    written = sum(inputs[n].numel() * inputs[n].element_size()
                  for n in ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights"))  # fmt: skip
    return read + written


def measure_copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (best of 5)."""
    src = torch.empty(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 31) / best


def make_case_inputs(dtype: str, num_tokens: int, seed: int) -> dict:
    inputs = problems.make_inputs("moe_experts_backward", num_tokens, seed=seed, device="cuda")
    if dtype == "bf16":
        inputs = {k: (v.bfloat16() if v.is_floating_point() and k != "topk_weights" else v) for k, v in inputs.items()}
    return inputs


def check_correctness(inputs: dict, dtype: str) -> tuple[bool, float]:
    """Compares against the fp32 reference; returns (all checks passed, worst relative error)."""
    upcast = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    start = time.perf_counter()
    with reference.tf32_disabled():
        want = reference.moe_experts_backward_reference(*upcast.values())
    torch.cuda.synchronize()
    log(f"  reference: {time.perf_counter() - start:.2f} s")
    del upcast
    # NaN-fill a block as large as the outputs and workspace, and free it: the call allocates from it
    poison = torch.full((sum(w.numel() for w in want) + (1 << 29),), float("nan"), device="cuda")
    del poison
    start = time.perf_counter()
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    torch.cuda.synchronize()
    log(f"  triton (first call, compiles): {time.perf_counter() - start:.2f} s")
    ok, worst = True, 0.0
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        stats = compare_output(g, w, ELEMENT_RULE)
        limit = FP32_REL_LIMIT[name] if dtype == "fp32" else BF16_REL_LIMIT
        passed = stats["finite"] and stats["rel_error"] <= limit and (dtype == "bf16" or stats["pass_fraction"] >= 0.99)
        ok &= passed
        worst = max(worst, stats["rel_error"])
        log(f"  {name:20s} rel {stats['rel']:.2e} (limit {limit:.0e})  element rule {stats['pass_fraction']:.4%}"
            f"  finite {stats['finite']}  {'ok' if passed else 'FAIL'}")  # fmt: skip
    again = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    repeatable = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    log(f"  two calls bitwise equal: {repeatable}")
    return ok and repeatable, worst


def measure_memory(inputs: dict) -> tuple[float, float]:
    """(peak extra GiB incl. outputs, peak workspace GiB) of one call."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton", validate=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    outputs = sum(g.numel() * g.element_size() for g in got)
    return peak / 2**30, (peak - outputs) / 2**30


def time_graph_replays(inputs: dict, reps: int, warmup: int = 2) -> list[float]:
    """Milliseconds per replay of the captured call, L2 overwritten before each."""
    torch.cuda.empty_cache()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_lib.moe_experts_backward(*inputs.values(), impl="triton", validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = moe_lib.moe_experts_backward(*inputs.values(), impl="triton", validate=False)
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(warmup + reps):
        flush.fill_(i % 256)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    del graph, outputs, flush
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="fp32:2048,fp32:8192,bf16:2048", help="dtype:num_tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=7, help="timed replays per case (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    log(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bandwidth = measure_copy_bandwidth()
    log(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (reference figure {COPY_BANDWIDTH_REFERENCE / 1e12} TB/s)")

    rows = []
    for case in args.cases.split(","):
        dtype, num_tokens = case.split(":")
        num_tokens = int(num_tokens)
        log(f"\n== {dtype} T={num_tokens} ==")
        inputs = make_case_inputs(dtype, num_tokens, args.seed)
        ok, worst = check_correctness(inputs, dtype)
        torch.cuda.empty_cache()
        peak_gib, workspace_gib = measure_memory(inputs)
        log(f"  peak extra memory {peak_gib:.2f} GiB (workspace {workspace_gib:.2f} GiB beyond the outputs)")
        times = time_graph_replays(inputs, args.reps)
        median = statistics.median(times)
        quantiles = statistics.quantiles(times, n=5) if len(times) >= 2 else [median] * 4
        floor = floor_bytes(inputs)
        log(f"  replays (ms): {', '.join(f'{t:.2f}' for t in times)}")
        rows.append(dict(case=f"{dtype} T={num_tokens}", ms=median, p20=quantiles[0], p80=quantiles[-1],
                         floor_gb=floor / 1e9, rate=floor / (median / 1e3) / 1e9,
                         floor_fraction=floor / bandwidth / (median / 1e3), peak=peak_gib, ws=workspace_gib,
                         correct=ok, worst=worst))  # fmt: skip
        del inputs
        torch.cuda.empty_cache()

    log("\nsummary (floor = inputs read once + outputs written once; rate = floor / time; "
        "floor fraction = floor time at the measured copy bandwidth / time)")  # fmt: skip
    header = (f"{'case':16s} {'ms':>8s} {'p20':>8s} {'p80':>8s} {'floor GB':>9s} {'GB/s':>7s} {'of floor':>8s} "
              f"{'peak GiB':>8s} {'ws GiB':>7s} {'worst rel':>9s} correct")  # fmt: skip
    log(header)
    for r in rows:
        log(f"{r['case']:16s} {r['ms']:8.2f} {r['p20']:8.2f} {r['p80']:8.2f} {r['floor_gb']:9.1f} {r['rate']:7.0f} "
            f"{r['floor_fraction']:8.2f} {r['peak']:8.2f} {r['ws']:7.2f} {r['worst']:9.1e} {r['correct']}")  # fmt: skip
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
