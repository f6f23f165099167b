"""Input-check primitives shared by every problem, run before any work.

Each raises a ``TypeError``/``ValueError`` that names the argument and what was expected. A public function's
tensor arguments are one table of :class:`Argument` (name, shape over named axes, dtype kind: the problem's
``definition.json`` lists the same), checked together by :func:`check_arguments`, so that no argument can be
left out of a check (``swiglu_down/checks.py``, ``moe_experts/checks.py``). Shape, dtype and device checks read
only metadata; checks of index values read indices back to the host, so those run only with ``validate=True``.
Also here: the opt-in check for NaN/Inf (:func:`finite`), the up-front check that what a call would allocate
fits on its device (:func:`fits_in_memory`), and the guard that makes a second differentiation of gradients
autograd cannot see into fail loudly (:func:`not_differentiable_again`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .dispatch import check_impl  # noqa: F401  (re-exported: the layers check impl with the inputs)


def tensor(name, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def float_tensor(name, value) -> torch.Tensor:
    t = tensor(name, value)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    return t


def shape(name, t: torch.Tensor, expected: tuple, labels: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(f"{lab}={n}" for lab, n in zip(labels, expected, strict=True)) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def ndim(name, t: torch.Tensor, count: int, labels: str) -> None:
    if t.dim() != count:
        raise ValueError(f"{name}: expected a {count}-d tensor [{labels}], got shape {list(t.shape)}")


def same_device(named: dict) -> None:
    devices = {name: t.device for name, t in named.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name}: expected device {first} (the device of {first_name}), got {device}")


def same_dtype(named: dict) -> None:
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} (the dtype of {first_name}), got {t.dtype}")


def check_contiguous(named: dict) -> None:
    """Fast kernels address their operands by row-major strides."""
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")


# the dtype kinds of an Argument
FLOAT = "float"  # the call's float dtype, one for every FLOAT argument
INDEX = "index"  # int64 or int32
FLOAT_OR_FP32 = "float or float32"  # the call's float dtype, or float32 (routing weights as a router gives them)
INDEX_DTYPES = (torch.int64, torch.int32)
ANY_LEADING = "..."  # as the first axis: any number of leading dimensions


@dataclass(frozen=True)
class Argument:
    """One tensor argument of a public function: its name, its shape over named axes and its dtype kind."""

    name: str
    axes: tuple[str, ...]
    dtype: str = FLOAT


def check_arguments(table: tuple[Argument, ...], values: dict, sizes_from: tuple[str, ...]) -> dict:
    """Checks every argument of ``table`` in ``values`` (name -> what was passed); returns the size of every axis.

    In turn: each is a tensor of its dtype kind; each has its shape, the axes' sizes taken from the arguments
    ``sizes_from`` (in that order: an axis's size is that of the first of them that has it, which a mismatch
    names); the FLOAT ones share one dtype; all share one device. The arguments of ``sizes_from`` come first in
    every step, so that the error names them rather than an argument compared with them.

    The layers call this on every call: in eager code one pass over the arguments settles the usual case (all
    valid, :func:`_sizes_when_valid`); where it finds anything wrong, or while ``torch.compile`` traces, the steps
    above run and raise as they always do.
    """
    if not torch.compiler.is_compiling():
        sizes = _sizes_when_valid(_plan(table, sizes_from), values)
        if sizes is not None:
            return sizes
    by_name = {argument.name: argument for argument in table}
    order = [by_name[name] for name in sizes_from] + [a for a in table if a.name not in sizes_from]
    for argument in order:
        _check_kind(argument, values[argument.name])
    sizes, source = {}, {}
    for argument in order:
        t = values[argument.name]
        fixed = argument.axes[1:] if argument.axes[:1] == (ANY_LEADING,) else argument.axes
        if argument.name in sizes_from:
            _check_rank(argument, t, fixed)
            for axis, size in zip(fixed, t.shape[t.dim() - len(fixed) :], strict=True):
                if axis not in sizes:
                    sizes[axis], source[axis] = size, argument.name
        _check_shape(argument, t, fixed, sizes, source)
    floats = {a.name: values[a.name] for a in order if a.dtype == FLOAT}
    same_dtype(floats)
    if floats:
        reference_name, reference = next(iter(floats.items()))
        for argument in order:
            t = values[argument.name]
            if argument.dtype == FLOAT_OR_FP32 and t.dtype not in (reference.dtype, torch.float32):
                raise TypeError(
                    f"{argument.name}: expected dtype {reference.dtype} (the dtype of {reference_name}) "
                    f"or torch.float32, got {t.dtype}"
                )
    same_device({a.name: values[a.name] for a in order})
    return sizes


# (id(table), id(sizes_from)) -> (table, sizes_from, their plan), made on their first check; the entry holds both,
# so that neither id is reused while it is kept
_PLANS: dict = {}
PLANS_KEPT = 64  # tables are module constants: more than this many means tables made per call, not worth keeping


def _plan(table: tuple[Argument, ...], sizes_from: tuple[str, ...]) -> tuple:
    """Per argument, in :func:`check_arguments`' order: (name, fixed axes, any leading axes, dtype kind, whether its
    dimensions give sizes)."""
    kept = _PLANS.get((id(table), id(sizes_from)))
    if kept is not None and kept[0] is table and kept[1] is sizes_from:
        return kept[2]
    by_name = {argument.name: argument for argument in table}
    order = [by_name[name] for name in sizes_from] + [a for a in table if a.name not in sizes_from]
    plan = tuple(
        (
            argument.name,
            argument.axes[1:] if argument.axes[:1] == (ANY_LEADING,) else argument.axes,
            argument.axes[:1] == (ANY_LEADING,),
            argument.dtype,
            argument.name in sizes_from,
        )
        for argument in order
    )
    if len(_PLANS) >= PLANS_KEPT:
        _PLANS.clear()
    _PLANS[id(table), id(sizes_from)] = (table, sizes_from, plan)
    return plan


def _sizes_when_valid(plan: tuple, values: dict) -> dict | None:
    """The sizes :func:`check_arguments` returns where every argument passes all its checks, else None (without
    saying what is wrong: its steps then find and name it)."""
    sizes, device, float_dtype, float_or_fp32 = {}, None, None, []
    for name, fixed, leading, kind, gives_sizes in plan:
        t = values[name]
        if not isinstance(t, torch.Tensor):
            return None
        dtype = t.dtype
        if kind == INDEX:
            if dtype not in INDEX_DTYPES:
                return None
        elif not dtype.is_floating_point:
            return None
        elif kind == FLOAT:
            if float_dtype is None:
                float_dtype = dtype
            elif dtype != float_dtype:
                return None
        elif kind == FLOAT_OR_FP32:
            float_or_fp32.append(dtype)
        shape = t.shape
        rank = len(fixed)
        if len(shape) != rank and not (leading and len(shape) > rank):
            return None
        for axis, size in zip(fixed, shape[len(shape) - rank :], strict=True):
            known = sizes.get(axis)
            if known is None:
                if not gives_sizes:
                    return None
                sizes[axis] = size
            elif known != size:
                return None
        if device is None:
            device = t.device
        elif t.device != device:
            return None
    if float_dtype is not None and any(d not in (float_dtype, torch.float32) for d in float_or_fp32):
        return None
    return sizes


def _check_kind(argument: Argument, value) -> None:
    if argument.dtype == INDEX:
        t = tensor(argument.name, value)
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{argument.name}: expected dtype torch.int64 or torch.int32, got {t.dtype}")
    else:
        float_tensor(argument.name, value)


def _check_rank(argument: Argument, t: torch.Tensor, fixed: tuple) -> None:
    if len(fixed) == len(argument.axes):
        ndim(argument.name, t, len(fixed), ", ".join(fixed))
    elif t.dim() < len(fixed):
        raise ValueError(f"{argument.name}: expected a tensor [{', '.join(argument.axes)}], got shape {list(t.shape)}")


def _check_shape(argument: Argument, t: torch.Tensor, fixed: tuple, sizes: dict, source: dict) -> None:
    """The shape of ``t`` against ``sizes``; the error names where each mismatched size came from."""
    leading = len(fixed) < len(argument.axes)
    got = tuple(t.shape[t.dim() - len(fixed) :]) if t.dim() >= len(fixed) else None
    expected = tuple(sizes[axis] for axis in fixed)
    if got == expected and (leading or t.dim() == len(fixed)):
        return
    want = ", ".join([ANY_LEADING] * leading + [f"{axis}={sizes[axis]}" for axis in fixed])
    same_rank = got is not None and (leading or t.dim() == len(fixed))  # else the rank alone is wrong
    mismatched = [axis for axis, n, m in zip(fixed, got, expected, strict=True) if n != m] if same_rank else []
    sources = [f"{axis} from {source[axis]}" for axis in dict.fromkeys(mismatched) if source[axis] != argument.name]
    where = f" ({', '.join(sources)})" if sources else ""
    raise ValueError(f"{argument.name}: expected shape [{want}], got {list(t.shape)}{where}")


def flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def finite(named: dict) -> None:
    """Raises a ValueError naming the first tensor of ``named`` (in its order) that holds a NaN or an Inf.

    The opt-in ``check_finite=True`` of the public functions: one host sync for all of them. Meta
    tensors have no values and are skipped.
    """
    checked = {name: t for name, t in named.items() if t.is_floating_point() and t.device.type != "meta"}
    if not checked:
        return
    all_finite = torch.stack([torch.isfinite(t).all().to(first_device(checked)) for t in checked.values()])
    for name, ok in zip(checked, all_finite.tolist(), strict=True):
        if not ok:
            raise ValueError(f"{name}: holds NaN or Inf (check_finite=True refuses non-finite inputs)")


def first_device(named: dict) -> torch.device:
    return next(iter(named.values())).device


def device_memory_bytes(device) -> int | None:
    """Total memory of ``device``: the GPU's for CUDA, the machine's RAM for the CPU; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_memory_bytes(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return _cpu_memory_bytes()
    return None


# read once per device, not on every call (the checks run on every call of the layers)
@functools.cache
def _cuda_memory_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


@functools.cache
def _cpu_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def fits_in_memory(name: str, nbytes: int, device, what: str) -> None:
    """Raises a ValueError naming ``name`` when ``nbytes`` (``what`` a call would allocate) exceed the
    whole memory of ``device``: refused up front rather than failing deep inside the allocator."""
    total = device_memory_bytes(device)
    if total is not None and nbytes > total:
        raise ValueError(
            f"{name}: {what} would take {nbytes / 2**30:,.1f} GiB, more than the {total / 2**30:,.1f} GiB "
            f"of memory of {torch.device(device)}"
        )


class _NotDifferentiableAgain(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them again raises ``RuntimeError(message)``."""

    @staticmethod
    def forward(ctx, message, count, *tensors):
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def not_differentiable_again(grads: tuple, depends_on: tuple, message: str) -> tuple:
    """``grads`` computed by a backward that autograd cannot see into (the Triton kernels).

    Outside a graph-recording backward (the usual case) they come back as they are. Within one
    (``create_graph=True``), they come back tied to the tensors of ``depends_on`` that require grad, so
    that differentiating them again raises ``RuntimeError(message)`` instead of silently treating the
    gradients as constants (a wrong second derivative).
    """
    anchors = [t for t in depends_on if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not anchors:
        return grads
    present = [g for g in grads if g is not None]
    tied = iter(_NotDifferentiableAgain.apply(message, len(present), *present, *anchors))
    return tuple(None if g is None else next(tied) for g in grads)
