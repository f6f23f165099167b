"""Compile the P1 Triton launches for sm_90 without a GPU and report registers, stack and shared memory.

    python scripts/p1_compile_check.py [candidate names from p1_tune.CANDIDATES]

Needs only the triton wheel (its ptxas and cuobjdump); a spill shows as a non-zero STACK.
"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(__file__))
from p1_tune import CANDIDATES  # noqa: E402

from moe_lib.kernels import swiglu_down_backward as kernels  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_for_hopper(kernel, kinds, warps, stages, group_m):
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name.endswith("partials_ptr"):
            signature[name] = "*fp32"
        elif name.endswith("counters_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        elif name in ("T", "H", "I"):
            signature[name] = "i32"
    constant_names = [n for n in names if n not in signature]
    constant_values = [v for kind in kinds for v in kind] + [group_m, False, "tf32"]
    constexprs = dict(zip(constant_names, constant_values, strict=True))
    signature.update({n: "constexpr" for n in constant_names})
    aligned = [n for n in names if n.endswith("_ptr") or n in ("H", "I")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout  # fmt: skip
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    wgmma = compiled.asm["ptx"].count("wgmma.mma_async")
    return f"{usage.group(0)} smem={compiled.metadata.shared // 1024}K wgmma={wgmma}"


def main():
    for name in sys.argv[1:] or list(CANDIDATES):
        config = CANDIDATES[name]
        launches = [(kernels._launch1_kernel, (config.d_intermediate, config.grad_down)),
                    (kernels._launch2_kernel, (config.grad_x, config.grad_gate_up))]  # fmt: skip
        report = []
        for i, (kernel, kinds) in enumerate(launches):
            try:
                report.append(resources(compile_for_hopper(kernel, kinds, config.warps[i], config.stages[i],
                                                           config.group_m)))  # fmt: skip
            except Exception as exc:  # report and go on with the other candidates
                report.append("FAIL " + str(exc).strip().splitlines()[-1][:120])
        print(f"{name:12s} launch1: {report[0]:40s} launch2: {report[1]}")


if __name__ == "__main__":
    main()
