"""The expert-parallel layer's sum over each token's K combined rows, alone on one GPU: three ways.

    PYTHONPATH=. python scripts/parallel/slot_sum_bench.py [--tokens 2048,8192,32768] [--dtypes bfloat16,float32]

Per token count T and dtype, at P2's shape (H 4096, K 8), rows [T·K, H] in a random send order:
- ``scatter_sum``: the rows scattered into slot order, summed over K in fp32, cast back (the layer before
  ``moe_lib.moe_experts.slot_sum``);
- ``gather_sum``: the rows gathered into slot order and summed (``sum_slot_rows_reference``);
- ``kernel``: ``sum_slot_rows_triton``, each row read once where it lies.
Each is checked against the float64 sum (within two roundings of the dtype), then timed by CUDA-graph replay after
an L2 flush (median of 30). Prints one table of ms; with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from moe_lib.bench import timing
from moe_lib.bench.cli import token_list
from moe_lib.bench.provenance import recorded_commit
from moe_lib.bench.tuning import write_out
from moe_lib.moe_experts.slot_sum import sum_slot_rows_reference, sum_slot_rows_triton

HIDDEN_SIZE, TOP_K = 4096, 8
DTYPES = ("bfloat16", "float32", "float16")


def scatter_sum(rows, send_slot, num_tokens, top_k):
    by_slot = torch.empty_like(rows)
    by_slot[send_slot] = rows
    return by_slot.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(rows.dtype)


def time_case(dtype_name: str, num_tokens: int, flush) -> list[dict]:
    """Every variant checked against the float64 sum, then timed: one result row each."""
    dtype, slots = getattr(torch, dtype_name), num_tokens * TOP_K
    rows = torch.randn((slots, HIDDEN_SIZE), device="cuda").to(dtype)
    send_slot = torch.randperm(slots, device="cuda")  # send row i holds slot send_slot[i]
    row_of_slot = torch.empty_like(send_slot)
    row_of_slot[send_slot] = torch.arange(slots, device="cuda")
    exact = rows.double()[row_of_slot].view(num_tokens, TOP_K, HIDDEN_SIZE).sum(dim=1)
    bound = (2.0**-7 if dtype != torch.float32 else 2.0**-22) * exact.abs() + 1e-5
    variants = {
        "scatter_sum": lambda: scatter_sum(rows, send_slot, num_tokens, TOP_K),
        "gather_sum": lambda: sum_slot_rows_reference(rows, row_of_slot, num_tokens, TOP_K),
        "kernel": lambda: sum_slot_rows_triton(rows, row_of_slot, num_tokens, TOP_K),
    }
    results = []
    for name, run in variants.items():
        out = run()
        correct = bool(((out.double() - exact).abs() <= bound).all()) and not bool(out.isnan().any())
        median = timing.time_graph(run, flush)["median_ms"]
        results.append(dict(dtype=dtype_name, tokens=num_tokens, variant=name, ms=median, correct=correct))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=token_list, default=[2048, 8192, 32768])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    unknown = [name for name in dtypes if name not in DTYPES]
    if unknown or not dtypes:
        parser.error(f"--dtypes: expected a comma list of {', '.join(DTYPES)}, got {args.dtypes!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the kernel and the timing run there)")
    flush = timing.L2Flusher(torch.device("cuda"))
    results = [
        row for dtype_name in dtypes for num_tokens in args.tokens for row in time_case(dtype_name, num_tokens, flush)
    ]
    frame = pd.DataFrame(results)
    print(frame.pivot_table(index=["dtype", "tokens"], columns="variant", values="ms", sort=False).round(3))
    print("all correct:", bool(frame["correct"].all()))
    write_out(
        "slot_sum_bench.json",
        dict(
            what="slot_sum_bench",
            commit=recorded_commit(),
            command="python scripts/parallel/slot_sum_bench.py",
            gpu=torch.cuda.get_device_name(),
            rows=results,
        ),
    )


if __name__ == "__main__":
    main()
