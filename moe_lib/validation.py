"""Input-check primitives shared by every problem, run before any work.

Each raises a ``TypeError``/``ValueError`` that names the argument and what was expected. The
problem packages compose them (``swiglu_down/checks.py``, ``moe_experts/checks.py``). Shape, dtype and
device checks read only metadata; checks of index values read indices back to the host, so those run
only with ``validate=True``.
"""

from __future__ import annotations

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
