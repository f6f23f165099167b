"""Triton kernels compiled for sm_90 (Hopper) without a GPU, and the resources the compiled code uses.

Needs only the triton wheel: its ptxas compiles, its cuobjdump reads the registers and stack of the
cubin (a spill shows as a non-zero STACK). The scripts ``scripts/p1/p1_compile_check.py`` and
``scripts/p2/p2_compile_check.py`` report their kernels with :func:`compile_for_sm90` and :func:`resources`.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


def constexpr_names(kernel) -> list[str]:
    """The compile-time (``tl.constexpr``) arguments of a ``@triton.jit`` function, in order."""
    return [param.name for param in kernel.params if param.is_constexpr]


def runtime_names(kernel) -> list[str]:
    """The run-time arguments (pointers and scalars) of a ``@triton.jit`` function, in order."""
    return [param.name for param in kernel.params if not param.is_constexpr]


def compile_for_sm90(kernel, types: dict, constexprs: dict, aligned, *, warps: int, stages: int):
    """Compiles ``kernel`` (a ``@triton.jit`` function) for sm_90.

    ``types`` gives each run-time argument's Triton type ("*bf16", "i32", ...), ``constexprs`` the value
    of every compile-time argument (and of any run-time one specialised to a constant). ``aligned``
    names the arguments specialised as divisible by 16 (pointers and sizes).
    """
    missing = [name for name in constexpr_names(kernel) if name not in constexprs]
    missing += [name for name in runtime_names(kernel) if name not in types and name not in constexprs]
    if missing:
        raise ValueError(f"constexprs: no value or type for {missing} of {kernel.__name__}")
    signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=dict(num_warps=warps, num_stages=stages))


def compile_gluon_for_sm90(kernel, arguments: dict, constexprs: dict, *, warps: int, maxnreg: int | None = None):
    """Compiles ``kernel`` (a ``@gluon.jit`` function) for sm_90.

    ``arguments`` gives each run-time argument a host tensor descriptor (its type read off it, as the launcher
    reads it) or a Triton type ("i32", "*bf16"); ``constexprs`` the compile-time values. Names the kernel does not
    take are left out, so one set of arguments serves kernels that take different parts of it. ``maxnreg``: the
    registers a thread may use (None: as many as ptxas takes).
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    missing = [name for name in kernel.arg_names if name not in constexprs and name not in arguments]
    if missing:
        raise ValueError(f"arguments: no descriptor, type or value for {missing} of {kernel.__name__}")
    signature = {
        name: "constexpr"
        if name in constexprs
        else arguments[name]
        if isinstance(arguments[name], str)
        else native_specialize_impl(BaseBackend, arguments[name], False, True, True)[0]
        for name in kernel.arg_names
    }
    # pointers 16-byte aligned, as the JIT specialises the arguments of torch's allocations (vector loads need it)
    aligned = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*")
    }
    return triton.compile(
        GluonASTSource(kernel, signature, constexprs, aligned),
        target=HOPPER,
        options=dict(num_warps=warps, maxnreg=maxnreg),
    )


def resource_usage(compiled) -> dict[str, int]:
    """{"registers": per thread, "stack": bytes per thread (non-zero: a spill), "shared": bytes per block} of a
    compiled kernel (cuobjdump on its cubin; the shared memory from Triton's metadata)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run(
            [str(TOOLS / "cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True, text=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if usage is None:
        raise RuntimeError(f"cuobjdump reported no registers and stack for {compiled.name}: {out[-500:]!r}")
    return dict(registers=int(usage.group(1)), stack=int(usage.group(2)), shared=compiled.metadata.shared)


def resources(compiled) -> str:
    """ "REG:<n> STACK:<n> smem=<KiB>K wgmma=<count>" of a compiled kernel (cuobjdump on its cubin)."""
    usage = resource_usage(compiled)
    wgmma = compiled.asm["ptx"].count("wgmma.mma_async")
    return f"REG:{usage['registers']} STACK:{usage['stack']} smem={usage['shared'] // 1024}K wgmma={wgmma}"


def sass_counts(compiled, ops) -> collections.Counter:
    """How often each SASS instruction in ``ops`` (e.g. "HGMMA", "UTMALDG") occurs in the cubin (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run(
            [str(TOOLS / "cuobjdump"), "--dump-sass", cubin.name], capture_output=True, text=True
        ).stdout
    return collections.Counter(re.findall(r"\b(" + "|".join(ops) + r")\b", sass))


def wgmma_serialized(compiled) -> str:
    """ptxas's reason where it serialises the wgmma instructions (each waits for the previous one: the tensor
    cores idle between them), else "no"."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run(
            [str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
        )
    found = re.search(r"serialized due to (.*?) in the function", out.stdout + out.stderr)
    return "SERIALIZED (" + " ".join(found.group(1).split()) + ")" if found else "no"


def over_limit(compiled) -> str:
    """ " (OVER 227K: will not launch)" where the kernel needs more shared memory than an SM has, else ""."""
    return " (OVER 227K: will not launch)" if compiled.metadata.shared > SHARED_MEMORY_LIMIT else ""


def first_error_line(exc: BaseException, limit: int = 160) -> str:
    """The last line of a compiler error (where ptxas and Triton put the reason), cut to ``limit``."""
    lines = str(exc).strip().splitlines()
    return (lines[-1] if lines else type(exc).__name__)[:limit]
