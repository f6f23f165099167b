"""P1's kernels compiled for sm_90 without a GPU: every kernel a configured design launches for a call of a given
shape, each as Triton's JIT would specialise it on the GPU.

    launches(design, T, H, I, with_lo=)   the design's kernel launches for one call, as hashable :class:`Launch`es
    compile_launch(launch)                 one of them compiled for sm_90 (:mod:`.sm90`)

The pointer-based Triton kernels (the designs triton_launches, chained and few_tokens, library_gemms' dSwiGLU
pass, the layer's elementwise step) are found by running the host code on meta tensors with Triton's launch
replaced by a recorder (:func:`recorded_launches`): what gets compiled is what the design's own launch code passes,
each argument specialised as the JIT specialises it (pointers on 16-byte boundaries or not, integers divisible by
16 or equal to 1), so that two calls share a :class:`Launch` exactly where the GPU would reuse one compiled kernel.
The Gluon launches are compiled from their configs: their descriptors' types come from descriptors of meta
tensors, and they specialise on neither T, H nor I. The kernels must be Triton's JIT functions: a process without
the interpreter (``TRITON_INTERPRET`` unset).

``scripts/p1/p1_compile_check.py`` reports them; ``tests/swiglu_down/test_compile_sm90.py`` checks them over shapes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from triton.runtime.jit import JITFunction

from ..swiglu_down.activation import swiglu_activation
from ..swiglu_down.backward import allocate_outputs
from ..swiglu_down.designs import GluonLaunches, Inputs
from ..swiglu_down.gluon_launch1 import GluonFirstLaunchConfig, first_launch_kernel
from ..swiglu_down.gluon_launch2 import GluonSecondLaunchConfig, second_launch_kernel
from .sm90 import compile_for_sm90, compile_gluon_for_sm90


@dataclass(frozen=True)
class Launch:
    """One kernel as the GPU would compile it: the kernel, its argument types (run-time arguments), its
    compile-time values, the arguments specialised as divisible by 16, and num_warps, num_stages; or a Gluon
    launch's config (``gluon``) with ``with_lo``."""

    kernel: object
    types: tuple = ()  # ((name, Triton type), ...)
    constexprs: tuple = ()  # ((name, value), ...)
    aligned: tuple = ()  # names
    warps: int = 4
    stages: int = 3
    gluon: GluonFirstLaunchConfig | GluonSecondLaunchConfig | None = None
    with_lo: bool = False

    @property
    def name(self) -> str:
        return self.kernel.__name__


@contextlib.contextmanager
def recorded_launches():
    """Inside it, ``kernel[grid](*args, **kwargs)`` of any ``@triton.jit`` kernel launches nothing and appends
    ``(kernel, args, kwargs)`` to the yielded list."""
    recorded = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield recorded
    finally:
        JITFunction.run = original


def specialised(kernel, args: tuple, kwargs: dict) -> Launch:
    """The :class:`Launch` of ``kernel[grid](*args, **kwargs)`` as Triton's JIT specialises it."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
    bound.apply_defaults()
    types, constexprs, aligned = [], [], []
    for param in kernel.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            constexprs.append((param.name, value))
            continue
        kind, attribute = native_specialize_impl(
            BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        if kind == "constexpr":  # an integer equal to 1
            constexprs.append((param.name, attribute))
        else:
            types.append((param.name, kind))
            if attribute == "D":
                aligned.append(param.name)
    return Launch(
        kernel, tuple(types), tuple(constexprs), tuple(aligned), kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
    )


def meta_inputs(T: int, H: int, I: int, dtype: torch.dtype, *, aligned: bool = True) -> Inputs:
    """P1's inputs as meta tensors (shapes, dtypes and where they start; no memory). ``aligned`` False: x and
    gate_silu start one element past a 16-byte boundary (views into larger tensors)."""

    def empty(*shape, shifted=False):
        if not shifted:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.empty(T * shape[1] + 1, dtype=dtype, device="meta")[1:].view(shape)

    return Inputs(
        empty(T, H),
        empty(T, H, shifted=not aligned),
        empty(I, H),
        empty(I, H),
        empty(H, I),
        empty(T, I),
        empty(T, I),
        empty(T, I, shifted=not aligned),
        empty(T, I),
        empty(T, I),
    )


def launches(
    design, T: int, H: int, I: int, *, with_lo: bool, dtype: torch.dtype = torch.bfloat16, aligned: bool = True
) -> list[Launch]:
    """The kernels ``design`` (a configured design of :data:`~moe_lib.swiglu_down.designs.DESIGNS`) launches for a
    call of this shape, in launch order; ``aligned`` as for :func:`meta_inputs`."""
    if isinstance(design, GluonLaunches):  # TMA: the operands' rows and starts on 16-byte boundaries
        return [
            Launch(first_launch_kernel, gluon=design.first, with_lo=with_lo, warps=design.first.warps),
            Launch(second_launch_kernel, gluon=design.second, with_lo=with_lo, warps=design.second.warps),
        ]
    inputs = meta_inputs(T, H, I, dtype, aligned=aligned)
    with recorded_launches() as recorded:
        design.run(inputs, with_lo=with_lo, out=allocate_outputs(inputs.x, I))
    return [specialised(*launch) for launch in recorded]


def activation_launches(T: int, I: int, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The ``swiglu_expert`` layer's elementwise step, forward and backward forms, on [T, I]."""
    gate = torch.empty((T, I), dtype=dtype, device="meta")
    with recorded_launches() as recorded:
        swiglu_activation(gate, gate, with_saved=False)
        swiglu_activation(gate, gate, with_saved=True)
    return [specialised(*launch) for launch in recorded]


def compile_launch(launch: Launch):
    """``launch`` compiled for sm_90: what :func:`.sm90.resources` reads."""
    if launch.gluon is not None:
        return compile_gluon(launch.gluon, launch.with_lo)
    return compile_for_sm90(
        launch.kernel,
        dict(launch.types),
        dict(launch.constexprs),
        list(launch.aligned),
        warps=launch.warps,
        stages=launch.stages,
    )


def compile_gluon(config, with_lo: bool, T: int = 256, H: int = 2048, I: int = 768):
    """A Gluon launch's kernel (launch 1 or 2 by the config's class) for bf16 operands: its descriptors' types read off
    descriptors of meta tensors (of any shape: the kernels specialise on their block shapes alone)."""

    def empty(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    halves = empty(2 if with_lo else 1, T, I)
    if isinstance(config, GluonFirstLaunchConfig):
        kernel = first_launch_kernel
        saved = empty(T, I)
        descriptors = config.descriptors(
            empty(T, H), empty(H, I), saved, saved, saved, saved, saved, halves, halves, empty(H, I)
        )
        others = dict(T="i32", I="i32", trace_ptr="*i32")
    else:
        kernel = second_launch_kernel
        x, weight = empty(T, H), empty(I, H)
        descriptors = config.descriptors(
            x, weight, weight, halves, halves, x, weight, weight, x, empty(T, I), empty(H, I)
        )
        others = dict(T="i32", I="i32", dx_partials_ptr="*fp32", dx_counters_ptr="*i32", trace_ptr="*i32")
    names = [name for name in kernel.arg_names if name.endswith("_desc")]
    arguments = dict(zip(names, descriptors, strict=True)) | others
    return compile_gluon_for_sm90(
        kernel,
        arguments,
        config.constexprs(with_lo) | dict(num_warps=config.warps),
        warps=config.warps,
        maxnreg=config.maxnreg,
    )
