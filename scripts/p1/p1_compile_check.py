"""Compile P1's kernels for sm_90 without a GPU and report registers, stack and shared memory.

    PYTHONPATH=. python scripts/p1/p1_compile_check.py [--precision faithful|fast] [--shape T,H,I] [CANDIDATE ...]

Candidates are the named configured designs of ``moe_lib.bench.tuning.P1_CANDIDATES`` and "default", the chooser's
own design for the shape on an H200 (default: all of them); each is compiled as it would launch for a call of that
shape with bf16 inputs (:mod:`moe_lib.bench.p1_compile`; the engine design's three launches from the calls it makes,
:func:`engine_launches`), each distinct kernel once; then the ``swiglu_expert`` layer's elementwise step (forward
and backward forms). Needs only the triton wheel (its ptxas and cuobjdump); a
spill shows as a non-zero STACK, a kernel needing more shared memory than an SM has is named, and so is ptxas's
serialisation of the wgmma (each waiting for the one before) where it happens.
"""

import argparse
import dataclasses

import torch

from moe_lib.bench.p1_compile import activation_launches, compile_launch, launches
from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, over_limit, resources, wgmma_serialized
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.swiglu_down.checks import PRECISIONS
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.designs import EngineDesign
from moe_lib.swiglu_down.runtime import Device, carries_low_halves

H200 = Device("cuda", 132, 232448, (9, 0), "H200")
POINTERS = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}


def engine_launches(design: EngineDesign, T: int, H: int, I: int) -> dict:
    """The engine design's Gluon launches for a bf16 call of this shape on the H200, as its ``calls`` makes them on
    meta tensors: {(kernel name, config but its grid, compile-time values): (label, kernel, run-time arguments,
    compile-time values, config)}, the run-time arguments as the engine's launcher makes them (descriptors; pointers
    and scalars as types). A config's ``programs`` is the grid alone, no part of the compiled kernel."""
    from moe_lib.bench.p1_compile import meta_inputs
    from moe_lib.engine import grouped_gemm, grouped_wgrad
    from moe_lib.swiglu_down.backward import allocate_outputs

    inputs = meta_inputs(T, H, I, torch.bfloat16)
    found = {}
    for call in design.calls(inputs, allocate_outputs(inputs.x, I), sms=H200.sms):
        arguments = dict(call.arguments)
        if call.kind == "gemm":  # grouped_gemm's own steps: its checks, the outputs it allocates, its arguments
            a, b, offsets = arguments.pop("a"), arguments.pop("b"), arguments.pop("offsets")
            epilogue = arguments.pop("epilogue", "none")
            saved = arguments.get("gate_sigmoid") is not None  # dswiglu reading the saved σ and silu
            config = arguments.pop("config", None) or grouped_gemm.default_config(epilogue, saved)
            b_transposed = grouped_gemm.check_arguments(
                a, b, offsets, epilogue=epilogue, b_transposed=arguments.pop("b_transposed"), config=config, **arguments
            )
            n = grouped_gemm.output_width(b, b_transposed, epilogue)
            tensors = grouped_gemm.with_defaults(epilogue, arguments, a.shape[0], n, a)
            run_time, constexprs = grouped_gemm.launch_arguments(
                config, a, b, offsets, epilogue, b_transposed, **tensors
            )
            kernel, label = grouped_gemm.grouped_gemm_kernel, f"engine gemm {epilogue}"
        else:
            config = arguments["config"]
            grouped_wgrad.check_arguments(
                arguments["problems"], arguments["offsets"], outs=arguments["outs"], config=config
            )
            run_time, constexprs = grouped_wgrad.launch_arguments(
                config, arguments["problems"], arguments["offsets"], arguments["outs"]
            )
            kernel, label = grouped_wgrad.grouped_wgrad_kernel, "engine weight_grad"
        for name, value in list(run_time.items()):  # pointers and scalars as the JIT specialises them
            if isinstance(value, torch.Tensor):
                run_time[name] = POINTERS[value.dtype]
            elif value == 1:  # an integer equal to 1 (num_experts here) is compiled in as a constant
                constexprs[name] = run_time.pop(name)
            elif isinstance(value, int):
                run_time[name] = "i32"
        label += f" {config.block_m}x{config.block_n}x{config.block_k} s{config.stages}"
        key = (kernel.__name__, dataclasses.replace(config, programs=0), tuple(sorted(constexprs.items())))
        found[key] = (label, kernel, run_time, constexprs, config)
    return found


def shape(text: str) -> tuple[int, int, int]:
    try:
        T, H, I = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,H,I (three integers), got {text!r}") from None
    return T, H, I


def main():
    names = ["default", *P1_CANDIDATES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default=PRECISIONS[0], choices=PRECISIONS)
    parser.add_argument(
        "--shape",
        type=shape,
        default=(4096, 2048, 768),
        metavar="T,H,I",
        help="the call's tokens, hidden and intermediate size (default: 4096,2048,768)",
    )
    parser.add_argument("candidates", nargs="*", metavar="CANDIDATE", help=f"default: all of {', '.join(names)}")
    args = parser.parse_args()
    unknown = [name for name in args.candidates if name not in names]
    if unknown:
        parser.error(f"CANDIDATE: {unknown} are not candidates ({', '.join(names)})")
    T, H, I = args.shape
    with_lo = carries_low_halves(torch.bfloat16, args.precision)
    default = choose_design(T, H, I, dtype=torch.bfloat16, precision=args.precision, device=H200)
    by_launch = {}  # each distinct kernel once, with the candidates that launch it
    by_engine_launch = {}  # the engine design's likewise, by (kernel, config, compile-time values)
    skipped = []
    for name in args.candidates or names:
        design = default if name == "default" else P1_CANDIDATES[name]
        if isinstance(design, EngineDesign):
            if with_lo:  # its run refuses the faithful path
                skipped.append(name)
                continue
            for key, launch in engine_launches(design, T, H, I).items():
                by_engine_launch.setdefault(key, (launch, []))[1].append(name)
            continue
        for launch in launches(design, T, H, I, with_lo=with_lo):
            by_launch.setdefault(launch, []).append(name)
    print(f"T = {T}, H = {H}, I = {I}, bf16, {args.precision}; default: {default.name}", flush=True)
    if skipped:
        print(f"not compiled, the fast path only: {', '.join(skipped)}", flush=True)
    for launch, candidates in by_launch.items():
        try:
            compiled = compile_launch(launch)
            report = f"{resources(compiled)}{over_limit(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
        except Exception as exc:  # report and go on with the other kernels
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{launch.name:36s} {report}  ({', '.join(candidates)})", flush=True)
    for (label, kernel, run_time, constexprs, config), candidates in by_engine_launch.values():
        try:
            compiled = compile_gluon_for_sm90(kernel, run_time, constexprs, warps=config.warps, maxnreg=config.maxnreg)
            report = f"{resources(compiled)}{over_limit(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
        except Exception as exc:  # report and go on with the other kernels
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{label:36s} {report}  ({', '.join(candidates)})", flush=True)
    for launch, form in zip(activation_launches(T, I), ("forward", "backward"), strict=True):
        try:
            report = resources(compile_launch(launch))
        except Exception as exc:  # report it
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{'activation ' + form:36s} {report}", flush=True)


if __name__ == "__main__":
    main()
