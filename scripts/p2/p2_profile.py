"""One call of the P2 Triton backward per case, for ncu (per-kernel time, DRAM bytes, stall reasons).

    PYTHONPATH=. ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy \
        -k regex:"^(swiglu_grad|expert_weight_grad|slot_projection|token_sum|gate_up_grad)_kernel$" \
        python3 scripts/p2/p2_profile.py --cases fp32:2048,bf16:2048

The ``-k`` filter keeps our kernels and leaves out PyTorch's input generation. A case is
``dtype:num_tokens``: the P2 problem with inputs of that dtype (fp32: moe_experts_backward, bf16: its
bf16 variant).
"""

import argparse

import torch

from moe_lib.bench.tuning import parse_case
from moe_lib.moe_experts.launch import moe_experts_backward_triton


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="fp32:2048", help="dtype:num_tokens, comma-separated")
    args = parser.parse_args()
    for case in args.cases.split(","):
        problem, num_tokens = parse_case(case)
        inputs = problem.make_inputs(num_tokens, seed=0, device="cuda")
        torch.cuda.nvtx.range_push(case)
        moe_experts_backward_triton(*inputs.values())
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
