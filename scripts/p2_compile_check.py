"""Compile the P2 Triton kernels for sm_90 without a GPU and report registers, stack and shared memory.

    python scripts/p2_compile_check.py [--dtype fp32|bf16] [--tokens 2048] [FIELD=VALUE ...]

FIELD=VALUE overrides a field of the LaunchConfig that ``launch_config`` picks (e.g. block_m=32).
Needs only the triton wheel (its ptxas and cuobjdump); a spill shows as a non-zero STACK.
"""

import argparse
import dataclasses
import os
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(__file__))
from p1_compile_check import resources  # noqa: E402

from moe_lib.kernels import moe_experts_backward as kernels  # noqa: E402

INT_POINTERS = ("sorted_slot_ptr", "expert_offsets_ptr")
SIZE_ARGS = ("hidden_size", "inter_size", "num_slots", "size_m", "size_n", "stride_i")
FP32_POINTERS = ("topk_partial_ptr", "dx_slot_ptr", "topk_weights_ptr")
OPERAND_POINTERS = ("x_hi_ptr", "x_lo_ptr", "dy_hi_ptr", "dy_lo_ptr", "dgate_ptr", "dup_ptr", "scaled_act_ptr")


def compile_for_hopper(kernel, constexprs: dict, input_type: str, warps: int, stages: int):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in FP32_POINTERS or name == "out_slot_ptr":
            signature[name] = "*fp32"
        elif name in OPERAND_POINTERS or name in ("a_ptr", "a2_ptr", "b_ptr", "rows1_ptr", "rows2_ptr", "x_ptr"):
            signature[name] = "*bf16"
        elif name.endswith("_ptr"):
            signature[name] = input_type
        elif name == "stride_h":  # kernel D's backward: Wgᵀ, Wuᵀ (1 is specialised away)
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr") or n in SIZE_ARGS]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def parse_field(text: str) -> tuple[str, object]:
    """FIELD=VALUE with VALUE an int, or ints joined by x for a tile (grad_down_tile=128x256x64)."""
    name, _, value = text.partition("=")
    return name, tuple(int(v) for v in value.split("x")) if "x" in value else int(value)


def tile_sizes(tile) -> dict:
    return dict(BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_ROWS=tile[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("overrides", nargs="*", help="FIELD=VALUE")
    args = parser.parse_args()
    config = kernels.launch_config(args.tokens * 8, 256, input_bytes=4 if args.dtype == "fp32" else 2)
    config = dataclasses.replace(config, **dict(parse_field(o) for o in args.overrides))
    print(config)
    input_type, split = ("*fp32", True) if args.dtype == "fp32" else ("*bf16", False)
    common = dict(INTERPRETER=False)
    g_tile = config.gate_up_dx_tile
    launches = {
        "A": (kernels._swiglu_grad_kernel, dict(OPERAND_DTYPE=tl.bfloat16, SPLIT_PRECISION=split, FORWARD_ONLY=False,
                                                BLOCK_I=config.block_i, BLOCK_M=config.block_m, BLOCK_H=config.block_h),
              config.warps_a, config.stages_a),
        "W dWg,dWu": (kernels._expert_weight_grad_kernel,
                      dict(A_BY_TOKEN=False, B_BY_TOKEN=True, TWO_OUTPUTS=True, **tile_sizes(config.grad_gate_up_tile)),
                      config.warps_gu, config.stages_gu),
        "W dWd": (kernels._expert_weight_grad_kernel,
                  dict(A_BY_TOKEN=True, B_BY_TOKEN=False, TWO_OUTPUTS=False, **tile_sizes(config.grad_down_tile)),
                  config.warps_dn, config.stages_dn),
        "G": (kernels._gate_up_grad_kernel,
              dict(OPERAND_DTYPE=tl.bfloat16, BLOCK_I=g_tile[0], BLOCK_H=g_tile[1], BLOCK_ROWS=g_tile[2]),
              config.warps_g, config.stages_g),
        "D": (kernels._slot_projection_kernel, dict(TWO_TERMS=True, OPERAND_DTYPE=tl.bfloat16,
                                                    BLOCK_H=config.block_h_dx, BLOCK_M=config.block_m,
                                                    BLOCK_I=config.block_i_dx),
              config.warps_d, config.stages_d),
    }  # fmt: skip
    for name, (kernel, constexprs, warps, stages) in launches.items():
        try:
            report = resources(compile_for_hopper(kernel, common | constexprs, input_type, warps, stages))
        except Exception as exc:  # report and go on with the other kernels
            report = "FAIL " + str(exc).strip().splitlines()[-1][:160]
        print(f"kernel {name:10s}: {report}")


if __name__ == "__main__":
    main()
