"""Compile the P1 Triton launches for sm_90 without a GPU and report registers, stack and shared memory.

    PYTHONPATH=. python scripts/p1_compile_check.py [--precision faithful|fast] [candidate names]

Candidates are the two-launch tile configurations of ``moe_lib.bench.tuning.P1_CANDIDATES`` (default:
all of them), compiled for bf16 inputs, and its chained launches (``chained.py``: both launches' tiles in one
kernel); then the TMA-fed launches (``tma_launches.py``) of the
candidates that have them, launch 2 in Gluon (``gluon_launch2.py``, its default tiles), and the ``swiglu_expert``
layer's elementwise step (``swiglu_activation_kernel``,
forward and backward forms). Needs only the triton wheel (its ptxas and
cuobjdump); a spill shows as a non-zero STACK, and ptxas's serialisation of the wgmma (each waiting for the one
before) is named where it happens.
"""

import argparse

import torch

from moe_lib.bench.sm90 import (
    compile_for_sm90,
    compile_gluon_for_sm90,
    constexpr_names,
    first_error_line,
    over_limit,
    resources,
    runtime_names,
    wgmma_serialized,
)
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.swiglu_down import chained, gluon_launch1, gluon_launch2, kernels, tma_launches
from moe_lib.swiglu_down.chained import ChainedConfig
from moe_lib.swiglu_down.checks import PRECISIONS
from moe_lib.swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
from moe_lib.swiglu_down.gluon_launch2 import GluonSecondLaunchConfig
from moe_lib.swiglu_down.launch import ACTIVATION_BLOCK, TileConfig, carries_low_halves

# each launch's kernel, and the prefix of its constexprs -> the TileConfig field with (M, N, K, SPLIT)
LAUNCHES = (
    (kernels.d_intermediate_and_grad_down_kernel, {"DA": "d_intermediate", "DWD": "grad_down"}),
    (kernels.grad_x_and_grad_gate_up_kernel, {"DX": "grad_x", "DW": "grad_gate_up"}),
)


def pointer_type(name: str) -> str:
    """The Triton type of a pointer argument: fp32 split-K partials, int32 counters, bf16 tensors."""
    if name.endswith("partials_ptr"):
        return "*fp32"
    if name.endswith("counters_ptr"):
        return "*i32"
    if name == "tickets_ptr":
        return "*i64"
    return "*bf16"


def compile_launch(kernel, tiles: dict, config: TileConfig, launch: int, with_lo: bool, warps_stages=None,
                   extra_constants=None):  # fmt: skip
    """Compiles one of the two launches under ``config`` (bf16 inputs, as the GPU runs them); ``warps_stages``
    overrides the launch's and ``extra_constants`` adds constexprs (the chained launch's own)."""
    constants = dict(GROUP_M=config.group_m, UPCAST=False, PRECISION="tf32", WITH_LO=with_lo,
                     GRAD_X_FIRST=config.grad_x_first) | (extra_constants or {})
    for prefix, field in tiles.items():
        constants.update(zip((f"{prefix}_M", f"{prefix}_N", f"{prefix}_K", f"{prefix}_SPLIT"), getattr(config, field),
                             strict=True))  # fmt: skip
    constexprs = {name: constants[name] for name in constexpr_names(kernel) if name in constants}
    types = {name: pointer_type(name) if name.endswith("_ptr") else "i32" for name in runtime_names(kernel)}
    # as the GPU specialises them at the benchmark's shapes: pointers, H, I and T·I (lo_offset) divisible by 16
    aligned = [name for name in runtime_names(kernel) if name.endswith("_ptr") or name in ("H", "I", "lo_offset")]
    warps, stages = warps_stages or (config.warps[launch], config.stages[launch])
    return compile_for_sm90(kernel, types, constexprs, aligned, warps=warps, stages=stages)


def compile_tma_launch(launch: int, config, with_lo: bool):
    """A TMA-fed launch (1 or 2) under ``config`` (bf16 inputs, 132 programs); its PTX must hold TMA copies."""
    if launch == 1:
        kernel = tma_launches.tma_d_intermediate_and_grad_down_kernel
        tiles = {"DA": config.da_tile, "DWD": config.dwd_tile}
    else:
        kernel = tma_launches.tma_grad_x_and_grad_gate_up_kernel
        tiles = {"DX": config.dx_tile, "DW": config.dw_tile}
    types = {name: pointer_type(name) if name.endswith("_ptr") else "i32" for name in runtime_names(kernel)}
    constexprs = {f"{prefix}_{axis}": size
                  for prefix, tile in tiles.items() for axis, size in zip("MNK", tile, strict=True)}  # fmt: skip
    constexprs.update(GROUP_M=config.group_m, NUM_PROGRAMS=132 if config.persistent else 0, UPCAST=False,
                      PRECISION="tf32", WITH_LO=with_lo)
    aligned = [name for name in runtime_names(kernel) if name.endswith("_ptr") or name in ("H", "I", "lo_offset")]
    compiled = compile_for_sm90(kernel, types, constexprs, aligned, warps=config.warps, stages=config.stages)
    if "cp.async.bulk.tensor" not in compiled.asm["ptx"]:
        raise RuntimeError("no TMA copy in the PTX")
    return compiled


def compile_gluon_second_launch(config, with_lo: bool, num_tokens: int = 256):
    """Launch 2 in Gluon (:mod:`.gluon_launch2`) under ``config`` for bf16 operands at H = 2048, I = 768: its
    descriptors' types taken from descriptors on CPU tensors of those shapes."""
    T, H, I = num_tokens, 2048, 768
    x = torch.empty((T, H), dtype=torch.bfloat16)
    weight = torch.empty((I, H), dtype=torch.bfloat16)
    halves = torch.empty((2 if with_lo else 1, T, I), dtype=torch.bfloat16)
    kernel = gluon_launch2.second_launch_kernel
    names = [name for name in kernel.arg_names if name.endswith("_desc")]
    intermediate, down_weight = torch.empty((T, I), dtype=torch.bfloat16), torch.empty((H, I), dtype=torch.bfloat16)
    descs = config.descriptors(x, weight, weight, halves, halves, x, weight, weight, x, intermediate, down_weight)
    arguments = dict(zip(names, descs, strict=True)) | dict(T="i32", I="i32", dx_partials_ptr="*fp32",
                                                            dx_counters_ptr="*i32", trace_ptr="*i32")  # fmt: skip
    return compile_gluon_for_sm90(kernel, arguments, config.constexprs(with_lo) | dict(num_warps=config.warps),
                                  warps=config.warps, maxnreg=config.maxnreg)  # fmt: skip


def compile_gluon_first_launch(config, with_lo: bool, num_tokens: int = 256):
    """Launch 1 in Gluon (:mod:`.gluon_launch1`) under ``config`` for bf16 operands at H = 2048, I = 768: its
    descriptors' types taken from descriptors on CPU tensors of those shapes."""
    T, H, I = num_tokens, 2048, 768
    grad_output = torch.empty((T, H), dtype=torch.bfloat16)
    down_weight = torch.empty((H, I), dtype=torch.bfloat16)
    intermediate = torch.empty((T, I), dtype=torch.bfloat16)
    halves = torch.empty((2 if with_lo else 1, T, I), dtype=torch.bfloat16)
    if config.pingpong_programs:  # the pingpong form: its own kernel, I compiled in
        kernel = gluon_launch1.pingpong_first_launch_kernel
        values = config.pingpong_arguments(grad_output, down_weight, intermediate, intermediate, intermediate,
                                           intermediate, halves, halves, None, False, with_lo)  # fmt: skip
        names = [name for name in kernel.arg_names if name != "num_warps"]
        arguments = {name: value for name, value in zip(names, values, strict=True) if name.endswith("_desc")}
        arguments |= dict.fromkeys(["gate_ptr", "gate_sigmoid_ptr", "gate_silu_ptr", "up_ptr"], "*bf16")
        after_t = names.index("T") + 1  # the compile-time values come after T
        constexprs = dict(zip(names[after_t:], values[after_t:], strict=True)) | dict(num_warps=4)
        return compile_gluon_for_sm90(kernel, arguments | dict(trace_ptr="*i64", T="i32"), constexprs, warps=4,
                                      maxnreg=config.maxnreg)  # fmt: skip
    kernel = gluon_launch1.first_launch_kernel
    descs = config.descriptors(grad_output, down_weight, intermediate, intermediate, intermediate, intermediate,
                               intermediate, halves, halves, down_weight)  # fmt: skip
    names = [name for name in kernel.arg_names if name.endswith("_desc")]
    arguments = dict(zip(names, descs, strict=True)) | dict(T="i32", I="i32", d_a_partials_ptr="*fp32",
                                                            d_a_counters_ptr="*i32", trace_ptr="*i32")  # fmt: skip
    return compile_gluon_for_sm90(kernel, arguments, config.constexprs(with_lo) | dict(num_warps=config.warps),
                                  warps=config.warps, maxnreg=config.maxnreg)  # fmt: skip


def main():
    two_launch = [name for name, config in P1_CANDIDATES.items() if isinstance(config, TileConfig | ChainedConfig)]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default=PRECISIONS[0], choices=PRECISIONS)
    parser.add_argument("candidates", nargs="*", metavar="CANDIDATE",
                        help=f"two-launch candidates (default: all): {', '.join(two_launch)}")  # fmt: skip
    args = parser.parse_args()
    unknown = [name for name in args.candidates if name not in two_launch]
    if unknown:
        parser.error(f"CANDIDATE: {unknown} are not two-launch candidates ({', '.join(two_launch)})")
    with_lo = carries_low_halves(torch.bfloat16, args.precision)
    for name in args.candidates or two_launch:
        config = P1_CANDIDATES[name]
        if isinstance(config, ChainedConfig):
            tiles = {prefix: field for _, fields in LAUNCHES for prefix, field in fields.items()}
            try:
                compiled = compile_launch(chained.chained_kernel, tiles, config.tiles, 0, with_lo,
                                          (config.warps, config.stages),
                                          {"GRAD_DOWN_FIRST": config.grad_down_first,
                                           "GRAD_DOWN_LAST": config.grad_down_last})  # fmt: skip
                report = f"{resources(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
            except Exception as exc:  # report and go on with the other candidates
                report = "FAIL " + first_error_line(exc, 120)
            print(f"{name:12s} chained: {report}", flush=True)
            continue
        report = []
        for launch, (kernel, tiles) in enumerate(LAUNCHES):
            try:
                compiled = compile_launch(kernel, tiles, config, launch, with_lo)
                serialised = wgmma_serialized(compiled)
                report.append(resources(compiled) + ("" if serialised == "no" else f" wgmma {serialised}"))
            except Exception as exc:  # report and go on with the other candidates
                report.append("FAIL " + first_error_line(exc, 120))
        print(f"{name:12s} launch1: {report[0]:40s} launch2: {report[1]}", flush=True)
    for name in args.candidates or two_launch:
        if isinstance(P1_CANDIDATES[name], ChainedConfig):
            continue
        for launch, tma in enumerate((P1_CANDIDATES[name].tma_first_launch, P1_CANDIDATES[name].tma_second_launch), 1):
            if tma is None:
                continue
            try:
                compiled = compile_tma_launch(launch, tma, with_lo)
                report = f"{resources(compiled)}{over_limit(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
            except Exception as exc:  # report and go on
                report = "FAIL " + first_error_line(exc, 120)
            print(f"{name:12s} TMA launch{launch}: {report}", flush=True)
    # the Gluon launches: their default tiles and those the candidates name
    gluon_configs = {("launch2", GluonSecondLaunchConfig()), ("launch1", GluonFirstLaunchConfig())}
    for name in args.candidates or two_launch:
        tiles = P1_CANDIDATES[name]
        if isinstance(tiles, TileConfig):
            gluon_configs |= {(launch, config) for launch, config in (("launch2", tiles.gluon_second_launch),
                                                                      ("launch1", tiles.gluon_first_launch)) if config}
    for launch, config in sorted(gluon_configs, key=repr):
        compile_gluon = compile_gluon_second_launch if launch == "launch2" else compile_gluon_first_launch
        try:
            compiled = compile_gluon(config, with_lo)
            report = f"{resources(compiled)}{over_limit(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
        except Exception as exc:  # report and go on
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{'gluon':12s} {launch}: {report}  {config}", flush=True)
    kernel = kernels.swiglu_activation_kernel
    types = {name: "*bf16" if name.endswith("_ptr") else "i32" for name in runtime_names(kernel)}
    for with_saved in (False, True):
        constexprs = dict(WITH_SAVED=with_saved, INTERPRETER=False, BLOCK=ACTIVATION_BLOCK)
        try:
            report = resources(compile_for_sm90(kernel, types, constexprs, list(types), warps=4, stages=1))
        except Exception as exc:  # report it
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{'activation':12s} {'backward' if with_saved else 'forward':8s}: {report}", flush=True)


if __name__ == "__main__":
    main()
