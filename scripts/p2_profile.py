"""One call of the P2 Triton backward per case, for ncu (per-kernel time, DRAM bytes, stall reasons).

    PYTHONPATH=. ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy -k regex:"^_" python3 scripts/p2_profile.py \
        --cases fp32:2048,bf16:2048

Our kernels' names start with an underscore; ``-k regex:"^_"`` leaves out PyTorch's input generation.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from p2_gpu_check import make_case_inputs  # noqa: E402

from moe_lib.kernels.moe_experts_backward import moe_experts_backward_triton  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="fp32:2048", help="dtype:num_tokens, comma-separated")
    args = parser.parse_args()
    for case in args.cases.split(","):
        dtype, num_tokens = case.split(":")
        inputs = make_case_inputs(dtype, int(num_tokens), seed=0)
        torch.cuda.nvtx.range_push(f"{dtype}:{num_tokens}")
        moe_experts_backward_triton(*inputs.values())
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
