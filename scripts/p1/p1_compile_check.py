"""Compile P1's kernels for sm_90 without a GPU and report registers, stack and shared memory.

    PYTHONPATH=. python scripts/p1/p1_compile_check.py [--precision faithful|fast] [--shape T,H,I] [CANDIDATE ...]

Candidates are the named configured designs of ``moe_lib.bench.tuning.P1_CANDIDATES`` and "default", the chooser's
own design for the shape on an H200 (default: all of them); each is compiled as it would launch for a call of that
shape with bf16 inputs (:mod:`moe_lib.bench.p1_compile`), each distinct kernel once; then the ``swiglu_expert``
layer's elementwise step (forward and backward forms). Needs only the triton wheel (its ptxas and cuobjdump); a
spill shows as a non-zero STACK, a kernel needing more shared memory than an SM has is named, and so is ptxas's
serialisation of the wgmma (each waiting for the one before) where it happens.
"""

import argparse

import torch

from moe_lib.bench.p1_compile import activation_launches, compile_launch, launches
from moe_lib.bench.sm90 import first_error_line, over_limit, resources, wgmma_serialized
from moe_lib.bench.tuning import P1_CANDIDATES
from moe_lib.swiglu_down.checks import PRECISIONS
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.runtime import Device, carries_low_halves

H200 = Device("cuda", 132, 232448, (9, 0), "H200")


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
    for name in args.candidates or names:
        design = default if name == "default" else P1_CANDIDATES[name]
        for launch in launches(design, T, H, I, with_lo=with_lo):
            by_launch.setdefault(launch, []).append(name)
    print(f"T = {T}, H = {H}, I = {I}, bf16, {args.precision}; default: {default.name}", flush=True)
    for launch, candidates in by_launch.items():
        try:
            compiled = compile_launch(launch)
            report = f"{resources(compiled)}{over_limit(compiled)} wgmma serialised: {wgmma_serialized(compiled)}"
        except Exception as exc:  # report and go on with the other kernels
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{launch.name:36s} {report}  ({', '.join(candidates)})", flush=True)
    for launch, form in zip(activation_launches(T, I), ("forward", "backward"), strict=True):
        try:
            report = resources(compile_launch(launch))
        except Exception as exc:  # report it
            report = "FAIL " + first_error_line(exc, 120)
        print(f"{'activation ' + form:36s} {report}", flush=True)


if __name__ == "__main__":
    main()
