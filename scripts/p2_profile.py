"""One call of the P2 Triton backward per case, for ncu (per-kernel time, DRAM bytes, stall reasons).

    PYTHONPATH=. ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy -k regex:_kernel python3 scripts/p2_profile.py \
        --cases fp32:2048,bf16:2048

Each case is called twice (the first call compiles); ``--skip-first`` in ncu terms is
``--launch-skip`` over the routing and compile launches, so profile the last launch of each
kernel name (``--launch-skip`` / ``-c``) or all of them.
"""

import argparse

import torch

from moe_lib import problems
from moe_lib.kernels.moe_experts_backward import moe_experts_backward_triton


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="fp32:2048", help="dtype:num_tokens, comma-separated")
    args = parser.parse_args()
    for case in args.cases.split(","):
        dtype, num_tokens = case.split(":")
        inputs = problems.make_inputs("moe_experts_backward", int(num_tokens), seed=0, device="cuda")
        if dtype == "bf16":
            inputs = {k: (v.bfloat16() if v.is_floating_point() and k != "topk_weights" else v)
                      for k, v in inputs.items()}  # fmt: skip
        torch.cuda.nvtx.range_push(f"{dtype}:{num_tokens}")
        moe_experts_backward_triton(*inputs.values())
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
