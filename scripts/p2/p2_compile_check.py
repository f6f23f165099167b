"""Compile the P2 Triton kernels for sm_90 without a GPU and report registers, stack and shared memory.

    PYTHONPATH=. python scripts/p2/p2_compile_check.py [--dtype fp32|bf16] [--tokens 2048] [--split] [FIELD=VALUE ...]

FIELD=VALUE overrides a field of the LaunchConfig that ``launch_config`` picks (e.g. block_m=32). ``--split``
(fp32): kernel A storing the lo halves of dg, du and aw and the pointer-based kernel W multiplying bf16×3, the
form the chooser takes where the weight gradients would leave the element rule (notes/p2/fp32-precision-rule.md).
Needs only the triton wheel (its ptxas and cuobjdump); a spill shows as a non-zero STACK.
"""

import argparse

import triton.language as tl

from moe_lib import problems
from moe_lib.bench.sm90 import compile_for_sm90, first_error_line, resources, runtime_names
from moe_lib.bench.tuning import parse_field, replace_fields
from moe_lib.moe_experts import kernels
from moe_lib.moe_experts.choose import launch_config
from moe_lib.moe_experts.launch import PREACT_COMPUTED

INT_POINTERS = ("sorted_slot_ptr", "expert_offsets_ptr")
SIZE_ARGS = ("hidden_size", "inter_size", "num_slots", "size_m", "size_n", "stride_i")
FP32_POINTERS = ("topk_partial_ptr", "dx_slot_ptr", "topk_weights_ptr", "out_slot_ptr")
OPERAND_POINTERS = (
    "x_hi_ptr",
    "x_lo_ptr",
    "dy_hi_ptr",
    "dy_lo_ptr",
    "dgate_ptr",
    "dup_ptr",
    "scaled_act_ptr",
    "dgate_lo_ptr",
    "dup_lo_ptr",
    "scaled_act_lo_ptr",
    "a_ptr",
    "a2_ptr",
    "b_ptr",
    "a_lo_ptr",
    "a2_lo_ptr",
    "b_lo_ptr",
    "rows1_ptr",
    "rows2_ptr",
)


def argument_type(name: str, input_type: str) -> str:
    """The Triton type of a run-time argument: int32 routing, fp32 workspaces, bf16 operands, the input
    dtype for the other tensors (weights, gradients), i32 for sizes."""
    if name in INT_POINTERS:
        return "*i32"
    if name in FP32_POINTERS:
        return "*fp32"
    if name in OPERAND_POINTERS:
        return "*bf16"
    return input_type if name.endswith("_ptr") else "i32"


def compile_kernel(kernel, constexprs: dict, input_type: str, warps: int, stages: int):
    constexprs = dict(constexprs, INTERPRETER=False)
    if "stride_h" in runtime_names(kernel):  # kernel D's backward: Wgᵀ, Wuᵀ (1 is specialised away)
        constexprs["stride_h"] = 1
    types = {name: argument_type(name, input_type) for name in runtime_names(kernel)}
    aligned = [name for name in runtime_names(kernel) if name.endswith("_ptr") or name in SIZE_ARGS]
    return compile_for_sm90(kernel, types, constexprs, aligned, warps=warps, stages=stages)


def tile_sizes(tile) -> dict:
    return dict(BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_ROWS=tile[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--split", action="store_true", help="kernel W's bf16×3 products (fp32 only)")
    parser.add_argument("overrides", nargs="*", help="FIELD=VALUE")
    args = parser.parse_args()
    if args.split and args.dtype != "fp32":
        parser.error("--split: bf16×3 splits fp32 inputs only; add --dtype fp32")
    sizes = problems.load("moe_experts_backward").sizes(args.tokens)
    input_bytes = 4 if args.dtype == "fp32" else 2
    base = launch_config(
        args.tokens * sizes["top_k"], sizes["num_experts"], input_bytes=input_bytes, split_weight_grads=args.split
    )
    try:
        config = replace_fields(base, dict(parse_field(text) for text in args.overrides))
    except ValueError as exc:
        parser.error(f"overrides: {exc}")
    print(config)
    input_type, split = ("*fp32", True) if args.dtype == "fp32" else ("*bf16", False)
    launches = {
        "A": (
            kernels.swiglu_grad_kernel,
            dict(
                OPERAND_DTYPE=tl.bfloat16,
                SPLIT_PRECISION=split,
                FORWARD_ONLY=False,
                PREACT=PREACT_COMPUTED,
                STORE_LO=args.split,
                BLOCK_I=config.block_i,
                BLOCK_M=config.block_m,
                BLOCK_H=config.block_h,
            ),
            config.warps_a,
            config.stages_a,
        ),
        "W dWg,dWu": (
            kernels.expert_weight_grad_kernel,
            dict(
                A_BY_TOKEN=False,
                B_BY_TOKEN=True,
                TWO_OUTPUTS=True,
                SPLIT=args.split,
                **tile_sizes(config.grad_gate_up_tile),
            ),
            config.warps_gu,
            config.stages_gu,
        ),
        "W dWd": (
            kernels.expert_weight_grad_kernel,
            dict(
                A_BY_TOKEN=True,
                B_BY_TOKEN=False,
                TWO_OUTPUTS=False,
                SPLIT=args.split,
                **tile_sizes(config.grad_down_tile),
            ),
            config.warps_dn,
            config.stages_dn,
        ),
        "D": (
            kernels.slot_projection_kernel,
            dict(
                TWO_TERMS=True,
                OPERAND_DTYPE=tl.bfloat16,
                BLOCK_H=config.block_h_dx,
                BLOCK_M=config.block_m,
                BLOCK_I=config.block_i_dx,
            ),
            config.warps_d,
            config.stages_d,
        ),
    }
    for name, (kernel, constexprs, warps, stages) in launches.items():
        try:
            report = resources(compile_kernel(kernel, constexprs, input_type, warps, stages))
        except Exception as exc:  # report and go on with the other kernels
            report = "FAIL " + first_error_line(exc)
        print(f"kernel {name:10s}: {report}", flush=True)


if __name__ == "__main__":
    main()
