"""Input-check primitives shared by every problem, run before any work.

Each raises a ``TypeError``/``ValueError`` that names the argument and what was expected. The
problem packages compose them (``swiglu_down/checks.py``, ``moe_experts/checks.py``). Shape, dtype and
device checks read only metadata; checks of index values read indices back to the host, so those run
only with ``validate=True``. Also here: the opt-in check for NaN/Inf (:func:`finite`), the up-front check
that what a call would allocate fits on its device (:func:`fits_in_memory`), and the guard that makes a
second differentiation of gradients autograd cannot see into fail loudly (:func:`not_differentiable_again`).
"""

from __future__ import annotations

import os

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
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return None
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
